"""mlxq: rotated keys and values stored in MLX's own quantized format (`mx.quantize`).

encode:  y = R x, R the seeded rotation `turboquant_mse` uses (a random rotation spreads a
         channel outlier over every coordinate, so each group's range fits its values,
         QuaRot, arXiv 2404.00456); then `mx.quantize(y, group_size, bits)`: per group of
         G consecutive coordinates an fp16 scale s and bias b, code = round((y - b) / s);
store:   `codes` (d*b bits, MLX's packing), `scales` and `biases` (fp16, d/G each) per token,
         one buffer per field (`Format.separate_buffers`: `mx.quantized_matmul` reads them
         contiguous, as mlx-lm's QuantizedKVCache keeps them);
attend:  domain = the rotated space: scores = (R q) . k_hat and the value sum
         sum_t p_t v_hat_t both straight from the codes with `mx.quantized_matmul`
         (maintained kernels on MLX's CPU, Metal and CUDA back ends), un-rotated once per query.

The cache's protections (fp16 sinks, fp16 window, centred keys and values) apply as to any
method; the `mlxq4` / `mlxq8` presets set them (`presets.py`). Where a back end lacks a
quantized_matmul for these shapes (CUDA), attention decodes the codes with `mx.dequantize` and runs MLX's
fused attention (`engine.sdpa_decode` on any GPU).
"""

import mlx.core as mx

from ..formats import Format, fp16, packed
from ..rotations import random_rotation, rotation_from_params, rotation_params
from ..settings import cuda_available
from .base import Codec, Method, register_method

GROUP_SIZES = (32, 64, 128)
BITS = (2, 3, 4, 5, 6, 8)


def group_for(dim: int, group_size: int) -> int:
    """`group_size` clipped to the head dim; MLX's quantized formats take only GROUP_SIZES dividing it."""
    group = min(group_size, dim)
    if group not in GROUP_SIZES or dim % group:
        fitting = [g for g in GROUP_SIZES if dim % g == 0]
        raise ValueError(f"mlxq needs a group size in {GROUP_SIZES} dividing the head dim {dim}, got {group_size}"
                         + (f"; try {fitting[0]}" if fitting else "; this head dim has none"))
    return group


def _on_cuda() -> bool:
    """MLX's CUDA back end lacks quantized_matmul for batched codes of these shapes (as `kivi.py` finds): there
    the codes are dequantized (`mx.dequantize`), which the GPU decode paths do anyway (`engine.sdpa_decode`)."""
    return mx.default_device().type == mx.DeviceType.gpu and cuda_available()


class MLXQuantCodec(Codec):
    """One role's codec: rotation, then MLX's affine quantization."""

    def __init__(self, dim: int, bits: int, group_size: int, seed: int, params=None):
        self.dim = self.domain_dim = dim
        self.bits, self.group_size = bits, group_for(dim, group_size)
        self.rotation = rotation_from_params(params) if params else random_rotation(dim, seed)
        groups = dim // self.group_size
        self.format = Format("mlxq", dim, dim, (packed("codes", dim, bits), fp16("scales", groups),
                                                fp16("biases", groups)), separate_buffers=True)

    def encode(self, x):
        y = self.rotation.apply(x.astype(mx.float32)).astype(mx.float16)
        codes, scales, biases = mx.quantize(y, group_size=self.group_size, bits=self.bits)
        return {"codes": codes, "scales": scales, "biases": biases}

    def decode(self, fields):
        return mx.dequantize(*self._quantized(fields, mx.float32), group_size=self.group_size, bits=self.bits)

    def _quantized(self, fields, dtype):
        return fields["codes"], fields["scales"].astype(dtype), fields["biases"].astype(dtype)

    def score(self, queries, fields):
        """q . k_hat for every token, from the codes (queries (B, H, M, D) -> (B, H, M, T))."""
        if _on_cuda():
            return super().score(queries, fields)
        return mx.quantized_matmul(queries, *self._quantized(fields, queries.dtype), transpose=True,
                                   group_size=self.group_size, bits=self.bits)

    def weighted_sum(self, weights, fields):
        """sum_t weights[..., t] v_hat_t from the codes (weights (B, H, R, L, T) -> (B, H, R, L, D))."""
        if _on_cuda():
            return super().weighted_sum(weights, fields)
        codes, scales, biases = self._quantized(fields, weights.dtype)
        if mx.default_device().type == mx.DeviceType.cpu:
            # MLX's CPU kernel sums each row of weights on its own: the R * L rows of a kv head as one matrix give
            # the broadcast form's result bit for bit, without the copy of the codes per query head it makes.
            B, H, R, L, T = weights.shape
            out = mx.quantized_matmul(weights.reshape(B, H, R * L, T), codes, scales, biases, transpose=False,
                                      group_size=self.group_size, bits=self.bits)
            return out.reshape(B, H, R, L, -1)
        codes, scales, biases = (mx.expand_dims(a, 2) for a in (codes, scales, biases))
        return mx.quantized_matmul(weights, codes, scales, biases, transpose=False, group_size=self.group_size,
                                   bits=self.bits)

    def to_domain(self, x):
        return self.rotation.apply(x)

    def from_domain(self, y):
        return self.rotation.invert(y)

    domain = "rotation"

    def params(self):
        return rotation_params(self.rotation)


@register_method("mlxq")
class MLXQuant(Method):
    key_bits = range(2, 9)
    value_bits = range(2, 9)
    summary = "random rotation + MLX's affine codes (mx.quantize), attention by mx.quantized_matmul"
    status = "recommended"
    status_note = ("runs on MLX's own quantized kernels on every back end (no custom kernel): the presets' "
                   "format where the custom kernels are unusable; rotation, sinks, window and centring give it "
                   "a fraction of mlx-lm's QuantizedKVCache's KL at the same bits (benchmarks/results/mlxq-kl-smollm2-cpu)")
    values_summary = "same codec at value_bits"

    @classmethod
    def validate(cls, config) -> None:
        super().validate(config)
        for role, bits in (("key", config.bits), ("value", config.value_bits)):
            if bits not in BITS:
                raise ValueError(f"mlxq stores {role}s with mx.quantize, which takes bits {BITS}, got {bits}")

    @classmethod
    def key_codec(cls, config, dim, params=None):
        return MLXQuantCodec(dim, config.bits, config.group_size, config.seed, params)

    @classmethod
    def value_codec(cls, config, dim, params=None):
        return MLXQuantCodec(dim, config.value_bits, config.group_size, config.seed + 1, params)
