"""What MLX's fused attention costs under the chunk-invariant "decode" prefill rule's band mask.

    PYTHONPATH=. python benchmarks/band_mask_attention.py --chunk 2048 --history 2048 --out DIR

One prefill chunk of Llama-3.1-8B's attention shape (32 query heads, 8 KV heads of dim 128, bfloat16) over a
history: the causal call over the codes alone (what the "chunk" rule costs), the band-masked call over the
codes and the fp16 recent span (what the "decode" rule needs: `engine.sdpa_prefill`) with a boolean and with an
additive mask, each with and without `force_fused`, and queries in groups that share one fp16 boundary (what a
window flushed a group at a time would allow). Interleaved repeats, median ms; the boolean and additive outputs
are compared. Writes results.json and results.md under --out.
"""
import argparse
import statistics
import time

import mlx.core as mx

from veloxquant_mlx.evaluation.results import write_json_and_markdown

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--chunk", type=int, default=2048, help="queries in the chunk (default: 2048)")
parser.add_argument("--history", type=int, default=2048, help="tokens before the chunk (default: 2048)")
parser.add_argument("--repeats", type=int, default=7, help="timed repeats after one warm-up (default: 7)")
parser.add_argument("--out", required=True, help="results folder")
args = parser.parse_args()
B, HQ, HK, D = 1, 32, 8, 128
L, HIST, W = args.chunk, args.history, 32
N = HIST + L
dt = mx.bfloat16
scale = D ** -0.5
mx.random.seed(0)
q = mx.random.normal((B, HQ, L, D)).astype(dt)
kc, vc = (mx.random.normal((B, HK, N, D)).astype(dt) for _ in range(2))   # decoded codes, every position
kf, vf = (mx.random.normal((B, HK, L + W, D)).astype(dt) for _ in range(2))  # fp16 recent span [HIST - W, N)
mx.eval(q, kc, vc, kf, vf)
qpos = mx.arange(HIST, N)[:, None]
code_pos = mx.arange(N)[None]
rec_pos = mx.arange(HIST - W, N)[None]
band = mx.concatenate([(code_pos <= qpos - W), (rec_pos > qpos - W) & (rec_pos <= qpos)], axis=1)
K2, V2 = mx.concatenate([kc, kf], axis=2), mx.concatenate([vc, vf], axis=2)
additive = mx.where(band, 0.0, -mx.inf).astype(dt)
mx.eval(band, K2, V2, additive)

def causal():
    return mx.fast.scaled_dot_product_attention(q, kc, vc, scale=scale, mask="causal")

def banded(mask, fused=False):
    def run():
        return mx.fast.scaled_dot_product_attention(q, K2, V2, scale=scale, mask=mask, force_fused=fused)
    return run

def groups(G):
    # queries in groups of G sharing one fp16 boundary (a window flushed G tokens at a time): per group,
    # keys [codes before the boundary | fp16 from it to the group's last query], causal.
    def run():
        outs = []
        for a in range(0, L, G):
            first = HIST + a - W + 1  # boundary of the group's first query
            last = HIST + min(a + G, L)  # one past its last query
            k = mx.concatenate([kc[..., :first, :], kf[..., first - (HIST - W):last - (HIST - W), :]], axis=2)
            v = mx.concatenate([vc[..., :first, :], vf[..., first - (HIST - W):last - (HIST - W), :]], axis=2)
            outs.append(mx.fast.scaled_dot_product_attention(q[..., a:a + G, :], k, v, scale=scale, mask="causal"))
        return mx.concatenate(outs, axis=2)
    return run

runs = {"causal over codes (chunk-rule cost)": causal, "band bool mask": banded(band),
        "band additive mask": banded(additive)}
for name, mask in (("band bool mask, force_fused", band), ("band additive mask, force_fused", additive)):
    try:
        mx.eval(banded(mask, True)())
        runs[name] = banded(mask, True)
    except Exception as e:
        print(name, "refused:", str(e)[:200])
for G in (64, 128, 256, 512):
    runs[f"groups of {G}, causal each"] = groups(G)
agree = float(mx.max(mx.abs(banded(band)().astype(mx.float32) - banded(additive)().astype(mx.float32))))
times = {k: [] for k in runs}
for rep in range(args.repeats + 1):
    for name, f in runs.items():
        mx.synchronize()
        t = time.perf_counter()
        mx.eval(f())
        mx.synchronize()
        if rep:
            times[name].append((time.perf_counter() - t) * 1e3)
base = statistics.median(times["causal over codes (chunk-rule cost)"])
rows = [{"run": name, "median_ms": statistics.median(t), "ms": t, "vs_causal": statistics.median(t) / base}
        for name, t in times.items()]
meta = {"chunk": L, "history": HIST, "window": W, "device": str(mx.default_device()), "mlx": mx.__version__,
        "max_abs_boolean_vs_additive": agree, "repeats": args.repeats}
lines = [f"Band-masked prefill attention: {L} queries over {HIST} earlier tokens, Llama-3.1-8B's attention shape, "
         f"bfloat16 ({meta['device']}, mlx {meta['mlx']}; median of {args.repeats}). Boolean and additive outputs "
         f"differ by at most {agree:.3g}.", "", "| run | median ms | vs causal |", "|---|---:|---:|"]
lines += [f"| {r['run']} | {r['median_ms']:.3f} | {r['vs_causal']:.2f}x |" for r in rows]
write_json_and_markdown(args.out, {"meta": meta, "rows": rows}, lines)
