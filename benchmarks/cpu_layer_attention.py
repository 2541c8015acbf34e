"""One SmolLM2-shaped layer's cache work on the CPU, per cache configuration.

    python benchmarks/cpu_layer_attention.py [--out benchmarks/results/cpu/layer_attention]

Prefill: a layer's cache takes two 2048-token chunks (random keys/values, 3 kv heads,
9 query heads, head dim 64); each chunk is stored and attended to with a causal mask,
timed per chunk. For the sinks/window configuration also with other sizes of the query
groups that score the chunk's fp16 span (`CompressedKVCache.band_queries`). Decode: one
token stored and attended to over an 8K history. Configurations alternate run by run;
medians. Writes layer_attention.json and layer_attention.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from veloxquant_mlx.cache import CompressedKVCache  # noqa: E402
from veloxquant_mlx.evaluation.specs import parse_method_spec  # noqa: E402

HEADS, Q_HEADS, DIM, CHUNK, HISTORY = 3, 9, 64, 2048, 8192
PLAIN = "turboquant_mse:3"
WINDOW = "turboquant_mse:3:sinks=4,window=64,center=true,renorm=true"


def cache_for(spec: str, band_queries=None) -> CompressedKVCache:
    cache = CompressedKVCache(parse_method_spec(spec).config)
    if band_queries is not None:
        cache.band_queries = band_queries
    return cache


def prefill_chunks(spec: str, band_queries, k, v, q) -> list:
    """Seconds for each of two chunks: store, then attend causally."""
    cache, times = cache_for(spec, band_queries), []
    for i in range(2):
        start = time.perf_counter()
        cache.update_and_fetch(k[..., i * CHUNK:(i + 1) * CHUNK, :], v[..., i * CHUNK:(i + 1) * CHUNK, :])
        mx.eval(cache.attend(q, scale=DIM ** -0.5, mask="causal"), cache.state)
        times.append(time.perf_counter() - start)
    return times


def decode_step(spec: str, k, v, steps: int = 100) -> float:
    """Median seconds to store one token and attend to it over HISTORY tokens."""
    cache = cache_for(spec)
    for s in range(0, HISTORY, CHUNK):
        cache.update_and_fetch(k[..., s:s + CHUNK, :], v[..., s:s + CHUNK, :])
        mx.eval(cache.state)
    q = mx.random.normal((1, Q_HEADS, 1, DIM), key=mx.random.key(5))
    new = mx.random.normal((1, HEADS, 1, DIM), key=mx.random.key(6))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        cache.update_and_fetch(new, new)
        mx.eval(cache.attend(q, scale=DIM ** -0.5))
        times.append(time.perf_counter() - start)
    return statistics.median(times[20:])  # after the compiled graphs are traced


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/cpu/layer_attention")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    k = mx.random.normal((1, HEADS, HISTORY, DIM), key=mx.random.key(1))
    v = mx.random.normal((1, HEADS, HISTORY, DIM), key=mx.random.key(2))
    q = mx.random.normal((1, Q_HEADS, CHUNK, DIM), key=mx.random.key(3))
    mx.eval(k, v, q)
    prefill_configs = [(PLAIN, None), (WINDOW, 256), (WINDOW, 64)]
    prefill = {c: [] for c in prefill_configs}
    decode = {PLAIN: [], WINDOW: []}
    for _ in range(args.repeats):
        for config in prefill_configs:
            prefill[config].append(prefill_chunks(*config, k, v, q))
        for spec in decode:
            decode[spec].append(decode_step(spec, k, v))
    rows = []
    for (spec, band), runs in prefill.items():
        rows.append({"kind": "prefill", "spec": spec, "band_queries": band,
                     "chunk1_ms": statistics.median(r[0] for r in runs) * 1e3,
                     "chunk2_ms": statistics.median(r[1] for r in runs) * 1e3})
    for spec, runs in decode.items():
        rows.append({"kind": "decode", "spec": spec, "step_ms": statistics.median(runs) * 1e3})
    lines = [f"One SmolLM2-shaped layer on the CPU ({HEADS} kv / {Q_HEADS} query heads, dim {DIM}); "
             f"medians of {args.repeats} interleaved runs.", "",
             "| work | cache | query groups | chunk 1 ms | chunk 2 ms | decode step ms |", "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        if r["kind"] == "prefill":
            lines.append(f"| prefill, 2 x {CHUNK} tokens | `{r['spec']}` | {r['band_queries'] or '—'} | "
                         f"{r['chunk1_ms']:.1f} | {r['chunk2_ms']:.1f} | |")
        else:
            lines.append(f"| decode at {HISTORY} tokens | `{r['spec']}` | | | | {r['step_ms']:.3f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "layer_attention.json").write_text(json.dumps({"rows": rows}, indent=1))
    (out / "layer_attention.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
