"""`QuantizedEmbedding`: an embedding table stored with `QuantizedLinear`'s row codec.

The table E (vocab, dims) is coded like a linear layer's weight (each embedding vector
is a row: normalised, column-scaled, rotated, Lloyd-Max coded), so the tied output
layer, logits = h E^T, is exactly `QuantizedLinear`'s forward (`as_linear`). A lookup
decodes only the requested rows and undoes the rotation on them: e = c * (R^T w_hat),
with c the column scales (`QuantizedLinear.from_weight`, `column_alpha`).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from ..packing import unpack
from .linear import QuantizedLinear
from .rotation import StructuredRotation


class QuantizedEmbedding(QuantizedLinear):
    """nn.Embedding(num_embeddings, dims) over `bits`-bit codes; `as_linear` for tied heads."""

    def __init__(self, in_features: int, out_features: int, bits: int, *, codes: mx.array, scales: mx.array,
                 codebook: mx.array, rotation: StructuredRotation, bias: Optional[mx.array] = None,
                 input_scales: Optional[mx.array] = None, dtype=mx.float32):
        if bias is not None:
            raise ValueError("an embedding has no bias")
        super().__init__(in_features, out_features, bits, codes=codes, scales=scales, codebook=codebook,
                         rotation=rotation, input_scales=input_scales)
        self.dtype = dtype  # what lookups return: the float table's dtype

    @classmethod
    def from_embedding(cls, weight: mx.array, bits: int, seed: int = 0, group_size: Optional[int] = None,
                       stages: int = 2, column_alpha: float = 0.0) -> "QuantizedEmbedding":
        layer = cls.from_weight(weight, bits, seed=seed, group_size=group_size, stages=stages,
                                column_alpha=column_alpha)
        layer.dtype = weight.dtype
        return layer

    @property
    def num_embeddings(self) -> int:
        return self.out_features

    @property
    def dims(self) -> int:
        return self.in_features

    def lookup(self, ids: mx.array) -> mx.array:
        """The decoded embedding rows of `ids` (any shape) -> ids.shape + (dims,)."""
        flat = ids.reshape(-1)
        codes = unpack(mx.take(self.codes, flat, axis=0), self.bits, self.in_features)
        w = mx.take(self.codebook, codes)
        scales = mx.take(self.scales, flat, axis=0).astype(mx.float32)
        n, groups = flat.shape[0], scales.shape[1]
        w = (w.reshape(n, groups, self.in_features // groups) * scales[..., None]).reshape(n, self.in_features)
        w = self.rotation.apply_transpose(w)
        if "input_scales" in self:
            w = w * self.input_scales.astype(mx.float32)
        return w.astype(self.dtype).reshape(*ids.shape, self.in_features)

    def __call__(self, ids: mx.array) -> mx.array:
        return self.lookup(ids)

    def as_linear(self, x: mx.array) -> mx.array:
        """x E^T (a tied output layer), without decoding the table."""
        return QuantizedLinear.__call__(self, x)

    def _extra_repr(self) -> str:
        return (f"num_embeddings={self.out_features}, dims={self.in_features}, bits={self.bits}, "
                f"group_size={self.group_size}")
