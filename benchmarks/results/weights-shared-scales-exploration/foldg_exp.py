import sys, json
import mlx.core as mx, mlx.nn as nn
from veloxquant_mlx.evaluation.data import load_text, tokenize_prefix
from veloxquant_mlx.models import load_model
from veloxquant_mlx.weights import quantize_model
from veloxquant_mlx.weights import model as wm, shared as ws
from veloxquant_mlx.weights.linear import column_scales

def concat(weights, alpha):
    if not alpha: return None
    return column_scales(mx.concatenate([w.astype(mx.float32) for w in weights]), alpha)

def rmspool(weights, alpha):
    """The first shared scale tried (commit "Weights: one input rotation per shared input..."): each
    layer's column RMS profile normalised to mean 1, pooled by root mean square over the layers."""
    if not alpha: return None
    pooled = None
    for w in weights:
        w = w.astype(mx.float32); rms = mx.sqrt((w * w).mean(axis=0))
        p = mx.square(rms / mx.maximum(rms.mean(), 1e-8))
        pooled = p if pooled is None else pooled + p
    r = mx.sqrt(pooled / len(weights))
    return mx.power(mx.maximum(r, 1e-8) / mx.maximum(r.mean(), 1e-8), alpha).astype(mx.float16)

pools = {"rmspool": rmspool, "concat": concat}

def fold_norms(model):
    for b in model.model.layers:
        g = b.input_layernorm.weight
        for n in ("q_proj", "k_proj", "v_proj"):
            l = getattr(b.self_attn, n); l.weight = l.weight * g
        b.input_layernorm.weight = mx.ones_like(g)
        g = b.post_attention_layernorm.weight
        for n in ("gate_proj", "up_proj"):
            l = getattr(b.mlp, n); l.weight = l.weight * g
        b.post_attention_layernorm.weight = mx.ones_like(g)
    mx.eval(model.parameters())

_, tok = load_model("smollm2")
ids = tokenize_prefix(tok, load_text("/work/shared/data/wikitext2-test.txt"), 1024)
windows = mx.array(ids).reshape(2, 512)[:int(sys.argv[3])]
bits = int(sys.argv[2])
for name in sys.argv[1].split(","):
    model, _ = load_model("smollm2")
    fold_norms(model)
    if name == "perlayer":
        quantize_model(model, bits, progress=False, share_rotations=False)
    elif name == "float":
        pass
    else:
        wm.shared_input_scales = pools[name]
        quantize_model(model, bits, progress=False)
    nll = n = 0
    for w in windows:
        logits = model(w[None])[0, :-1].astype(mx.float32)
        nll += nn.losses.cross_entropy(logits, w[1:], reduction="sum").item(); n += w.size - 1
    print(json.dumps({"foldg": name, "bits": bits, "ppl": float(mx.exp(mx.array(nll / n)).item()), "windows": len(windows)}), flush=True)
