"""TurboQuant with a residual second pass (two-stage residual VQ in the rotated domain).

encode:  y = R x / ||x|| (R a seeded random rotation, as in turboquant_mse);
         pass 1: codes1_j = nearest Lloyd-Max centroid of y_j for the coordinate law of a
         random unit vector (TurboQuant, arXiv 2504.19874, Alg. 1) at b1 bits;
         pass 2: the residual e = y - c1[codes1] is scaled by its per-token RMS
         s = sqrt(mean_j e_j^2) and quantized with the unit-variance Laplace Lloyd-Max
         codebook at b2 bits (residual VQ, Juang & Gray 1982; the residual of a scalar
         Lloyd-Max stage is peaked at 0 with heavier tails than uniform, so a Laplace fit);
store:   `codes1` (d*b1 bits), `codes2` (d*b2 bits), both packed, plus `norm` and
         `rscale` = s, fp16 each: d*(b1 + b2) + 32 bits per token and head;
attend:  domain = the rotated space, u = norm * (c1[codes1] + s * c2[codes2]); scores are
         (R q) . u and the value sum is un-rotated once per query with R^T.

Bit split: b2 = option `second_pass_bits` (default 1) and b1 = bits - b2, so the codes
take exactly `bits` per coordinate (b1 >= 1, hence bits >= 2). Versus turboquant_mse at
the same `bits` this spends 16 more bits per token (the residual scale). The second
pass does NOT pay off (tests/test_method_rvq_polar_kivi.py): on Gaussian vectors, d = 128,
E||x - x^||^2/||x||^2 = 0.131, 0.042, 0.0122 at bits 2, 3, 4 versus turboquant_mse's
0.116, 0.034, 0.0093 (1.13x to 1.31x), matching the prediction d * mse1(b1) * D2, where D2
~ 0.36 is the 1-bit Laplace codebook's error on the normalised pass-1 residual. Two
scalar stages form a constrained 2^bits-level quantizer, and the one-stage Lloyd-Max
quantizer is already the optimal one; this method is a residual-coding baseline.

Values use the same codec at value_bits (same split).
"""

import mlx.core as mx

from ..codebooks import dequantize, lloyd_max, quantize
from ..formats import Format, fp16, packed
from ..packing import pack, unpack
from ..rotations import random_rotation, rotation_from_params, rotation_params
from .base import Codec, Method, register_method
from .turboquant_mse import kernel_rotated_unit

DEFAULT_SECOND_PASS_BITS = 1


