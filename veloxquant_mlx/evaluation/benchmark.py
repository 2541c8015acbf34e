"""Prefill and decode speed, KV bytes and peak memory per method and context length.

Each configuration (method, context) gets `warmup` untimed runs of the same
shapes (GPU backends compile kernels per shape on first use: on CUDA a first
8B-shape prefill ran 10x slower than the next), then `repeats` timed runs on
fresh caches; each figure is the median of the runs. The methods of a context
take turns run by run, so that ratios between them are not skewed by a machine
that speeds up or slows down during the sweep.
A run prefills `batch` rows of `context` random tokens (prompts of equal length) in chunks (evaluating the caches between
chunks, as mlx-lm does) and then greedily decodes `decode_tokens` tokens with
the next step queued before the current one is read (mlx-lm's pipelining).
`max_seconds` bounds a configuration's own run time: another run starts only when
the last one would still fit, and a run that outlasts the budget is abandoned
(status "timed_out" when no run completed).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx

from ..footprint import footprint
from ..kvlayout import cache_arrays
from .results import error_text, finite, kv_fields
from .specs import MethodSpec
from .watchdog import STOPPED_BY_GUARD, MemoryGuard, MemoryGuardTriggered, release_memory

TIMED_OUT = "timed_out"


class ConfigTimeout(RuntimeError):
    pass


def median_call_ms(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median wall time in ms of evaluating `fn()`, after `warmup` untimed calls (first-use compiles)."""
    for _ in range(warmup):
        mx.eval(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def prefill(model, caches, tokens: mx.array, chunk: int, check: Callable[[], None]):
    """Feed `tokens` (B, T); (the first generated token of each row (B,), the attention paths
    of the prompt's last chunk)."""
    paths = []
    while tokens.shape[1] > 1:
        check()
        n = min(chunk, tokens.shape[1] - 1)
        model(tokens[:, :n], cache=caches)
        mx.eval(cache_arrays(caches))
        tokens = tokens[:, n:]
        paths = attention_paths(caches)
        mx.clear_cache()
    check()
    first = mx.argmax(model(tokens, cache=caches)[:, -1, :], axis=-1)
    mx.eval(first)
    return first, paths


def attention_paths(caches) -> List[str]:
    """The attention paths the compressed caches took on their last call (`engine.py`)."""
    return sorted({c.last_path for c in caches if getattr(c, "last_path", None)})


def decode(model, caches, token: mx.array, steps: int,
           check: Callable[[], None]) -> Tuple[List[float], List[float], List[float]]:
    """Greedy decoding of `steps` tokens after `token` (B,). Returns (intervals, build, dispatch):
    the seconds between one token's arrival and the next (the first from the call), and for each
    step after the first the host's seconds to build its graph and to launch it (`mx.async_eval`,
    which also waits when the GPU is behind). With the next step queued before the current one is
    read, a stall shows as one long interval, a slower step as all of them."""

    def step(y):
        return mx.argmax(model(y[:, None], cache=caches)[:, -1, :], axis=-1)

    if steps < 1:
        return [], [], []
    intervals, build, dispatch, last = [], [], [], time.perf_counter()
    next_token = step(token)
    mx.async_eval(next_token)
    for n in range(steps):
        token = next_token
        if n + 1 < steps:
            start = time.perf_counter()
            next_token = step(token)
            built = time.perf_counter()
            mx.async_eval(next_token)
            build.append(built - start)
            dispatch.append(time.perf_counter() - built)
        mx.eval(token)
        now = time.perf_counter()
        intervals.append(now - last)
        last = now
        check()
    return intervals, build, dispatch


def timed_run(model, spec: MethodSpec, tokens: mx.array, decode_tokens: int, chunk: int,
              check: Callable[[], None]) -> Dict:
    caches = spec.make_caches(model)
    try:
        mx.synchronize()
        mx.reset_peak_memory()
        start = time.perf_counter()
        first, prefill_paths = prefill(model, caches, tokens, chunk, check)
        prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        intervals, build, dispatch = decode(model, caches, first, decode_tokens, check)
        decode_s = time.perf_counter() - start
        return {
            "prefill_s": prefill_s,
            "decode_s": decode_s,
            "decode_token_intervals_s": intervals,
            "decode_build_s": build,
            "decode_dispatch_s": dispatch,
            "prefill_paths": prefill_paths,
            "decode_paths": attention_paths(caches),
            "peak_memory_bytes": mx.get_peak_memory(),
            "kv": footprint(caches),
        }
    finally:
        del caches
        mx.clear_cache()


def _rounded(value):
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


class ConfigRuns:
    """The runs of one (method, context) configuration, taken one at a time so that the
    configurations of a context can alternate (a slow spell of a shared machine then lands
    on every method, not on whichever ran during it). `max_seconds` bounds the
    configuration's own run time."""

    def __init__(self, model, spec: MethodSpec, context: int, *, vocab_size: int,
                 decode_tokens: int, chunk: int, max_seconds: float, guard: MemoryGuard, seed: int, clock_zero: float,
                 batch: int = 1):
        self.model, self.spec, self.context = model, spec, context
        self.decode_tokens, self.chunk, self.max_seconds, self.guard = decode_tokens, chunk, max_seconds, guard
        self.clock_zero = clock_zero
        self.batch = batch
        self.record = {**spec.describe(), "context": context, "batch": batch, "decode_tokens": decode_tokens,
                       "status": "ok", "error": None}
        self.tokens = mx.random.randint(0, vocab_size, (batch, context),
                                        key=mx.random.key(seed + context)).astype(mx.uint32)
        self.runs: List[Dict] = []
        self.seconds = 0.0  # spent in this configuration's runs so far
        self.done = False

    def step(self, timed: bool = True) -> None:
        """One run (untimed when warming up); marks the configuration done on a failure,
        a timeout, or when another run would not fit its budget."""
        if self.done:
            return
        start = time.perf_counter()

        def check():
            self.guard.check(f"{self.spec.label}, context {self.context}")
            if self.seconds + time.perf_counter() - start > self.max_seconds:
                raise ConfigTimeout(f"over the {self.max_seconds:g} s budget of this configuration")

        try:
            run = timed_run(self.model, self.spec, self.tokens, self.decode_tokens, self.chunk, check)
            if timed:
                run["start_s"] = start - self.clock_zero
                self.runs.append(run)
        except MemoryGuardTriggered as error:
            self.record.update(status=STOPPED_BY_GUARD, error=str(error))
        except ConfigTimeout as error:
            if not self.runs:
                self.record.update(status=TIMED_OUT, error=str(error))
            self.done = True
        except Exception as error:  # e.g. a kernel missing on this backend
            self.record.update(status="error", error=error_text(error))
        spent = time.perf_counter() - start
        self.seconds += spent
        if self.record["status"] != "ok":
            self.done = True
            release_memory()
        elif timed and self.seconds + spent > self.max_seconds:
            self.done = True

    def result(self) -> Dict:
        record = self.record
        record["seconds"] = round(self.seconds, 3)
        record["repeats_done"] = len(self.runs)
        runs = self.runs
        if not runs or record["status"] != "ok":
            return record

        def median(key):
            return statistics.median(r[key] for r in runs)

        context, decode_tokens = self.context, self.decode_tokens
        prefill_s, decode_s = median("prefill_s"), median("decode_s")
        batch = self.batch
        record.update(
            prefill_seconds=finite(prefill_s),
            prefill_tokens_per_s=finite(batch * context / prefill_s) if prefill_s > 0 else None,
            decode_seconds=finite(decode_s),
            decode_tokens_per_s=finite(batch * decode_tokens / decode_s) if decode_s > 0 and decode_tokens else None,
            prefill_paths=runs[-1]["prefill_paths"],
            decode_paths=runs[-1]["decode_paths"],
            peak_memory_bytes=int(median("peak_memory_bytes")),
            # the bytes and coordinates of every sequence of the batch; kv_tokens count one sequence
            **kv_fields(runs[-1]["kv"]),
            runs=[{k: _rounded(v) for k, v in r.items() if k != "kv"} for r in runs],
        )
        return record


def run_benchmark(model, specs: List[MethodSpec], contexts: List[int], *,
                  vocab_size: int, decode_tokens: int = 32, repeats: int = 3, warmup: int = 1, chunk: int = 2048,
                  max_seconds: float = 300.0, guard: Optional[MemoryGuard] = None,
                  progress: bool = True, on_update: Optional[Callable[[List[Dict]], None]] = None,
                  seed: int = 0, batch: int = 1) -> List[Dict]:
    """Records for every (context, method), shortest context first. Within a context the
    methods take turns: every method's warm-up runs, then round r of every method, for r
    in 1..repeats. A method stopped by the memory guard is not run at longer contexts."""
    from tqdm.auto import tqdm

    guard = guard or MemoryGuard(0)
    clock_zero = time.perf_counter()
    records: List[Dict] = []
    stopped: Dict[str, int] = {}
    bar = tqdm(total=len(specs) * len(contexts) * (warmup + max(1, repeats)), desc="benchmark", unit="run",
               disable=not progress)
    for context in sorted(contexts):
        configs = [ConfigRuns(model, spec, context, vocab_size=vocab_size, decode_tokens=decode_tokens,
                              chunk=chunk, max_seconds=max_seconds, guard=guard, seed=seed, clock_zero=clock_zero,
                              batch=batch)
                   for spec in specs if spec.label not in stopped]
        by_label = {config.spec.label: config for config in configs}

        def context_records() -> List[Dict]:
            out = []
            for spec in specs:
                if spec.label in by_label:
                    out.append(by_label[spec.label].result())
                else:
                    out.append({**spec.describe(), "context": context, "batch": batch, "decode_tokens": decode_tokens,
                                "status": "skipped", "repeats_done": 0,
                                "error": f"skipped after the memory guard stopped context {stopped[spec.label]}"})
            return out

        for round_ in range(warmup + max(1, repeats)):
            for config in configs:
                bar.set_postfix_str(f"{config.spec.label} @ {context}")
                config.step(timed=round_ >= warmup)
                bar.update(1)
            if on_update is not None:  # what is measured so far survives an interrupted sweep
                on_update(records + context_records())
        finished = context_records()
        stopped.update({r["label"]: context for r in finished if r["status"] == STOPPED_BY_GUARD})
        records += finished
        if on_update is not None:
            on_update(records)
    bar.close()
    return records
