"""Attention over a compressed cache: the read-only `engine.History` its paths get, the
segments the generic path walks, the path chosen per kind of call, and `keep_attended`'s shares."""

from __future__ import annotations

import math

import mlx.core as mx

from .. import engine
from ..attention import Segment
from ..kept import window_shares
from ..methods.base import at_positions
from .errors import CacheInputError


class CacheAttention:
    """How a `CompressedKVCache` attends (its mixin)."""

    attention_block = 4096  # most tokens decoded per generic attention block
    score_tile = 1 << 21  # most query-by-key scores per generic block: bounds prefill memory
    band_queries = 64  # prefill queries per group scoring the recent tokens in fp16 (`_recent_fp16`): ~ the window

    def attention_history(self) -> engine.History:
        """The read-only view the engine's and kernels' attention paths read, with every pending
        token stored first (`flush`)."""
        self.flush()
        return self._history()

    def _history(self, pending=None, slide: bool = False, sink_logits=None) -> engine.History:
        """The read-only view attention paths get; with `slide`, `pending` is the token that
        enters the window, whose oldest token is at `window_start`; `sink_logits`: the call's learned
        attention sinks (`attend`)."""
        history = engine.History(
            store=self.store, key_codec=self.key_codec, value_codec=self.value_codec, kv_heads=self.kv_heads,
            offset=self.offset, sinks=self.sinks, window=self.window, key_mean=self.key_mean,
            value_mean=self.value_mean, settings=self.settings, fp16=self._fp16_tokens, segments=self.segments,
            fp16_parts=self._fp16_parts,
            band=self.just_encoded is not None, pending=pending, recent=self._recent_tokens,
            fp16_from=self._fp16_from, window_slot=self.window_start if slide else None,
            window_capacity=None if self.window_fill is None else self._window_keys.shape[2],
            kept=(self.kept, self.sinks) if self.kept is not None and self.kept.capacity else None,
        )
        history.sink_logits = sink_logits
        return history

    def segments(self, query_rows: int = 1, query_len: int = 0):
        """The history as attention consumes it; encoded blocks are decoded lazily and
        sized so that `query_rows` (queries x query heads) x block scores fit a tile.
        With `query_len`, tokens this update encoded are scored in fp16 by the queries
        that would still have seen them in the window."""
        self.flush()
        if query_len and self.just_encoded is not None:
            just, _, first = self.just_encoded
            last = first + just.shape[2]
            query_pos = mx.arange(self.offset - query_len, self.offset)
            fp16_from = self._prefill_fp16_from(query_pos, first, last, query_len)[:, None]
        value_shift = None
        if self.value_mean is not None:
            value_shift = self.value_codec.to_domain(self.value_mean.astype(mx.float32))
        block = min(self.attention_block, max(256, self.score_tile // max(query_rows, 1)))
        block = math.ceil(block / self.block) * self.block
        encoded = self.encoded
        # The kept tokens' codes, masked out of every block (`kept.py`): -inf at their rows.
        kept_codes = self.kept.code_bias(self.sinks, encoded) if self.kept is not None and self.kept.capacity else None
        if query_len and self.just_encoded is not None and self._chunk_sees_fp16(query_len):
            # Every query sees this update's tokens in fp16: their codes would be masked out whole.
            encoded = max(0, first - self.sinks)
        for start in range(0, encoded, block):
            stop = min(start + block, encoded)
            only_codes = None
            if query_len and self.just_encoded is not None and self.sinks + stop > first:
                only_codes = mx.arange(self.sinks + start, self.sinks + stop)[None] < fp16_from
            if kept_codes is not None:
                coded = (kept_codes[start:stop] == 0)[None]
                only_codes = coded if only_codes is None else only_codes & coded
            yield Segment(
                self.key_codec.decode(at_positions(self.key_codec, self.store.fields("keys", start, stop),
                                                   self.sinks + start)),
                None,
                self.sinks + start,
                encoded=True,
                extra_mask=only_codes,
                value_fields=self.store.fields("values", start, stop),
                value_shift=value_shift,
            )
        # The fp16 segments come after the codes: until the first of them there is no fp16
        # accumulator for every block of codes to rescale (a prefill chunk's (L, D) per block).
        if self.sinks:
            yield Segment(self._centered(self.sink_keys), self.sink_values, 0, encoded=False)
        kept = None if self.kept is None else self.kept.held()
        if kept is not None:
            # A query sees a kept token here when it no longer sees it in its fp16 band (below);
            # empty slots sit at a position after every query.
            keys, values, positions = kept
            sees_from = fp16_from if query_len and self.just_encoded is not None else self.sinks + self.encoded
            yield Segment(self._centered(keys), values, 0, encoded=False, extra_mask=positions[None] < sees_from,
                          positions=positions)
        if query_len and self.just_encoded is not None:
            yield from self._recent_fp16(*self._recent_tokens(), query_len, fp16_from)
        elif self.window:
            yield Segment(
                self._centered(self.window_keys), self.window_values, self.sinks + self.encoded, encoded=False
            )

    def _recent_fp16(self, keys: mx.array, values: mx.array, first: int, query_len: int, fp16_from: mx.array):
        """Positions [first, offset) in fp16 (the tokens this update encoded, then the
        window; keys centered) for the queries that still see them so: query i sees keys [fp16_from[i], i]
        in fp16 (a band about one window wide), so the queries go in groups of
        `band_queries`, each scoring only its band's keys, not every query the whole span."""
        first_query = self.offset - query_len
        last = first + keys.shape[2]
        if self._chunk_sees_fp16(query_len):  # every query sees the whole span
            yield Segment(keys, values, first, encoded=False)
            return
        for a in range(0, query_len, self.band_queries):
            b = min(a + self.band_queries, query_len)
            lo = self._prefill_fp16_from(first_query + a, first, last, query_len)
            hi = min(max(first_query + b, first), last)  # causal: no key after the group's last query
            if hi <= lo:
                continue
            yield Segment(
                keys[..., lo - first : hi - first, :], values[..., lo - first : hi - first, :], lo,
                encoded=False, extra_mask=mx.arange(lo, hi)[None] >= fp16_from[a:b], query_rows=(a, b),
            )

    def attend(self, queries: mx.array, scale: float, mask=None, sinks=None) -> mx.array:
        """Attention of `queries` (B, n_heads, L, D) over everything this cache holds, through
        the first registered path that takes the call (`engine.py`); `last_path` names it.
        `sinks` (n_heads,): learned attention sinks (GPT-OSS), as mlx-lm's attention takes them: one
        logit per query head that joins the softmax's denominator and adds no value."""
        if self.store is None or self.offset == 0:
            raise CacheInputError("attend() on an empty cache: it holds no tokens (none added, or all trimmed)")
        if not isinstance(queries, mx.array) or queries.ndim != 4:
            raise CacheInputError(f"queries must be an mx.array (batch, heads, tokens, head_dim), got "
                                  f"{getattr(queries, 'shape', type(queries).__name__)}")
        B, heads, L, dim = queries.shape
        if B != self.batch or heads % self.kv_heads or dim != self.key_dim:
            raise CacheInputError(
                f"queries {tuple(queries.shape)} do not fit this cache: batch {self.batch}, a multiple of "
                f"{self.kv_heads} heads, head dim {self.key_dim}")
        if sinks is not None and (not isinstance(sinks, mx.array) or sinks.shape != (heads,)):
            raise CacheInputError(f"attention sinks must be an mx.array of one logit per query head ({heads},), got "
                                  f"{getattr(sinks, 'shape', type(sinks).__name__)}")
        if L == 0:
            return mx.zeros((B, heads, 0, self.value_dim), dtype=queries.dtype)
        self._check_queries(queries)
        if self.kept is not None:
            self._keep_attended(queries, scale)
        store = self.store
        if store.pending is not None or self.incoming is not None:
            path = self._route("decode_store", queries, mask, sinks is not None)
            if path is not None:
                if self.incoming is None:
                    out, rows = path.run(self._history(pending=store.take_pending(), sink_logits=sinks), queries,
                                         scale, mask)
                else:
                    incoming, self.incoming = self.incoming, None
                    store.reserve(1)
                    out, rows, window = path.run(self._history(pending=incoming, slide=True, sink_logits=sinks),
                                                 queries, scale, mask)
                    self._window_keys, self._window_values = window
                    self.window_start = (self.window_start + 1) % self.window
                store.put_row(rows)
                self.last_path = path.name
                return out
            self.flush()
        path = self._route("decode" if queries.shape[2] == 1 else "prefill", queries, mask, sinks is not None)
        history = self._history(sink_logits=sinks)
        if path is None:
            out, self.last_path = engine.generic(history, queries, scale, mask), "generic"
        else:
            out, self.last_path = path.run(history, queries, scale, mask), path.name
        self.just_encoded = None  # only the call after the update scores them in fp16
        return out

    def _keep_attended(self, queries: mx.array, scale: float):
        """`keep_attended`: add this call's window shares (`kept.window_shares`) and settle the
        tokens that have left the window, before any path scores, so that the later queries of a
        prefill chunk see the tokens its earlier ones kept."""
        L = queries.shape[2]
        band = self.config.residual_length
        if self.incoming is not None:  # a "decode_store" kernel slides the window after this
            ring = (self._window_keys, self._window_values, self.window_start)
            if self.kept.decode_step_sliding(self.settings.backend, queries, scale, self.sink_keys, ring,
                                             self.incoming[0], self._fp16_from(self.offset - 1), self.offset,
                                             self.sinks + self.encoded, band):
                return
            self._enter_window()  # the shares do not line up (a cache just loaded or trimmed): slide op by op
        if L == 1 and self.just_encoded is not None and self.window and self.kept.decode_step(
                queries, scale, self.sink_keys, self.window_keys, self._fp16_from(self.offset - 1), self.offset,
                self.sinks + self.encoded, band, self.just_encoded):
            return  # a decode step: shares and settling in one compiled graph
        if self.just_encoded is not None:
            span, _, first = self.just_encoded
            if self.window:
                span = mx.concatenate([span, self.window_keys], axis=2)
        else:
            span, first = (self.window_keys if self.window else None), self.sinks + self.encoded
        if span is not None:
            query_pos = mx.arange(self.offset - L, self.offset)
            shares = window_shares(queries, scale, self.sink_keys, span, first, self._fp16_from(query_pos),
                                   self.offset - L, band)
            self.kept.add_shares(shares, first, self.offset)
        self.kept.settle(self.sinks + self.encoded, self.just_encoded)

    def _route(self, phase: str, queries, mask, sinks: bool = False):
        """The registered path for this kind of call (`engine.choose`), memoised on what the
        paths' `supports` look at (shapes, dtypes, the mask's kind, the fp16 spans against
        `engine.FP16_HELD_LIMIT`, whether codes exist and means are fixed), so a decode step does
        not re-run the checks.
        "defer": whether a decode token may wait for a "decode_store" path; "slide": whether
        one may wait to enter a full window, which a "decode_store" path slides (`incoming`).
        `sinks`: the call has learned attention sinks (only paths that take them are chosen)."""
        if mask is not None and not isinstance(mask, str):
            return None  # an explicit mask array: the generic path applies it
        if self.kept is not None and phase == "defer":
            return None  # a token leaves the window in the update: `_keep_attended` needs its fp16 copy
        slide = phase == "slide" or (phase == "decode_store" and self.incoming is not None)
        key = (phase, None if queries is None else (queries.shape, queries.dtype), mask, *self._fp16_route_key(),
               self.just_encoded is not None, self.store.count > 0, self.key_mean is None, slide,
               self.kept is not None and self.kept.capacity > 0, sinks)
        if key not in self._routes:
            history = self._history(pending=self.incoming or self.store.pending, slide=slide,
                                    sink_logits=mx.zeros((queries.shape[1],)) if sinks else None)
            if phase in ("defer", "slide"):
                self._routes[key] = True if engine.defers(history) else None
            else:
                self._routes[key] = engine.choose(phase, history, queries, mask)
        return self._routes[key]

    def _fp16_route_key(self) -> tuple:
        """The sinks' length and what of the fp16 window the paths' `supports` look at: whether it holds
        tokens, and whether the sinks with the window's tokens, and with its buffer whole, fit
        `engine.FP16_HELD_LIMIT`. Keyed on the window's length itself, a group format (KIVI's tokens
        waiting for a whole group) would choose its path again on every decode step until each length
        had been seen once."""
        sinks = 0 if self.sink_keys is None else self.sink_keys.shape[2]
        if self.window_fill is None:
            window, capacity = (0 if self._window_keys is None else self._window_keys.shape[2]), 0
        else:
            window, capacity = self.window_fill, self._window_keys.shape[2]
        limit = engine.FP16_HELD_LIMIT
        return sinks, window > 0, sinks + window <= limit, sinks + capacity <= limit

    def dequantized(self):
        """(keys, values) as the attention sees them, in fp32. For tests and debugging:
        this materialises the whole history, which attention itself never does."""
        parts = []
        for seg in self.segments():
            if seg.positions is not None:
                continue  # the kept tokens: written over their codes below
            values = seg.decoded_values(self.value_codec)
            if seg.encoded:
                parts.append((seg.start, self.key_codec.from_domain(seg.keys), self.value_codec.from_domain(values)))
            else:
                parts.append((seg.start, seg.keys.astype(mx.float32), values))
        parts.sort(key=lambda part: part[0])  # segments come in attention's order, not by position
        keys = mx.concatenate([k for _, k, _ in parts], axis=2)
        if self.key_mean is not None:
            keys = keys + self.key_mean
        values = mx.concatenate([v for _, _, v in parts], axis=2)
        kept = None if self.kept is None else self.kept.held()
        if kept is not None:
            kept_keys, kept_values, positions = kept
            held = [i for i, p in enumerate(positions.tolist()) if p < self.offset]
            if held:
                slots, at = mx.array(held), positions[mx.array(held)]
                keys[:, :, at] = kept_keys[:, :, slots].astype(mx.float32)
                values[:, :, at] = kept_values[:, :, slots].astype(mx.float32)
        return keys, values
