"""TurboQuant_prod (Zandieh et al., arXiv 2504.19874, Alg. 2): unbiased inner products.

encode:  x_mse = (b-1)-bit TurboQuant_mse reconstruction of x (Alg. 1), residual
         r = x - x_mse, then a 1-bit QJL sketch of r: sign(S r) with S a seeded
         (m, d) N(0, 1) matrix (m = `sketch_dim`, default d), and ||r||;
store:   `codes` (d*(b-1) bits) + `norm` (fp16) of the MSE stage, `signs` (m bits)
         + `residual_norm` (fp16) of the sketch, per token and head;
attend:  domain = [rotated space | sketch space] (d + m), to_domain(q) = [R q, S q],
         decode = [norm * c[codes], ||r|| sqrt(pi/2)/m * sign(S r)], so a score is
             <q, x_mse> + ||r|| sqrt(pi/2)/m <S q, sign(S r)>,
         unbiased for <q, x> (Alg. 2 / Thm 2; QJL Lemma 3.2 on r), with
         Var = E[(pi/2 ||q||^2 ||r||^2 - <q, r>^2) / m] <= (pi/2) D_mse(b-1) ||q||^2 ||x||^2 / m;
         from_domain(u) = R^T u[:d] + S^T u[d:].

Key bits b >= 2: b = 1 would leave a 0-bit MSE stage, i.e. a pure QJL sketch; that
is rejected here, use method="qjl" (bits=1 gives the same m = d sketch).

Values: the prod estimator only serves inner products (its reconstructions are
*worse* than the MSE stage alone: E||x~ - x||^2 = E||r||^2 (pi d/2 - 1)/m), so values
use plain TurboQuant_mse codes at `value_bits`, as the paper does for the KV cache.
"""

import math

import mlx.core as mx
import numpy as np

from ..formats import Format, fp16, packed
from ..packing import pack, unpack
from ..rotations import gaussian_projection
from .base import Codec, Method, register_method
from .turboquant_mse import MSECodec


