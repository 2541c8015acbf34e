"""DeepSeek-V4.1's layer cache, held in MLX's microscaling formats.

DeepSeek-V4.1 (`mlx_lm.models.deepseek_v41`) keeps each layer in its own `LayerCache`: a sliding window of
keys rounded to FP8 e4m3 with power-of-two block scales (blocks of 32), groups of pooled keys rounded to FP4
e2m1 with e4m3 block scales (blocks of 16), and the indexer's keys rounded to FP4 with power-of-two scales
(blocks of 32); mlx-lm stores those rounded values in the model's float type. `MicroscaledLayerCache` stores
the same values, bit for bit, in MLX's own formats (`mx.quantize`): the window as `mxfp8`, the index keys as
`mxfp4`, and the groups as `mxfp4` codes of the values over their e4m3 block scale, with that scale as one FP8
byte per 16 values (MLX's `nvfp4` takes a block's scale as its largest entry over 6, which is not the model's
where e4m3's coarse subnormals rounded it: `_model_scales`). A value `q * s` with `q` on a format's grid and `s` the model's scale decodes back
exactly: a power-of-two scale at or below `s` that still holds the block's largest entry moves `q` by a power
of two, within the grid. The file's attention reads what the getters decode, one layer at a time.
"""

from __future__ import annotations

from typing import Optional, Tuple

import mlx.core as mx
from mlx_lm.models.deepseek_v41 import LayerCache

FP4_E4M3_BLOCK = 16
# The model's floor on an e4m3-scaled FP4 block's largest entry (`_fake_quant_fp4`): its scale is at least 2^-9.
FP4_E4M3_FLOOR = 6.0 * 2.0**-9
MX_GROUP = 32


def _on_fp4_grid(blocks: mx.array, scale: mx.array) -> mx.array:
    grid = (blocks / scale).reshape(*blocks.shape[:-2], -1)
    back = mx.dequantize(*mx.quantize(grid, group_size=MX_GROUP, mode="mxfp4"), group_size=MX_GROUP, mode="mxfp4",
                         dtype=mx.float32)
    return mx.all(back.reshape(blocks.shape) * scale == blocks, axis=-1, keepdims=True)


def _model_scales(blocks: mx.array) -> mx.array:
    """Each FP4 block's e4m3 scale `s` as the model chose it, from its rounded values `q * s`: the block's
    largest entry over the largest code (6 unless `s` was rounded up, as e4m3's subnormals below 2^-6 are
    coarsely), taking the first of the codes 6, 4, 3, 2, 1.5, 1 and 0.5 whose scale is an e4m3 value that puts
    every entry on the grid (the floor's 2^-9 for a block of zeros). Values the model did not round get the
    nearest e4m3 scale of their largest entry over 6, as MLX's nvfp4 does."""
    largest = mx.max(mx.abs(blocks), axis=-1, keepdims=True)
    chosen = mx.where(largest < FP4_E4M3_FLOOR, FP4_E4M3_FLOOR / 6.0, mx.from_fp8(mx.to_fp8(largest / 6.0),
                                                                                  mx.float32))
    found = largest == 0
    for code in (6.0, 4.0, 3.0, 2.0, 1.5, 1.0, 0.5):
        candidate = largest / code
        exact = (mx.from_fp8(mx.to_fp8(candidate), mx.float32) == candidate) & _on_fp4_grid(blocks, candidate)
        chosen = mx.where(exact & ~found, candidate, chosen)
        found = found | exact
    return chosen


