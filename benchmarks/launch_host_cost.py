"""Host cost of issuing one kernel from Python, by the way it is issued, on a GPU back end.

    python benchmarks/launch_host_cost.py --out benchmarks/results/gpu/launch-host-cost

A decode step of our 4-bit weights makes about as many kernels as MLX's affine one, yet its
host time was about twice affine's (`weights_gpu_model_decode.py`). This measures, per call,
(1) building the graph node ("build us": the Python call that returns the lazy array) and
(2) issuing it ("dispatch us": `mx.async_eval` of a graph of `--batch` independent such
nodes, divided by their number; the GPU's own run is excluded by synchronizing first), for:

  builtin-op         mx.quantized_matmul, MLX affine 4-bit (what affine decode issues)
  trivial-kernel     mx.fast.cuda_kernel with a one-line body
  trivial-compiled   the same under mx.compile
  lut-kernel         our rotating LUT matmul (`weights/rotating_matmul.py`), as its route issues it
                     uncompiled
  lut-compiled       the same under mx.compile (the library's default route)
  lut-group-compiled the q/k/v grouped launch under mx.compile, per launch

Median of `--rounds`; each shape is the Llama-3.1-8B q_proj's (4096 x 4096, one row).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from veloxquant_mlx.weights import QuantizedLinear, kernel, rotating_matmul

TRIVIAL = "int elem = blockIdx.x * blockDim.x + threadIdx.x; out[elem] = inp[elem];"  # grid = dim threads


def per_call_us(issue, batch: int, rounds: int) -> tuple:
    """(build us, dispatch us) per call of `issue()`, medians over rounds."""
    builds, dispatches = [], []
    for _ in range(rounds):
        mx.synchronize()
        start = time.perf_counter()
        outs = [issue() for _ in range(batch)]
        built = time.perf_counter()
        mx.async_eval(outs)
        dispatched = time.perf_counter()
        mx.synchronize()
        builds.append(1e6 * (built - start) / batch)
        dispatches.append(1e6 * (dispatched - built) / batch)
        del outs
    return statistics.median(builds), statistics.median(dispatches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out", default="benchmarks/results/gpu/launch-host-cost")
    args = parser.parse_args()
    dim = args.dim
    x = mx.random.normal((1, 1, dim)).astype(mx.float16)
    affine = nn.QuantizedLinear(dim, dim, bias=False, group_size=64, bits=4)
    weight = mx.random.normal((dim, dim)) * dim ** -0.5
    ours = [QuantizedLinear.from_weight(weight, 4, seed=s) for s in range(3)]
    mx.eval(x, affine.parameters(), [layer.parameters() for layer in ours])

    issues = {"builtin-op": lambda: affine(x)}
    record = {"device": str(mx.default_device()), "args": vars(args), "rows": {}}
    dialect = kernel.dialect_for(x)
    if dialect == "cuda":
        trivial = mx.fast.cuda_kernel(name="trivial", input_names=["inp"], output_names=["out"], source=TRIVIAL)

        def trivial_call(inp):
            return trivial(inputs=[inp], grid=(dim, 1, 1), threadgroup=(256, 1, 1), output_shapes=[inp.shape],
                           output_dtypes=[inp.dtype])[0]
        trivial_compiled = mx.compile(trivial_call)
        issues.update({"trivial-kernel": lambda: trivial_call(x), "trivial-compiled": lambda: trivial_compiled(x)})
        signs = ours[0].rotation._signs(0, x.dtype, ours[0].get("input_scales"))
        mx.eval(signs)
        for name, compiled in (("lut-kernel", False), ("lut-compiled", True)):
            kernel.COMPILE_ROUTES = compiled
            route = rotating_matmul.route(ours[0], x, signs, dialect)
            issues[name] = lambda route=route: route(x)
        kernel.COMPILE_ROUTES = True
        group = rotating_matmul.group_route(ours, x, dialect)
        if group is not None:
            issues["lut-group-compiled"] = lambda: group(x)
    else:
        record["note"] = "no CUDA back end: only the builtin op's row"
    for issue in issues.values():  # warm-up: JIT and compile traces
        mx.eval(issue())
    for name, issue in issues.items():
        build, dispatch = per_call_us(issue, args.batch, args.rounds)
        record["rows"][name] = {"build_us": build, "dispatch_us": dispatch}
        print(json.dumps({"row": name, "build_us": round(build, 2), "dispatch_us": round(dispatch, 2)}), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(record, indent=2))
    lines = [f"| {record['device']}: how a kernel is issued | build us per call | dispatch us per call |",
             "|---|---:|---:|"]
    lines += [f"| {name} | {row['build_us']:.2f} | {row['dispatch_us']:.2f} |" for name, row in record["rows"].items()]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
