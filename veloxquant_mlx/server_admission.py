"""`veloxquant serve --kv-memory-gb X`: a request starts only while its KV caches fit in X.

Each admitted request reserves the bytes its caches would hold at its prompt's length plus its
`max_tokens` (`CacheBytes`: the `nbytes` of the served caches, measured once at two lengths and
taken as linear between them, so it counts what each cache class really allocates, mlx-lm's
256-token growth steps included). A request whose reservation would take the live total over X
waits, first come first served, and is logged as queued; one that could never fit alone is
refused with HTTP 400. The same rule applies to mlx-lm's own caches (`--kv none`), so two servers
compare at equal memory.
"""

from __future__ import annotations

import collections
import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional

import mlx.core as mx

from .server_requests import RequestError

GB = 1e9
STEP = 256  # tokens mlx-lm's caches and ours grow by
PROBE_TOKENS = (STEP, 5 * STEP)  # two lengths the caches' bytes are measured at


class CacheBytes:
    """Bytes one sequence's caches hold at `tokens` tokens: `make_caches()` filled with random keys and
    values to the two PROBE_TOKENS lengths, their `nbytes` read, and the line through the two points."""

    def __init__(self, model, make_caches: Callable[[], list]):
        from .kvlayout import kv_layout

        layout = kv_layout(model).layers
        dtype = _activation_dtype(model)
        sizes = []
        for tokens in PROBE_TOKENS:
            caches = [c for c in make_caches() if hasattr(c, "update_and_fetch")]
            for cache, (heads, key_dim, value_dim) in zip(caches, layout):
                keys = mx.random.normal((1, heads, tokens, key_dim)).astype(dtype)
                values = mx.random.normal((1, heads, tokens, value_dim)).astype(dtype)
                cache.update_and_fetch(keys, values)
            sizes.append(sum(c.nbytes for c in caches))
            del caches
        (t0, t1), (b0, b1) = PROBE_TOKENS, sizes
        self.per_token = (b1 - b0) / (t1 - t0)
        self.fixed = b0 - self.per_token * t0

    def __call__(self, tokens: int) -> int:
        """At whole growth steps: every cache here allocates 256 tokens at a time."""
        return int(self.fixed + self.per_token * -(-tokens // STEP) * STEP + 0.5)


def _activation_dtype(model):
    for _, array in _leaves(model.parameters()):
        if array.dtype in (mx.float16, mx.bfloat16, mx.float32):
            return array.dtype
    return mx.float32


def _leaves(tree, prefix=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _leaves(value, f"{prefix}.{key}")
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from _leaves(value, f"{prefix}.{i}")
    else:
        yield prefix, tree


@dataclass
class AdmissionStats:
    admitted: int = 0
    queued: int = 0
    refused: int = 0
    live: int = 0  # requests holding a reservation now
    most_live: int = 0
    reserved_bytes: int = 0
    most_reserved_bytes: int = 0


@dataclass
class _Waiting:
    request: tuple
    need: int
    logged: bool = False


@dataclass
class KVBudget:
    """The admission rule of `--kv-memory-gb`: reservations against `limit` bytes."""

    limit: int
    cache_bytes: Callable[[int], int]
    stats: AdmissionStats = field(default_factory=AdmissionStats)

    def __post_init__(self):
        self._waiting = collections.deque()
        self._reserved = {}  # id(response queue) -> bytes
        self._lock = threading.Lock()

    def next(self, fetch, timeout, prompt_tokens) -> Optional[tuple]:
        """The next request to start, or None: `fetch(timeout)` gives the requests that arrive (each
        (response queue, request, args)); `prompt_tokens(request)` its prompt's token count."""
        arrived = fetch(None if self._waiting else timeout)
        while arrived is not None:
            rqueue, _, args = arrived
            try:
                need = self.cache_bytes(prompt_tokens(arrived) + args.max_tokens)
            except Exception as error:  # a bad request: mlx-lm's loop answers it when it tokenizes again
                logging.debug(f"admission could not size a request: {error}")
                need = 0
            if need > self.limit:
                self.stats.refused += 1
                rqueue.put(RequestError(f"this request's KV cache would need {need / GB:.3f} GB, more than this "
                                        f"server's --kv-memory-gb {self.limit / GB:g}", 400))
            else:
                self._waiting.append(_Waiting(arrived, need))
            arrived = fetch(None)
        if not self._waiting:
            return None
        head = self._waiting[0]
        with self._lock:
            if self.stats.reserved_bytes + head.need > self.limit:
                fresh = [w for w in self._waiting if not w.logged]  # every request that waits counts once
                for waiting in fresh:
                    waiting.logged = True
                self.stats.queued += len(fresh)
                if fresh:
                    logging.info(f"KV budget: request queued ({len(self._waiting)} waiting): it needs "
                                 f"{head.need / GB:.3f} GB, {self.stats.reserved_bytes / GB:.3f} GB of "
                                 f"{self.limit / GB:g} GB are held by {self.stats.live} running")
                return None
            self._waiting.popleft()
            rqueue = head.request[0]
            self._reserved[id(rqueue)] = head.need
            # a request stopped early (its client gone) gets no last answer: its queue's end releases it too
            weakref.finalize(rqueue, self._release, id(rqueue))
            self.stats.admitted += 1
            self.stats.live += 1
            self.stats.reserved_bytes += head.need
            self.stats.most_live = max(self.stats.most_live, self.stats.live)
            self.stats.most_reserved_bytes = max(self.stats.most_reserved_bytes, self.stats.reserved_bytes)
        return head.request

    def release(self, rqueue) -> None:
        """The request of `rqueue` has had its last answer: its reservation ends."""
        self._release(id(rqueue))

    def _release(self, key) -> None:
        with self._lock:
            need = self._reserved.pop(key, None)
            if need is not None:
                self.stats.live -= 1
                self.stats.reserved_bytes -= need
