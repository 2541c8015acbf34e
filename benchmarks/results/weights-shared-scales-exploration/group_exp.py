import sys, json
import mlx.core as mx, mlx.nn as nn
sys.argv += []
from veloxquant_mlx.evaluation.data import load_text, tokenize_prefix
from veloxquant_mlx.models import load_model
from veloxquant_mlx.weights import quantize_model
from veloxquant_mlx.weights import model as wm
from veloxquant_mlx.weights.linear import column_scales

def concat(weights, alpha):
    if not alpha: return None
    return column_scales(mx.concatenate([w.astype(mx.float32) for w in weights]), alpha)
wm.shared_input_scales = concat
orig_find = wm.find_shared_inputs
_, tok = load_model("smollm2")
ids = tokenize_prefix(tok, load_text("/work/shared/data/wikitext2-test.txt"), 1024)
windows = mx.array(ids).reshape(2, 512)[:1]
bits = int(sys.argv[2])
for name in sys.argv[1].split(","):
    keep = {"mlp": "mlp", "attn": "self_attn"}[name]
    def find(model):
        found, un = orig_find(model)
        return [g for g in found if f".{keep}." in g.layers[0]], un
    wm.find_shared_inputs = find
    model, _ = load_model("smollm2")
    quantize_model(model, bits, progress=False)
    nll = n = 0
    for w in windows:
        logits = model(w[None])[0, :-1].astype(mx.float32)
        nll += nn.losses.cross_entropy(logits, w[1:], reduction="sum").item(); n += w.size - 1
    print(json.dumps({"shared": name, "pool": "concat", "bits": bits, "ppl": float(mx.exp(mx.array(nll / n)).item())}), flush=True)
