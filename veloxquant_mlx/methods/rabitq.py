"""RaBitQ keys (Gao & Long, arXiv 2405.12497), extended to B bits (Gao et al., arXiv 2409.09913).

encode:  o' = P k / ||k||, P the seeded randomized Hadamard rotation (`rotations.py`), centre
         c = 0 (the cache's `center` option subtracts a mean where one is wanted). The code is a
         point y of the grid {-(2^B-1)/2, ..., (2^B-1)/2}^D stored as x_u = y + (2^B-1)/2:
         * B = 1: x_u = [o' >= 0], so o_bar = P^T y/||y|| = P^T sign(o')/sqrt(D) (2405.12497 Sec. 3.1);
         * B > 1 (2409.09913 Sec. 3): the grid point nearest in angle to o'. It is the rounding
           of t|o'| for the best rescaling t, |y_i| = min(floor(t|o'_i|), 2^(B-1) - 1) + 1/2 with
           sign(y_i) = sign(o'_i). The paper enumerates every critical t; here the best of
           `SCALE_CANDIDATES` values of t is kept, which only picks a slightly worse code when
           the grid misses the optimum (the estimator stays unbiased for any code rule);
store:   `codes` (D*B bits, packed) and RaBitQ's two corrective scalars per vector (fp16):
         `scale` = ||k|| / ||y|| (the key's norm in units of its code's length: ||y|| is a sum over
         the codes, which a kernel decoding one element cannot take) and `alignment` = <o_bar, o>
         = <y, o'>/||y||;
attend:  the unbiased estimator (2405.12497 Sec. 3.2, Thm 3.2; the same estimator in 2409.09913)
             <k, q> ~ ||k|| <o_bar, q> / <o_bar, o>,
         in the rotated domain q' = P q (the query is not quantized):
             score = scale / <o_bar, o> * (<x_u, q'> - (2^B-1)/2 sum_i q'_i)
         (2405.12497 Sec. 3.3: <x_bar, q'> split into the code bits and the sum of q').
         `score` works on the stored words: codes come out of them by shift-and-mask
         (`packing.unpack`), are multiplied unscaled with the queries, and the per-token
         correction is applied to the scores. The codes are not multiplied by popcount: that
         needs the query quantized to a few bit planes (2405.12497 Sec. 3.3), a second error,
         and MLX has no popcount op.
         decode (for the fp16-joining paths) returns the same estimator's vector:
         y scale / <o_bar, o> in the rotated domain; `kernel_decode` is its element j, which the
         formats' dequant and partial kernels decode in place (`kernels/partial.py`).

The estimator is unbiased but not norm-preserving: decoded keys are longer than the input by
1/<o_bar, o> (about 1.25 at B = 1), so single scores spread wider than TurboQuant-MSE's.
RaBitQ is data-oblivious: nothing to calibrate.

Values: TurboQuant-MSE codes at `value_bits` (`turboquant_mse.MSECodec`), e.g. `rabitq:1:vbits=4`.
"""

import math

import mlx.core as mx
import numpy as np

from ..formats import Format, fp16, packed
from ..packing import pack, unpack
from ..rotations import random_rotation, rotation_from_params, rotation_params
from .base import Codec, Method, register_method
from .turboquant_mse import MSECodec

MAX_KEY_BITS = 4
SCALE_CANDIDATES = 24
ENCODE_ROWS = 1024  # tokens whose (candidates, D) trial codes are built at once


def rescale_candidates(bits: int) -> mx.array:
    """The t tried for B-bit codes, in units of 1/sqrt(D) per coordinate of the unit vector:
    [0.25, 0.7] x 2^(B-1), which holds the best t of 98% of Gaussian vectors at D = 64 and
    B = 2..4 (B = 1 has one code: every coordinate on the innermost level)."""
    if bits == 1:
        return mx.array([0.0])
    top = 2 ** (bits - 1)
    return mx.linspace(0.25 * top, 0.7 * top, SCALE_CANDIDATES)


