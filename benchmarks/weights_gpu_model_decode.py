"""Whole-model decode of the Llama-3.1-8B shape (random weights, fp16 activations, mlx-lm's
fp16 KV cache): our 4-bit codebook weights against MLX's affine 4-bit (group 64), in one run.

    python benchmarks/weights_gpu_model_decode.py --out benchmarks/results/gpu/weights-model-decode

Both models come from the same fp16 weights (seed 0). Each round decodes `--tokens`
tokens after a `--prompt`-token prompt with each model in turn (mlx-lm's `generate_step`),
so the two alternate; the table reports the median tokens per second over `--rounds`
rounds and the ratio, with the time `quantize_model` took.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step

from veloxquant_mlx.evaluation.shapes import build_shape_model, quantize_weights, shape_config
from veloxquant_mlx.weights import quantize_model


def decode_rate(model, prompt: mx.array, tokens: int) -> float:
    steps = generate_step(prompt, model, max_tokens=tokens + 1)
    next(steps)  # the prompt and the first token
    mx.synchronize()
    start = time.perf_counter()
    for _ in steps:
        pass
    mx.synchronize()
    return tokens / (time.perf_counter() - start)


def host_ms(model, rounds: int = 20) -> float:
    """Host time to build one decode step's graph (not evaluated): what mlx-lm's pipelined
    decode overlaps with the GPU, so the GPU waits when it exceeds the step's GPU time."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.zeros((1, 8), dtype=mx.int32), cache=cache))
    token = mx.zeros((1, 1), dtype=mx.int32)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        logits = model(token, cache=cache)
        times.append(time.perf_counter() - start)
        mx.eval(logits)
        for c in cache:
            c.trim(1)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/gpu/weights-model-decode")
    args = parser.parse_args()
    affine = build_shape_model(args.shape, "float16", None, seed=0)
    quantize_weights(affine, args.bits)
    ours = build_shape_model(args.shape, "float16", None, seed=0)
    start = time.perf_counter()
    quantize_model(ours, args.bits, seed=0, skip=("lm_head",), progress=False)
    # The output head and the embeddings take MLX affine in both models, so that the
    # comparison is the blocks' linear layers.
    nn.quantize(ours, group_size=64, bits=args.bits,
                class_predicate=lambda path, m: path in ("lm_head", "model.embed_tokens"))
    mx.eval(ours.parameters())
    quantize_seconds = time.perf_counter() - start
    gc.collect()
    vocab = shape_config(args.shape)["vocab_size"]
    prompt = mx.random.randint(0, vocab, (args.prompt,), key=mx.random.key(1))
    models = {"affine": affine, "codebook": ours}
    for model in models.values():  # warm-up: compile the kernels
        decode_rate(model, prompt, 8)
    host = {name: host_ms(model) for name, model in models.items()}
    print(json.dumps({"host_ms_per_step": host}), flush=True)
    rates = {name: [] for name in models}
    for _ in range(args.rounds):
        for name, model in models.items():
            rates[name].append(decode_rate(model, prompt, args.tokens))
            print(json.dumps({"model": name, "tok_s": rates[name][-1]}), flush=True)
    median = {name: statistics.median(r) for name, r in rates.items()}
    record = {"device": str(mx.default_device()), "args": vars(args), "tok_s": rates, "median_tok_s": median,
              "codebook_vs_affine": median["codebook"] / median["affine"], "quantize_model_s": quantize_seconds,
              "host_ms_per_step": host,
              "note": "lm_head and embeddings are MLX affine in both models"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(record, indent=2))
    lines = [f"| {args.shape}, {args.bits}-bit weights | decode tok/s (median of {args.rounds}) | vs affine "
             "| host ms to build a step's graph |", "|---|---|---|---|"]
    for name in models:
        lines.append(f"| {name} | {median[name]:.1f} | {median[name] / median['affine']:.2f}x | {host[name]:.2f} |")
    lines.append(f"\nquantize_model: {quantize_seconds:.1f} s")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
