"""Shared groups with a smaller column-scaling exponent than the per-layer 0.5 (stacked-RMS scale with
alpha = A, or none at A = 0: quantize_model(shared_alpha=A)); o_proj/down_proj keep alpha 0.5.
Args: A:BITS,... windows."""
import sys, json
import mlx.core as mx, mlx.nn as nn
from veloxquant_mlx.evaluation.data import load_text, tokenize_prefix
from veloxquant_mlx.models import load_model
from veloxquant_mlx.weights import quantize_model

_, tok = load_model("smollm2")
ids = tokenize_prefix(tok, load_text("/work/shared/data/wikitext2-test.txt"), 1024)
windows = mx.array(ids).reshape(2, 512)[:int(sys.argv[2])]
for spec in sys.argv[1].split(","):
    a, bits = spec.split(":")
    model, _ = load_model("smollm2")
    quantize_model(model, int(bits), shared_alpha=float(a), progress=False)
    nll = n = 0
    for w in windows:
        logits = model(w[None])[0, :-1].astype(mx.float32)
        nll += nn.losses.cross_entropy(logits, w[1:], reduction="sum").item(); n += w.size - 1
    print(json.dumps({"shared_alpha": float(a), "bits": int(bits), "windows": len(windows), "ppl": float(mx.exp(mx.array(nll / n)).item())}), flush=True)
