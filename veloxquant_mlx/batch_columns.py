"""Where each sequence's tokens sit in the columns of mlx-lm's `BatchKVCache`, for batch caches whose rows hold
only their real tokens (`batch.py`, `batch_latent.py`).

mlx-lm's `BatchKVCache` keeps one buffer of shape (B, H, columns, D), every row right-aligned after its left
padding; `make_mask` and `offset` describe that layout to the model. A batch of compressed rows stores no padding,
so it keeps, per row, the padding columns before the row's tokens (`_pad`), the left padding of inputs still to
come (`_skip`, from `prepare(left_padding=)`), and the real tokens still to come of a right-padded prefill
(`_real`, from `prepare(lengths=, right_padding=)`). Until `finalize`, mlx-lm holds a right-padded chunk's padding
after the row's tokens (and then rolls it to the left); a model that computes on the fetched arrays itself gets
them in that layout (`_padded`), so that the mask it was given matches them.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import mlx.core as mx


class RowColumns:
    """The padding bookkeeping of a batch of rows (module docstring); `rows` are caches with `size()`."""

    rows: list

    def _start_columns(self, count: int) -> None:
        self._skip = [0] * count  # left padding still to come, per row
        self._pad = [0] * count  # padding columns before each row's tokens (`columns`)
        self._real: Optional[List[int]] = None  # real tokens still to come per row (right padding), or None
        self._spans: Optional[List[Tuple[int, int]]] = None  # (start, count) of each row's tokens in the last chunk
        self._chunk = 0  # the last chunk's length

    def _visible(self) -> List[int]:
        """Tokens each row's attention sees."""
        return [row.size() for row in self.rows]

    @property
    def columns(self) -> int:
        """The columns of mlx-lm's `BatchKVCache` buffers for these rows: each row's tokens right-aligned, after
        the padding columns the batch took (left padding, a right-padded prefill's, an `extend`'s alignment)."""
        return self._columns(self._visible())

    def _columns(self, visible: List[int]) -> int:
        return max((p + n for p, n in zip(self._pad, visible)), default=0)

    @property
    def left_padding(self) -> mx.array:
        """Per row, the columns of `make_mask`'s array before its first token (as `BatchKVCache`'s: rows
        right-aligned on `columns`), padding still to come included."""
        visible = self._visible()
        columns = self._columns(visible)
        return mx.array([columns - n + skip for n, skip in zip(visible, self._skip)])

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        if left_padding is not None:
            if any(not row.empty() for row in self.rows):
                raise ValueError("left padding can only be added to an empty batch cache")
            self._skip = [s + int(p) for s, p in zip(self._skip, left_padding)]
        if right_padding is not None and max(right_padding) > 0:
            self._real = [int(n) for n in lengths]

    def finalize(self):
        self._real = None

    def _take_chunk(self, length: int) -> List[Tuple[int, int]]:
        """(start, count) of each row's real tokens in an input chunk of `length` columns; the rest is padding."""
        spans = []
        for i in range(len(self.rows)):
            start = min(self._skip[i], length)
            self._skip[i] -= start
            count = length - start
            if self._real is not None:
                count = min(count, self._real[i])
                self._real[i] -= count
            self._pad[i] += length - count
            spans.append((start, count))
        self._spans, self._chunk = spans, length
        return spans

    def _trailing(self) -> List[int]:
        """Per row, the padding columns after its tokens in mlx-lm's layout: a right-padded prefill's, until
        `finalize`."""
        if self._real is None or self._spans is None:
            return [0] * len(self.rows)
        return [self._chunk - start - count for start, count in self._spans]

    def _extend_columns(self, other: "RowColumns") -> None:
        """The padding of `self` and `other` joined, right-aligned on the longer batch's columns as mlx-lm's
        `BatchKVCache.extend` pads them (before `other`'s rows join `self.rows`)."""
        if other._real is not None or self._real is not None:
            raise ValueError("cannot extend a batch in the middle of a right-padded prefill")
        own, theirs = self.columns, other.columns
        columns = max(own, theirs)
        self._pad = [p + columns - own for p in self._pad] + [p + columns - theirs for p in other._pad]
        self._skip += other._skip

    def _keep_columns(self, indices: Sequence[int]) -> None:
        self._skip = [self._skip[i] for i in indices]
        self._pad = [self._pad[i] for i in indices]
        if self._real is not None:
            self._real = [self._real[i] for i in indices]

    def _shift_out_padding(self) -> None:
        """Drop the padding columns every row has, as mlx-lm's `BatchKVCache.filter` shifts them out."""
        visible = self._visible()
        columns = self._columns(visible)
        unused = min((columns - n for n in visible), default=0)
        self._pad = [columns - n - unused for n in visible]

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None, **kwargs):
        """`BatchKVCache`'s (B, 1, N, columns + N) boolean array, whatever `return_array` says (a batch has no
        mask kind that says where each row starts)."""
        total = self.columns + N
        query = mx.arange(total - N, total)[:, None]
        key = mx.arange(total)[None]
        mask = (query >= key) & (key >= mx.expand_dims(self.left_padding, (1, 2, 3)))
        if window_size is not None:
            mask = mask & (query < key + window_size)
        return mask

    def _padded(self, held: Sequence[Optional[mx.array]]) -> mx.array:
        """Each row's (1, H, n, D) tokens (None: none), zero-padded into one array in mlx-lm's layout."""
        like = next(a for a in held if a is not None)
        counts = [0 if a is None else a.shape[2] for a in held]
        total = max(max(p + n for p, n in zip(self._pad, counts)), self.columns)
        rows = []
        for a, n, after in zip(held, counts, self._trailing()):
            parts = [mx.zeros((1, like.shape[1], total - n - after, like.shape[3]), like.dtype)]
            if n:
                parts.append(a.astype(like.dtype))
            if after:
                parts.append(mx.zeros((1, like.shape[1], after, like.shape[3]), like.dtype))
            rows.append(parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2))
        return mx.concatenate(rows, axis=0)
