"""Where a `keep_attended` cache's decode step goes: one decode step through 32 layers of caches
(Llama-3.1-8B's attention shapes: 8 kv heads, 32 query heads, head dim 128; no model), pieces of
the kept-token bookkeeping stubbed out in turn.

    python benchmarks/kept_step_breakdown.py --out DIR [--layers 32] [--context 4096] [--first N]
    python benchmarks/kept_step_breakdown.py --render DIR     (results.md from DIR/results.json)

Each layer's cache is prefilled with `--context` random tokens, then 40 decode steps are pipelined
as mlx-lm's generate loop pipelines them (build step t+1, async_eval it, wait for step t); the
median of the last 32 is reported: the step (wall) and the host's part (building and launching the
next step). Rows, each with fresh caches: `vq4`, `vq4` with a 24-token window, that window with
`keep_attended=3.33`, then the same with (a) the general bookkeeping (`KeptTokens.add_shares` and
`settle`, not a decode step's one compiled graph, `KeptTokens.decode_step`) with the window shares
replaced by zeros (no share computation; the running shares and settling still run), (b) the kept tokens' code split replaced
by an empty one (GPU kernel step only), (c) no shares at all (nothing is ever settled), (d) no
bookkeeping call at all. The stubbed rows give wrong attention: they measure cost only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from veloxquant_mlx import CompressedKVCache, KVCacheConfig  # noqa: E402
from veloxquant_mlx import cache as cache_module  # noqa: E402
from veloxquant_mlx import kept as kept_module  # noqa: E402
from veloxquant_mlx.kernels import step as step_module  # noqa: E402

HEADS, QUERY_HEADS, DIM, STEPS, WARM = 8, 32, 128, 40, 8
VQ4 = KVCacheConfig.preset("vq4")
KEEP = dict(residual_length=24, options={**VQ4.options, "keep_attended": 3.33})


def prefilled(layers: int, context: int, overrides: dict) -> list:
    caches = [CompressedKVCache(KVCacheConfig.preset("vq4", **overrides)) for _ in range(layers)]
    mx.random.seed(0)
    for c in caches:
        k = mx.random.normal((1, HEADS, context, DIM)).astype(mx.float16)
        v = mx.random.normal((1, HEADS, context, DIM)).astype(mx.float16)
        q = mx.random.normal((1, QUERY_HEADS, context, DIM)).astype(mx.float16)
        for s in range(0, context, 2048):
            c.update_and_fetch(k[..., s : s + 2048, :], v[..., s : s + 2048, :])
            mx.eval(c.attend(q[..., s : s + 2048, :], DIM ** -0.5, mask="causal"))
    return caches


def decode_step(caches: list, x: mx.array) -> mx.array:
    out = x
    for c in caches:
        kv = out[:, :HEADS]
        c.update_and_fetch(kv, kv)
        out = c.attend(out, DIM ** -0.5).astype(mx.float16) * 0.5 + x
    return out


def timed(name: str, layers: int, context: int, overrides: dict) -> dict:
    caches = prefilled(layers, context, overrides)
    x = mx.random.normal((1, QUERY_HEADS, 1, DIM)).astype(mx.float16)
    y = decode_step(caches, x)
    mx.async_eval(y)
    steps, hosts = [], []
    for i in range(STEPS):
        t0 = time.perf_counter()
        following = decode_step(caches, y * 0.01 + x)
        mx.async_eval(following)
        t1 = time.perf_counter()
        mx.eval(y)
        y = following
        if i >= WARM:
            steps.append(time.perf_counter() - t0)
            hosts.append(t1 - t0)
    mx.eval(y)
    steps.sort()
    hosts.sort()
    row = dict(name=name, step_ms=1e3 * steps[len(steps) // 2], host_ms=1e3 * hosts[len(hosts) // 2],
               path=caches[0].last_path, kept_slots=caches[-1].kept.capacity if caches[-1].kept else None)
    print(json.dumps(row), flush=True)
    return row


def rows(layers: int, context: int, first: int = 7) -> list:
    out = [timed("vq4", layers, context, {})]
    if first >= 3:
        out.append(timed("vq4, window 24", layers, context, dict(residual_length=24)))
    out.append(timed("window 24, keep_attended=3.33", layers, context, KEEP))
    if first <= 3:
        return out
    shares, one_graph = cache_module.window_shares, kept_module.KeptTokens.decode_step
    kept_module.KeptTokens.decode_step = lambda self, *args: False  # the general path, which calls window_shares
    cache_module.window_shares = lambda queries, scale, sinks, span, *rest: mx.zeros((span.shape[2],), mx.float32)
    out.append(timed("(a) no share computation", layers, context, KEEP))
    cache_module.window_shares, kept_module.KeptTokens.decode_step = shares, one_graph
    split = step_module.kept_code_split

    def empty_split(h, queries, scale):
        B, n_heads, _, dim = queries.shape
        rep = n_heads // h.kv_heads
        return mx.zeros((B * h.kv_heads, 1, rep, dim)), mx.full((B * h.kv_heads, 1, rep, 2), -mx.inf)

    step_module.kept_code_split = empty_split
    out.append(timed("(b) no code split", layers, context, KEEP))
    step_module.kept_code_split = split
    keep = cache_module.CompressedKVCache._keep_attended
    cache_module.CompressedKVCache._keep_attended = lambda self, q, s: self.kept.settle(self.sinks + self.encoded,
                                                                                     self.just_encoded)
    out.append(timed("(c) no shares (nothing settles)", layers, context, KEEP))
    cache_module.CompressedKVCache._keep_attended = lambda self, q, s: None
    out.append(timed("(d) no bookkeeping call", layers, context, KEEP))
    cache_module.CompressedKVCache._keep_attended = keep
    return out


def render(folder: Path):
    data = json.loads((folder / "results.json").read_text())
    lines = [f"One decode step through {data['layers']} layers of caches (8 kv heads, 32 query heads, head dim 128), "
             f"{data['context']} tokens prefilled, steps pipelined; median of 32 steps. Device: {data['device']}.", "",
             "| configuration | step ms | host ms | decode path | kept slots a layer |", "|---|---|---|---|---|"]
    for r in data["rows"]:
        lines.append(f"| {r['name']} | {r['step_ms']:.2f} | {r['host_ms']:.2f} | {r['path']} | "
                     f"{'' if r['kept_slots'] is None else r['kept_slots']} |")
    (folder / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--render", type=Path)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--first", type=int, default=7, help="run the first N rows only (2: vq4 and keep_attended)")
    args = parser.parse_args()
    if args.render:
        return render(args.render)
    if args.out is None:
        parser.error("give --out DIR (or --render DIR)")
    measured = rows(args.layers, args.context, args.first)
    args.out.mkdir(parents=True, exist_ok=True)
    device = f"{mx.default_device()}" + (f" ({mx.device_info().get('device_name', '')})" if mx.default_device().type == mx.DeviceType.gpu else "")
    (args.out / "results.json").write_text(json.dumps(dict(layers=args.layers, context=args.context, device=device,
                                                           rows=measured), indent=1))
    render(args.out)


if __name__ == "__main__":
    main()
