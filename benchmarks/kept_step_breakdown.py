"""Where a `keep_attended` cache's decode step goes: one decode step through 32 layers of caches
(Llama-3.1-8B's attention shapes: 8 kv heads, 32 query heads, head dim 128; no model), pieces of
the kept-token bookkeeping stubbed out in turn.

    python benchmarks/kept_step_breakdown.py --out DIR [--layers 32] [--context 4096] [--first N]
    python benchmarks/kept_step_breakdown.py --render DIR     (results.md from DIR/results.json)

Each layer's cache is prefilled with `--context` random tokens, then 40 decode steps are pipelined
as mlx-lm's generate loop pipelines them (build step t+1, async_eval it, wait for step t); the
median of the last 32 is reported: the step (wall) and the host's part (building and launching the
next step). Rows, each with fresh caches: `vq4`, `vq4` with a 24-token window, that window with
`keep_attended=3.33` (on a GPU: the fused step slides the window, the settling one compiled graph
before it, `KeptTokens.decode_step_sliding`), then the same with (a) the window slid op by op and
the step on the "decode" paths (`KeptTokens.decode_step`, `mse_kernel_step`), (b) the settling
stubbed out (nothing settles after the prefill; the fused step still reads the kept slots), (c) the
`kept_splits` kernel replaced by two empty splits (`--first 6`). The stubbed rows give wrong
attention: they measure cost only. First, a check that the fused step and
(a) agree (`agreement`: outputs and kept positions over 64 decode steps of one layer).
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
from veloxquant_mlx.kernels import ops as kernel_ops  # noqa: E402
from veloxquant_mlx.kernels import step as kernel_step  # noqa: E402

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


def agreement(context: int, steps: int = 64) -> dict:
    """One layer's cache decoding `steps` tokens with the fused step and with the window slid op by op
    (row (a)), from the same prefill and inputs: the largest difference of their attention outputs,
    and whether they kept the same positions."""
    route = cache_module.CompressedKVCache._route
    fused, sliding = prefilled(1, context, KEEP)[0], prefilled(1, context, KEEP)[0]
    cache_module.CompressedKVCache._route = lambda self, phase, queries, mask: (
        None if self is sliding and phase == "slide" else route(self, phase, queries, mask))
    worst, paths = 0.0, set()
    direction = mx.random.normal((DIM,))
    direction = direction / mx.linalg.norm(direction)
    try:
        for i in range(steps):
            # Every fifth token's key lies along the direction every query leans to: those draw attention.
            q = (mx.random.normal((1, QUERY_HEADS, 1, DIM)) + 4 * direction).astype(mx.float16)
            kv = mx.random.normal((1, HEADS, 1, DIM))
            kv = (mx.broadcast_to(16 * direction, kv.shape) if i % 5 == 0 else kv).astype(mx.float16)
            outs = []
            for c in (fused, sliding):
                c.update_and_fetch(kv, kv)
                outs.append(c.attend(q, DIM ** -0.5).astype(mx.float32))
                paths.add(c.last_path)
            worst = max(worst, mx.abs(outs[0] - outs[1]).max().item())
    finally:
        cache_module.CompressedKVCache._route = route
    held = [sorted(p for p in c.kept.positions.tolist() if p < kept_module.EMPTY) for c in (fused, sliding)]
    row = dict(max_abs_difference=worst, same_kept=held[0] == held[1], kept=len(held[0]), paths=sorted(paths))
    print(json.dumps(row), flush=True)
    return row


def rows(layers: int, context: int, first: int = 5) -> list:
    out = [timed("vq4", layers, context, {})]
    if first >= 3:
        out.append(timed("vq4, window 24", layers, context, dict(residual_length=24)))
    out.append(timed("window 24, keep_attended=3.33", layers, context, KEEP))
    if first <= 3:
        return out
    route = cache_module.CompressedKVCache._route

    def no_slide(self, phase, queries, mask):
        return None if self.kept is not None and phase == "slide" else route(self, phase, queries, mask)

    cache_module.CompressedKVCache._route = no_slide
    out.append(timed("(a) kept, the window slid op by op (no fused step)", layers, context, KEEP))
    cache_module.CompressedKVCache._route = route
    if first >= 5:
        sliding = kept_module.KeptTokens.decode_step_sliding
        kept_module.KeptTokens.decode_step_sliding = lambda self, *args: True
        out.append(timed("(b) kept, fused step, no settling (the prefill's kept slots)", layers, context, KEEP))
        kept_module.KeptTokens.decode_step_sliding = sliding
    if first >= 6:
        splits = kernel_ops.kept_splits

        def empty_splits(run, o, ml, *args):  # two splits of nothing (l = 0), made by two MLX ops
            extra = mx.zeros((o.shape[0], 2, *o.shape[2:]), o.dtype)
            return (mx.concatenate([o, extra], axis=1), mx.concatenate([ml, mx.zeros((*extra.shape[:3], 2))], axis=1),
                    args[-1])

        kernel_ops.kept_splits = empty_splits
        kernel_step._step_fn.cache_clear()  # the compiled steps traced the kernel: trace them again
        try:
            out.append(timed("(c) kept, fused step, the kept_splits kernel replaced by two empty splits", layers,
                             context, KEEP))
        finally:
            kernel_ops.kept_splits = splits
            kernel_step._step_fn.cache_clear()
    return out


def render(folder: Path):
    data = json.loads((folder / "results.json").read_text())
    lines = [f"One decode step through {data['layers']} layers of caches (8 kv heads, 32 query heads, head dim 128), "
             f"{data['context']} tokens prefilled, steps pipelined; median of 32 steps. Device: {data['device']}.", "",
             "| configuration | step ms | host ms | decode path | kept slots a layer |", "|---|---|---|---|---|"]
    for r in data["rows"]:
        lines.append(f"| {r['name']} | {r['step_ms']:.2f} | {r['host_ms']:.2f} | {r['path']} | "
                     f"{'' if r['kept_slots'] is None else r['kept_slots']} |")
    check = data.get("agreement")
    if check:
        lines += ["", f"Agreement, one layer, {data['context']} tokens then 64 decode steps, the fused step against the window "
                  f"slid op by op: largest output difference {check['max_abs_difference']:.2e}, same kept positions: "
                  f"{check['same_kept']} ({check['kept']} kept), paths {', '.join(check['paths'])}."]
    (folder / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--render", type=Path)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--first", type=int, default=6, help="run the first N rows only (2: vq4 and keep_attended; 6: every row)")
    args = parser.parse_args()
    if args.render:
        return render(args.render)
    if args.out is None:
        parser.error("give --out DIR (or --render DIR)")
    check = agreement(args.context)
    measured = rows(args.layers, args.context, args.first)
    args.out.mkdir(parents=True, exist_ok=True)
    device = f"{mx.default_device()}" + (f" ({mx.device_info().get('device_name', '')})" if mx.default_device().type == mx.DeviceType.gpu else "")
    (args.out / "results.json").write_text(json.dumps(dict(layers=args.layers, context=args.context, device=device,
                                                           rows=measured, agreement=check), indent=1))
    render(args.out)


if __name__ == "__main__":
    main()
