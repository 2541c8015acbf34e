"""KIVI (Liu et al., arXiv 2402.02750): asymmetric min/max integer codes, keys per channel.

encode:  keys PER CHANNEL: each channel's values over a group of G = config.group_size
         consecutive tokens share one zero point m = min and scale s = (max - min)/(2^b - 1)
         (Sec. 3.2: key outliers live in fixed channels, so grouping along tokens keeps
         them from inflating other channels' scales); code = round((x - m)/s), clipped.
         Values PER TOKEN: each token's groups of G channels (G clipped to the head dim,
         which it must divide) share m and s (Sec. 3.2, values have no channel outliers);
store:   keys: `codes` (d*b bits, packed, one row per token) and `channel_scale`,
         `channel_min` (fp16, one row of d per group of G tokens: 32 d / G bits per
         token amortised);
         values: `codes` (d*b bits, packed) and `scale`, `min` (fp16, d/G each) per token;
attend:  domain = identity: decode returns m + s * code in float32, scores are q . k^.

KIVI's fp16 residual of the R most recent tokens is the cache's generic window
(config.residual_length); the codec keeps no window of its own. A key group can only be
encoded once all G of its tokens exist, so the key codec has token_block = G: during
decoding, tokens stay in fp16 until a whole group of G has aged out of the window, and
are then quantized together (CompressedKVCache does this). The paper's defaults are
G = 32, R = 128; here G is config.group_size (default 64) for both keys and values.
"""

import mlx.core as mx

from ..formats import Format, fp16, packed
from ..packing import pack, unpack
from ..settings import cuda_available
from .base import Codec, Method, register_method


def _fp16_round_down(x: mx.array) -> mx.array:
    """fp16(x) rounded toward -inf, so that every element of a group is >= its stored min
    (rounding to nearest could put the min above the smallest element by an fp16 ulp,
    which exceeds scale / 2 for a narrow group far from 0)."""
    y = x.astype(mx.float16)
    word = mx.view(y, mx.uint16)
    # One fp16 step down: |y| - ulp for y > 0, |y| + ulp for y < 0, and -min_subnormal at 0.
    lower = mx.where(word == 0, 0x8001, mx.where(word >= 0x8000, word + 1, word - 1)).astype(mx.uint16)
    return mx.where(y.astype(mx.float32) > x, mx.view(lower, mx.float16), y)


def affine_quantize(x: mx.array, bits: int, axis: int):
    """Min/max asymmetric quantization of x along `axis` (the group axis).

    Returns (codes uint8 of x's shape, scale fp16, min fp16), scale/min with `axis` kept
    as size 1. Codes are computed against the stored fp16 scale and min (the min rounded
    down), so decoding min + scale * code errs by at most scale / 2 per element, up to
    float32 rounding.
    """
    levels = (1 << bits) - 1
    # A NaN/Inf element (e.g. one bad token of a key group) is left out of its group's range,
    # so it spoils only its own code and trimming its token leaves the group's others intact.
    finite = mx.isfinite(x)
    lo = mx.min(mx.where(finite, x, mx.inf), axis=axis, keepdims=True)
    hi = mx.max(mx.where(finite, x, -mx.inf), axis=axis, keepdims=True)
    lo, hi = mx.where(mx.isfinite(lo), lo, 0.0), mx.where(mx.isfinite(hi), hi, 0.0)
    lo = _fp16_round_down(lo)
    scale = ((hi - lo.astype(mx.float32)) / levels).astype(mx.float16)
    lo32, scale32 = lo.astype(mx.float32), scale.astype(mx.float32)
    # A constant group has scale 0: every element is `min` itself, code 0.
    q = mx.round((x - lo32) / mx.where(scale32 > 0, scale32, 1.0))
    codes = mx.clip(mx.where(finite, q, 0), 0, levels).astype(mx.uint8)
    return codes, scale, lo


