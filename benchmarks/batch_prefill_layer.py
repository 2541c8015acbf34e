"""One attention layer's cache work in a batched prefill: mlx-lm's `BatchKVCache` with MLX's fused attention against
the library's batch cache, the same rows one after another, and their parts, interleaved in one process.

Random keys, values and queries of the Llama-3.1-8B shape (32 query heads, 8 KV heads of dim 128, bfloat16) are fed
in chunks of `--chunk`, as mlx-lm's server prefills. The runs:
- `fp16 batch`: `BatchKVCache.update_and_fetch`, its mask, `mx.fast.scaled_dot_product_attention`;
- `<preset> batch` (and `<preset> batch, chunk rule`): the library's batch cache, `update_and_fetch` then `attend`,
  under the default `prefill_rule` "decode" (and under "chunk");
- `<preset> rows`: one cache per sequence, one after another;
- `<preset> update only`: the rows' `update_and_fetch` and encoding, no attention;
- `fp16 band-masked sdpa` (and `, additive mask`): per row, the fused attention over the chunk's keys twice over
  (once where codes would be, once as the fp16 band) with a boolean (an additive) band mask: what MLX's attention
  costs with such a mask.

    PYTHONPATH=. python benchmarks/batch_prefill_layer.py --batch 8 --prompt 4096 --chunk 2048 \
        --out benchmarks/results/batch-prefill-layer-h100
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import time

import mlx.core as mx
import mlx_lm
from mlx_lm.models.cache import BatchKVCache

from veloxquant_mlx.cache import CompressedKVCache
from veloxquant_mlx.evaluation.results import write_json_and_markdown
from veloxquant_mlx.presets import usable_preset_config

QUERY_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
BAND = 32  # the fp16 band of the masked-attention run: vq4's window


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8, help="sequences (default: 8)")
    parser.add_argument("--prompt", type=int, default=4096, help="prompt tokens per sequence (default: 4096)")
    parser.add_argument("--chunk", type=int, default=2048, help="prefill chunk (default: 2048, mlx-lm's server)")
    parser.add_argument("--preset", default="vq4", help="cache preset (default: vq4)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats of every run, after one warm-up")
    parser.add_argument("--out", required=True, help="results folder (required)")
    args = parser.parse_args()
    B, P, C = args.batch, args.prompt, args.chunk
    scale = HEAD_DIM ** -0.5
    mx.random.seed(0)
    keys, values = (mx.random.normal((B, KV_HEADS, P, HEAD_DIM)).astype(mx.bfloat16) for _ in range(2))
    queries = mx.random.normal((B, QUERY_HEADS, P, HEAD_DIM)).astype(mx.bfloat16)
    mx.eval(keys, values, queries)
    config = usable_preset_config(args.preset)
    chunks = [(s, min(s + C, P)) for s in range(0, P, C)]
    paths = set()

    def row_cache(rule=None):
        cache = CompressedKVCache(config)
        if rule is not None:
            cache.settings = dataclasses.replace(cache.settings, prefill_rule=rule)
        return cache

    def fp16_batch():
        cache = BatchKVCache([0] * B)
        for a, b in chunks:
            mask = cache.make_mask(b - a, return_array=True)
            k, v = cache.update_and_fetch(keys[..., a:b, :], values[..., a:b, :])
            mx.eval(mx.fast.scaled_dot_product_attention(queries[..., a:b, :], k, v, scale=scale, mask=mask))

    def compressed_batch(rule=None):
        cache = CompressedKVCache.merge([row_cache(rule) for _ in range(B)])
        for a, b in chunks:
            mask = cache.make_mask(b - a)
            cache.update_and_fetch(keys[..., a:b, :], values[..., a:b, :])
            mx.eval(cache.attend(queries[..., a:b, :], scale=scale, mask=mask))
        paths.update(row.last_path for row in cache.rows)

    def compressed_rows(attend=True):
        for r in range(B):
            cache = row_cache()
            for a, b in chunks:
                cache.update_and_fetch(keys[r:r + 1, :, a:b, :], values[r:r + 1, :, a:b, :])
                if attend:
                    mx.eval(cache.attend(queries[r:r + 1, :, a:b, :], scale=scale, mask="causal"))
                else:
                    cache.flush()
                    mx.eval([x for x in cache.state[:-1] if isinstance(x, mx.array)])

    def band_masked_sdpa(additive=False):
        position = mx.arange(P)
        q, j = position[:, None], position[None]
        mask = mx.concatenate([j < q - BAND, (j >= q - BAND) & (j <= q)], axis=1)
        if additive:
            mask = mx.where(mask, mx.array(0.0, mx.bfloat16), mx.array(-mx.inf, mx.bfloat16))
        for r in range(B):
            k2, v2 = (mx.concatenate([x[r:r + 1], x[r:r + 1]], axis=2) for x in (keys, values))
            for a, b in chunks:
                mx.eval(mx.fast.scaled_dot_product_attention(queries[r:r + 1, :, a:b], k2, v2, scale=scale,
                                                             mask=mask[a:b]))

    p = args.preset
    runs = {"fp16 batch": fp16_batch, f"{p} batch": compressed_batch,
            f"{p} batch, chunk rule": lambda: compressed_batch("chunk"), f"{p} rows": compressed_rows,
            f"{p} update only": lambda: compressed_rows(attend=False), "fp16 band-masked sdpa": band_masked_sdpa,
            "fp16 band-masked sdpa, additive mask": lambda: band_masked_sdpa(additive=True)}
    for run in runs.values():
        run()
    times = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, run in runs.items():
            mx.synchronize()
            start = time.perf_counter()
            run()
            mx.synchronize()
            times[name].append((time.perf_counter() - start) * 1e3)
    median = {name: statistics.median(t) for name, t in times.items()}
    meta = {"batch": B, "prompt": P, "chunk": C, "preset": p, "repeats": args.repeats, "attention_paths": sorted(paths),
            "device": str(mx.default_device()), "machine": platform.processor(), "mlx": mx.__version__,
            "mlx_lm": mlx_lm.__version__, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    rows = [{"run": name, "median_ms": median[name], "ms": times[name]} for name in runs]
    base = median["fp16 batch"]
    lines = [f"One attention layer's cache work in a batched prefill: {B} sequences of {P} tokens in chunks of {C}, "
             f"Llama-3.1-8B's attention shape, `{p}` ({meta['device']}, attention paths "
             f"{', '.join(meta['attention_paths'])}; mlx {meta['mlx']}, {meta['when']}; median of {args.repeats}).", "",
             "| run | median ms per layer | vs fp16 batch |", "|---|---:|---:|"]
    lines += [f"| {name} | {median[name]:.2f} | {median[name] / base:.2f}x |" for name in runs]
    write_json_and_markdown(args.out, {"meta": meta, "rows": rows}, lines)


if __name__ == "__main__":
    main()
