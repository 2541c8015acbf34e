"""The band-masked prefill of one attention layer with its queries in groups against one fused call, on a GPU.

Under the default "decode" prefill rule each query of a chunk attends through an explicit additive band mask
(engine.sdpa_prefill). Where MLX's attention may materialise the scores, the queries go in groups that fit
`engine.SDPA_MASK_BYTES`, one evaluation each; where its fused kernel takes the mask (`masked_attention_is_fused`,
MLX's CUDA attention), one call. Both are run here on the same batch cache of the Llama-3.1-8B attention shape
(32 query heads, 8 KV heads of dim 128, bfloat16) fed in chunks of 2048 as mlx-lm's server prefills, interleaved
with mlx-lm's `BatchKVCache` and fused attention, with each run's MLX peak and the largest difference between the
two cache paths' outputs.

    PYTHONPATH=. python benchmarks/prefill_query_groups.py --shapes 8x4096,1x32768 --out results/prefill-query-groups
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import mlx.core as mx
import mlx_lm
from mlx_lm.models.cache import BatchKVCache

from veloxquant_mlx import engine
from veloxquant_mlx.cache import CompressedKVCache
from veloxquant_mlx.evaluation.results import write_json_and_markdown
from veloxquant_mlx.presets import usable_preset_config

QUERY_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
RUNS = ("fp16", "query groups", "one call")


def measure(batch: int, prompt: int, chunk: int, preset: str, repeats: int) -> dict:
    mx.random.seed(0)
    keys, values = (mx.random.normal((batch, KV_HEADS, prompt, HEAD_DIM)).astype(mx.bfloat16) for _ in range(2))
    queries = mx.random.normal((batch, QUERY_HEADS, prompt, HEAD_DIM)).astype(mx.bfloat16)
    mx.eval(keys, values, queries)
    chunks = [(a, min(a + chunk, prompt)) for a in range(0, prompt, chunk)]
    scale = HEAD_DIM ** -0.5
    device_rule = engine.masked_attention_is_fused
    last = {}

    def fp16():
        cache = BatchKVCache([0] * batch)
        for a, b in chunks:
            mask = cache.make_mask(b - a, return_array=True)
            k, v = cache.update_and_fetch(keys[..., a:b, :], values[..., a:b, :])
            mx.eval(mx.fast.scaled_dot_product_attention(queries[..., a:b, :], k, v, scale=scale, mask=mask))

    def compressed(one_call: bool):
        engine.masked_attention_is_fused = device_rule if one_call else (lambda *args: False)
        try:
            cache = CompressedKVCache.merge([CompressedKVCache(usable_preset_config(preset)) for _ in range(batch)])
            for a, b in chunks:
                mask = cache.make_mask(b - a)
                cache.update_and_fetch(keys[..., a:b, :], values[..., a:b, :])
                out = cache.attend(queries[..., a:b, :], scale=scale, mask=mask)
                mx.eval(out)
            last[one_call] = out
        finally:
            engine.masked_attention_is_fused = device_rule

    runs = {"fp16": fp16, "query groups": lambda: compressed(False), "one call": lambda: compressed(True)}
    for run in runs.values():
        run()
    times = {name: [] for name in runs}
    peaks = {}
    for _ in range(repeats):
        for name, run in runs.items():
            mx.synchronize()
            mx.reset_peak_memory()
            start = time.perf_counter()
            run()
            mx.synchronize()
            times[name].append((time.perf_counter() - start) * 1e3)
            peaks[name] = mx.get_peak_memory() / 1e9
    diff = float(mx.abs(last[False].astype(mx.float32) - last[True].astype(mx.float32)).max())
    return {"runs": {name: {"median_ms": statistics.median(t), "ms": t, "peak_gb": peaks[name]}
                     for name, t in times.items()}, "max_abs_diff": diff}


def markdown(record: dict) -> list:
    meta = record["meta"]
    lines = [f"One attention layer's band-masked prefill, `{meta['preset']}` batch cache, Llama-3.1-8B's attention "
             f"shape, chunks of {meta['chunk']} ({meta['device']}, fused masked attention: {meta['fused']}; mlx "
             f"{meta['mlx']}, {meta['when']}; median of {meta['repeats']}, runs interleaved). `query groups`: the "
             "queries in groups that fit `SDPA_MASK_BYTES`, evaluated one after another; `one call`: one fused call "
             "per chunk. Peak: MLX's peak memory over one run.", "",
             "| sequences x tokens | run | median ms per layer | vs fp16 | MLX peak GB | max abs diff, groups vs one call |",
             "|---|---|---:|---:|---:|---:|"]
    for shape, result in record["shapes"].items():
        base = result["runs"]["fp16"]["median_ms"]
        for name in RUNS:
            run = result["runs"][name]
            diff = f"{result['max_abs_diff']:.3g}" if name == "one call" else ""
            lines.append(f"| {shape} | {name} | {run['median_ms']:.2f} | {run['median_ms'] / base:.2f}x | "
                         f"{run['peak_gb']:.2f} | {diff} |")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="8x4096,1x32768", help="sequences x prompt tokens, comma-separated")
    parser.add_argument("--chunk", type=int, default=2048, help="prefill chunk (default: 2048, mlx-lm's server)")
    parser.add_argument("--preset", default="vq4", help="cache preset (default: vq4)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats of every run, after one warm-up")
    parser.add_argument("--out", required=True, help="results folder (required)")
    args = parser.parse_args()
    settings = CompressedKVCache(usable_preset_config(args.preset)).settings
    shapes = {}
    for shape in args.shapes.split(","):
        batch, prompt = (int(x) for x in shape.split("x"))
        shapes[shape] = measure(batch, prompt, args.chunk, args.preset, args.repeats)
    meta = {"chunk": args.chunk, "preset": args.preset, "repeats": args.repeats,
            "fused": engine.masked_attention_is_fused(settings, *(mx.zeros((1, 1, 1, HEAD_DIM), mx.bfloat16),) * 2),
            "device": str(mx.default_device()),
            "machine": platform.processor(), "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    record = {"meta": meta, "shapes": shapes}
    write_json_and_markdown(args.out, record, markdown(record))


if __name__ == "__main__":
    main()
