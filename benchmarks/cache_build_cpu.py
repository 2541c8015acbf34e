"""The cache's own host time per decode step and layer, on the CPU, for the GPU kernel paths.

On a GPU a decode step at short contexts is bound by the host (docs/engine.md, nineteenth and twentieth
sessions), and device time is scarce. This measures, without a GPU, the part of that host time the cache
itself spends: `update_and_fetch` + `attend` of one layer, graph construction only, with the CUDA back
end's routing (the fused decode step, the window slid by its kernel) and the kernels replaced by lazy
zero outputs of their planned shapes. It leaves out what only the GPU machine has (MLX's CUDA launches,
its compiled-call overhead, the model's layers), so compare configs and contexts with each other, not
with `host_probe.py`'s figures. The mean over many steps includes the steps on which a compiled decode
step traces itself again (a new shape); the traces column counts them (partial-kernel plans seen).

    python benchmarks/cache_build_cpu.py --contexts 4096,131072 \
        --methods "turboquant_mse:3:vbits=4,turboquant_mse:3:vbits=4,sinks=4,window=64,center=true" --out DIR
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from veloxquant_mlx import EngineSettings  # noqa: E402
from veloxquant_mlx.cache import CompressedKVCache  # noqa: E402
from veloxquant_mlx.evaluation.specs import parse_method_list  # noqa: E402
from veloxquant_mlx.kernels import check, launch, ops  # noqa: E402


TRACED = []  # the partial kernels' plans seen by the runner: a compiled decode step calls it only when it traces


def lazy_zeros_runner(plan, inputs, shapes=None):
    """A kernel runner whose outputs are zeros of the plan's shapes, depending on the inputs (so the
    graph keeps its shape and nothing is computed before evaluation)."""
    if plan.kernel.startswith(("partial", "mse_partial")):
        TRACED.append(plan.kernel)
    shapes = shapes or plan.output_shapes
    anchor = inputs[0].reshape(-1)[:1].astype(mx.float32) * 0
    return [mx.zeros(shape, launch._DTYPES[dtype]) + anchor.astype(launch._DTYPES[dtype])
            for shape, dtype in zip(shapes, plan.output_dtypes)]


def build_us(config, context: int, layers: int, steps: int, kv_heads: int = 8, heads: int = 32,
             dim: int = 128) -> dict:
    settings = EngineSettings.resolve(backend="cuda", kernels=True)
    caches = [CompressedKVCache(config, settings=settings) for _ in range(layers)]
    prompt = mx.random.normal((1, kv_heads, context, dim), key=mx.random.key(0)).astype(mx.float16)
    for cache in caches:
        cache.update_and_fetch(prompt, prompt)
        cache.flush()
    del prompt
    queries = mx.random.normal((1, heads, 1, dim), key=mx.random.key(1)).astype(mx.float16)
    token = mx.random.normal((1, kv_heads, 1, dim), key=mx.random.key(2)).astype(mx.float16)

    def step():
        outs = []
        for cache in caches:
            cache.update_and_fetch(token, token)
            outs.append(cache.attend(queries, 0.088))
        return outs

    for _ in range(3):  # the compiled step traces
        mx.eval(step())
    times = []
    TRACED.clear()
    for _ in range(steps):
        start = time.perf_counter()
        outs = step()
        times.append(time.perf_counter() - start)
        mx.eval(outs)
    path = caches[0].last_path
    caches.clear()
    gc.collect()
    mx.clear_cache()
    traced = len(TRACED)  # the layers share one compiled step per shape: a new shape traces once
    return {"build_us_per_layer": 1e6 * statistics.median(times) / layers,
            "mean_build_us_per_layer": 1e6 * statistics.mean(times) / layers,
            "traces": traced, "decode_path": path}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", required=True)
    parser.add_argument("--contexts", default="4096")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    ops._RUNNERS["cuda"] = lazy_zeros_runner
    check.usable = lambda name: True  # no CUDA kernel runs here, so there is nothing to check
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        for spec in parse_method_list(args.methods):
            if spec.config is None:
                continue
            row = {"method": spec.label, "context": context, **build_us(spec.config, context, args.layers, args.steps)}
            rows.append(row)
            print(row, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    lines = ["| method | context | cache build us / layer / step (median, mean) | compiled-step traces "
             f"in {args.steps} steps (all layers) | decode path |", "|---|---|---|---|---|"]
    lines += [f"| `{r['method']}` | {r['context']} | {r['build_us_per_layer']:.1f}, {r['mean_build_us_per_layer']:.1f} "
              f"| {r['traces']} | {r['decode_path']} |" for r in rows]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