class GroupAffineCodec(Codec):
    """Per-token codec: each token's groups of `group_size` consecutive channels share
    an fp16 scale and min (KIVI's value quantization, also QJL's values). With `ragged`,
    a last, shorter group covers dim % group_size channels; otherwise group_size must
    divide the head dim."""

    def __init__(self, dim: int, bits: int, group_size: int, ragged: bool = False):
        group_size = max(1, min(group_size, dim))
        if dim % group_size and not ragged:
            raise ValueError(
                f"group_size {group_size} must divide the head dim {dim} "
                f"(per-token groups of channels); choose a divisor of {dim}"
            )
        self.dim = self.domain_dim = dim
        self.bits, self.group_size = bits, group_size
        self.groups = -(-dim // group_size)
        self.padded = self.groups * group_size
        self.format = Format("affine_token", dim, dim, (packed("codes", dim, bits), fp16("scale", self.groups),
                                                         fp16("min", self.groups)))

    def _grouped(self, x):
        if self.padded != self.dim:
            # Repeat the last channel: padding never changes a group's min or max.
            x = mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, self.padded - self.dim)], mode="edge")
        return x.reshape(*x.shape[:-1], self.groups, self.group_size)

    def encode(self, x):
        *lead, dim = x.shape
        codes, scale, lo = affine_quantize(self._grouped(x.astype(mx.float32)), self.bits, axis=-1)
        return {
            "codes": pack(codes.reshape(*lead, self.padded)[..., :dim], self.bits),
            "scale": scale.squeeze(-1),
            "min": lo.squeeze(-1),
        }

    def decode(self, fields):
        codes = unpack(fields["codes"], self.bits, self.dim).astype(mx.float32)
        *lead, _ = codes.shape
        if self.padded != self.dim:
            codes = mx.pad(codes, [(0, 0)] * (codes.ndim - 1) + [(0, self.padded - self.dim)])
        codes = codes.reshape(*lead, self.groups, self.group_size)
        scale = fields["scale"].astype(mx.float32)[..., None]
        lo = fields["min"].astype(mx.float32)[..., None]
        return (lo + scale * codes).reshape(*lead, self.padded)[..., : self.dim]

    def kernel_decode(self, a):
        """The dequant kernel's element j (`kernels/dequant.py`): min_g + scale_g * code_j, g = j / G."""
        scale, low, code = self.kernel_value_fold(a)
        return f"v = {low} + {scale} * {code};"

    @property
    def kernel_fold_channels(self) -> int:
        return self.group_size

    def kernel_value_fold(self, a):
        """The same element as (scale, offset, value) with scale and offset shared by groups of
        `kernel_fold_channels` channels: the formats' partial kernel takes the scale into the token's
        weight and sums the offset once (`kernels/partial.py`)."""
        g = f"j / {self.group_size}"
        return a.half("scale", g), a.half("min", g), f"vq_code_float({a.code('codes', 'j')})"

    def kernel_encode(self, e):
        """The encode kernel's element t (`kernels/encode.py`): `affine_quantize` over the
        thread's group, the min rounded down to fp16 and the codes taken against the fp16 scale."""
        g, levels = self.group_size, (1 << self.bits) - 1
        lo, hi = e.group_range(e.x, g)
        low = e.half_down(lo)
        scale, q = e.var(), e.var()
        e.emit(f"const float {scale} = VQ_F(VQ_CAST(vq_half, ({hi} - {low}) / {levels}.0f));")
        e.emit(f"float {q} = VQ_ROUND(({e.x} - {low}) / ({scale} > 0.0f ? {scale} : 1.0f));")
        e.emit(f"if (!VQ_ISFINITE({q})) {q} = 0.0f;")
        e.emit(f"{q} = {q} < 0.0f ? 0.0f : ({q} > {levels}.0f ? {levels}.0f : {q});")
        e.code("codes", f"(uint32_t){q}")
        first = f"act && t % {g} == 0"
        e.half("scale", scale, index=f"t / {g}", when=first)
        e.half("min", low, index=f"t / {g}", when=first)

    def weighted_sum(self, weights, fields):
        """p @ V straight from the codes with `mx.quantized_matmul`: the packing and the
        min + scale * code form are MLX's affine format (as mlx-lm's QuantizedKVCache
        uses it), so no value is decoded. MLX's CUDA back end has no kernel for these
        shapes, and it covers only some widths and group sizes: elsewhere, decode."""
        if not _quantized_matmul_applies(self.bits, self.group_size, self.padded == self.dim):
            return super().weighted_sum(weights, fields)
        codes, scale, low = (mx.expand_dims(fields[name], 2) for name in ("codes", "scale", "min"))
        return mx.quantized_matmul(weights, codes, scale.astype(mx.float32), low.astype(mx.float32),
                                   transpose=False, group_size=self.group_size, bits=self.bits)


def _code_group(dim: int):
    """A group size of MLX's quantized formats that divides `dim` (the codes' own scale is 1)."""
    return next((g for g in (128, 64, 32) if dim % g == 0), None)


def _quantized_matmul_applies(bits: int, group_size: int, whole_groups: bool) -> bool:
    if not whole_groups or bits not in (2, 3, 4, 5, 6, 8) or group_size not in (32, 64, 128):
        return False
    return not (mx.default_device().type == mx.DeviceType.gpu and cuda_available())


