"""TurboQuant_mse (Zandieh et al., arXiv 2504.19874, Alg. 1).

encode:  y = R x / ||x||  (R a seeded random rotation), codes_j = nearest Lloyd-Max
         centroid of y_j for the exact coordinate law of a random unit vector in R^d
         (Thm 1: MSE ~ 0.36, 0.117, 0.03, 0.009 x ||x||^2 at b = 1..4);
store:   `codes` (d*b bits, packed) and `norm` (fp16) per token and head;
attend:  domain = the rotated space, so scores are (R q) . (norm * c[codes]) and the
         value sum is un-rotated once per query: R^T sum_i p_i norm_i c[codes_i].

Keys and values both use this codec, at `bits` and `value_bits`.

Option `renorm=True` stores ||x|| / ||c[codes]|| instead of ||x||, so decoded
vectors keep their exact length: Lloyd-Max reconstructions are shorter than the
input (E||x_hat||^2 = (1 - MSE)||x||^2), which shrinks every attention score
towards zero; same storage.
"""

import mlx.core as mx

from ..codebooks import dequantize, lloyd_max, quantize
from ..formats import Format, fp16, packed
from ..packing import pack, unpack
from ..rotations import random_rotation, rotation_from_params, rotation_params
from .base import Codec, Method, register_method


def kernel_rotated_unit(e, rotation):
    """(norm, unit) C variables of the encode kernel (`kernels/encode.py`): ||x|| and element t of
    R x / ||x||, the input of a Lloyd-Max stage for the coordinate law of a random unit vector."""
    sq = e.sum(f"{e.x} * {e.x}")
    y = e.rotated(rotation)
    norm, unit = e.var(), e.var()
    e.emit(f"float {norm} = VQ_SQRT({sq});")
    e.emit(f"const float {unit} = {y} / VQ_MAXF({norm}, 1e-30f);")
    return norm, unit


# What a token stores as its scale s (decoded = s * c[codes], c on the unit sphere's codebook):
# "norm" ||x||; "renorm" ||x|| / ||c|| (the decoded vector keeps the true norm); "unbiased"
# ||x|| / <u, c> with u = Rx / ||x|| (its projection on the true vector is exact, so errors
# averaged over many tokens, as attention's value sum does, do not shrink the output).
SCALES = ("norm", "renorm", "unbiased")


class MSECodec(Codec):
    def __init__(self, dim: int, bits: int, seed: int, params=None, renorm: bool = False, unbiased: bool = False):
        self.dim = self.domain_dim = dim
        self.bits = bits
        self.scale = "unbiased" if unbiased else ("renorm" if renorm else "norm")
        if params:
            self.rotation = rotation_from_params(params)
            self.centroids = params["centroids"]
        else:
            self.rotation = random_rotation(dim, seed)
            self.centroids = lloyd_max("sphere", bits, dim).centroids
        self.boundaries = (self.centroids[1:] + self.centroids[:-1]) / 2
        self.format = Format("turboquant_mse", dim, dim, (packed("codes", dim, bits), fp16("norm")),
                             kernel="mse", kernel_params=(("bits", bits), ("scale", self.scale)))

    def encode(self, x):
        x = x.astype(mx.float32)
        norm = mx.sqrt(mx.sum(x * x, axis=-1, keepdims=True))
        unit = self.rotation.apply(x) / mx.maximum(norm, 1e-30)
        codes = quantize(unit, self.boundaries)
        if self.scale != "norm":
            decoded = dequantize(codes, self.centroids)
            if self.scale == "unbiased":
                gain = mx.sum(unit * decoded, axis=-1, keepdims=True)
            else:
                gain = mx.sqrt(mx.sum(decoded * decoded, axis=-1, keepdims=True))
            norm = norm / mx.maximum(gain, 1e-30)
        return {"codes": pack(codes, self.bits), "norm": norm.astype(mx.float16)}

    def decode(self, fields):
        codes = unpack(fields["codes"], self.bits, self.dim)
        return dequantize(codes, self.centroids) * fields["norm"].astype(mx.float32)

    def kernel_decode(self, a):
        """The dequant kernel's element j (`kernels/dequant.py`): norm * c[code_j]."""
        return f"v = {a.table(self.centroids)}[{a.code('codes', 'j')}] * {a.half('norm', '0')};"

    def kernel_encode(self, e):
        """The encode kernel's element t (`kernels/encode.py`): `encode`'s steps."""
        code, norm = self.kernel_encode_stage(e)
        e.code("codes", code)
        e.half("norm", norm)

    def kernel_encode_stage(self, e):
        """(code, norm) C variables of `encode` for the thread's element (turboquant_prod's first stage)."""
        norm, unit = kernel_rotated_unit(e, self.rotation)
        code = e.nearest(unit, self.boundaries)
        if self.scale != "norm":
            c = e.var()
            e.emit(f"const float {c} = {e.table(self.centroids)}[{code}];")
            if self.scale == "unbiased":
                gain = e.sum(f"{unit} * {c}")
            else:
                gain = f"VQ_SQRT({e.sum(f'{c} * {c}')})"
            e.emit(f"{norm} = {norm} / VQ_MAXF({gain}, 1e-30f);")
        return code, norm

    def to_domain(self, x):
        return self.rotation.apply(x)

    def from_domain(self, y):
        return self.rotation.invert(y)

    domain = "rotation"  # from_domain is self.rotation.invert (base Codec.domain)

    def params(self):
        state = rotation_params(self.rotation)
        return {**state, "centroids": self.centroids}


@register_method("turboquant_mse")
class TurboQuantMSE(Method):
    key_bits = range(1, 9)
    value_bits = range(1, 9)
    options = {"renorm": bool, "unbiased_values": bool}
    summary = "random rotation + Lloyd-Max codes + fp16 norm"
    status = "recommended"
    status_note = ("the best quality here at every bit width measured on SmolLM2; on Gemma 3 (QK-norm keys) plain "
                   "it loses to kivi, and the presets need smooth_keys to beat it (docs/methods.md); CPU, CUDA "
                   "and Metal decode kernels")
    encode_options = frozenset({"renorm", "unbiased_values"})  # same codebooks and rotations with or without them
    values_summary = "same codec at value_bits"

    @classmethod
    def key_codec(cls, config, dim, params=None):
        return MSECodec(dim, config.bits, config.seed, params, config.options.get("renorm", False))

    @classmethod
    def value_codec(cls, config, dim, params=None):
        return MSECodec(dim, config.value_bits, config.seed + 1, params, config.options.get("renorm", False),
                        config.options.get("unbiased_values", False))
