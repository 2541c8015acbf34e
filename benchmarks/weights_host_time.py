"""Host time to build one decode step's graph (not evaluated), on the CPU, with the GPU
kernel launch replaced by a stand-in: the Python cost of our layers' per-call path as a
GPU back end runs it (route lookup, rotation, launch arguments), without a GPU.

    PYTHONPATH=. python benchmarks/weights_host_time.py --out benchmarks/results/weights-host-time-cpu
    PYTHONPATH=/path/to/other/checkout python benchmarks/weights_host_time.py ...   # another version

The model is a random llama with the Llama-3.1-8B layer count (32) and small dims (graph
building does not depend on them). The kernel stand-in returns `mx.zeros` of the output
shape, so MLX's own cost of a custom-kernel call (building its source text) is not in
these numbers; the lead's GPU run (`weights_gpu_model_decode.py`) has it. Variants:
`affine` (MLX nn.quantize 4-bit, its quantized matmul), `per-layer` (ours, one rotation
per layer, as the library runs it: sibling launches and compiled routes), `per-layer-single`
(one launch per layer), `per-layer-uncompiled` (no route compiled), `per-layer-unfused-mlp` (each MLP as its layers'
calls, not one compiled call: `compiled_mlp.COMPILE_MLPS` off), `shared` (ours, shared
input rotations; only where the checkout has them). The MLP is 28 * hidden / 16 wide, a
Hadamard size that is not a power of two, as Llama-3.1-8B's 14336.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama

import veloxquant_mlx
from veloxquant_mlx.kernels import launch
from veloxquant_mlx.weights import kernel, quantize_model

import weights_gpu_model_decode as model_decode  # benchmarks/ (run as a script from the repo root)


def tiny_llama(layers: int, hidden: int) -> nn.Module:
    args = llama.ModelArgs(model_type="llama", hidden_size=hidden, num_hidden_layers=layers,
                           intermediate_size=28 * hidden // 16, num_attention_heads=8, num_key_value_heads=2,
                           rms_norm_eps=1e-5, vocab_size=256, tie_word_embeddings=False)
    mx.random.seed(0)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def stand_in_kernel(*_args, **_kwargs):
    def run(inputs, template, grid, threadgroup, output_shapes, output_dtypes, **_):
        return [mx.zeros(shape, dtype) for shape, dtype in zip(output_shapes, output_dtypes)]
    return run


def host_ms(model, rounds: int, profile: str = "") -> float:
    return model_decode.host_ms(model, rounds, prompt=4, profile=profile)[0]


def use(variant: str) -> None:
    """The settings a variant's routes are made under (each model makes them on its first step)."""
    from veloxquant_mlx.weights import compiled_mlp, rotating_matmul

    compiled_mlp.COMPILE_MLPS = not variant.endswith("-unfused-mlp")
    kernel.COMPILE_ROUTES = not variant.endswith("-uncompiled")
    rotating_matmul.SIBLING_LAUNCH = not variant.endswith("-single")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5, help="variants take turns this many times")
    parser.add_argument("--label", default="", help="a name for this checkout in the table")
    parser.add_argument("--profile", default="", help="comma-separated variants to cProfile (host-profile-NAME.txt)")
    parser.add_argument("--out", default="benchmarks/results/weights-host-time-cpu")
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    kernel._gpu_dialect = lambda: "cuda"  # the GPU route, with the stand-in kernel below
    launch._mlx_kernel = stand_in_kernel
    # the stand-in computes nothing, so the kernels' first-use checks would turn them off
    from veloxquant_mlx.weights import rotating_matmul
    rotating_matmul.usable = rotating_matmul.group_usable = lambda *_: True
    shares = "share_rotations" in inspect.signature(quantize_model).parameters
    models = {}
    affine = tiny_llama(args.layers, args.hidden)
    nn.quantize(affine, group_size=64, bits=4)
    models["affine"] = affine
    ours = ("per-layer", "per-layer-single", "per-layer-uncompiled", "per-layer-unfused-mlp", "shared")
    for variant in ours if shares else ("per-layer",):
        model = tiny_llama(args.layers, args.hidden)
        extra = {"share_rotations": variant == "shared"} if shares else {}
        quantize_model(model, 4, skip=("lm_head",), progress=False, **extra)
        models[variant] = model
    times = {name: [] for name in models}
    for repeat in range(args.repeats):
        for name, model in models.items():
            use(name)
            profile = (str(Path(args.out) / f"host-profile-{name}.txt") if repeat == 0 and name in args.profile.split(",")
                       else "")
            times[name].append(host_ms(model, args.rounds, profile))
    median = {name: statistics.median(t) for name, t in times.items()}
    record = {"checkout": str(Path(veloxquant_mlx.__file__).parent.parent), "label": args.label,
              "args": vars(args), "host_ms_per_step": times, "median_host_ms_per_step": median,
              "load_average": list(__import__("os").getloadavg())}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"results{'-' + args.label if args.label else ''}"
    (out / f"{name}.json").write_text(json.dumps(record, indent=2))
    lines = [f"| {args.label or 'this checkout'}: variant | host ms to build a decode step ({args.layers} layers, "
             f"GPU route, kernel stand-in; median of {args.repeats}) | vs affine |", "|---|---|---|"]
    for name_, value in median.items():
        lines.append(f"| {name_} | {value:.3f} | {value / median['affine']:.2f}x |")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
