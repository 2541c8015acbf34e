"""QJL: 1-bit quantized Johnson-Lindenstrauss keys (Zandieh et al., arXiv 2406.03482).

encode:  keys -> sign(S k) with S a seeded (m, d) N(0, 1) matrix (Def. 3.1), and ||k||;
store:   `signs` (m bits, packed) and `norm` (fp16) per token and head;
attend:  domain = the sketch space R^m, to_domain(q) = S q (the query is projected but
         not quantized: the asymmetric estimator), decode = ||k|| sqrt(pi/2)/m sign(S k), so
             score = ||k|| sqrt(pi/2)/m <S q, sign(S k)>,
         unbiased for <q, k> with Var = (pi/2 ||q||^2 ||k||^2 - <q, k>^2) / m (Lemma 3.2);
         from_domain(u) = S^T u.

Bits: m = bits * d signs (option `sketch_dim` overrides), so a key costs bits*d + 16 bits,
i.e. `bits` bits per coordinate plus the fp16 norm, comparable with the other methods'
`bits`. bits = 2 is the paper's main setting (m = 256 for d = 128); the paper needs
m >= d for useful scores, which bits >= 1 guarantees. Reconstructions S^T u are poor by
nature (E||k~ - k||^2 = ||k||^2 (pi d/2 - 1)/m); only the scores are accurate.

Values: per-token asymmetric integer groups at `value_bits` (KIVI's value codec, min/max
affine over groups of min(group_size, d) channels, fp16 scale and minimum per group, a
shorter last group allowed), as the QJL reference implementation quantizes values per token.
"""

import math

import mlx.core as mx
import numpy as np

from ..formats import Format, fp16, packed
from ..packing import pack, unpack
from ..rotations import gaussian_projection
from .base import Codec, Method, register_method
from .kivi import GroupAffineCodec


class QJLCodec(Codec):
    def __init__(self, dim: int, sketch_dim: int, seed: int, params=None):
        self.dim = dim
        if params:
            self.sketch = params["sketch"].astype(mx.float32)
            if self.sketch.shape != (sketch_dim, dim):
                raise ValueError(
                    f"stored sketch has shape {self.sketch.shape}, expected ({sketch_dim}, {dim})"
                )
        else:
            self.sketch = gaussian_projection(sketch_dim, dim, seed)
        self.sketch_dim = self.domain_dim = sketch_dim
        self.scale = math.sqrt(math.pi / 2) / sketch_dim  # QJL Def. 3.1 / Lemma 3.2
        self.format = Format("qjl", dim, sketch_dim, (packed("signs", sketch_dim, 1), fp16("norm")),
                             orthogonal_domain=False)

    def encode(self, x):
        x = x.astype(mx.float32)
        norm = mx.sqrt(mx.sum(x * x, axis=-1, keepdims=True))
        signs = (x @ self.sketch.T >= 0).astype(mx.uint8)
        return {"signs": pack(signs, 1), "norm": norm.astype(mx.float16)}

    def decode(self, fields):
        signs = unpack(fields["signs"], 1, self.sketch_dim).astype(mx.float32) * 2 - 1
        return signs * (fields["norm"].astype(mx.float32) * self.scale)

    def kernel_decode(self, a):
        """The dequant kernel's element j of the sketch domain: +-norm * sqrt(pi/2) / m."""
        return f"v = ({a.code('signs', 'j')} ? 1.0f : -1.0f) * {a.half('norm', '0')} * {self.scale!r}f;"

    def kernel_encode(self, e):
        """The encode kernel's element t (`kernels/encode.py`): the norm and sign(S x)."""
        sq = e.sum(f"{e.x} * {e.x}")
        e.sketch_signs("signs", np.array(self.sketch), e.x)
        e.half("norm", f"VQ_SQRT({sq})")

    def to_domain(self, x):
        return x @ self.sketch.T

    def from_domain(self, y):
        return y @ self.sketch

    def params(self):
        return {"sketch": self.sketch}


@register_method("qjl")
class QJL(Method):
    key_bits = range(1, 9)
    value_bits = range(1, 9)
    options = {"sketch_dim": int}
    summary = "1-bit JL sign sketch of keys (m = bits*d signs) + fp16 norm, unbiased scores"
    status = "experimental"
    status_note = "far too noisy on SmolLM2: much worse than turboquant_mse at the same bits"
    values_summary = "per-token min/max integer groups at value_bits (group_size channels)"

    @classmethod
    def validate(cls, config):
        super().validate(config)
        m = config.options.get("sketch_dim")
        if m is not None and (isinstance(m, bool) or m < 1):
            raise ValueError(f"qjl option 'sketch_dim' must be a positive int, got {m!r}")

    @classmethod
    def key_codec(cls, config, dim, params=None):
        m = config.options.get("sketch_dim") or config.bits * dim
        return QJLCodec(dim, m, config.seed, params)

    @classmethod
    def value_codec(cls, config, dim, params=None):
        return GroupAffineCodec(dim, config.value_bits, config.group_size, ragged=True)
