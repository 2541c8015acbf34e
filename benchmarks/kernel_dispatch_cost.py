"""What one custom-kernel node costs MLX to dispatch, by what the node carries.

    python benchmarks/kernel_dispatch_cost.py --out benchmarks/results/gpu/kernel-dispatch-cost

`dispatch_breakdown.py` found our decode step's nodes costing the dispatch (`mx.async_eval`)
about 2.5 times as much each as affine's, with the CUDA API calls alike. This times chains of
`--nodes` dependent nodes on a (1, 4096) fp16 row, nothing else in the graph (median of
`--rounds`, the device idle before each), per node:

  multiply                    a built-in elementwise op
  affine qmv                  mx.quantized_matmul, 4096 x 4096, 4 bits, group 64
  trivial kernel              mx.fast.cuda_kernel / metal_kernel copying its input, 1 input
  ... + N inputs / T template constants / 3 outputs / a K-byte header
                              the same kernel varied one property at a time
  trivial kernel, compiled    the same under mx.compile
  ours, one layer             our rotating LUT matmul kernel, 4096 x 4096
  ours, q/k/v launch          our grouped kernel for 4096 -> 4096, 1024, 1024 (q output chained)
  ours, layer call            a QuantizedLinear's decode call (its kept, compiled route)
  hadamard D                  mx.hadamard_transform of a (1, D) row (14336: 28 x 512, the MLP's width)

and, chained the same way, each part of one block of the Llama-3.1-8B shape (random weights,
1 layer, quantized as `dispatch_breakdown.quantized`), affine against ours: the o projection,
the MLP, the attention without a cache and the whole block without a cache.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx

from veloxquant_mlx.weights import QuantizedLinear, rotating_matmul

from dispatch_breakdown import quantized, timed  # benchmarks/ (run as a script from the repo root)

DIM = 4096


def timed_chain(step, x: mx.array, nodes: int, rounds: int) -> dict:
    """Build and dispatch us per node of `nodes` applications of `step` from x."""
    def chain():
        y = x
        for _ in range(nodes):
            y = step(y)
        return [y]
    record = timed(chain, rounds)
    return {"build_us": record["build_us"] / nodes, "dispatch_us": record["dispatch_us"] / nodes}


def copy_kernel(dialect: str, inputs: int = 1, outputs: int = 1, template: int = 0, header_bytes: int = 0,
                compiled: bool = False):
    cuda = dialect == "cuda"
    index = "int elem = blockIdx.x * blockDim.x + threadIdx.x;" if cuda else "uint elem = thread_position_in_grid.x;"
    body = index + "".join(f" out{i}[elem] = a0[elem];" for i in range(outputs))
    header = ("// " + "x" * (header_bytes - 4) + "\n") if header_bytes else ""
    make = mx.fast.cuda_kernel if cuda else mx.fast.metal_kernel
    name = f"dispatch_copy_{inputs}_{outputs}_{template}_{header_bytes}"
    kern = make(name=name, input_names=[f"a{i}" for i in range(inputs)],
                output_names=[f"out{i}" for i in range(outputs)], source=body, header=header,
                ensure_row_contiguous=True)
    extras = [mx.zeros((64,), dtype=mx.float16) for _ in range(inputs - 1)]
    constants = [(f"T{i}", i) for i in range(template)]

    def run(y, *more):
        return kern(inputs=[y, *more], template=constants or None, grid=(DIM, 1, 1), threadgroup=(256, 1, 1),
                    output_shapes=[y.shape] * outputs, output_dtypes=[y.dtype] * outputs)[0]
    if compiled:
        run = mx.compile(run)
    mx.eval(extras)
    return lambda y: run(y, *extras)


def ours(dialect: str):
    def layer(out_features: int, seed: int) -> QuantizedLinear:
        w = mx.random.normal((out_features, DIM), key=mx.random.key(seed)).astype(mx.float16) * 0.02
        return QuantizedLinear.from_weight(w, 4, seed=seed)
    q, k, v = layer(DIM, 1), layer(1024, 2), layer(1024, 3)
    o = layer(DIM, 4)
    signs = [lay.rotation._signs(0, mx.float16, None) for lay in (q, k, v)]
    return {
        "ours, one layer": lambda y: rotating_matmul.rotating_matmul(y, q, signs[0], dialect),
        "ours, q/k/v launch": lambda y: rotating_matmul.group_matmul(y, [q, k, v], signs, dialect)[0],
        "ours, layer call": o,
    }


def block_parts(variant: str) -> dict:
    layer = quantized(variant, "llama-3.1-8b", {"num_hidden_layers": 1}).model.layers[0]
    attn = layer.self_attn
    width = attn.n_heads * attn.head_dim
    return {
        f"{variant}: o projection": attn.o_proj if width == DIM else None,
        f"{variant}: mlp": layer.mlp,
        f"{variant}: attention, no cache": lambda y: attn(y, mask=None, cache=None),
        f"{variant}: block, no cache": lambda y: layer(y, mask=None, cache=None),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default="benchmarks/results/gpu/kernel-dispatch-cost")
    args = parser.parse_args()
    dialect = "cuda" if mx.cuda.is_available() else "metal"
    row = mx.random.normal((1, DIM)).astype(mx.float16)
    wq, scales, biases = mx.quantize(mx.random.normal((DIM, DIM)).astype(mx.float16) * 0.02, group_size=64, bits=4)
    steps = {
        "multiply": lambda y: y * 1.0001,
        "affine qmv": lambda y: mx.quantized_matmul(y, wq, scales, biases, transpose=True, group_size=64, bits=4),
        "trivial kernel": copy_kernel(dialect),
        "trivial kernel, 11 inputs": copy_kernel(dialect, inputs=11),
        "trivial kernel, 12 template constants": copy_kernel(dialect, template=12),
        "trivial kernel, 3 outputs": copy_kernel(dialect, outputs=3),
        "trivial kernel, 8 KB header": copy_kernel(dialect, header_bytes=8192),
        "trivial kernel, 64 KB header": copy_kernel(dialect, header_bytes=65536),
        "trivial kernel, compiled": copy_kernel(dialect, compiled=True),
        **ours(dialect),
        "hadamard 4096": lambda y: mx.hadamard_transform(y),
        "hadamard 14336": lambda y: mx.hadamard_transform(y),
    }
    results = {}
    for variant in ("affine", "codebook"):
        parts = block_parts(variant)
        steps.update({name: step for name, step in parts.items() if step is not None})
    inputs = {"hadamard 14336": mx.random.normal((1, 14336)).astype(mx.float16)}
    for name, step in steps.items():
        x = inputs.get(name, row.reshape(1, 1, DIM) if ":" in name else row)
        mx.eval(step(x))  # first use: the JIT compile and the kernels' checks
        results[name] = timed_chain(step, x, args.nodes, args.rounds)
        print(json.dumps({name: results[name]}), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"device": str(mx.default_device()), "args": vars(args),
                                                  "per_node": results}, indent=2))
    lines = [f"| node ({mx.default_device()}, chains of {args.nodes}) | build us / node | dispatch us / node |",
             "|---|---:|---:|"]
    lines += [f"| {name} | {r['build_us']:.2f} | {r['dispatch_us']:.2f} |" for name, r in results.items()]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
