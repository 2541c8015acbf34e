"""Batches of MLA latent caches (`cache/latent.py`) for mlx-lm's `BatchGenerator` (`batch_generate`,
`mlx_lm.server`).

An absorbed MLA layer computes its attention itself on the (latent, RoPE part) arrays its cache returns, with the
mask `make_mask` gave it. `BatchLatentCache` keeps one batch-1 `CompressedLatentCache` per sequence, each holding
only that sequence's real tokens, and returns every row's history decoded and zero-padded into the columns of
mlx-lm's `BatchKVCache` (`batch_columns.py`), so that the model's mask, offsets and its own padding rules apply
unchanged. Each row decodes its history as it does alone (one row after another: the latent cache decodes a
layer's history at every call, `cache/latent.py`), so a row gives what it gives alone whichever rows share its
batch, up to the batched matmuls' rounding.
"""

from __future__ import annotations

import copy
import json
from typing import List, Sequence

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache

from .batch_columns import RowColumns
from .cache import CacheFormatError
from .cache.latent import CompressedLatentCache, register_latent_batch

BATCH_FORMAT_VERSION = 1


class BatchLatentCache(RowColumns, _BaseCache):
    """B latent caches as one batch; the mlx-lm batch cache protocol (`merge`, `extend`, `filter`, `extract`,
    `prepare`, `finalize`, `trim`, `make_mask`, `state`)."""

    def __init__(self, rows: List[CompressedLatentCache]):
        for row in rows:
            if not isinstance(row, CompressedLatentCache):
                raise TypeError(f"cannot batch a {type(row).__name__} with latent caches")
            if row.batch not in (None, 1):
                raise ValueError(f"a batch is made of batch-1 caches, got one of batch {row.batch}")
        self.rows = list(rows)
        self._start_columns(len(self.rows))

    @classmethod
    def merge(cls, caches: Sequence[CompressedLatentCache]) -> "BatchLatentCache":
        """One batch of copies of `caches` (the callers' caches are left as they were)."""
        return cls([copy.deepcopy(cache) for cache in caches])

    def extend(self, other: "BatchLatentCache"):
        self._extend_columns(other)
        self.rows += other.rows

    def filter(self, batch_indices):
        indices = batch_indices.tolist() if isinstance(batch_indices, mx.array) else list(batch_indices)
        self.rows = [self.rows[i] for i in indices]
        self._keep_columns(indices)
        self._shift_out_padding()

    def extract(self, idx: int) -> CompressedLatentCache:
        """An independent copy of sequence `idx`'s cache (its codes, never decoded values)."""
        return copy.deepcopy(self.rows[idx])

    @property
    def offset(self) -> mx.array:
        return mx.array([row.offset - skip for row, skip in zip(self.rows, self._skip)])

    def update_and_fetch(self, latent: mx.array, rope: mx.array):
        """Every row's (latent, RoPE part) history in `BatchKVCache`'s columns, this chunk's tokens as given."""
        if latent.shape[0] != len(self.rows):
            raise ValueError(f"batch of {latent.shape[0]} sequences for a cache of {len(self.rows)}")
        histories = []
        for i, (row, (start, count)) in enumerate(zip(self.rows, self._take_chunk(latent.shape[2]))):
            if count:
                histories.append(row.update_and_fetch(latent[i : i + 1, :, start : start + count],
                                                      rope[i : i + 1, :, start : start + count]))
            else:
                histories.append(row.fetch() or (None, None))
        return tuple(self._padded([pair[role] for pair in histories]) for role in (0, 1))

    @property
    def keys(self):
        """The newest array of the first row that holds tokens (`CompressedLatentCache.keys`): DeepSeek-V3.2
        ties its indexer cache to `cache[0].keys` with `mx.depends`."""
        return self._first_held().keys

    @keys.setter
    def keys(self, value: mx.array) -> None:
        self._first_held().keys = value

    def _first_held(self) -> CompressedLatentCache:
        row = next((row for row in self.rows if not row.empty()), None)
        if row is None:
            raise ValueError("the latent batch is empty: it has no keys")
        return row

    # ---- the rest of the cache protocol ------------------------------------------------------
    @property
    def state(self):
        header = {"format": BATCH_FORMAT_VERSION, "skip": self._skip, "pad": self._pad, "rows": len(self.rows)}
        return [json.dumps(header), [row.state for row in self.rows]]

    @state.setter
    def state(self, state):
        try:
            header_text, row_states = state
            header = json.loads(header_text)
            version, count = header["format"], int(header["rows"])
            skip, pad = [int(s) for s in header["skip"]], [int(p) for p in header["pad"]]
        except Exception as error:
            raise CacheFormatError(f"not a VeloxQuant latent batch cache (unreadable header: {error!r})") from None
        if version != BATCH_FORMAT_VERSION:
            raise CacheFormatError(f"latent batch cache format {version!r} is not supported")
        if not (len(row_states) == len(skip) == len(pad) == count) or min(skip + pad, default=0) < 0:
            raise CacheFormatError(f"corrupted latent batch cache: {count} rows named, {len(row_states)} saved, "
                                   f"padding {pad!r}, skip {skip!r}")
        self.__init__([CompressedLatentCache.from_state(row_state) for row_state in row_states])
        self._skip, self._pad = skip, pad

    @property
    def nbytes(self) -> int:
        return sum(row.nbytes for row in self.rows)

    def size(self) -> int:
        return max((row.offset for row in self.rows), default=0)

    def empty(self) -> bool:
        return all(row.empty() for row in self.rows)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        return max((row.trim(n) for row in self.rows), default=0)


register_latent_batch(BatchLatentCache)
