"""Host cost of building one call (no evaluation), by what is called: where our layers' decode
calls spend their build time on a GPU back end.

    python benchmarks/compiled_call_cost.py --out benchmarks/results/gpu/compiled-call-cost

`dispatch_breakdown.py` found our q/k/v call (one compiled launch) costing 20-30 us to build on
the H200, against 1-2 us for a compiled call of a plain op on the CPU. This times, per call
(median over `--rounds` of `--calls` calls each, nothing evaluated), on one block of the
Llama-3.1-8B shape quantized as the library does (2 layers):

  affine q_proj          MLX's nn.QuantizedLinear
  ours q,k,v             our q_proj call (its route launches q, k and v) plus k_proj and v_proj
  ours o_proj            our o_proj (one compiled launch)
  ours mlp               our compiled MLP
  plain op, compiled     mx.compile of x * 2 with 11 array inputs
  trivial kernel         mx.fast.cuda_kernel / metal_kernel with a one-line body and 11 inputs,
                         uncompiled and compiled
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx

from veloxquant_mlx.weights import kernel

from dispatch_breakdown import quantized  # benchmarks/ (run as a script from the repo root)

TRIVIAL = "int elem = blockIdx.x * blockDim.x + threadIdx.x; out[elem] = a0[elem];"
TRIVIAL_METAL = "uint elem = thread_position_in_grid.x; out[elem] = a0[elem];"


def per_call_us(call, calls: int, rounds: int) -> float:
    for _ in range(20):
        call()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - start) / calls)
    return 1e6 * statistics.median(times)


def trivial_kernel(dialect: str, inputs: int):
    make = mx.fast.cuda_kernel if dialect == "cuda" else mx.fast.metal_kernel
    kern = make(name="trivial_copy", input_names=[f"a{i}" for i in range(inputs)], output_names=["out"],
                source=TRIVIAL if dialect == "cuda" else TRIVIAL_METAL)

    def run(*arrays):
        return kern(inputs=list(arrays), grid=(arrays[0].size, 1, 1), threadgroup=(256, 1, 1),
                    output_shapes=[arrays[0].shape], output_dtypes=[arrays[0].dtype])[0]
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default="benchmarks/results/gpu/compiled-call-cost")
    args = parser.parse_args()
    overrides = {"num_hidden_layers": 2}
    affine, ours = quantized("affine", args.shape, overrides), quantized("codebook", args.shape, overrides)
    hidden = ours.args.hidden_size
    x = mx.random.normal((1, 1, hidden), key=mx.random.key(0)).astype(mx.float16)
    small = [mx.random.normal((1, 1, 4096), key=mx.random.key(i)).astype(mx.float16) for i in range(11)]
    mx.eval(x, small)
    a_attn = affine.model.layers[0].self_attn
    attn, mlp = ours.model.layers[0].self_attn, ours.model.layers[0].mlp
    for _ in range(3):  # make the routes and the compiled traces
        mx.eval(attn.q_proj(x), attn.k_proj(x), attn.v_proj(x), attn.o_proj(x), mlp(x))

    plain = mx.compile(lambda *a: a[0] * 2)
    calls = {
        "affine q_proj": lambda: a_attn.q_proj(x),
        "ours q,k,v": lambda: (attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)),
        "ours o_proj": lambda: attn.o_proj(x),
        "ours mlp": lambda: mlp(x),
        "plain op, compiled, 11 inputs": lambda: plain(*small),
    }
    dialect = kernel._gpu_dialect()
    if dialect:
        run = trivial_kernel(dialect, 11)
        compiled_run = mx.compile(run)
        mx.eval(run(*small), compiled_run(*small))
        calls["trivial kernel, 11 inputs"] = lambda: run(*small)
        calls["trivial kernel, 11 inputs, compiled"] = lambda: compiled_run(*small)
    record = {name: per_call_us(call, args.calls, args.rounds) for name, call in calls.items()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"device": str(mx.default_device()), "dialect": dialect,
                                                  "args": vars(args), "build_us": record}, indent=2))
    lines = [f"| call ({mx.default_device()}, {args.shape} block) | build us (median of {args.rounds}) |", "|---|---:|"]
    lines += [f"| {name} | {us:.2f} |" for name, us in record.items()]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