class ChannelGroupAffineCodec(Codec):
    """Per-channel codec over groups of `group_size` tokens (KIVI's key quantization):
    per-token packed `codes` plus per-group fp16 `channel_scale` and `channel_min` of
    shape (..., T/G, dim). (Their names differ from the value codec's per-token `scale`
    and `min`: the cache records tokens-per-row by field name.)"""

    def __init__(self, dim: int, bits: int, group_size: int):
        self.dim = self.domain_dim = dim
        self.bits = bits
        self.format = Format("affine_channel", dim, dim, (
            packed("codes", dim, bits), fp16("channel_scale", dim, group_size), fp16("channel_min", dim, group_size),
        ), token_block=group_size)

    def kernel_decode(self, a):
        """The dequant kernel's element j: min[c] + scale[c] * code_j, from the row of this
        token's group (`kernels/dequant.py` reads per-block fields by t / G)."""
        scale, low, code = self.kernel_key_fold(a)
        return f"v = {low} + {scale} * {code};"

    def kernel_key_fold(self, a):
        """The same element as (scale, offset, value) with scale and offset shared by the token's group:
        the formats' partial kernel folds the query into each group (`kernels/partial.py`)."""
        return a.half("channel_scale", "j"), a.half("channel_min", "j"), f"vq_code_float({a.code('codes', 'j')})"

    def score(self, queries, fields):
        """q . k straight from the codes (`mx.quantized_matmul`, CPU / Metal): within a group g
        k_t = min_g + scale_g * code_t per channel, so q . k_t = (q * scale_g) . code_t + q . min_g,
        one batched integer-code product per group and no decoded key."""
        group = _code_group(self.dim)
        if group is None or not _quantized_matmul_applies(self.bits, group, True):
            return super().score(queries, fields)
        G = self.token_block
        codes = fields["codes"]
        *lead, tokens, words = codes.shape
        groups = tokens // G
        codes = codes.reshape(*lead, groups, G, words)
        scale = fields["channel_scale"].astype(mx.float32)[..., None, :]  # (B, H, groups, 1, D)
        low = fields["channel_min"].astype(mx.float32)[..., :, None]  # (B, H, groups, D, 1)
        q = mx.expand_dims(queries, 2)  # (B, H, 1, M, D)
        ones = mx.ones((*lead, groups, G, self.dim // group), mx.float32)
        scores = mx.quantized_matmul(q * scale, codes, ones, mx.zeros_like(ones), transpose=True,
                                     group_size=group, bits=self.bits)  # (B, H, groups, M, G)
        scores = scores + q @ low
        return scores.swapaxes(2, 3).reshape(*lead, queries.shape[-2], tokens)

    def encode(self, x):
        *lead, tokens, dim = x.shape
        if tokens % self.token_block:
            raise ValueError(f"KIVI keys are encoded in whole groups of {self.token_block} tokens, got {tokens}")
        grouped = x.astype(mx.float32).reshape(*lead, tokens // self.token_block, self.token_block, dim)
        codes, scale, lo = affine_quantize(grouped, self.bits, axis=-2)
        return {
            "codes": pack(codes.reshape(*lead, tokens, dim), self.bits),
            "channel_scale": scale.squeeze(-2),
            "channel_min": lo.squeeze(-2),
        }

    def decode(self, fields):
        codes = unpack(fields["codes"], self.bits, self.dim).astype(mx.float32)
        *lead, tokens, dim = codes.shape
        codes = codes.reshape(*lead, tokens // self.token_block, self.token_block, dim)
        scale = fields["channel_scale"].astype(mx.float32)[..., None, :]
        lo = fields["channel_min"].astype(mx.float32)[..., None, :]
        return (lo + scale * codes).reshape(*lead, tokens, dim)


@register_method("kivi")
class KIVI(Method):
    key_bits = range(1, 9)
    value_bits = range(1, 9)
    summary = "min/max integer codes, keys per channel over groups of group_size tokens"
    status = "baseline"
    status_note = ("the published KIVI method; with 32-token groups it beats plain turboquant_mse at similar "
                   "measured bits, not the protected config; it prefills slower than fp16 (README's results)")
    values_summary = "min/max integer codes per token, groups of group_size channels"

    @classmethod
    def key_codec(cls, config, dim, params=None):
        return ChannelGroupAffineCodec(dim, config.bits, config.group_size)

    @classmethod
    def value_codec(cls, config, dim, params=None):
        return GroupAffineCodec(dim, config.value_bits, config.group_size)
