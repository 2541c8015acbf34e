"""Shared rotation (one per norm, as quantize_model seeds it) with per-layer column scales: the layers keep
rotating their own input (no fold). Separates the effect of sharing the rotation from sharing the scale."""
import sys, json
import mlx.core as mx, mlx.nn as nn
from veloxquant_mlx.evaluation.data import load_text, tokenize_prefix
from veloxquant_mlx.models import load_model
from veloxquant_mlx.weights import quantize_model
from veloxquant_mlx.weights import model as wm
from veloxquant_mlx.weights.linear import column_scales

orig_settings = wm._shared_settings
def own_scales(model, groups, seed, stages, column_alpha):
    settings = orig_settings(model, groups, seed, stages, column_alpha)
    modules = dict(model.named_modules())
    for path, s in settings.items():
        s["input_scales"] = column_scales(wm._float_weight(modules[path]), column_alpha)
    return settings
wm._shared_settings = own_scales
wm.share_input_rotations = lambda model, groups: model
_, tok = load_model("smollm2")
ids = tokenize_prefix(tok, load_text("/work/shared/data/wikitext2-test.txt"), 1024)
windows = mx.array(ids).reshape(2, 512)[:int(sys.argv[2])]
for seed in sys.argv[1].split(","):
    model, _ = load_model("smollm2")
    quantize_model(model, int(sys.argv[3]) if len(sys.argv) > 3 else 4, seed=int(seed), progress=False)
    nll = n = 0
    for w in windows:
        logits = model(w[None])[0, :-1].astype(mx.float32)
        nll += nn.losses.cross_entropy(logits, w[1:], reduction="sum").item(); n += w.size - 1
    print(json.dumps({"shared_rotation_own_scales_seed": int(seed), "bits": int(sys.argv[3]) if len(sys.argv) > 3 else 4, "ppl": float(mx.exp(mx.array(nll / n)).item())}), flush=True)
