"""Batches of compressed caches for mlx-lm's `BatchGenerator` (`batch_generate`, `mlx_lm.server`).

mlx-lm's `BatchKVCache` keeps one fp16 buffer of shape (B, H, max_len, D): shorter
sequences are left-padded and a mask array hides the padding. Codes cannot be
left-padded the same way without breaking what the compressed layout relies on
(the sinks are the first tokens, a KIVI key group starts on a block boundary), so
`BatchCompressedKVCache` keeps one batch-1 cache per sequence, each holding only that
sequence's real tokens: a `CompressedKVCache`, or a `CompressedRotatingKVCache` for a
sliding-window layer (mlx-lm's `BatchRotatingKVCache`). Padding is never stored: the
protocol's left padding (`prepare(left_padding=)`) and right padding
(`prepare(lengths=, right_padding=)`) only tell the cache which positions of an input
chunk belong to no sequence.

The projections and MLPs run on the whole batch. A decode step (one query per
sequence) attends over the rows that allow it in one call (`batch_decode.py`: their
codes in shared batch-shaped buffers, each row's length and fp16 window masked), a batch
of one included; the other rows (too young to hold codes, formats without a batched
path) and anything else (a prefill chunk) run row by row, each with its own causal or
sliding-window mask. Which way a row runs depends on that row alone, so a decode step gives
a row the same bits whichever sequences share its batch (on the CPU, whose decode matmuls
treat rows independently); a batched prefill's matmuls still round by batch shape.

`offset` is an array of each sequence's next position (what RoPE needs, as with
`BatchKVCache`). `make_mask` returns, as `BatchKVCache`'s does, an array in its layout
(rows right-aligned, `left_padding` columns of padding), which `attend` recognises as its
own and replaces with each row's mask. A mask array the model built itself cannot be applied row by
row, and `attend` refuses it rather than ignore it.
"""

from __future__ import annotations

import copy
import json
import weakref
from typing import List, Optional, Sequence, Union

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache

from .batch_columns import RowColumns
from .batch_decode import BatchDecoder, eligible
from .cache import CacheFormatError, CompressedKVCache, DecodedReads, register_batch, run_on_load
from .rotating import CompressedRotatingKVCache, register_rotating_batch

BATCH_FORMAT_VERSION = 1
Row = Union[CompressedKVCache, CompressedRotatingKVCache]

# Mask arrays `make_mask` returned (a model builds one mask and hands it to many layers).
_OWN_MASKS: "weakref.WeakValueDictionary[int, mx.array]" = weakref.WeakValueDictionary()


