"""Shared column scale from the largest of the layers' mean-normalised column profiles (so that no
layer's W/c gets a column larger than its own per-layer scaling would give) vs the stacked RMS; 1 window."""
import sys, json
import mlx.core as mx, mlx.nn as nn
from veloxquant_mlx.evaluation.data import load_text, tokenize_prefix
from veloxquant_mlx.models import load_model
from veloxquant_mlx.weights import quantize_model
from veloxquant_mlx.weights import model as wm

def maxpool(weights, alpha):
    if not alpha: return None
    top = None
    for w in weights:
        w = w.astype(mx.float32); rms = mx.sqrt((w * w).mean(axis=0)); p = rms / mx.maximum(rms.mean(), 1e-8)
        top = p if top is None else mx.maximum(top, p)
    return mx.power(mx.maximum(top, 1e-8) / mx.maximum(top.mean(), 1e-8), alpha).astype(mx.float16)

concat = wm.shared_input_scales
_, tok = load_model("smollm2")
ids = tokenize_prefix(tok, load_text("/work/shared/data/wikitext2-test.txt"), 1024)
windows = mx.array(ids).reshape(2, 512)[:int(sys.argv[2])]
for spec in sys.argv[1].split(","):
    pool, bits = spec.split(":")
    wm.shared_input_scales = {"max": maxpool, "concat": concat, "perlayer": concat}[pool]
    model, _ = load_model("smollm2")
    quantize_model(model, int(bits), progress=False, share_rotations=pool != "perlayer")
    nll = n = 0
    for w in windows:
        logits = model(w[None])[0, :-1].astype(mx.float32)
        nll += nn.losses.cross_entropy(logits, w[1:], reduction="sum").item(); n += w.size - 1
    print(json.dumps({"pool": pool, "bits": int(bits), "windows": len(windows), "ppl": float(mx.exp(mx.array(nll / n)).item())}), flush=True)
