"""Prefill and decode speed, KV bytes and peak memory per method and context length.

Each configuration (method, context) gets `warmup` untimed runs of the same
shapes (GPU backends compile kernels per shape on first use: on CUDA a first
8B-shape prefill ran 10x slower than the next), then `repeats` timed runs on
fresh caches; each figure is the median of the runs.
A run prefills `context` random tokens in chunks (evaluating the caches between
chunks, as mlx-lm does) and then greedily decodes `decode_tokens` tokens with
the next step queued before the current one is read (mlx-lm's pipelining).
`max_seconds` bounds a configuration: another run starts only when the last one
would still fit, and a run that outlasts the budget is abandoned (status
"timed_out" when no run completed).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List, Optional

import mlx.core as mx

from .kvlayout import KVLayout, cache_arrays, cache_bytes, cache_tokens
from .results import error_text, finite
from .specs import MethodSpec
from .watchdog import STOPPED_BY_GUARD, MemoryGuard, MemoryGuardTriggered, release_memory

TIMED_OUT = "timed_out"


class ConfigTimeout(RuntimeError):
    pass


def prefill(model, caches, tokens: mx.array, chunk: int, check: Callable[[], None]) -> mx.array:
    """Feed `tokens` (T,) and return the first generated token."""
    while tokens.shape[0] > 1:
        check()
        n = min(chunk, tokens.shape[0] - 1)
        model(tokens[:n][None], cache=caches)
        mx.eval(cache_arrays(caches))
        tokens = tokens[n:]
        mx.clear_cache()
    check()
    first = mx.argmax(model(tokens[None], cache=caches)[:, -1, :], axis=-1)
    mx.eval(first)
    return first


def decode(model, caches, token: mx.array, steps: int, check: Callable[[], None]) -> None:
    """Greedy decoding of `steps` tokens after `token` (1,)."""

    def step(y):
        return mx.argmax(model(y[:, None], cache=caches)[:, -1, :], axis=-1)

    if steps < 1:
        return
    next_token = step(token)
    mx.async_eval(next_token)
    for n in range(steps):
        token = next_token
        if n + 1 < steps:
            next_token = step(token)
            mx.async_eval(next_token)
        mx.eval(token)
        check()


def timed_run(model, spec: MethodSpec, tokens: mx.array, decode_tokens: int, chunk: int,
              check: Callable[[], None]) -> Dict:
    caches = spec.make_caches(model)
    try:
        mx.synchronize()
        mx.reset_peak_memory()
        start = time.perf_counter()
        first = prefill(model, caches, tokens, chunk, check)
        prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        decode(model, caches, first, decode_tokens, check)
        decode_s = time.perf_counter() - start
        return {
            "prefill_s": prefill_s,
            "decode_s": decode_s,
            "peak_memory_bytes": mx.get_peak_memory(),
            "kv_bytes": cache_bytes(caches),
            "kv_tokens": cache_tokens(caches),
        }
    finally:
        del caches
        mx.clear_cache()


def benchmark_config(model, spec: MethodSpec, context: int, layout: KVLayout, *, vocab_size: int,
                     decode_tokens: int = 32, repeats: int = 3, warmup: int = 1, chunk: int = 2048,
                     max_seconds: float = 300.0,
                     guard: Optional[MemoryGuard] = None, seed: int = 0) -> Dict:
    guard = guard or MemoryGuard(0)
    record = {**spec.describe(), "context": context, "decode_tokens": decode_tokens,
              "status": "ok", "error": None}
    tokens = mx.random.randint(0, vocab_size, (context,), key=mx.random.key(seed + context)).astype(mx.uint32)

    start = time.perf_counter()
    deadline = start + max_seconds

    def check():
        guard.check(f"{spec.label}, context {context}")
        if time.perf_counter() > deadline:
            raise ConfigTimeout(f"over the {max_seconds:g} s budget of this configuration")

    runs = []
    try:
        for _ in range(warmup):
            timed_run(model, spec, tokens, decode_tokens, chunk, check)
        for _ in range(max(1, repeats)):
            run_start = time.perf_counter()
            runs.append(timed_run(model, spec, tokens, decode_tokens, chunk, check))
            if time.perf_counter() + (time.perf_counter() - run_start) > deadline:
                break
    except MemoryGuardTriggered as error:
        record.update(status=STOPPED_BY_GUARD, error=str(error))
    except ConfigTimeout as error:
        if not runs:
            record.update(status=TIMED_OUT, error=str(error))
    except Exception as error:  # e.g. a kernel missing on this backend
        record.update(status="error", error=error_text(error))
    record["seconds"] = round(time.perf_counter() - start, 3)
    record["repeats_done"] = len(runs)
    if record["status"] != "ok":
        release_memory()
    if not runs or record["status"] != "ok":
        return record

    def median(key):
        return statistics.median(r[key] for r in runs)

    prefill_s, decode_s = median("prefill_s"), median("decode_s")
    kv_bytes, kv_tokens = runs[-1]["kv_bytes"], runs[-1]["kv_tokens"]
    record.update(
        prefill_seconds=finite(prefill_s),
        prefill_tokens_per_s=finite(context / prefill_s) if prefill_s > 0 else None,
        decode_seconds=finite(decode_s),
        decode_tokens_per_s=finite(decode_tokens / decode_s) if decode_s > 0 and decode_tokens else None,
        peak_memory_bytes=int(median("peak_memory_bytes")),
        kv_bytes=kv_bytes,
        kv_tokens=kv_tokens,
        fp16_kv_bytes=layout.fp16_bytes(kv_tokens),
        bits_per_coord=finite(layout.bits_per_coordinate(kv_bytes, kv_tokens)),
        runs=[{k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()} for r in runs],
    )
    return record


def run_benchmark(model, specs: List[MethodSpec], contexts: List[int], layout: KVLayout, *,
                  vocab_size: int, decode_tokens: int = 32, repeats: int = 3, warmup: int = 1, chunk: int = 2048,
                  max_seconds: float = 300.0, guard: Optional[MemoryGuard] = None,
                  progress: bool = True, on_update: Optional[Callable[[List[Dict]], None]] = None,
                  seed: int = 0) -> List[Dict]:
    """Records for every (context, method), shortest context first. A method stopped by
    the memory guard is not run at longer contexts."""
    from tqdm.auto import tqdm

    records: List[Dict] = []
    stopped: Dict[str, int] = {}
    bar = tqdm(total=len(specs) * len(contexts), desc="benchmark", unit="config", disable=not progress)
    for context in sorted(contexts):
        for spec in specs:
            bar.set_postfix_str(f"{spec.label} @ {context}")
            if spec.label in stopped:
                record = {**spec.describe(), "context": context, "decode_tokens": decode_tokens,
                          "status": "skipped", "repeats_done": 0,
                          "error": f"skipped after the memory guard stopped context {stopped[spec.label]}"}
            else:
                record = benchmark_config(
                    model, spec, context, layout, vocab_size=vocab_size, decode_tokens=decode_tokens,
                    repeats=repeats, warmup=warmup, chunk=chunk, max_seconds=max_seconds, guard=guard,
                    seed=seed,
                )
                if record["status"] == STOPPED_BY_GUARD:
                    stopped[spec.label] = context
            records.append(record)
            bar.update(1)
            if on_update is not None:
                on_update(records)
    bar.close()
    return records