class BatchCompressedKVCache(RowColumns, DecodedReads, _BaseCache):
    """B compressed caches decoded as one batch; the mlx-lm batch cache protocol
    (`merge`, `extend`, `filter`, `extract`, `prepare`, `finalize`, `trim`, `make_mask`, `state`)."""

    def __init__(self, rows: List[Row]):
        kinds = {type(cache) for cache in rows}
        if len(kinds) > 1:
            raise TypeError("a batch holds caches of one kind (plain or sliding-window), got "
                            + ", ".join(sorted(k.__name__ for k in kinds)))
        if kinds == {CompressedRotatingKVCache}:
            sizes = {(cache.max_size, cache.keep) for cache in rows}
            if len(sizes) > 1:
                raise ValueError("sliding-window caches batch only with the same max_size and keep, got "
                                 f"{sorted(sizes)}")
        for cache in rows:
            inner = _inner(cache)
            if inner.key_codec is not None and inner.batch != 1:
                raise ValueError(f"a batch is made of batch-1 caches, got one of batch {inner.batch}")
        self.rows = list(rows)
        self._start_columns(len(self.rows))
        self._masks = None  # each row's mask for the last chunk's queries
        self._decoder = BatchDecoder()
        self._members: List[int] = []  # the rows the decoder holds, in its buffers' order
        self._decoded = False  # the last update was a decode step
        self._fetches_decoded: Optional[bool] = None  # whether a row fetches decoded tokens (rows changed: None)

    # ---- mlx-lm batch protocol --------------------------------------------------------------
    @classmethod
    def merge(cls, caches: Sequence[Row]) -> "BatchCompressedKVCache":
        """One batch of copies of `caches` (the callers' caches are left as they were)."""
        for cache in caches:
            if not isinstance(cache, (CompressedKVCache, CompressedRotatingKVCache)):
                raise TypeError(f"cannot batch a {type(cache).__name__} with compressed caches")
        return cls([copy.deepcopy(cache) for cache in caches])

    def extend(self, other: "BatchCompressedKVCache"):
        other._release()
        if self.rows and other.rows:
            type(self)(self.rows[:1] + other.rows[:1])  # the same kind and window, or refused
        self._extend_columns(other)
        self.rows += other.rows  # they join the decoder's buffers on their first decode step
        self._fetches_decoded = None

    def filter(self, batch_indices):
        indices = batch_indices.tolist() if isinstance(batch_indices, mx.array) else list(batch_indices)
        self.rows = [self.rows[i] for i in indices]
        self._fetches_decoded = None
        self._keep_columns(indices)
        held = {row: b for b, row in enumerate(self._members)}
        kept = [(new, held[old]) for new, old in enumerate(indices) if old in held]
        self._decoder.filter([b for _, b in kept])
        self._members = [new for new, _ in kept] if self._decoder.active else []
        self._shift_out_padding()

    def extract(self, idx: int) -> Row:
        """An independent copy of sequence `idx`'s cache (codes, never dequantized values)."""
        if idx in self._members:
            return self._decoder.extract(self._members.index(idx))
        return copy.deepcopy(self.rows[idx])

    def _visible(self) -> List[int]:
        """Tokens each row's attention sees (`_held`), the decoder's rows counted where it holds them."""
        held = [_held(cache) for cache in self.rows]
        for b, row in enumerate(self._members):
            held[row] = int(self._decoder.row_offset(b))
        return held

    def decoded(self):
        """(keys, values) of every row, decoded (`CompressedKVCache.decoded`) and left-padded with zeros into
        mlx-lm's `BatchKVCache` layout (`RowColumns._padded`); (None, None) while every row is empty. A copy, for
        reading."""
        self._release()
        rows = [cache.decoded() for cache in self.rows]
        if all(keys is None for keys, _ in rows):
            return None, None
        return tuple(self._padded([pair[role] for pair in rows]) for role in (0, 1))

    def keys_and_values(self):
        return BatchHistory(self, "keys"), BatchHistory(self, "values")

    # ---- what the model calls ---------------------------------------------------------------
    @property
    def offset(self) -> mx.array:
        if self._all_held():
            return self._decoder.positions()
        offsets = [cache.offset - skip for cache, skip in zip(self.rows, self._skip)]
        for b, row in enumerate(self._members):
            offsets[row] = self._decoder.row_offset(b)
        return mx.array(offsets)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if keys.shape[0] != len(self.rows):
            raise ValueError(f"batch of {keys.shape[0]} sequences for a cache of {len(self.rows)}")
        length = keys.shape[2]
        if length == 1 and self._real is None and not any(self._skip):
            self._decode_step(keys, values)
            return self._fetched()
        self._release()
        self._masks = []
        for i, (cache, (start, count)) in enumerate(zip(self.rows, self._take_chunk(length))):
            mask = ("causal" if count > 1 else None)
            if count and isinstance(cache, CompressedRotatingKVCache):
                mask = cache.make_mask(count)  # before the update: its window as the update leaves it
            self._masks.append(mask)
            if count:
                cache.update_and_fetch(keys[i : i + 1, :, start : start + count],
                                       values[i : i + 1, :, start : start + count])
        return self._fetched()

    def _fetched(self):
        """What `update_and_fetch` returns: the batch's history, or its tokens decoded into `BatchKVCache`'s
        columns for a model that computes on them itself (`fetch_decoded`)."""
        if self._fetches_decoded is None:
            self._fetches_decoded = any(getattr(cache, "inner", cache).fetch_decoded for cache in self.rows)
        if self._fetches_decoded:
            return self.decoded()
        return BatchHistory(self, "keys"), BatchHistory(self, "values")

    def attend(self, queries: mx.array, scale: float, mask=None, sinks=None) -> mx.array:
        """Each row's queries over its own cache; positions that belong to no sequence get zeros. `sinks`:
        learned attention sinks, the same for every row (the shared-buffer decode takes none yet)."""
        if mask is not None and not isinstance(mask, str) and _OWN_MASKS.get(id(mask)) is not mask:
            raise ValueError(
                "batched compressed caches apply each sequence's causal mask themselves; this model "
                "passed an explicit mask array, which they cannot apply row by row"
            )
        if sinks is not None:
            self._release()  # the shared-buffer decode takes no learned sinks
        if self._decoded and self._members:
            return self._decode_attend(queries, scale)
        batch, heads, length, _ = queries.shape
        outputs = []
        for i, (cache, (start, count)) in enumerate(zip(self.rows, self._spans)):
            dim = _inner(cache).value_dim if _inner(cache).key_codec is not None else queries.shape[-1]
            parts = []
            if start:
                parts.append(mx.zeros((1, heads, start, dim), dtype=queries.dtype))
            if count:
                row = queries[i : i + 1, :, start : start + count]
                parts.append(cache.attend(row, scale=scale, mask=self._masks[i], sinks=sinks).astype(queries.dtype))
            if length - start - count:
                parts.append(mx.zeros((1, heads, length - start - count, dim), dtype=queries.dtype))
            outputs.append(parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2))
        return mx.concatenate(outputs, axis=0)

    # ---- decode steps: the rows the decoder holds in one call, the others row by row ----------------
    def _decode_step(self, keys: mx.array, values: mx.array):
        self._decoded = True
        self._spans, self._masks = [(0, 1)] * len(self.rows), [None] * len(self.rows)
        joining = [b for b in self._outside() if eligible(self.rows[b])]
        if joining:
            joined = (self._decoder.extend if self._decoder.active else self._decoder.takes)(
                [self.rows[b] for b in joining])
            if joined:
                self._members += joining
                self._hold_in_batch_order()
        if self._members:
            self._decoder.step(*(_rows(x, self._members) for x in (keys, values)))
        for b in self._outside():
            self.rows[b].update_and_fetch(keys[b : b + 1], values[b : b + 1])

    def _decode_attend(self, queries: mx.array, scale: float) -> mx.array:
        held = self._decoder.attend(_rows(queries, self._members), scale)
        if self._all_held():
            return held
        out = [None] * len(self.rows)
        for b, row in enumerate(self._members):
            out[row] = held[b : b + 1]
        for b in self._outside():
            out[b] = self.rows[b].attend(queries[b : b + 1], scale=scale, mask=None).astype(queries.dtype)
        return mx.concatenate(out, axis=0)

    def _hold_in_batch_order(self):
        """Once the decoder holds every row, its buffers in the batch's order (a row that joined late came last):
        each layer then reads the batch's offsets, queries and outputs as they are, with no gather."""
        if len(self._members) == len(self.rows) and self._members != list(range(len(self.rows))):
            self._decoder.filter(sorted(range(len(self._members)), key=self._members.__getitem__))
            self._members = list(range(len(self.rows)))

    def _all_held(self) -> bool:
        """Whether the decoder holds every row, in the batch's order."""
        return (self._decoder.active and len(self._members) == len(self.rows)
                and self._members == list(range(len(self.rows))))

    def _outside(self) -> List[int]:
        if len(self._members) == len(self.rows):
            return []
        held = set(self._members)
        return [b for b in range(len(self.rows)) if b not in held]

    def _release(self):
        """The decoder's buffers written back into their rows."""
        self._decoder.release()
        self._members, self._decoded = [], False

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None, **kwargs):
        """`RowColumns.make_mask`'s array, which `attend` recognises and replaces with each row's own mask
        (a sliding-window row's its window, `rotating.py`)."""
        mask = super().make_mask(N, return_array, window_size)
        _OWN_MASKS[id(mask)] = mask
        return mask

    # ---- the rest of the cache protocol ------------------------------------------------------
    @property
    def state(self):
        self._release()
        header = {"format": BATCH_FORMAT_VERSION, "skip": self._skip, "pad": self._pad,
                  "rows": [type(cache).__name__ for cache in self.rows]}
        return [json.dumps(header), [cache.state for cache in self.rows]]

    @state.setter
    def state(self, state):
        try:
            header_text, row_states = state if len(state) == 2 else (state[0], [])
            header = json.loads(header_text)
            version, kinds, skip = header["format"], header["rows"], [int(s) for s in header["skip"]]
        except Exception as error:
            raise CacheFormatError(f"not a VeloxQuant batch cache (unreadable header: {error!r})") from None
        if version != BATCH_FORMAT_VERSION:
            raise CacheFormatError(f"batch cache format {version!r} is not supported")
        if len(kinds) != len(skip) or len(row_states) != len(kinds):
            raise CacheFormatError(f"corrupted batch cache: {len(kinds)} rows named, {len(row_states)} saved")
        classes = {cls.__name__: cls for cls in (CompressedKVCache, CompressedRotatingKVCache)}
        rows = []
        for kind, row_state in zip(kinds, row_states):
            if kind not in classes:
                raise CacheFormatError(f"batch cache row of unknown kind {kind!r}")
            rows.append(classes[kind].from_state(row_state))
        self.__init__(rows)
        self._skip = skip
        pad = header.get("pad", [0] * len(rows))
        if not isinstance(pad, list) or len(pad) != len(rows) or not all(isinstance(p, int) and p >= 0 for p in pad):
            raise CacheFormatError(f"corrupted batch cache: padding {pad!r} for {len(rows)} rows")
        self._pad = pad

    @classmethod
    def from_state(cls, state):
        cache = cls.__new__(cls)
        cache.state = state
        run_on_load()
        return cache

    @property
    def nbytes(self) -> int:
        return sum(cache.nbytes for cache in self.rows) + self._decoder.nbytes

    def size(self) -> int:
        self._release()
        return max((cache.offset for cache in self.rows), default=0)

    def empty(self) -> bool:
        self._release()
        return all(cache.empty() for cache in self.rows)

    def is_trimmable(self) -> bool:
        self._release()
        return all(cache.is_trimmable() for cache in self.rows)

    def trim(self, n: int) -> int:
        self._release()
        return max((cache.trim(n) for cache in self.rows), default=0)