class RVQCodec(Codec):
    """Two residual passes: sphere Lloyd-Max at b1 bits, Laplace Lloyd-Max at b2 bits."""

    def __init__(self, dim: int, bits: int, seed: int, second_pass_bits: int = DEFAULT_SECOND_PASS_BITS, params=None):
        self.dim = self.domain_dim = dim
        if params:
            self.rotation = rotation_from_params(params)
            self.centroids1 = params["centroids1"]
            self.centroids2 = params["centroids2"]
        else:
            b2 = second_pass_bits
            if not 1 <= b2 < bits:
                raise ValueError(
                    f"turboquant_rvq needs 1 <= second_pass_bits < bits, got second_pass_bits={b2}, bits={bits}"
                )
            self.rotation = random_rotation(dim, seed)
            self.centroids1 = lloyd_max("sphere", bits - b2, dim).centroids
            self.centroids2 = lloyd_max("laplace", b2).centroids
        # The bit widths are implied by the codebook sizes, so params alone rebuild the codec.
        self.bits1 = self.centroids1.shape[0].bit_length() - 1
        self.bits2 = self.centroids2.shape[0].bit_length() - 1
        self.bits = self.bits1 + self.bits2
        self.boundaries1 = (self.centroids1[1:] + self.centroids1[:-1]) / 2
        self.boundaries2 = (self.centroids2[1:] + self.centroids2[:-1]) / 2
        self.format = Format("turboquant_rvq", dim, dim, (packed("codes1", dim, self.bits1),
                                                          packed("codes2", dim, self.bits2), fp16("norm"),
                                                          fp16("rscale")))

    def encode(self, x):
        x = x.astype(mx.float32)
        norm = mx.sqrt(mx.sum(x * x, axis=-1, keepdims=True))
        unit = self.rotation.apply(x) / mx.maximum(norm, 1e-30)
        codes1 = quantize(unit, self.boundaries1)
        residual = unit - dequantize(codes1, self.centroids1)
        # Quantize against the fp16 scale that decode will use, not the exact one.
        rscale = mx.sqrt(mx.mean(residual * residual, axis=-1, keepdims=True)).astype(mx.float16)
        scaled = residual / mx.maximum(rscale.astype(mx.float32), 1e-30)
        codes2 = quantize(scaled, self.boundaries2)
        return {
            "codes1": pack(codes1, self.bits1),
            "codes2": pack(codes2, self.bits2),
            "norm": norm.astype(mx.float16),
            "rscale": rscale,
        }

    def decode(self, fields):
        first = dequantize(unpack(fields["codes1"], self.bits1, self.dim), self.centroids1)
        second = dequantize(unpack(fields["codes2"], self.bits2, self.dim), self.centroids2)
        unit = first + fields["rscale"].astype(mx.float32) * second
        return unit * fields["norm"].astype(mx.float32)

    def kernel_decode(self, a):
        """The dequant kernel's element j (`kernels/dequant.py`): norm * (c1[code1_j] + s * c2[code2_j])."""
        c1, c2 = a.code("codes1", "j"), a.code("codes2", "j")
        t1, t2 = a.table(self.centroids1), a.table(self.centroids2)
        return f"v = {a.half('norm', '0')} * ({t1}[{c1}] + {a.half('rscale', '0')} * {t2}[{c2}]);"

    def kernel_encode(self, e):
        """The encode kernel's element t (`kernels/encode.py`): `encode`'s steps, with the
        residual scale rounded to fp16 before it divides, as there."""
        norm, unit = kernel_rotated_unit(e, self.rotation)
        c1 = e.nearest(unit, self.boundaries1)
        e.emit(f"const float r = {unit} - {e.table(self.centroids1)}[{c1}];")
        rr = e.sum("r * r")
        e.emit(f"const float rs = VQ_F(VQ_CAST(vq_half, VQ_SQRT({rr} / {self.dim}.0f)));")
        c2 = e.nearest("r / VQ_MAXF(rs, 1e-30f)", self.boundaries2)
        e.code("codes1", c1)
        e.code("codes2", c2)
        e.half("norm", norm)
        e.half("rscale", "rs")

    def to_domain(self, x):
        return self.rotation.apply(x)

    def from_domain(self, y):
        return self.rotation.invert(y)

    domain = "rotation"  # from_domain is self.rotation.invert (base Codec.domain)

    def params(self):
        state = rotation_params(self.rotation)
        return {**state, "centroids1": self.centroids1, "centroids2": self.centroids2}


@register_method("turboquant_rvq")
class TurboQuantRVQ(Method):
    key_bits = range(2, 9)
    value_bits = range(2, 9)
    options = {"second_pass_bits": int}
    summary = "rotation + Lloyd-Max codes + Laplace-coded residual pass (fp16 norm, fp16 residual scale)"
    status = "experimental"
    status_note = "worse than turboquant_mse by KL at the same bits, for more bits per coordinate"
    values_summary = "same codec at value_bits"

    @classmethod
    def validate(cls, config):
        super().validate(config)
        b2 = cls._second_pass_bits(config)
        for name in ("bits", "value_bits"):
            bits = getattr(config, name)
            if not 1 <= b2 < bits:
                raise ValueError(
                    f"turboquant_rvq splits {name}={bits} into (bits - second_pass_bits) + "
                    f"second_pass_bits with both >= 1; second_pass_bits={b2} does not fit"
                )

    @classmethod
    def _second_pass_bits(cls, config):
        return config.options.get("second_pass_bits", DEFAULT_SECOND_PASS_BITS)

    @classmethod
    def key_codec(cls, config, dim, params=None):
        return RVQCodec(dim, config.bits, config.seed, cls._second_pass_bits(config), params)

    @classmethod
    def value_codec(cls, config, dim, params=None):
        return RVQCodec(dim, config.value_bits, config.seed + 1, cls._second_pass_bits(config), params)
