"""`GroupAffineLinear`: per-group affine codes whose group scales and centres are themselves
quantized (double quantization: QLoRA, arXiv 2305.14314, Sec. 3; llama.cpp's K-quants keep
6-bit sub-block scales the same way).

A group g of `group_size` weights of a row is coded on its min-max grid,

    w ~ d_g (q - L/2) + c_g,   q in 0..L,  L = 2^bits - 1,
    d_g = (max_g - min_g) / L,  c_g = (max_g + min_g) / 2,

which is MLX's affine format (scale d_g, bias c_g - d_g L/2) and the grid of llama.cpp's
Q4_1 at 4 bits with groups of 32. When the source weights already sit on such a grid (a
dequantized Q4_1 GGUF), min-max finds it again: the codes are the source's own.

The group parameters are stored as codes against one fp16 maximum per row:
d_g = d_max (k + 1) / 2^scale_bits and c_g = c_max (j - h) / h with h = 2^(center_bits-1) - 1,
so a group costs scale_bits + center_bits bits instead of MLX's 32. The codes q are chosen
against the decoded (d_g, c_g), the values the forward uses.

Forward: the group parameters are decoded (out x groups values, per call, so that memory
holds what the bit count counts) and `mx.quantized_matmul` runs on the codes, whose packing
(`packing.pack`) is MLX's affine layout at 2, 3 and 4 bits.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from ..packing import pack, packed_words, unpack

SUPPORTED_BITS = (2, 3, 4)
DEFAULT_GROUP_SIZE = 32
DEFAULT_SCALE_BITS = 4
DEFAULT_CENTER_BITS = 6
MAX_PARAM_BITS = 8
# Step ratios tried per group by the clip search (1.0, min-max, first: ties keep it, so a
# source already on a grid keeps its own).
CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6)


def _check(bits: int, group_size: int, in_features: int, scale_bits: int, center_bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")
    if group_size not in (32, 64, 128) or in_features % group_size:
        raise ValueError(f"group_size must be 32, 64 or 128 and divide in_features {in_features}, got {group_size}")
    if not 2 <= scale_bits <= MAX_PARAM_BITS or not 2 <= center_bits <= MAX_PARAM_BITS:
        raise ValueError(f"scale_bits and center_bits must be in 2..{MAX_PARAM_BITS}, got {scale_bits}, {center_bits}")


def decode_group_params(scale_codes: mx.array, center_codes: mx.array, row_ranges: mx.array,
                        scale_bits: int, center_bits: int) -> tuple[mx.array, mx.array]:
    """(d, c), float32 (out, groups), from their codes and the fp16 (d_max, c_max) of each row."""
    ranges = row_ranges.astype(mx.float32)
    d = ranges[:, :1] * (scale_codes.astype(mx.float32) + 1) / (1 << scale_bits)
    half = (1 << (center_bits - 1)) - 1
    c = ranges[:, 1:] * (center_codes.astype(mx.float32) - half) / half
    return d, c


def quantize_group_affine(weight: mx.array, bits: int, group_size: int, scale_bits: int, center_bits: int,
                          clip_search: bool = True):
    """(codes (out, in) uint8, scale codes, centre codes (out, groups) uint8, row ranges (out, 2) fp16).
    `clip_search`: each group's step is the one of `CLIP_RATIOS` times its min-max step with the
    least squared error (the grid narrowed around the group's centre, clipping its extremes)."""
    out_features, in_features = weight.shape
    levels = (1 << bits) - 1
    w = weight.astype(mx.float32).reshape(out_features, -1, group_size)
    low, high = w.min(axis=-1), w.max(axis=-1)
    d, c = (high - low) / levels, (high + low) * 0.5
    if clip_search:
        d = _searched_steps(w, d, c, levels)
    d_max = mx.maximum(d.max(axis=-1, keepdims=True), 1e-12)
    c_max = mx.maximum(mx.abs(c).max(axis=-1, keepdims=True), 1e-12)
    # the fp16 maxima are rounded up so that no group's parameter code needs clipping
    row_ranges = mx.concatenate([d_max, c_max], axis=-1).astype(mx.float16)
    row_ranges = mx.where(row_ranges.astype(mx.float32) < mx.concatenate([d_max, c_max], axis=-1),
                          _next_up_fp16(row_ranges), row_ranges)
    ranges = row_ranges.astype(mx.float32)
    steps = 1 << scale_bits
    scale_codes = mx.clip(mx.round(d / ranges[:, :1] * steps) - 1, 0, steps - 1).astype(mx.uint8)
    half = (1 << (center_bits - 1)) - 1
    center_codes = (mx.clip(mx.round(c / ranges[:, 1:] * half), -half, half) + half).astype(mx.uint8)
    d, c = decode_group_params(scale_codes, center_codes, row_ranges, scale_bits, center_bits)
    bias = c - d * (levels / 2)
    q = mx.clip(mx.round((w - bias[..., None]) / d[..., None]), 0, levels).astype(mx.uint8)
    return q.reshape(out_features, in_features), scale_codes, center_codes, row_ranges


def _searched_steps(w: mx.array, d: mx.array, c: mx.array, levels: int) -> mx.array:
    """Per group, the step r d (r in CLIP_RATIOS) whose grid around c codes w with the least squared error."""
    best_error, best = None, d
    for ratio in CLIP_RATIOS:
        step = mx.maximum(d * ratio, 1e-12)[..., None]
        bias = c[..., None] - step * (levels / 2)
        q = mx.clip(mx.round((w - bias) / step), 0, levels)
        error = ((q * step + bias - w) ** 2).sum(axis=-1)
        if best_error is None:
            best_error = error
        else:
            better = error < best_error
            best_error, best = mx.where(better, error, best_error), mx.where(better, d * ratio, best)
        mx.eval(best_error, best)
    return best


def _next_up_fp16(x: mx.array) -> mx.array:
    """The next larger float16 of positive finite x."""
    return mx.view(mx.view(x, mx.uint16) + 1, mx.float16)


class GroupAffineLinear(nn.Module):
    """y = x W^T + b with W as `bits`-bit per-group affine codes and quantized group parameters."""

    def __init__(self, in_features: int, out_features: int, bits: int, *, codes: mx.array, scale_codes: mx.array,
                 center_codes: mx.array, row_ranges: mx.array, group_size: int = DEFAULT_GROUP_SIZE,
                 scale_bits: int = DEFAULT_SCALE_BITS, center_bits: int = DEFAULT_CENTER_BITS,
                 bias: Optional[mx.array] = None):
        """`scale_codes` and `center_codes` come packed (`packing.pack` of the (out, groups) codes
        flattened to one row, so a layer pads to a word once)."""
        super().__init__()
        _check(bits, group_size, in_features, scale_bits, center_bits)
        groups = in_features // group_size
        words = packed_words(in_features, bits)
        if codes.shape != (out_features, words) or codes.dtype != mx.uint32:
            raise ValueError(f"codes must be uint32 of shape ({out_features}, {words}), got {codes.dtype} {codes.shape}")
        for name, array, b in (("scale_codes", scale_codes, scale_bits), ("center_codes", center_codes, center_bits)):
            expected = (1, packed_words(out_features * groups, b))
            if array.shape != expected or array.dtype != mx.uint32:
                raise ValueError(f"{name} must be uint32 of shape {expected}, got {array.dtype} {array.shape}")
        if row_ranges.shape != (out_features, 2):
            raise ValueError(f"row_ranges must have shape ({out_features}, 2), got {row_ranges.shape}")
        self.in_features, self.out_features, self.bits = in_features, out_features, bits
        self.group_size, self.scale_bits, self.center_bits = group_size, scale_bits, center_bits
        self.codes, self.scale_codes, self.center_codes = codes, scale_codes, center_codes
        self.row_ranges = row_ranges.astype(mx.float16)
        if bias is not None:
            self.bias = bias
        self.freeze()

    @classmethod
    def from_weight(cls, weight: mx.array, bits: int, group_size: int = DEFAULT_GROUP_SIZE,
                    scale_bits: int = DEFAULT_SCALE_BITS, center_bits: int = DEFAULT_CENTER_BITS,
                    bias: Optional[mx.array] = None, clip_search: bool = True) -> "GroupAffineLinear":
        out_features, in_features = weight.shape
        _check(bits, group_size, in_features, scale_bits, center_bits)
        q, scale_codes, center_codes, row_ranges = quantize_group_affine(weight, bits, group_size, scale_bits,
                                                                         center_bits, clip_search)
        layer = cls(in_features, out_features, bits, codes=pack(q, bits),
                    scale_codes=pack(scale_codes.reshape(1, -1), scale_bits),
                    center_codes=pack(center_codes.reshape(1, -1), center_bits), row_ranges=row_ranges,
                    group_size=group_size, scale_bits=scale_bits, center_bits=center_bits, bias=bias)
        mx.eval(layer.parameters())
        return layer

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int, **kwargs) -> "GroupAffineLinear":
        return cls.from_weight(linear.weight, bits, bias=linear.get("bias"), **kwargs)

    def group_params(self, dtype=mx.float32) -> tuple[mx.array, mx.array]:
        """MLX's affine (scales, biases), (out, groups), decoded from the stored codes."""
        groups = self.in_features // self.group_size
        n = self.out_features * groups
        scale_codes = unpack(self.scale_codes, self.scale_bits, n).reshape(self.out_features, groups)
        center_codes = unpack(self.center_codes, self.center_bits, n).reshape(self.out_features, groups)
        d, c = decode_group_params(scale_codes, center_codes, self.row_ranges, self.scale_bits, self.center_bits)
        return d.astype(dtype), (c - d * (((1 << self.bits) - 1) / 2)).astype(dtype)

    def dequantized_weight(self, dtype=mx.float32) -> mx.array:
        scales, biases = self.group_params(mx.float32)
        return mx.dequantize(self.codes, scales, biases, self.group_size, self.bits).astype(dtype)

    def storage_nbytes(self) -> int:
        """Bytes the weight matrix costs: codes, packed group-parameter codes, row maxima (not the bias)."""
        return sum(a.nbytes for a in (self.codes, self.scale_codes, self.center_codes, self.row_ranges))

    def bits_per_weight(self) -> float:
        return 8.0 * self.storage_nbytes() / (self.in_features * self.out_features)

    def __call__(self, x: mx.array) -> mx.array:
        scales, biases = self.group_params(x.dtype)
        y = mx.quantized_matmul(x, self.codes, scales, biases, transpose=True, group_size=self.group_size,
                                bits=self.bits)
        if "bias" in self:
            y = y + self["bias"]
        return y

    def _extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, scale_bits={self.scale_bits}, center_bits={self.center_bits}, "
                f"bias={'bias' in self}")
