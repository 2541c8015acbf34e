"""Batches of compressed caches for mlx-lm's `BatchGenerator` (`batch_generate`, `mlx_lm.server`).

mlx-lm's `BatchKVCache` keeps one fp16 buffer of shape (B, H, max_len, D): shorter
sequences are left-padded and a mask array hides the padding. Codes cannot be
left-padded the same way without breaking what the compressed layout relies on
(the sinks are the first tokens, a KIVI key group starts on a block boundary), so
`BatchCompressedKVCache` keeps one batch-1 `CompressedKVCache` per sequence, each
holding only that sequence's real tokens, and runs attention row by row. Padding
is never stored: the protocol's left padding (`prepare(left_padding=)`) and right
padding (`prepare(lengths=, right_padding=)`) only tell the cache which positions
of an input chunk belong to no sequence. The projections and MLPs still run on the
whole batch; attention, a small share of a short context's work, runs per row.

`offset` is an array of each sequence's next position (what RoPE needs, as with
`BatchKVCache`). `make_mask` returns the mask kind only ("causal" or None); each
row applies its own causal mask. A model that hands attention a mask array of its
own cannot be served row by row, and `attend` refuses it rather than ignore it.
"""

from __future__ import annotations

import copy
from typing import List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache

from .cache import CompressedKVCache, register_batch


class BatchCompressedKVCache(_BaseCache):
    """B compressed caches decoded as one batch; the mlx-lm batch cache protocol
    (`merge`, `extend`, `filter`, `extract`, `prepare`, `finalize`, `trim`)."""

    def __init__(self, rows: List[CompressedKVCache]):
        for cache in rows:
            if cache.key_codec is not None and cache.batch != 1:
                raise ValueError(f"a batch is made of batch-1 caches, got one of batch {cache.batch}")
        self.rows = list(rows)
        self._skip = [0] * len(self.rows)  # left padding still to come, per row
        self._real = None  # real tokens still to come per row (right padding), or None
        self._spans = None  # (start, count) of each row's real tokens in the last chunk

    # ---- mlx-lm batch protocol --------------------------------------------------------------
    @classmethod
    def merge(cls, caches: Sequence[CompressedKVCache]) -> "BatchCompressedKVCache":
        """One batch of copies of `caches` (the callers' caches are left as they were)."""
        for cache in caches:
            if not isinstance(cache, CompressedKVCache):
                raise TypeError(f"cannot batch a {type(cache).__name__} with compressed caches")
        return cls([copy.deepcopy(cache) for cache in caches])

    def extend(self, other: "BatchCompressedKVCache"):
        if other._real is not None or self._real is not None:
            raise ValueError("cannot extend a batch in the middle of a right-padded prefill")
        self.rows += other.rows
        self._skip += other._skip

    def filter(self, batch_indices):
        indices = batch_indices.tolist() if isinstance(batch_indices, mx.array) else list(batch_indices)
        self.rows = [self.rows[i] for i in indices]
        self._skip = [self._skip[i] for i in indices]
        if self._real is not None:
            self._real = [self._real[i] for i in indices]

    def extract(self, idx: int) -> CompressedKVCache:
        """An independent copy of sequence `idx`'s cache (codes, never dequantized values)."""
        return copy.deepcopy(self.rows[idx])

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        if left_padding is not None:
            if any(not cache.empty() for cache in self.rows):
                raise ValueError("left padding can only be added to an empty batch cache")
            self._skip = [s + int(p) for s, p in zip(self._skip, left_padding)]
        if right_padding is not None and max(right_padding) > 0:
            self._real = [int(n) for n in lengths]

    def finalize(self):
        self._real = None

    # ---- what the model calls ---------------------------------------------------------------
    @property
    def offset(self) -> mx.array:
        return mx.array([cache.offset - skip for cache, skip in zip(self.rows, self._skip)])

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if keys.shape[0] != len(self.rows):
            raise ValueError(f"batch of {keys.shape[0]} sequences for a cache of {len(self.rows)}")
        length = keys.shape[2]
        self._spans = []
        for i, cache in enumerate(self.rows):
            start = min(self._skip[i], length)
            self._skip[i] -= start
            count = length - start
            if self._real is not None:
                count = min(count, self._real[i])
                self._real[i] -= count
            self._spans.append((start, count))
            if count:
                cache.update_and_fetch(keys[i : i + 1, :, start : start + count], values[i : i + 1, :, start : start + count])
        return BatchHistory(self, "keys"), BatchHistory(self, "values")

    def attend(self, queries: mx.array, scale: float, mask=None, sinks=None) -> mx.array:
        """Each row's queries over its own cache; positions that belong to no sequence get zeros. `sinks`:
        learned attention sinks, the same for every row."""
        if mask is not None and not isinstance(mask, str):
            raise ValueError(
                "batched compressed caches apply each sequence's causal mask themselves; this model "
                "passed an explicit mask array, which they cannot apply row by row"
            )
        batch, heads, length, _ = queries.shape
        outputs = []
        for cache, (start, count) in zip(self.rows, self._spans):
            dim = cache.value_dim if cache.key_codec is not None else queries.shape[-1]
            parts = []
            if start:
                parts.append(mx.zeros((1, heads, start, dim), dtype=queries.dtype))
            if count:
                row = queries[len(outputs) : len(outputs) + 1, :, start : start + count]
                parts.append(cache.attend(row, scale=scale, mask="causal" if count > 1 else None,
                                          sinks=sinks).astype(queries.dtype))
            if length - start - count:
                parts.append(mx.zeros((1, heads, length - start - count, dim), dtype=queries.dtype))
            outputs.append(parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2))
        return mx.concatenate(outputs, axis=0)

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None, **kwargs):
        if return_array or window_size:
            raise ValueError("batched compressed caches take no mask arrays or attention windows")
        return "causal" if N > 1 else None

    # ---- the rest of the cache protocol ------------------------------------------------------
    @property
    def state(self):
        return [cache.state for cache in self.rows]

    @property
    def nbytes(self) -> int:
        return sum(cache.nbytes for cache in self.rows)

    def size(self) -> int:
        return max((cache.offset for cache in self.rows), default=0)

    def empty(self) -> bool:
        return all(cache.empty() for cache in self.rows)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        return max((cache.trim(n) for cache in self.rows), default=0)


class BatchHistory:
    """What `update_and_fetch` returns: a stand-in that `scaled_dot_product_attention`
    (routed by `integration.py`) hands back to `BatchCompressedKVCache.attend`."""

    def __init__(self, batch: BatchCompressedKVCache, role: str):
        self.batch, self.role = batch, role

    def __repr__(self):
        return f"BatchHistory({self.role}, {len(self.batch.rows)} sequences)"


register_batch(BatchCompressedKVCache)
