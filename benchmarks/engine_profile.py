"""One layer of the Llama-3.1-8B shape (8 kv heads, 32 query heads, head dim 128, fp16):
the time of each attention path per call, and of its parts, for several methods.

    python benchmarks/engine_profile.py --contexts 4096 --out results/gpu/runN/engine_profile.json

Per method and context: the decode call through the path the engine picks (`path`),
the same call through the generic blockwise path, the codecs' decode of the whole history
(keys + values, what the compiled decode path does per step), fp16 SDPA over the same
tokens; and a 2048-token prefill chunk (time and peak memory above the cache itself).
Times are medians of `--rounds` calls, each evaluated on its own.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx

from veloxquant_mlx import EngineSettings, engine
from veloxquant_mlx.cache import CompressedKVCache
from veloxquant_mlx.evaluation.specs import parse_method_spec

KV_HEADS, Q_HEADS, DIM = 8, 32, 128


def timed(fn, rounds: int) -> float:
    mx.eval(fn())
    times = []
    for _ in range(rounds):
        mx.synchronize()
        start = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def filled(spec: str, context: int, settings: EngineSettings):
    cache = CompressedKVCache(parse_method_spec(spec).config, settings=settings)
    k = (mx.random.normal((1, KV_HEADS, context, DIM), key=mx.random.key(1)) * 2).astype(mx.float16)
    v = mx.random.normal((1, KV_HEADS, context, DIM), key=mx.random.key(2)).astype(mx.float16)
    for start in range(0, context, 2048):
        cache.update_and_fetch(k[..., start : start + 2048, :], v[..., start : start + 2048, :])
        mx.eval(cache.state)
    return cache, k, v


def profile(spec: str, context: int, rounds: int, settings: EngineSettings) -> dict:
    cache, k, v = filled(spec, context, settings)
    q = mx.random.normal((1, Q_HEADS, 1, DIM), key=mx.random.key(3)).astype(mx.float16)
    new_k, new_v = k[..., :1, :], v[..., :1, :]

    def step():
        cache.update_and_fetch(new_k, new_v)
        cache.trim(1)
        return cache.attend(q, DIM ** -0.5)

    record = {"spec": spec, "context": context, "decode_step_ms": timed(step, rounds), "path": cache.last_path}
    h = cache._history()
    record["generic_ms"] = timed(lambda: engine.generic(h, q, DIM ** -0.5), rounds)
    record["all_formats_decode_compiled_ms"] = timed(lambda: engine.compiled_decode(h, q, DIM ** -0.5), rounds)
    record["all_formats_decode_uncompiled_ms"] = timed(
        lambda: engine.compiled_decode(h, q, DIM ** -0.5, compiled=False), rounds)
    store = cache.store
    record["codec_decode_ms"] = timed(lambda: [cache.key_codec.decode(store.fields("keys")),
                                               cache.value_codec.decode(store.fields("values"))], rounds)
    record["fp16_sdpa_ms"] = timed(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=DIM ** -0.5), rounds)
    # A prefill chunk: 2048 new tokens over the history.
    chunk_k, chunk_v = k[..., :2048, :], v[..., :2048, :]
    queries = mx.random.normal((1, Q_HEADS, 2048, DIM), key=mx.random.key(4)).astype(mx.float16)

    def prefill():
        cache.update_and_fetch(chunk_k, chunk_v)
        out = cache.attend(queries, DIM ** -0.5, "causal")
        mx.eval(out)
        cache.trim(2048)
        return out

    mx.eval(prefill())
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    record["prefill_chunk_ms"] = timed(prefill, max(1, rounds // 4))
    record["prefill_path"] = cache.last_path
    record["prefill_peak_over_active_mb"] = (mx.get_peak_memory() - base) / 2 ** 20
    record["cache_mb"] = cache.nbytes / 2 ** 20
    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in record.items()}), flush=True)
    return record


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="4096")
    parser.add_argument("--methods", default="turboquant_mse:3:vbits=4;"
                        "turboquant_mse:3:vbits=4,sinks=4,window=64,center=true,renorm=true;kivi:4;turboquant_rvq:2")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    settings = EngineSettings.resolve(backend=args.backend)
    records = [profile(spec, int(c), args.rounds, settings) for c in args.contexts.split(",")
               for spec in args.methods.split(";")]
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"backend": settings.backend, "device": str(mx.default_device()), "mlx": mx.__version__,
                       "records": records}, fh, indent=1)


if __name__ == "__main__":
    main()