class ProdCodec(Codec):
    def __init__(self, dim: int, bits: int, seed: int, sketch_dim=None, params=None):
        if bits < 2:
            raise ValueError(
                f"turboquant_prod needs key bits >= 2 (b-1 MSE bits + 1 sketch bit), got {bits}; "
                "for a pure 1-bit sketch use method='qjl'"
            )
        self.dim = dim
        self.bits = bits
        if params:
            mse_params = {k[len("mse.") :]: v for k, v in params.items() if k.startswith("mse.")}
            self.mse = MSECodec(dim, bits - 1, seed, mse_params)
            self.sketch = params["sketch"].astype(mx.float32)
            if sketch_dim is not None and self.sketch.shape[0] != sketch_dim:
                raise ValueError(
                    f"stored sketch has {self.sketch.shape[0]} rows, config asks sketch_dim={sketch_dim}"
                )
        else:
            self.mse = MSECodec(dim, bits - 1, seed)
            # Stream 3 of the seed: independent of the rotation R (streams 1/2).
            self.sketch = gaussian_projection(sketch_dim or dim, dim, seed)
        if self.sketch.shape[1] != dim:
            raise ValueError(f"sketch must have {dim} columns, got shape {self.sketch.shape}")
        self.sketch_dim = self.sketch.shape[0]
        self.domain_dim = dim + self.sketch_dim
        self.qjl_scale = math.sqrt(math.pi / 2) / self.sketch_dim  # Alg. 2 line 9 / QJL Def. 3.1
        self.format = Format("turboquant_prod", dim, self.domain_dim,
                             self.mse.format.fields + (packed("signs", self.sketch_dim, 1), fp16("residual_norm")),
                             orthogonal_domain=False)

    def encode(self, x):
        x = x.astype(mx.float32)
        fields = self.mse.encode(x)
        # Residual against exactly what decode will return (fp16 norm included), so the
        # sketch corrects the stored x_mse and the estimator stays unbiased.
        r = x - self.mse.reconstruct(fields)
        residual_norm = mx.sqrt(mx.sum(r * r, axis=-1, keepdims=True))
        signs = (r @ self.sketch.T >= 0).astype(mx.uint8)
        fields["signs"] = pack(signs, 1)
        fields["residual_norm"] = residual_norm.astype(mx.float16)
        return fields

    def decode(self, fields):
        mse_part = self.mse.decode(fields)
        signs = unpack(fields["signs"], 1, self.sketch_dim).astype(mx.float32) * 2 - 1
        weight = fields["residual_norm"].astype(mx.float32) * self.qjl_scale
        return mx.concatenate([mse_part, signs * weight], axis=-1)

    def kernel_decode(self, a):
        """The dequant kernel's element j: the MSE part for j < d, then the residual sketch."""
        d = self.dim
        code, sign = a.code("codes", f"(j < {d} ? j : {d - 1})"), a.code("signs", f"(j < {d} ? 0 : j - {d})")
        mse = f"{a.table(self.mse.centroids)}[{code}] * {a.half('norm', '0')}"
        qjl = f"({sign} ? 1.0f : -1.0f) * {a.half('residual_norm', '0')} * {self.qjl_scale!r}f"
        return f"v = j < {d} ? {mse} : {qjl};"

    def kernel_encode(self, e):
        """The encode kernel's element t (`kernels/encode.py`): the MSE stage, the residual
        against its reconstruction with the fp16 norm (as `encode`), then its sketch."""
        code, norm = self.mse.kernel_encode_stage(e)
        decoded = e.var()
        e.emit(f"const float {decoded} = {e.table(self.mse.centroids)}[{code}] * VQ_F(VQ_CAST(vq_half, {norm}));")
        x_mse = e.unrotated(decoded, self.mse.rotation)
        r = e.var()
        e.emit(f"const float {r} = {e.x} - {x_mse};")
        rr = e.sum(f"{r} * {r}")
        e.sketch_signs("signs", np.array(self.sketch), r)
        e.code("codes", code)
        e.half("norm", norm)
        e.half("residual_norm", f"VQ_SQRT({rr})")

    def to_domain(self, x):
        return mx.concatenate([self.mse.to_domain(x), x @ self.sketch.T], axis=-1)

    def from_domain(self, y):
        return self.mse.from_domain(y[..., : self.dim]) + y[..., self.dim :] @ self.sketch

    def params(self):
        return {**{f"mse.{k}": v for k, v in self.mse.params().items()}, "sketch": self.sketch}


@register_method("turboquant_prod")
class TurboQuantProd(Method):
    key_bits = range(2, 9)
    value_bits = range(1, 9)
    options = {"sketch_dim": int}
    summary = "(b-1)-bit TurboQuant_mse + 1-bit QJL sketch of the residual (unbiased scores)"
    status = "experimental"
    status_note = "unbiased scores but higher variance: much worse than turboquant_mse at the same bits on SmolLM2"
    values_summary = "TurboQuant_mse at value_bits"

    @classmethod
    def validate(cls, config):
        if config.bits == 1:
            raise ValueError(
                "turboquant_prod needs bits >= 2 ((b-1)-bit MSE stage + 1-bit residual sketch); "
                "bits=1 is a pure QJL sketch: use method='qjl'"
            )
        super().validate(config)
        m = config.options.get("sketch_dim")
        if m is not None and (isinstance(m, bool) or m < 1):
            raise ValueError(f"turboquant_prod option 'sketch_dim' must be a positive int, got {m!r}")

    @classmethod
    def key_codec(cls, config, dim, params=None):
        return ProdCodec(dim, config.bits, config.seed, config.options.get("sketch_dim"), params)

    @classmethod
    def value_codec(cls, config, dim, params=None):
        return MSECodec(dim, config.value_bits, config.seed + 1, params)