class RaBitQCodec(Codec):
    def __init__(self, dim: int, bits: int, seed: int, params=None):
        if not 1 <= bits <= MAX_KEY_BITS:
            raise ValueError(f"rabitq key bits must be 1..{MAX_KEY_BITS}, got {bits}")
        self.dim = self.domain_dim = dim
        self.bits = bits
        self.rotation = rotation_from_params(params) if params else random_rotation(dim, seed)
        self.offset = (2**bits - 1) / 2  # x_u = y + offset
        self.candidates = rescale_candidates(bits)
        self.format = Format(f"rabitq_{bits}", dim, dim, (packed("codes", dim, bits), fp16("scale"), fp16("alignment")))

    def _grid_code(self, unit: mx.array) -> mx.array:
        """x_u of the grid point of largest cosine with `unit` (..., D), as uint8."""
        upper = 2 ** (self.bits - 1)
        if self.bits == 1:
            return (unit >= 0).astype(mx.uint8)
        *lead, dim = unit.shape
        flat = unit.reshape(-1, dim)
        levels = [self._best_levels(flat[i : i + ENCODE_ROWS]) for i in range(0, flat.shape[0], ENCODE_ROWS)]
        level = (mx.concatenate(levels, axis=0) if len(levels) > 1 else levels[0]).reshape(*lead, dim)
        return mx.where(unit >= 0, upper + level, upper - 1 - level).astype(mx.uint8)

    def _best_levels(self, unit: mx.array) -> mx.array:
        """|y| - 1/2 of the best rescaling of each row of `unit` (N, D)."""
        magnitude = mx.abs(unit) * math.sqrt(self.dim)
        level = mx.minimum(mx.floor(magnitude[:, None, :] * self.candidates[:, None]), 2 ** (self.bits - 1) - 1)
        half = level + 0.5  # (N, candidates, D)
        cos = mx.sum(half * magnitude[:, None, :], axis=-1) / mx.sqrt(mx.sum(half * half, axis=-1))
        best = mx.argmax(cos, axis=-1)
        return mx.take_along_axis(level, best[:, None, None], axis=1).squeeze(1)

    def encode(self, x):
        x = x.astype(mx.float32)
        norm = mx.sqrt(mx.sum(x * x, axis=-1, keepdims=True))
        unit = self.rotation.apply(x) / mx.maximum(norm, 1e-30)
        codes = self._grid_code(unit)
        y = codes.astype(mx.float32) - self.offset
        y_norm = mx.sqrt(mx.sum(y * y, axis=-1, keepdims=True))
        return {"codes": pack(codes, self.bits), "scale": (norm / y_norm).astype(mx.float16),
                "alignment": (mx.sum(y * unit, axis=-1, keepdims=True) / y_norm).astype(mx.float16)}

    def _codes(self, fields) -> mx.array:
        return unpack(fields["codes"], self.bits, self.dim).astype(mx.float32)

    def _factor(self, fields) -> mx.array:
        """||k|| / (||y|| <o_bar, o>) = scale / <o_bar, o> per token (..., T, 1); 0 for a zero key."""
        alignment = fields["alignment"].astype(mx.float32)
        factor = fields["scale"].astype(mx.float32) / mx.where(alignment > 0, alignment, 1.0)
        return mx.where(alignment > 0, factor, 0.0)

    def decode(self, fields):
        return (self._codes(fields) - self.offset) * self._factor(fields)

    def kernel_decode(self, a):
        """The kernels' element j (`kernels/dequant.py`): `decode`'s (x_u_j - offset) * factor."""
        code, alignment = a.code("codes", "j"), a.half("alignment", "0")
        return (f"v = ({alignment} > 0.0f) ? ((float){code} - {self.offset!r}f) * "
                f"({a.half('scale', '0')} / {alignment}) : 0.0f;")

    def kernel_encode(self, e):
        """The encode kernel's element t (`kernels/encode.py`): `encode`'s steps, the best of the
        rescalings t_c chosen by two block sums each (the first largest cosine, as `mx.argmax`)."""
        from .turboquant_mse import kernel_rotated_unit

        norm, unit = kernel_rotated_unit(e, self.rotation)
        upper = 2 ** (self.bits - 1)
        level = "0.0f"
        if self.bits > 1:
            magnitude, best, best_t = e.var(), e.var(), e.var()
            e.emit(f"const float {magnitude} = VQ_ABSF({unit}) * {math.sqrt(self.dim)!r}f;")
            e.emit(f"float {best} = VQ_NEG_INF, {best_t} = 0.0f;")
            for t in np.array(self.candidates).tolist():  # float32 values, written exactly
                half = f"(VQ_MINF(VQ_FLOOR({magnitude} * {t!r}f), {upper - 1}.0f) + 0.5f)"
                num, den = e.sum(f"{half} * {magnitude}"), e.sum(f"{half} * {half}")
                e.emit(f"{{ const float c_ = {num} / VQ_SQRT({den}); if (c_ > {best}) {{ {best} = c_; {best_t} = {t!r}f; }} }}")
            level = f"VQ_MINF(VQ_FLOOR({magnitude} * {best_t}), {upper - 1}.0f)"
        code, y = e.var(), e.var()
        e.emit(f"const uint32_t {code} = (uint32_t)({unit} >= 0.0f ? {upper}.0f + {level} : {upper - 1}.0f - {level});")
        e.emit(f"const float {y} = (float){code} - {self.offset!r}f;")
        e.code("codes", code)
        y_norm = e.var()
        e.emit(f"const float {y_norm} = VQ_SQRT({e.sum(f'{y} * {y}')});")
        alignment = e.sum(f"{y} * {unit}")
        e.half("scale", f"{norm} / {y_norm}")
        e.half("alignment", f"{alignment} / {y_norm}")

    def score(self, queries, fields):
        """The estimator from the packed codes: queries (B, H, M, D) in the rotated domain against
        the unscaled codes, then the -offset * sum(q') term and the per-token factor."""
        dots = queries @ self._codes(fields).swapaxes(-1, -2) - self.offset * mx.sum(queries, axis=-1, keepdims=True)
        return dots * self._factor(fields).swapaxes(-1, -2)

    def to_domain(self, x):
        return self.rotation.apply(x)

    def from_domain(self, y):
        return self.rotation.invert(y)

    domain = "rotation"  # from_domain is self.rotation.invert (base Codec.domain)

    def params(self):
        return rotation_params(self.rotation)


@register_method("rabitq")
class RaBitQ(Method):
    key_bits = range(1, MAX_KEY_BITS + 1)
    value_bits = range(1, 9)
    summary = "RaBitQ keys: 1-bit signs (or extended B-bit grid codes) of a random rotation + norm + <o_bar, o>, unbiased scores"
    values_summary = "TurboQuant_mse at value_bits (use vbits=4)"
    status = "experimental"
    status_note = ("worse than turboquant_mse at 1-2 key bits on SmolLM2 (unbiased but noisier scores); at 3 key "
                   "bits slightly better by KL for 16 more bits, far behind kivi:3:group=32 at ~4 bits (docs/methods.md)")

    @classmethod
    def key_codec(cls, config, dim, params=None):
        return RaBitQCodec(dim, config.bits, config.seed, params)

    @classmethod
    def value_codec(cls, config, dim, params=None):
        return MSECodec(dim, config.value_bits, config.seed + 1, params)
