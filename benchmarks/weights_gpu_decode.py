"""Decode-step matmuls of one Llama-3.1-8B block (M = 1 token) on the GPU: our 4-bit codebook
layers (input rotation + LUT kernel) vs MLX's affine 4-bit `nn.QuantizedLinear` (group 64) vs fp16.

    python -m veloxquant_mlx.weights.selftest                # correctness first
    python benchmarks/weights_gpu_decode.py --out benchmarks/results/gpu/weights-decode

Random weights (the speed does not depend on them). Each timing runs the block's seven
projections (q, k, v, o, gate, up, down) `--steps` times inside one graph per step, after
`--warmup` steps, and reports the median over `--repeats` of the mean time per block.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from veloxquant_mlx.weights import QuantizedLinear

LLAMA_8B = {"q_proj": (4096, 4096), "k_proj": (1024, 4096), "v_proj": (1024, 4096), "o_proj": (4096, 4096),
            "gate_proj": (14336, 4096), "up_proj": (14336, 4096), "down_proj": (4096, 14336)}


def build(kind: str, bits: int, dtype):
    layers = {}
    for name, (out, inp) in LLAMA_8B.items():
        linear = nn.Linear(inp, out, bias=False)
        linear.set_dtype(dtype)
        mx.eval(linear.parameters())
        if kind == "vq":
            layer = QuantizedLinear.from_weight(linear.weight, bits, seed=1)
        elif kind == "affine":
            layer = nn.QuantizedLinear.from_linear(linear, group_size=64, bits=bits)
        else:
            layer = linear
        mx.eval(layer.parameters())
        layers[name] = layer
    return layers


def step(layers, x_hidden, x_mlp, rotation_only: bool = False):
    def run(layer, x):
        return layer.rotation.apply(x, layer.get("input_scales")) if rotation_only else layer(x)

    outs = [run(layers[n], x_hidden) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj")]
    outs.append(run(layers["down_proj"], x_mlp))
    return outs


def time_block(layers, dtype, steps: int, warmup: int, repeats: int, tokens: int = 1,
               rotation_only: bool = False, one_graph: bool = False) -> float:
    x_hidden = mx.random.normal((1, tokens, 4096)).astype(dtype)
    x_mlp = mx.random.normal((1, tokens, 14336)).astype(dtype)
    for _ in range(warmup):
        mx.eval(step(layers, x_hidden, x_mlp, rotation_only))
    results = []
    for _ in range(repeats):
        mx.synchronize()
        start = time.perf_counter()
        if one_graph:  # as in a model's decode step: many blocks' matmuls in one graph
            mx.eval([step(layers, x_hidden, x_mlp, rotation_only) for _ in range(steps)])
        else:
            for _ in range(steps):
                mx.eval(step(layers, x_hidden, x_mlp, rotation_only))
        mx.synchronize()
        results.append((time.perf_counter() - start) / steps)
    return statistics.median(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kinds", default="fp16,affine,vq",
                        help="fp16, affine, vq, and vq-rotation (the input rotations of the vq layers alone)")
    parser.add_argument("--one-graph", action="store_true",
                        help="evaluate all --steps blocks in one graph (no host sync between blocks)")
    parser.add_argument("--tokens", type=int, default=1, help="rows per matmul (1: decode; e.g. 512: prefill)")
    parser.add_argument("--out", default="benchmarks/results/gpu/weights-decode")
    args = parser.parse_args()
    dtype = getattr(mx, args.dtype)
    rows = []
    for kind in args.kinds.split(","):
        layers = build("vq" if kind == "vq-rotation" else kind, args.bits, dtype)
        seconds = time_block(layers, dtype, args.steps, args.warmup, args.repeats, args.tokens,
                             rotation_only=kind == "vq-rotation", one_graph=args.one_graph)
        rows.append({"kind": kind, "bits": None if kind == "fp16" else args.bits, "ms_per_block": 1e3 * seconds})
        print(json.dumps(rows[-1]), flush=True)
        del layers
    base = {r["kind"]: r["ms_per_block"] for r in rows}
    for r in rows:
        if "affine" in base:
            r["speed_vs_affine"] = base["affine"] / r["ms_per_block"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"device": str(mx.default_device()), "args": vars(args),
                                                  "rows": rows}, indent=2))
    graph = "all blocks in one graph" if args.one_graph else "one graph per block"
    lines = [f"| weights | ms per Llama-3.1-8B block ({args.tokens} token(s), {graph}) | speed vs affine |", "|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['ms_per_block']:.4f} | {r.get('speed_vs_affine', float('nan')):.2f}x |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
