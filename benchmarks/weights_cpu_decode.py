"""Decode speed on the CPU of weight-quantized SmolLM2: our 4-bit codes through the C++ LUT
matmul (csrc/lut_matmul.cpp) and through the tiled path, against MLX's affine 4-bit (its own
quantized matmul, and dequantized to float) and the float reference.

    python benchmarks/weights_cpu_decode.py --out benchmarks/results/weights-cpu-decode-smollm2

Each variant prefills `--prompt` tokens of the packaged text into an fp16 KV cache (mlx-lm's),
then decodes `--tokens` tokens greedily with the harness's loop (evaluation.benchmark.decode);
`--repeats` rounds, variants interleaved, median reported. Wall clock on a shared CPU: noisy.
Variants: `ref` (the float32 model as loaded on the CPU), `ref-fp16` (cast to float16),
`vq4` / `vq4-emb` (ours, C++ kernel; -emb: the tied embedding/head too), `vq4-tiled` /
`vq4-emb-tiled` (VELOXQUANT_KERNELS=portable: codes decoded in tiles), `affine4` /
`affine4-emb` (nn.quantize group 64, mx.quantized_matmul), `affine4-dequant` (the same weights
dequantized to float32: the speed of a float model), `vq4-uncompiled` (vq4 with no route under
mx.compile, VELOXQUANT_WEIGHT_COMPILE=0), `vq4-unfused-mlp` (vq4 with each MLP as its layers'
calls, not one compiled call: `compiled_mlp.COMPILE_MLPS` off).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from veloxquant_mlx.evaluation.benchmark import decode  # noqa: E402
from veloxquant_mlx.texts import load_text, sample_text_path, tokenize_prefix  # noqa: E402
from veloxquant_mlx.models import load_model  # noqa: E402
from veloxquant_mlx.weights import quantize_model  # noqa: E402

DEFAULT = "ref,vq4,vq4-tiled,vq4-emb,vq4-emb-tiled,affine4,affine4-emb,affine4-dequant,ref-fp16"


def build(name: str, model_name: str):
    model, _ = load_model(model_name)
    if name.startswith("vq4"):
        quantize_model(model, 4, embeddings="-emb" in name, progress=False)
    elif name.startswith("affine4"):
        emb = "-emb" in name
        nn.quantize(model, group_size=64, bits=4,
                    class_predicate=lambda _, m: isinstance(m, nn.Linear) or (emb and isinstance(m, nn.Embedding)))
        if name.endswith("-dequant"):
            from weights_quality import dequantize_mlx_layers

            dequantize_mlx_layers(model)
    elif name == "ref-fp16":
        model.set_dtype(mx.float16)
    mx.eval(model.parameters())
    return model


def weights_mb(model) -> float:
    from weights_quality import weights_megabytes

    return weights_megabytes(model)


def run_once(name: str, model, prompt: mx.array, tokens: int) -> tuple[float, float]:
    """(tokens per second of wall clock, CPU seconds of this process, all threads, per token)."""
    from veloxquant_mlx.weights import compiled_mlp, kernel

    env = os.environ.get("VELOXQUANT_KERNELS")
    if name.endswith("-tiled"):
        os.environ["VELOXQUANT_KERNELS"] = "portable"
    kernel._native_cpu.cache_clear()  # the choice is made once per process otherwise
    # routes are made at a model's first call (the warm-up round), under this setting
    kernel.COMPILE_ROUTES = not name.endswith("-uncompiled")
    compiled_mlp.COMPILE_MLPS = not name.endswith("-unfused-mlp")
    try:
        cache = make_prompt_cache(model)
        logits = model(prompt[None], cache=cache)
        first = mx.argmax(logits[:, -1, :], axis=-1)
        mx.eval(first)
        start, cpu = time.perf_counter(), time.process_time()
        decode(model, cache, first, tokens, lambda: None)
        return tokens / (time.perf_counter() - start), (time.process_time() - cpu) / tokens
    finally:
        if env is None:
            os.environ.pop("VELOXQUANT_KERNELS", None)
        else:
            os.environ["VELOXQUANT_KERNELS"] = env
        kernel._native_cpu.cache_clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--variants", default=DEFAULT)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/weights-cpu-decode-smollm2")
    args = parser.parse_args()
    mx.set_default_device(mx.cpu)
    _, tokenizer = load_model(args.model)
    prompt = mx.array(tokenize_prefix(tokenizer, load_text(str(sample_text_path())), args.prompt))
    names = args.variants.split(",")
    # a -tiled variant runs the model of its base variant with the C++ kernel turned off
    built = {}
    for name in names:
        base = name.removesuffix("-tiled")
        if base not in built:
            built[base] = build(base, args.model)
    models = {name: built[name.removesuffix("-tiled")] for name in names}
    rates = {name: [] for name in names}
    cpu_per_token = {name: [] for name in names}
    for name in names:  # warm-up round, untimed
        run_once(name, models[name], prompt, 2)
    for _ in range(args.repeats):
        for name in names:
            rate, cpu = run_once(name, models[name], prompt, args.tokens)
            rates[name].append(rate)
            cpu_per_token[name].append(cpu)
            print(name, f"{rate:.2f} tok/s, {1e3 * cpu:.0f} CPU ms/token", flush=True)
    ref = statistics.median(rates["ref"]) if "ref" in rates else None
    ref_cpu = statistics.median(cpu_per_token["ref"]) if "ref" in rates else None
    rows = []
    for name in names:
        median = statistics.median(rates[name])
        rows.append({"variant": name, "tokens_per_s": round(median, 3), "runs": [round(r, 3) for r in rates[name]],
                     "vs_ref": round(median / ref, 3) if ref else None,
                     "cpu_ms_per_token": round(1e3 * statistics.median(cpu_per_token[name]), 1),
                     "cpu_speedup_vs_ref": (round(ref_cpu / statistics.median(cpu_per_token[name]), 3)
                                            if ref_cpu else None),
                     "weights_mb": round(weights_mb(models[name]), 1)})
    meta = {"model": args.model, "prompt": args.prompt, "tokens": args.tokens, "repeats": args.repeats,
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "mlx": mx.__version__, "note": "shared CPU: wall-clock numbers are noisy"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = [f"CPU decode, {args.model}, {args.prompt}-token prompt, {args.tokens} tokens greedy, median of "
             f"{args.repeats} (shared {os.cpu_count()}-core CPU: noisy).", "",
             "CPU ms/token: CPU time of the process (all threads) per decoded token, steadier than wall clock "
             "under load.", "",
             "| variant | tokens/s | vs ref | CPU ms/token | CPU-time speedup vs ref | weights MB | runs (tokens/s) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        vs = "" if r["vs_ref"] is None else f"{r['vs_ref']:.2f}x"
        cs = "" if r["cpu_speedup_vs_ref"] is None else f"{r['cpu_speedup_vs_ref']:.2f}x"
        lines.append(f"| {r['variant']} | {r['tokens_per_s']:.2f} | {vs} | {r['cpu_ms_per_token']:.0f} | {cs} | "
                     f"{r['weights_mb']:.1f} | "
                     f"{', '.join(f'{x:.2f}' for x in r['runs'])} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
