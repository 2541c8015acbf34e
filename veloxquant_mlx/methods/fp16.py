"""fp16 passthrough: the baseline every code path can be compared against."""

import mlx.core as mx

from ..formats import Format, fp16
from .base import Codec, Method, register_method


class Fp16Codec(Codec):
    def __init__(self, dim: int):
        self.dim = self.domain_dim = dim
        self.format = Format("fp16", dim, dim, (fp16("x", dim),))

    def encode(self, x):
        return {"x": x.astype(mx.float16)}

    def kernel_decode(self, a):
        return f"v = {a.half('x', 'j')};"

    def decode(self, fields):
        return fields["x"].astype(mx.float32)


@register_method("fp16")
class Fp16(Method):
    key_bits = range(16, 17)
    value_bits = range(16, 17)
    summary = "no compression (baseline)"
    status = "reference"
    status_note = "no compression: the comparison point inside the same code path"
    values_summary = "fp16"

    @classmethod
    def key_codec(cls, config, dim, params=None):
        return Fp16Codec(dim)

    value_codec = key_codec