class BatchHistory:
    """What `update_and_fetch` returns: a stand-in that `scaled_dot_product_attention`
    (routed by `integration.py`) hands back to `BatchCompressedKVCache.attend`."""

    def __init__(self, batch: BatchCompressedKVCache, role: str):
        self.batch, self.role = batch, role

    @property
    def shape(self):
        """(B, kv heads, `columns`, head dim), as `BatchKVCache`'s keys would be."""
        columns = self.batch.columns
        rows = [_inner(cache) for cache in self.batch.rows]
        shaped = next((c for c in rows if c.key_codec is not None), None)
        if shaped is None:
            return (len(rows), 0, columns, 0)
        return (len(rows), shaped.kv_heads, columns, shaped.key_dim if self.role == "keys" else shaped.value_dim)

    @property
    def dtype(self):
        return next((_inner(c).window_dtype for c in self.batch.rows if _inner(c).key_codec is not None), mx.float16)

    def astype(self, dtype) -> "BatchHistory":
        """Itself: attention over it runs in float32 whatever the cast."""
        return self

    def __mlx_array__(self) -> mx.array:
        """`mx.array(history)`: every row decoded, in `BatchKVCache`'s layout (`BatchCompressedKVCache.decoded`)."""
        keys, values = self.batch.decoded()
        return keys if self.role == "keys" else values

    def __repr__(self):
        return f"BatchHistory({self.role}, {len(self.batch.rows)} sequences)"


def _rows(x: mx.array, rows: List[int]) -> mx.array:
    """`x`'s batch rows `rows`, in that order (`x` itself when they are all, in order)."""
    if rows == list(range(x.shape[0])):
        return x
    return x[mx.array(rows, dtype=mx.int32)]


def _inner(cache: Row) -> CompressedKVCache:
    return cache.inner if isinstance(cache, CompressedRotatingKVCache) else cache


def _held(cache: Row) -> int:
    """Tokens a row's attention sees (a sliding window's, at most what it keeps)."""
    return cache.size() if isinstance(cache, CompressedRotatingKVCache) else cache.offset


register_batch(BatchCompressedKVCache)
register_rotating_batch(BatchCompressedKVCache)
