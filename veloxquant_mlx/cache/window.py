"""Position bookkeeping of a compressed cache: the fp16 sinks, the fp16 window (a ring a decode
kernel slides, or a fixed-capacity buffer for block formats) and the tokens that leave it for the
store, and which of them a query sees in fp16."""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from ..storage import grow


class WindowPositions:
    """Sinks, window and store positions of a `CompressedKVCache` (its mixin)."""

    @property
    def encoded(self) -> int:
        return 0 if self.store is None else self.store.count

    @property
    def key_fields(self):
        """The key codec's fields of the encoded tokens (views of the store)."""
        return {} if self.store is None else self.store.fields("keys")

    @property
    def value_fields(self):
        return {} if self.store is None else self.store.fields("values")

    @property
    def tokens_per_row(self):
        return self.store.tokens_per_row

    @property
    def sinks(self) -> int:
        return 0 if self.sink_keys is None else self.sink_keys.shape[2]

    @property
    def window(self) -> int:
        if self.window_fill is not None:
            return self.window_fill
        return 0 if self._window_keys is None else self._window_keys.shape[2]

    # The window in position order, for everything but a decode step's kernels: a token waiting
    # to enter it enters, and a ring slid by the kernels is put back in order (one copy).
    @property
    def window_keys(self) -> Optional[mx.array]:
        self._window_in_order()
        return self._held(self._window_keys)

    @window_keys.setter
    def window_keys(self, keys: Optional[mx.array]):
        self._settle_window()
        self._window_keys = keys

    @property
    def window_values(self) -> Optional[mx.array]:
        self._window_in_order()
        return self._held(self._window_values)

    @window_values.setter
    def window_values(self, values: Optional[mx.array]):
        self._settle_window()
        self._window_values = values

    def _held(self, window: Optional[mx.array]) -> Optional[mx.array]:
        """The tokens of a window array (a view of the filled part of a fixed-capacity buffer)."""
        return window if self.window_fill is None else window[..., : self.window_fill, :]

    def _settle_window(self):
        """Both roles' window as exactly its tokens (before either is replaced), no buffer (copies:
        a view would keep the buffer alive, out of `nbytes`)."""
        if self.window_fill is not None:
            self._window_keys = mx.contiguous(self._held(self._window_keys))
            self._window_values = mx.contiguous(self._held(self._window_values))
            self.window_fill = None

    def _window_in_order(self):
        self._enter_window()
        if self.window_start:
            start, self.window_start = self.window_start, 0
            self._window_keys = mx.roll(self._window_keys, -start, axis=2)
            self._window_values = mx.roll(self._window_values, -start, axis=2)

    def _enter_window(self):
        """The waiting decode token enters the window, its oldest token going to the store (op
        by op: what the "decode_store" kernels would have done in the attention call)."""
        if self.incoming is not None:
            (keys, values), self.incoming = self.incoming, None
            self._slide_window(keys, values, 1)

    def flush(self):
        """Store what waits for the next attention call: a token waiting to enter the window,
        a token waiting to be encoded (`storage.RowStore.defer`)."""
        self._enter_window()
        self.store.flush()

    def _tail_append(self, keys: mx.array, values: mx.array, flush: int):
        """A decode token of a block format (KIVI) joins the window, held in a buffer of fixed
        capacity (residual_length + block, the most it holds before a block leaves) that it fills
        in part: one in-place slice update per role, and the decode step's shapes stay the same
        from token to token. A window that grew by concatenation instead changed them on every
        token, and a compiled decode step traced itself again for each new length (64 traces per
        256 tokens of `kivi:4`). The kernel path reads the buffer and the fill
        (`_fp16_parts(held=True)`), every other reader a view of the filled part."""
        capacity = self.config.residual_length + self.block
        if self.window_fill is None:  # into a buffer (the first decode token, or after a prefill or trim)
            held = self.window
            self._window_keys = grow(self._window_keys, capacity, keys, capacity)
            self._window_values = grow(self._window_values, capacity, values, capacity)
            self.window_fill = held
        fill = self.window_fill
        self._window_keys[..., fill : fill + 1, :] = keys
        self._window_values[..., fill : fill + 1, :] = values
        self.window_fill = fill + 1
        if flush > 0:
            leaving_keys, leaving_values = self._window_keys[..., :flush, :], self._window_values[..., :flush, :]
            self.just_encoded = (leaving_keys, leaving_values, self.sinks + self.encoded)
            self._store_for(flush)(leaving_keys, leaving_values)
            kept = fill + 1 - flush
            if kept:  # the residual tokens move to the front (once per block)
                self._window_keys = grow(self._window_keys[..., flush : fill + 1, :], capacity, keys, capacity)
                self._window_values = grow(self._window_values[..., flush : fill + 1, :], capacity, values, capacity)
            self.window_fill = kept

    def _store_for(self, flush: int):
        """How `flush` tokens leaving the window reach the store. A decode step pushes one token
        out: like a token of the plain cache, it may wait for the attention call's "decode_store"
        path, which encodes, attends to and stores it in one kernel (the query no longer sees it
        in fp16)."""
        return self.store.defer if flush == 1 and self._route("defer", None, None) else self.store.append

    def _slide_window(self, keys: mx.array, values: mx.array, flush: int):
        """The first `flush` window tokens (no more than it holds) leave for the store, as the
        general path of `update_and_fetch` sends them, and `keys` / `values` join the window."""
        self._window_in_order()
        leaving_keys, kept_keys = mx.split(self._window_keys, [flush], axis=2)
        leaving_values, kept_values = mx.split(self._window_values, [flush], axis=2)
        self.just_encoded = (leaving_keys, leaving_values, self.sinks + self.encoded)
        # The shadow is the previous window whole (no work unless a trim reads it; counted in `nbytes`).
        self.shadow = (self._window_keys, self._window_values, flush)
        self._store_for(flush)(leaving_keys, leaving_values)
        self._window_keys = mx.concatenate([kept_keys, keys], axis=2)
        self._window_values = mx.concatenate([kept_values, values], axis=2)

    def _keep_shadow(self, keys: mx.array, values: mx.array):
        """Keep the fp16 copies of the newest tokens that left the window in this update (at most a
        window's worth: copies, so a prefill chunk is not kept alive), for `trim`: a trim of no more
        than these leaves the window it would hold had the trimmed tokens never come (speculative
        decoding's rejected drafts, mlx-lm's `trim_prompt_cache`)."""
        if not self.config.residual_length:
            return  # no window: a trim drops codes only, exactly
        keep = min(keys.shape[2], self.config.residual_length)
        self.shadow = (mx.contiguous(keys[..., -keep:, :]), mx.contiguous(values[..., -keep:, :]), keep)
        mx.async_eval(*self.shadow[:2])  # a copy not yet made would keep the whole chunk alive

    def _trim_from_shadow(self, n: int) -> bool:
        """Trim `n` tokens (n < offset - sinks) so that the window is a fresh cache's: codes after
        the fresh window's start go, and the fp16 copies of their tokens (`shadow`) join the window
        back. False, and nothing changed, where the shadow does not reach far enough back."""
        if self.block != 1 or self.shadow is None:
            return False
        shadow_keys, shadow_values, held = self.shadow  # the copies are the first `held` tokens
        target = self.offset - n - self.sinks  # tokens after the sinks a fresh cache would hold
        encoded = max(0, target - self.config.residual_length)
        if not self.encoded - held <= encoded <= self.encoded:
            return False
        back = self.encoded - encoded  # the newest shadow tokens go back to the window
        window_keys, window_values = self.window_keys, self.window_values
        if back:
            keys, values = shadow_keys[..., held - back : held, :], shadow_values[..., held - back : held, :]
            window_keys, window_values = _join(keys, window_keys), _join(values, window_values)
            self.shadow = None if back == held else (shadow_keys, shadow_values, held - back)
        keep = target - encoded
        self.window_keys = mx.contiguous(window_keys[..., :keep, :]) if keep else None
        self.window_values = mx.contiguous(window_values[..., :keep, :]) if keep else None
        self.store.truncate(encoded)
        return True

    def refill_span(self) -> int:
        """How many tokens to trim, and feed again, for this cache to hold what a fresh prefill of the
        same tokens would: 0 where it does; else back to a code boundary at least a window before
        the end, so the tokens of the window come back in fp16 (a trim reaching past `shadow` leaves
        codes where a fresh cache holds fp16; `prompt_cache.FreshPromptCache`)."""
        if self.store is None or self.offset <= self.sinks:
            return 0
        fresh = max(0, (self.offset - self.sinks - self.config.residual_length) // self.block * self.block)
        if self.encoded == fresh:
            return 0
        return self.offset - self.sinks - min(self.encoded, fresh)

    def fresh_means(self, first_chunk: int, seen: Optional[int] = None) -> bool:
        """Whether this cache, holding the first `offset` tokens of a prompt, has the centring means a fresh
        prefill of that prompt whose first chunk holds `first_chunk` tokens computes (none, or the same
        tokens'). Capped means (`config.mean_tokens`) are where they came from their whole span, the cache
        still holds it, and that first chunk's flush covers it; uncapped means came from the first flush of
        the prompt that made them, which another prompt's need not match. `seen`: the tokens the cache has
        taken, where that is more than it holds (a sliding-window cache evicts; its means stay)."""
        if self.key_mean is None:
            return True
        span = self.config.mean_tokens
        flushed = (first_chunk - self.config.sink_tokens - self.config.residual_length) // self.block * self.block
        seen = self.offset if seen is None else seen
        return span is not None and self.mean_count == span and seen >= self.sinks + span and flushed >= span

    def _recent_tokens(self):
        """(keys (centered), values, first position) of the tokens this update encoded followed by
        the window: one fp16 span, which the chunk's earlier queries still see in fp16."""
        if self.just_encoded is None:
            return None
        keys, values, first = self.just_encoded
        if self.window:
            keys = mx.concatenate([keys, self.window_keys], axis=2)
            values = mx.concatenate([values, self.window_values], axis=2)
        return self._centered(keys), values, first

    def _fp16_parts(self, held: bool = False):
        """The sinks' and the window's (keys, values) as held (keys not centered), present ones only,
        for decode paths: the window in its ring order (one query's attention does not depend
        on the order of its keys), not settled (a "decode_store" path may slide it). `held`: a
        window buffer of fixed capacity whole (`window_fill` tokens of it filled), else its
        filled part."""
        parts = ((self.sink_keys, self.sink_values),) if self.sinks else ()
        if self.window:
            window = (self._window_keys, self._window_values)
            parts += (window if held else tuple(self._held(a) for a in window),)
        return parts

    def _fp16_tokens(self):
        parts = [(self.sink_keys, self.sink_values), (self.window_keys, self.window_values)]
        parts = [(self._centered(k), v) for k, v in parts if k is not None and k.shape[2]]
        if not parts:
            return None
        if len(parts) == 1:
            return parts[0]
        return (mx.concatenate([k.astype(mx.float32) for k, _ in parts], axis=2),
                mx.concatenate([v for _, v in parts], axis=2))

    def _fp16_from(self, query_pos):
        """First non-sink position still in fp16 when `query_pos` (an int or an array) was
        the newest token."""
        sinks, window = self.config.sink_tokens, self.config.residual_length
        blocks = (query_pos + 1 - sinks - window) // self.block
        blocks = max(0, blocks) if isinstance(blocks, int) else mx.maximum(0, blocks)
        return sinks + blocks * self.block

    def _chunk_sees_fp16(self, query_len: int) -> bool:
        """Whether `query_len` queries see the whole recent fp16 span (the "chunk" prefill rule)."""
        return self.settings.prefill_rule == "chunk" and query_len > 1

    def _prefill_fp16_from(self, query_pos, first: int, last: int, query_len: int):
        """First position of the recent fp16 span [first, offset) that one of `query_len` queries,
        at `query_pos` (an int or an array), sees in fp16; it sees the span's earlier tokens,
        encoded at [first, last), from their codes. The "decode" rule: what token-by-token
        decoding would show it (a band about one window wide); the "chunk" rule: the whole span,
        for the queries of a prefill chunk (more than one)."""
        if self._chunk_sees_fp16(query_len):
            return first if isinstance(query_pos, int) else mx.full(query_pos.shape, first)
        pos = self._fp16_from(query_pos)
        return min(max(pos, first), last) if isinstance(pos, int) else mx.clip(pos, first, last)

    def _centered(self, keys: mx.array) -> mx.array:
        return keys if self.key_mean is None else keys.astype(mx.float32) - self.key_mean


def _join(a: mx.array, b: Optional[mx.array]) -> mx.array:
    return a if b is None or b.shape[2] == 0 else mx.concatenate([a, b.astype(a.dtype)], axis=2)
