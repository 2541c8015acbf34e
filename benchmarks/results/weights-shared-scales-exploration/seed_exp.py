import sys, json
import mlx.core as mx, mlx.nn as nn
from veloxquant_mlx.evaluation.data import load_text, tokenize_prefix
from veloxquant_mlx.models import load_model
from veloxquant_mlx.weights import quantize_model
_, tok = load_model("smollm2")
ids = tokenize_prefix(tok, load_text("/work/shared/data/wikitext2-test.txt"), 1024)
windows = mx.array(ids).reshape(2, 512)[:1]
for spec in sys.argv[1].split(","):
    share, seed = spec.split(":")
    model, _ = load_model("smollm2")
    quantize_model(model, 4, seed=int(seed), progress=False, share_rotations=share == "shared")
    nll = n = 0
    for w in windows:
        logits = model(w[None])[0, :-1].astype(mx.float32)
        nll += nn.losses.cross_entropy(logits, w[1:], reduction="sum").item(); n += w.size - 1
    print(json.dumps({"spec": spec, "ppl": float(mx.exp(mx.array(nll / n)).item())}), flush=True)
