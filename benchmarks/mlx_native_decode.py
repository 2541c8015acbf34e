"""MLX's own quantized KV formats on one device: mlx-lm's `QuantizedKVCache` against the library's `mlxq4` /
`mlxq8`, whole-model decode and one step's attention alone.

    PYTHONPATH=. python benchmarks/mlx_native_decode.py --shape llama-3.1-8b --contexts 4096,32768 --out results/mlx-native

Whole model: a random-weight model of `--shape` (4-bit weights, float16 activations) is prefilled with `--contexts`
random tokens in chunks of 2048; mlx-lm's `QuantizedKVCache` is made as mlx-lm's `generate` makes it (the first
chunk in fp16, then `to_quantized`, group 64). Then 32 tokens are decoded greedily, 3 rounds with the caches taking
turns; the median tok/s (the first step left out) is reported against fp16 of the same context. A cache that fails
records its error.

Attention alone: one decode query of 32 heads over 8 KV heads of dim 128 at each context, 32 calls per step (one per
layer of an 8B model): MLX's fused attention over fp16 keys and values, mlx-lm's `quantized_scaled_dot_product_attention`
over `mx.quantize`d ones, and `mx.dequantize` followed by the fused attention (what `mlxq` does on a GPU,
`engine.sdpa_decode`); the median of 15 steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.base import quantized_scaled_dot_product_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from veloxquant_mlx.config import KVCacheConfig  # noqa: E402
from veloxquant_mlx.evaluation.benchmark import decode, median_call_ms  # noqa: E402
from veloxquant_mlx.evaluation.shapes import build_shape_model  # noqa: E402
from veloxquant_mlx.integration import compressed_caches  # noqa: E402

CACHES = ("fp16", "mlx-q4", "mlxq4", "mlx-q8", "mlxq8")
ATTENTION_REPEATS = 15


def attention_alone(context: int) -> dict:
    q = mx.random.normal((1, 32, 1, 128), key=mx.random.key(0)).astype(mx.float16)
    keys = mx.random.normal((1, 8, context, 128), key=mx.random.key(1)).astype(mx.float16)
    values = mx.random.normal((1, 8, context, 128), key=mx.random.key(2)).astype(mx.float16)
    mx.eval(q, keys, values)
    row = {"T": context, "fp16 sdpa ms/32 layers": median_call_ms(
        lambda: [mx.fast.scaled_dot_product_attention(q + i, keys, values, scale=0.088) for i in range(32)],
        ATTENTION_REPEATS)}
    for bits in (4, 8):
        kq, vq = mx.quantize(keys, group_size=64, bits=bits), mx.quantize(values, group_size=64, bits=bits)
        mx.eval(kq, vq)
        try:
            row[f"mlx-lm quantized sdpa q{bits}"] = median_call_ms(lambda: [quantized_scaled_dot_product_attention(
                q + i, kq, vq, scale=0.088, mask=None, group_size=64, bits=bits) for i in range(32)], ATTENTION_REPEATS)
        except Exception as error:
            row[f"mlx-lm quantized sdpa q{bits}"] = f"error: {error}"[:160]

        def dequantized(i):
            k = mx.dequantize(*kq, group_size=64, bits=bits).astype(mx.float16)
            v = mx.dequantize(*vq, group_size=64, bits=bits).astype(mx.float16)
            return mx.fast.scaled_dot_product_attention(q + i, k, v, scale=0.088)

        row[f"dequantize + sdpa q{bits}"] = median_call_ms(lambda: [dequantized(i) for i in range(32)],
                                                            ATTENTION_REPEATS)
    return row


def prefilled(model, name: str, ids: mx.array):
    if name.startswith("mlxq"):
        caches = compressed_caches(model, KVCacheConfig.preset(name))
    else:
        caches = mlx_cache.make_prompt_cache(model)
    for start in range(0, ids.shape[1], 2048):
        model(ids[:, start:start + 2048], cache=caches)
        mx.eval([c.state for c in caches])
        if name.startswith("mlx-q") and start == 0:  # as mlx-lm's generate: quantized after the first chunk
            caches[:] = [c.to_quantized(group_size=64, bits=int(name[-1])) for c in caches]
    return caches


def whole_model(model, context: int) -> dict:
    ids = mx.random.randint(0, 1000, (1, context), key=mx.random.key(3))
    made = {}
    for name in CACHES:
        try:
            made[name] = prefilled(model, name, ids)
        except Exception as error:
            made[name] = f"error: {type(error).__name__}: {error}"[:200]
        mx.clear_cache()
    rates = {name: [] for name in made}
    for _ in range(3):
        for name, caches in made.items():
            if isinstance(caches, str):
                continue
            try:
                intervals, _, _ = decode(model, caches, mx.array([5]), 32, lambda: None)
                rates[name].append((len(intervals) - 1) / sum(intervals[1:]))
            except Exception as error:
                made[name] = f"error: {type(error).__name__}: {error}"[:200]
    row = {"T": context}
    for name in made:
        row[name] = made[name] if isinstance(made[name], str) else statistics.median(rates[name])
    row.update({f"{n} vs fp16": row[n] / row["fp16"] for n in made if not isinstance(row[n], str)})
    return row


def markdown(out: dict) -> str:
    lines = [f"MLX's quantized KV formats, {out['device']}, `{out['shape']}` (4-bit weights, float16).", "",
             "Whole-model decode (tok/s, 32 tokens, median of 3 rounds, caches taking turns):", "",
             "| context | " + " | ".join(CACHES) + " |", "|---" * (len(CACHES) + 1) + "|"]
    for row in out["model"]:
        cells = [f"{row[n]:.1f} ({row[n + ' vs fp16']:.2f}x)" if not isinstance(row[n], str) else row[n]
                 for n in CACHES]
        lines.append(f"| {row['T']} | " + " | ".join(cells) + " |")
    lines += ["", "One decode step's attention alone, ms for 32 layers (median of 15):", ""]
    names = [k for k in out["layer"][0] if k != "T"]
    lines += ["| context | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for row in out["layer"]:
        lines.append(f"| {row['T']} | " + " | ".join(
            f"{row[n]:.2f}" if not isinstance(row[n], str) else row[n] for n in names) + " |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--contexts", default="4096,32768")
    parser.add_argument("--out", default="results/mlx-native")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    out = {"device": str(mx.default_device()), "shape": args.shape, "layer": [], "model": []}
    out["layer"] = [attention_alone(c) for c in contexts]
    model = build_shape_model(args.shape, "float16", 4)
    for context in contexts:
        out["model"].append(whole_model(model, context))
        mx.clear_cache()
    os.makedirs(args.out, exist_ok=True)
    Path(args.out, "results.json").write_text(json.dumps(out, indent=1))
    Path(args.out, "results.md").write_text(markdown(out))
    print(markdown(out))


if __name__ == "__main__":
    main()
