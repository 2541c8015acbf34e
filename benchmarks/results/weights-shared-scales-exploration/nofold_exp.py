"""Shared rotation AND shared (stacked-RMS) scales, but each layer rotating its own input (no norm fold):
the same codes as quantize_model's shared mode, run through the per-layer forward. Separates the
quality of the shared codes from the fold into the norm."""
import sys, json
import mlx.core as mx, mlx.nn as nn
from veloxquant_mlx.evaluation.data import load_text, tokenize_prefix
from veloxquant_mlx.models import load_model
from veloxquant_mlx.weights import quantize_model
from veloxquant_mlx.weights import model as wm

fold = sys.argv[3] == "fold"
if not fold:
    wm.share_input_rotations = lambda model, groups: model
_, tok = load_model("smollm2")
ids = tokenize_prefix(tok, load_text("/work/shared/data/wikitext2-test.txt"), 1024)
windows = mx.array(ids).reshape(2, 512)[:int(sys.argv[2])]
for bits in sys.argv[1].split(","):
    model, _ = load_model("smollm2")
    quantize_model(model, int(bits), progress=False)
    nll = n = 0
    for w in windows:
        logits = model(w[None])[0, :-1].astype(mx.float32)
        nll += nn.losses.cross_entropy(logits, w[1:], reduction="sum").item(); n += w.size - 1
    print(json.dumps({"shared_codes": True, "fold": fold, "bits": int(bits), "ppl": float(mx.exp(mx.array(nll / n)).item())}), flush=True)
