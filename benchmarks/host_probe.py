"""Is a decode step bound by the host or by the GPU? The benchmark's pipelined decode (the next step queued
while the current one runs) times each step's graph build and `mx.async_eval`; but `async_eval` can also wait
for the GPU, so an equal step and host time does not prove the host is the limit. Here each step runs
alone: build its graph, wait until the GPU is idle, time `async_eval` (the launch cost with nothing to wait
for), then time the rest until its token is ready (GPU work left after the launch). Build + launch against
the pipelined step says which side sets the pace.

    python benchmarks/host_probe.py --context 4096 --methods "fp16,turboquant_mse:3:vbits=4" [--rounds 3] --out DIR

Each step's medians are over every round's steps (the first two of each turn, which compile, left out);
the last column gives each round's median build + launch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx

from veloxquant_mlx.evaluation.benchmark import prefill
from veloxquant_mlx.evaluation.shapes import build_shape_model
from veloxquant_mlx.evaluation.specs import parse_method_list


def probe(model, spec, tokens, steps: int, chunk: int) -> dict:
    caches = spec.make_caches(model)
    token, _ = prefill(model, caches, tokens, chunk, lambda: None)
    build, launch, rest = [], [], []
    for _ in range(steps):
        mx.synchronize()
        start = time.perf_counter()
        nxt = mx.argmax(model(token[:, None], cache=caches)[:, -1, :], axis=-1)
        built = time.perf_counter()
        mx.synchronize()
        queued = time.perf_counter()
        mx.async_eval(nxt)
        launched = time.perf_counter()
        mx.eval(nxt)
        done = time.perf_counter()
        build.append(built - start)
        launch.append(launched - queued)
        rest.append(done - launched)
        token = nxt
    del caches
    mx.clear_cache()
    return {"build": build[2:], "launch": launch[2:], "rest": rest[2:]}  # the first two steps compile


def _ms(seconds) -> float:
    return 1000 * statistics.median(seconds)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--weights-bits", type=int, default=4)
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--methods", required=True)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=1,
                        help="the methods take turns this many times (the host's speed drifts between turns)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    model = build_shape_model(args.shape, args.dtype, args.weights_bits)
    tokens = mx.random.randint(0, 1000, (1, args.context), key=mx.random.key(0)).astype(mx.uint32)
    specs = parse_method_list(args.methods)
    turns = [[probe(model, spec, tokens, args.steps, args.chunk) for spec in specs] for _ in range(args.rounds)]
    rows = []
    for i, spec in enumerate(specs):
        mine = [turn[i] for turn in turns]
        row = {"method": spec.label}
        for key, name in (("build", "build_ms"), ("launch", "launch_ms"), ("rest", "gpu_after_launch_ms")):
            row[name] = _ms([t for m in mine for t in m[key]])
            row[name + "_per_round"] = [_ms(m[key]) for m in mine]
        rows.append(row)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    lines = ["| method | build ms | launch ms (GPU idle) | GPU after launch ms | build + launch per round |",
             "|---|---|---|---|---|"]
    for r in rows:
        per_round = ", ".join(f"{b + l:.2f}" for b, l in zip(r["build_ms_per_round"], r["launch_ms_per_round"]))
        lines.append(f"| `{r['method']}` | {r['build_ms']:.2f} | {r['launch_ms']:.2f} | {r['gpu_after_launch_ms']:.2f} "
                     f"| {per_round} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
