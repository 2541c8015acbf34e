"""usage: PYTHONPATH=. python benchmarks/set_ratequant_widths.py ARTIFACT_DIR KEY_WIDTHS VALUE_WIDTHS  (each: one width, or comma list per layer)
Rewrites a ratequant artifact's per-layer widths (a hand allocation for the sweep), through the
package's own artifact writer (checksums and digest recomputed); the record says widths_set_by_hand."""
import sys
import mlx.core as mx
from veloxquant_mlx.artifacts import load_artifact_dir, save_artifact_dir
d, kw, vw = sys.argv[1:4]
meta, arrays = load_artifact_dir(d)
arrays = dict(arrays)
n = 1 + max(int(k.split(".")[0]) for k in arrays)
def widths(spec):
    w = [float(x) for x in spec.split(",")]
    return w * n if len(w) == 1 else w
W = {"keys": widths(kw), "values": widths(vw)}
for k in list(arrays):
    layer, role, dim, name = k.split(".", 3)
    if name == "width":
        arrays[k] = mx.array([W[role][int(layer)]], mx.float32)
rec = meta.get("calibration", {})
for role in ("keys", "values"):
    rec[f"{role}_widths"] = W[role]; rec[f"{role}_mean_width"] = sum(W[role]) / n
rec["widths_set_by_hand"] = True
meta = {k: v for k, v in meta.items() if k not in ("format", "tensors", "digest")}
save_artifact_dir(d, arrays, meta)
print("set", d, kw, vw)
