"""Tokens kept in fp16 after they leave the window, chosen by the attention they got there.

The fp16 sinks and window are a rate per token: full precision for the first and the newest
tokens, codes for the rest. `keep_attended=T` adds a third fp16 set per layer: a token that
leaves the window stays in fp16 (its codes masked out) when its *window share* reaches T.

A token's window share is the attention it received while it was in the window, with each
query's attention normalised over that query's fp16 tokens only (the sinks and its window
band), summed over those queries and over the layer's query heads, divided by the number of
query heads (1 is about what a token of uniform attention gets). The cache computes it from
the queries and the fp16 tokens it holds, whichever path scores the codes, and settles each
token once, as it leaves the window, when every query that sees it there has been scored:
the choice never changes after a query has used it, and it does not depend on how a prompt
was split into chunks. This is an H2O-like criterion (Zhang et al. 2023, arXiv 2306.14048), restricted to what a
cache can see; docs/methods.md gives its measured quality and speed.

`keep_most=F` bounds the kept tokens by F times the settled tokens (counted from
`MIN_TOKENS`, so that early tokens get a budget): past it, tokens are coded whatever their
share. The slots are the whole budget, allocated as it grows (one slot per 1/F settled
tokens), so a cache's bytes do not depend on the text, and the host never reads anything:
the slots fill by scatter and the count lives on the device. (Slots that grew with what was
kept needed the count read back, a sync that stalled a GPU's pipelined decode once per few
steps in every layer.)
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Tuple

import mlx.core as mx

from .engine import small_array

EMPTY = 1 << 30  # the position of an empty slot: after every query, so no query attends to it
MIN_TOKENS = 2048  # the budget counts at least this many settled tokens
DEFAULT_MOST = 1 / 256


def window_shares(queries: mx.array, scale: float, sink_keys: Optional[mx.array], span_keys: mx.array,
                  span_first: int, fp16_from: mx.array, query_first: int, band: int) -> mx.array:
    """(S,) the window share that this call's queries give each token of the fp16 span.

    queries (1, Hq, L, D) at positions query_first.., the span's keys (1, H, S, D) at positions
    span_first.., sink_keys (1, H, n, D) at 0..n-1 (or None); fp16_from (L,) the first non-sink
    position each query sees in fp16. Each query's band holds at most `band` tokens, gathered
    rather than scored against the whole span. (A decode step in the steady state takes
    `KeptTokens.decode_step` instead: the same shares, one compiled graph.)"""
    _, query_heads, L, dim = queries.shape
    heads, S = span_keys.shape[1], span_keys.shape[2]
    repeats = query_heads // heads
    # (H, L, R, D): the R query heads of a kv head, per query, as one matmul batch with its band
    q = (queries[0].astype(mx.float32) * scale).reshape(heads, repeats, L, dim).transpose(0, 2, 1, 3)
    query_pos = mx.arange(query_first, query_first + L)
    band_pos = query_pos[:, None] - band + 1 + mx.arange(band)[None]  # (L, band), the last one is the query's own
    valid = (band_pos >= fp16_from[:, None]) & (band_pos >= span_first)
    index = mx.clip(band_pos - span_first, 0, S - 1)
    band_keys = mx.take(span_keys[0].astype(mx.float32), index.reshape(-1), axis=1).reshape(heads, L, band, dim)
    share = _band_shares(q, band_keys, valid[None, :, None], sink_keys, query_pos[:, None], query_heads)  # (L, band)
    return mx.zeros((S,), mx.float32).at[index.reshape(-1)].add(mx.where(valid, share, 0.0).reshape(-1))


def _band_shares(q: mx.array, band_keys: mx.array, valid: mx.array, sink_keys: Optional[mx.array],
                 query_pos: mx.array, query_heads: int) -> mx.array:
    """Each query's softmax over its fp16 tokens (the sinks, then its band), the band's part summed over
    the query heads (axes 0 and -2 of q's (H, ..., R, D)) and divided by their number: (..., band)."""
    scores = mx.where(valid, q @ band_keys.swapaxes(-1, -2), -mx.inf)  # (H, ..., R, band)
    sinks = 0
    if sink_keys is not None and sink_keys.shape[2]:
        sinks = sink_keys.shape[2]
        keys = sink_keys[0].astype(mx.float32).reshape(sink_keys.shape[1], *([1] * (q.ndim - 3)), sinks, -1)
        causal = mx.arange(sinks) <= query_pos  # (..., n)
        scores = mx.concatenate([mx.where(causal[..., None, :], q @ keys.swapaxes(-1, -2), -mx.inf), scores], axis=-1)
    probs = mx.softmax(scores, axis=-1, precise=True)[..., sinks:]
    # A query that sees no fp16 token at all (none held yet) has a row of -inf: it gives nothing.
    return mx.sum(mx.where(valid, probs, 0.0), axis=(0, -2)) / query_heads


def _fill_slots(chosen, count, keys, values, positions, leaving_keys, leaving_values, leaving_positions):
    """The slots after the tokens of `chosen` took the next free ones (those past the last slot write
    the spare one, which stays EMPTY), and the new count."""
    cap = positions.shape[0] - 1
    rank = count + mx.cumsum(chosen.astype(mx.int32)) - 1
    fits = chosen & (rank < cap)
    slot = mx.where(fits, rank, cap)
    keys[:, :, slot] = leaving_keys
    values[:, :, slot] = leaving_values
    positions[slot] = leaving_positions
    positions[cap] = EMPTY
    return keys, values, positions, count + mx.sum(fits.astype(mx.int32))


@functools.lru_cache(maxsize=64)
def _decode_step_fn(scale: float, band: int, threshold: float):
    """A decode step's whole bookkeeping as one compiled graph (`KeptTokens.decode_step`): the one
    query's window shares, as `window_shares` computes them, with its band a slice of the span (the
    query is the span's newest token), added to the running shares; the oldest position settled
    and, if its share reaches the threshold, put in the next slot (`_fill_slots`). (Before a fused
    step slides the window ring, the kernels do this instead: `KeptTokens.decode_step_sliding`.)"""

    def step(queries, window_keys, leaving_keys, leaving_values, running, firsts, fp16_from, count, keys, values,
             positions, sink_keys=None):
        _, query_heads, _, dim = queries.shape
        heads, held = window_keys.shape[1], window_keys.shape[2]
        span_first, query_pos = firsts[0], firsts[1]
        S = held + 1  # the span: the leaving token, then the window
        width = min(band, S)
        q = (queries[0].astype(mx.float32) * scale).reshape(heads, query_heads // heads, dim)
        band_pos = query_pos - width + 1 + mx.arange(width)
        valid = (band_pos >= fp16_from[0]) & (band_pos >= span_first)
        band_keys = window_keys if width == held else mx.concatenate([leaving_keys, window_keys], axis=2)
        band_keys = band_keys[0, :, band_keys.shape[2] - width :].astype(mx.float32)  # (H, width, D)
        share = _band_shares(q, band_keys, valid, sink_keys, query_pos, query_heads)  # (width,)
        total = mx.concatenate([running, mx.zeros((1,), mx.float32)])
        total = mx.concatenate([total[: S - width], total[S - width :] + share])
        chosen = total[:1] >= threshold
        keys, values, positions, count = _fill_slots(chosen, count, keys, values, positions, leaving_keys,
                                                     leaving_values, span_first[None])
        return total[1:], keys, values, positions, count

    return mx.compile(step)


class KeptTokens:
    """One layer's kept tokens: fp16 keys and values in slots, their positions, and the shares
    of the tokens not yet settled. Slots hold `capacity` tokens plus one that takes the writes
    of tokens not kept (scatter has no "skip"), never read."""

    def __init__(self, threshold: float, most: float):
        self.threshold, self.most = float(threshold), float(most)
        self.keys = self.values = None  # (1, H, capacity + 1, D) fp16
        self.positions = None  # (capacity + 1,) int32, EMPTY where no token is held
        self.count = mx.zeros((1,), mx.int32)  # slots filled (some may have been trimmed away since)
        self.shares = mx.zeros((0,), mx.float32)  # of positions [share_start, share_start + len)
        self.share_start: Optional[int] = None
        self.settled = 0  # tokens whose fate is decided: the budget counts them

    @classmethod
    def for_config(cls, config) -> Optional["KeptTokens"]:
        threshold = config.options.get("keep_attended", 0)
        if not threshold:
            return None
        return cls(threshold, config.options.get("keep_most", DEFAULT_MOST))

    @property
    def capacity(self) -> int:
        return 0 if self.positions is None else self.positions.shape[0] - 1

    def budget(self, settled: int) -> int:
        return math.ceil(self.most * max(settled, MIN_TOKENS))

    # ---- shares ---------------------------------------------------------------------------
    def add_shares(self, shares: mx.array, first: int, offset: int):
        """Add `shares` of positions [first, first + len) to the running ones, which then cover
        every position from the oldest unsettled one to `offset`."""
        if self.share_start is None:
            self.share_start = first
        held = self.shares.shape[0]
        needed = offset - self.share_start
        if needed > held:
            self.shares = mx.concatenate([self.shares, mx.zeros((needed - held,), mx.float32)])
        lead = first - self.share_start
        self.shares[lead : lead + shares.shape[0]] += shares

    def settle(self, stop: int, leaving: Optional[Tuple[mx.array, mx.array, int]]):
        """Decide every unsettled position before `stop` (they have left the window, and every
        query that saw them there has been scored): those whose share reaches the threshold take
        a slot, from `leaving` = (keys, values, first position), their fp16 copies. A position
        `leaving` does not hold (no attention call came between two updates) is coded."""
        if self.share_start is None or stop <= self.share_start:
            return
        start, n = self.share_start, stop - self.share_start
        shares = self.shares[:n]
        if shares.shape[0] < n:
            shares = mx.concatenate([shares, mx.zeros((n - shares.shape[0],), mx.float32)])
        self.shares, self.share_start = self.shares[n:], stop
        self.settled += n
        if leaving is None:
            return
        keys, values, first = leaving
        lo, hi = max(start, first), min(stop, first + keys.shape[2])
        if hi <= lo:
            return
        chosen = shares[lo - start : hi - start] >= self.threshold
        self._grow(keys, values)
        self.keys, self.values, self.positions, self.count = _fill_slots(
            chosen, self.count, self.keys, self.values, self.positions, keys[..., lo - first : hi - first, :],
            values[..., lo - first : hi - first, :], lo + mx.arange(hi - lo, dtype=mx.int32))

    def decode_step(self, queries: mx.array, scale: float, sink_keys: Optional[mx.array], window_keys: mx.array,
                    fp16_from: int, offset: int, stop: int, band: int,
                    leaving: Tuple[mx.array, mx.array, int]) -> bool:
        """A decode step's `add_shares` and `settle(stop, leaving)` in one compiled graph, where they
        line up: the one token that left the window (`leaving`, at `first` = stop - 1) is the one to
        settle, the window holds [first + 1, offset) and the running shares cover [first, offset - 1).
        The span is the leaving token and the window, not joined unless the band reaches past the
        window. False (nothing done) otherwise."""
        keys, values, first = leaving
        if not (stop - 1 == first and keys.shape[2] == 1 and self._steady(first, window_keys.shape[2], offset)):
            return False
        self.settled += 1
        self._grow(keys, values)
        sinks = () if sink_keys is None or not sink_keys.shape[2] else (sink_keys,)
        self.shares, self.keys, self.values, self.positions, self.count = _decode_step_fn(
            float(scale), int(band), self.threshold)(
            queries, window_keys, keys, values, self.shares, small_array((first, offset - 1)),
            small_array((fp16_from,)), self.count, self.keys, self.values, self.positions, *sinks)
        self.share_start = first + 1
        return True

    def decode_step_sliding(self, runner: str, queries: mx.array, scale: float, sink_keys: Optional[mx.array],
                            ring: Tuple[mx.array, mx.array, int], entering_keys: mx.array, fp16_from: int,
                            offset: int, first: int, band: int) -> bool:
        """`decode_step` before the window slides, in one kernel on `runner`'s back end
        (`kernels.ops.kept_settle`): `ring` = (keys, values, slot of the oldest token) is the full
        window as a ring, whose oldest token, at position `first`, leaves as `entering_keys` (the token
        at offset - 1) takes its slot, which a "decode_store" kernel does after this call. False
        (nothing done) where the shares do not line up with that window or the band is not the window."""
        ring_keys, ring_values, slot = ring
        if band != ring_keys.shape[2] or not self._steady(first, ring_keys.shape[2], offset):
            return False
        from .kernels import ops

        self.settled += 1
        self._grow(ring_keys, ring_values)
        sinks = 0 if sink_keys is None else sink_keys.shape[2]
        meta = small_array((slot, first, offset - 1, fp16_from, self.capacity, sinks, self.capacity + 1))
        self.shares, self.keys, self.values, self.positions, self.count = ops.kept_settle(
            ops.runner(runner), queries, ring_keys, ring_values, entering_keys, sink_keys if sinks else None,
            self.shares, meta, scale, self.threshold, self.count, self.keys, self.values, self.positions)
        self.share_start = first + 1
        return True

    def _steady(self, first: int, tokens: int, offset: int) -> bool:
        """Whether the running shares are those of the `tokens` positions from `first` (the leaving
        token's) up to the step's query at offset - 1, which the step's window holds with it."""
        return self.share_start == first and tokens > 0 and self.shares.shape[0] == tokens \
            and first + tokens == offset - 1

    def _grow(self, keys: mx.array, values: mx.array):
        """Slots for the budget of the tokens settled so far (and the spare one)."""
        more = self.budget(self.settled) - self.capacity
        if more <= 0:
            return
        shape = (*keys.shape[:2], more + (1 if self.positions is None else 0))
        if self.positions is None:
            self.keys = mx.zeros((*shape, keys.shape[3]), keys.dtype)
            self.values = mx.zeros((*shape, values.shape[3]), values.dtype)
            self.positions = mx.full((shape[2],), EMPTY, mx.int32)
            return
        self.keys = mx.concatenate([self.keys, mx.zeros((*shape, keys.shape[3]), keys.dtype)], axis=2)
        self.values = mx.concatenate([self.values, mx.zeros((*shape, values.shape[3]), values.dtype)], axis=2)
        self.positions = mx.concatenate([self.positions, mx.full((shape[2],), EMPTY, mx.int32)])

    # ---- what attention reads -------------------------------------------------------------
    def held(self) -> Optional[Tuple[mx.array, mx.array, mx.array]]:
        """(keys, values, positions) of the slots (empty ones at EMPTY), or None before any."""
        if not self.capacity:
            return None
        cap = self.capacity
        return self.keys[:, :, :cap], self.values[:, :, :cap], self.positions[:cap]

    def code_rows(self, first_code: int) -> mx.array:
        """(slots,) each slot's row in the store (from position `first_code`), 0 for an empty slot."""
        positions = self.positions[: self.capacity]
        return mx.where(positions < EMPTY, positions - first_code, 0)

    def slot_bias(self) -> mx.array:
        """(slots,) 0 for a slot holding a token, -inf for an empty one."""
        return mx.where(self.positions[: self.capacity] < EMPTY, 0.0, -mx.inf)

    def code_bias(self, first_code: int, code_capacity: int) -> mx.array:
        """(code_capacity,) -inf at the rows of the store (from position `first_code`) of the kept
        tokens' codes, else 0: what a path that scores the store's whole capacity adds to its scores."""
        positions = self.positions[: self.capacity]
        rows = mx.where(positions < EMPTY, positions - first_code, code_capacity)
        code_bias = mx.zeros((code_capacity + 1,), mx.float32)
        code_bias[rows] = -mx.inf
        return code_bias[:code_capacity]

    # ---- trim, bytes, state ---------------------------------------------------------------
    def truncate(self, coded_stop: int, offset: int):
        """After a trim: no kept token at `coded_stop` or later (they are gone), no share past `offset`."""
        if self.positions is not None:
            self.positions = mx.where(self.positions >= coded_stop, EMPTY, self.positions)
        if self.share_start is not None:
            self.share_start = min(self.share_start, offset)
            self.shares = self.shares[: offset - self.share_start]

    def arrays(self) -> list:
        return [a for a in (self.keys, self.values, self.positions, self.count, self.shares) if a is not None]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    def state(self) -> Tuple[dict, dict]:
        header = {"share_start": self.share_start, "settled": self.settled}
        arrays = {"kept_count": self.count, "kept_shares": self.shares}
        if self.positions is not None:
            arrays.update(kept_keys=self.keys, kept_values=self.values, kept_positions=self.positions)
        return header, arrays

    def load(self, header: dict, arrays: dict, shape: Tuple[int, int, int, int], dtype, offset: int) -> list:
        """Restore from `state`; the problems found (shapes that do not fit), empty when none."""
        problems = []
        try:
            self.share_start, self.settled = header["share_start"], int(header["settled"])
            if self.share_start is not None:
                self.share_start = int(self.share_start)
        except Exception as error:
            return [f"kept tokens: unusable header ({error!r})"]
        count, shares = arrays.get("kept_count"), arrays.get("kept_shares")
        if count is None or count.shape != (1,) or shares is None or shares.ndim != 1:
            return ["kept tokens: no count or shares"]
        if shares.shape[0] != (0 if self.share_start is None else offset - self.share_start):
            problems.append(f"kept shares hold {shares.shape[0]} positions, not {offset} - {self.share_start}")
        self.count, self.shares = count.astype(mx.int32), shares.astype(mx.float32)
        if "kept_positions" in arrays:
            self.keys, self.values = arrays.get("kept_keys"), arrays.get("kept_values")
            self.positions = arrays["kept_positions"].astype(mx.int32)
            batch, heads, key_dim, value_dim = shape
            slots = self.positions.shape[0] if self.positions.ndim == 1 else -1
            if slots != self.budget(self.settled) + 1:
                problems.append(f"kept tokens: {slots} slots, for a budget of {self.budget(self.settled)}")
            for name, array, dim in (("keys", self.keys, key_dim), ("values", self.values, value_dim)):
                if array is None or array.shape != (batch, heads, slots, dim) or array.dtype != dtype:
                    problems.append(f"kept {name} have shape {getattr(array, 'shape', None)} and dtype "
                                    f"{getattr(array, 'dtype', None)}, expected {(batch, heads, slots, dim)} {dtype}")
        return problems
