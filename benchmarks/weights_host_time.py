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
per layer), `shared` (ours, shared input rotations; only where the checkout has them).
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
                           intermediate_size=2 * hidden, num_attention_heads=8, num_key_value_heads=2,
                           rms_norm_eps=1e-5, vocab_size=256, tie_word_embeddings=False)
    mx.random.seed(0)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def stand_in_kernel(*_args, **_kwargs):
    def run(inputs, template, grid, threadgroup, output_shapes, output_dtypes, **_):
        return [mx.zeros(output_shapes[0], output_dtypes[0])]
    return run


def host_ms(model, rounds: int) -> float:
    return model_decode.host_ms(model, rounds, prompt=4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5, help="variants take turns this many times")
    parser.add_argument("--label", default="", help="a name for this checkout in the table")
    parser.add_argument("--out", default="benchmarks/results/weights-host-time-cpu")
    args = parser.parse_args()
    kernel._gpu_dialect = lambda: "cuda"  # the GPU route, with the stand-in kernel below
    launch._mlx_kernel = stand_in_kernel
    shares = "share_rotations" in inspect.signature(quantize_model).parameters
    models = {}
    affine = tiny_llama(args.layers, args.hidden)
    nn.quantize(affine, group_size=64, bits=4)
    models["affine"] = affine
    for variant in ("per-layer", "shared") if shares else ("per-layer",):
        model = tiny_llama(args.layers, args.hidden)
        extra = {"share_rotations": variant == "shared"} if shares else {}
        quantize_model(model, 4, skip=("lm_head",), progress=False, **extra)
        models[variant] = model
    times = {name: [] for name in models}
    for _ in range(args.repeats):
        for name, model in models.items():
            times[name].append(host_ms(model, args.rounds))
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