class PackedRows:
    """Rows (axis 1) of a (batch, rows, dim) array in one format: "mxfp8", "mxfp4" or "fp4_e4m3"; a last dim
    that is not a multiple of 32 (which the model's rounding may skip) is kept as it is."""

    def __init__(self, mode: str):
        self.mode = mode
        self.parts: Optional[Tuple[mx.array, ...]] = None
        self.dtype = None
        self.rows = 0
        self.size = 0  # values held

    def pack(self, x: mx.array) -> Tuple[mx.array, ...]:
        if x.shape[-1] % MX_GROUP:
            return (x,)
        if self.mode != "fp4_e4m3":
            return tuple(mx.quantize(x, group_size=MX_GROUP, mode=self.mode))
        blocks = x.astype(mx.float32).reshape(*x.shape[:-1], -1, FP4_E4M3_BLOCK)
        scale = _model_scales(blocks)
        grid = (blocks / scale).reshape(x.shape)
        return (*mx.quantize(grid, group_size=MX_GROUP, mode="mxfp4"), mx.to_fp8(scale[..., 0]))

    def unpack(self, parts: Tuple[mx.array, ...]) -> mx.array:
        if len(parts) == 1:
            return parts[0]
        if self.mode != "fp4_e4m3":
            return mx.dequantize(*parts, group_size=MX_GROUP, mode=self.mode, dtype=self.dtype)
        codes, exponents, scale = parts
        grid = mx.dequantize(codes, exponents, group_size=MX_GROUP, mode="mxfp4", dtype=mx.float32)
        blocks = grid.reshape(*grid.shape[:-1], -1, FP4_E4M3_BLOCK) * mx.from_fp8(scale, mx.float32)[..., None]
        return blocks.reshape(grid.shape).astype(self.dtype)

    def get(self) -> Optional[mx.array]:
        return None if self.parts is None else self.unpack(self.parts)

    def set(self, x: Optional[mx.array]) -> None:
        self.parts, self.dtype, self.rows, self.size = None, None, 0, 0
        if x is not None:
            self.parts, self.dtype, self.rows, self.size = self.pack(x), x.dtype, x.shape[1], x.size

    def extend(self, x: mx.array) -> None:
        """Hold `x`, whose first `rows` rows are those held (DeepSeek-V4.1 only ever appends to its groups
        and index keys), packing only the rows past them."""
        if self.parts is None or x.shape[1] < self.rows or x.dtype != self.dtype:
            return self.set(x)
        new = self.pack(x[:, self.rows:])
        self.parts = tuple(mx.concatenate([a, b], axis=1) for a, b in zip(self.parts, new))
        self.rows, self.size = x.shape[1], x.size

    @property
    def nbytes(self) -> int:
        return 0 if self.parts is None else sum(a.nbytes for a in self.parts)


class PackedField:
    """A `LayerCache` field held as the cache's `PackedRows` of the same name with a leading underscore: reads
    decode it; writes pack it, only the new rows where the file only appends to it (`appended`)."""

    def __init__(self, appended: bool):
        self.appended = appended

    def __set_name__(self, owner, name: str) -> None:
        self.slot = "_" + name

    def __get__(self, cache, owner=None):
        return self if cache is None else getattr(cache, self.slot).get()

    def __set__(self, cache, value: Optional[mx.array]) -> None:
        rows = getattr(cache, self.slot)
        rows.extend(value) if self.appended and value is not None else rows.set(value)


class MicroscaledLayerCache(LayerCache):
    """`LayerCache` with its window, groups and index keys packed (`PackedRows`); the open group's rows
    (fewer than its pooling ratio) stay as the model makes them."""

    window = PackedField(appended=False)
    compress_kv = PackedField(appended=True)
    index_k = PackedField(appended=True)

    def __init__(self, window_size: int):
        self._window = PackedRows("mxfp8")
        self._compress_kv = PackedRows("fp4_e4m3")
        self._index_k = PackedRows("mxfp4")
        super().__init__(window_size)

    @property
    def state(self):
        return tuple(part for packed in (self._window, self._compress_kv, self._index_k)
                     for part in (packed.parts or ())) + tuple(
            a for a in (self.pending_kv, self.pending_gate) if a is not None)

    @property
    def nbytes(self) -> int:
        pending = sum(a.nbytes for a in (self.pending_kv, self.pending_gate) if a is not None)
        return self._window.nbytes + self._compress_kv.nbytes + self._index_k.nbytes + pending

    used_nbytes = nbytes

    @property
    def held_coordinates(self) -> int:
        """The values held (window, groups, index keys and the open group), as mlx-lm's `LayerCache` holds them."""
        pending = sum(a.size for a in (self.pending_kv, self.pending_gate) if a is not None)
        return self._window.size + self._compress_kv.size + self._index_k.size + pending
