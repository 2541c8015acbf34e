"""The plain LUT matmul kernel's chunk layouts and rows per warp, one layer at a time, against
MLX's affine 4-bit quantized matmul of the same shape (GPU only).

    python benchmarks/weights_lut_variants.py --out benchmarks/results/gpu/weights-lut-variants

For each shape (default: Llama-3.1-8B's down_proj 14336 -> 4096 and o_proj 4096 -> 4096, one
batch row, float16), each variant of `kernel.plan` (layout "word" / "vec", rows per warp)
runs `--calls` launches per round in one evaluated graph; the table gives the median over
`--rounds` rounds of the time per launch (launch costs included, as in a decode step), and
the largest difference from the default variant's output (all variants compute the same sums
in another order).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from veloxquant_mlx.kernels import launch
from veloxquant_mlx.weights import QuantizedLinear, kernel

VARIANTS = (("word", 1), ("word", 2), ("vec", 1), ("vec", 2), ("vec", 4))


def per_call_us(fn, calls: int, rounds: int) -> float:
    mx.eval([fn() for _ in range(calls)])  # compile, warm up
    times = []
    for _ in range(rounds):
        mx.synchronize()
        start = time.perf_counter()
        mx.eval([fn() for _ in range(calls)])
        mx.synchronize()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="14336x4096,4096x4096", help="in x out, comma separated")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dialect = kernel._gpu_dialect()
    if dialect is None:
        raise SystemExit("needs a GPU back end (cuda / metal)")
    rng = np.random.default_rng(0)
    records = []
    for shape in args.shapes.split(","):
        d_in, d_out = (int(v) for v in shape.split("x"))
        weight = mx.array(rng.standard_normal((d_out, d_in)).astype(np.float32) * 0.02)
        layer = QuantizedLinear.from_weight(weight, 4).with_rotated_input()
        x = mx.array(rng.standard_normal((1, d_in)).astype(np.float32)).astype(mx.float16)
        affine = nn.QuantizedLinear.from_linear(nn.Linear(d_in, d_out, bias=False), group_size=64, bits=4)
        affine.weight, affine.scales, affine.biases = mx.quantize(weight.astype(mx.float16), group_size=64, bits=4)
        mx.eval(layer.parameters(), affine.parameters(), x)
        row = {"shape": shape, "affine_us": per_call_us(lambda: affine(x), args.calls, args.rounds), "variants": {}}
        reference = None
        for layout, rpw in VARIANTS:
            plan = kernel.plan(1, d_in, d_out, 4, 1, "float16", "float16", layout=layout, rpw=rpw)
            inputs = [x, layer.codes, layer.scales, layer.codebook]

            def run(plan=plan, inputs=inputs):
                return launch.run_mlx(dialect, plan, inputs)[0]
            out = run().astype(mx.float32)
            reference = out if reference is None else reference
            row["variants"][f"{layout}/rpw{rpw}"] = {
                "us": per_call_us(run, args.calls, args.rounds),
                "max_abs_diff_vs_first": float(mx.max(mx.abs(out - reference))),
                "blocks": plan.grid[0] // plan.threadgroup[0]}
        records.append(row)
        print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"device": str(mx.default_device()), "args": vars(args),
                                                  "records": records}, indent=2))
    names = [f"{layout}/rpw{rpw}" for layout, rpw in VARIANTS]
    lines = ["| in x out (1 row, fp16, 4-bit) | MLX affine us | " + " | ".join(f"{n} us" for n in names) + " |",
             "|---|---:|" + "---:|" * len(names)]
    for r in records:
        lines.append(f"| {r['shape']} | {r['affine_us']:.1f} | "
                     + " | ".join(f"{r['variants'][n]['us']:.1f}" for n in names) + " |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
