"""One uint32 row per token and kv head for turboquant_mse keys and values.

    words [0, KW)             key codes   (D * key_bits, packed as in `packing.py`)
    words [KW, KW + VW)       value codes
    word  KW + VW             key norm (fp16, low half) | value norm (fp16, high half)

The codes and norms are exactly the codecs' fields, so this costs no bit: it
only puts them side by side, which lets a decode step store a token with one
`slice_update` instead of four. On MLX's CUDA back end every op of a decode step
costs ~10-25 us however small (docs/kernels.md), so the op count is what sets
decode speed at short context. `views` gives the codecs' fields back (for the
generic attention path, saving and trimming).
"""

from __future__ import annotations

from typing import Dict, Tuple

import mlx.core as mx

from ..packing import packed_words

Fields = Dict[str, mx.array]


class RowLayout:
    def __init__(self, key_codec, value_codec):
        self.key_codec, self.value_codec = key_codec, value_codec
        self.key_words = packed_words(key_codec.dim, key_codec.bits)
        self.value_words = packed_words(value_codec.dim, value_codec.bits)
        self.norm_word = self.key_words + self.value_words
        self.words = self.norm_word + 1

    def pack(self, key_fields: Fields, value_fields: Fields) -> mx.array:
        """The codecs' fields (..., n, KW), (..., n, 1) x 2 -> rows (..., n, W)."""
        norms = mx.concatenate([key_fields["norm"].astype(mx.float16), value_fields["norm"].astype(mx.float16)],
                               axis=-1).view(mx.uint32)
        return mx.concatenate([key_fields["codes"], value_fields["codes"], norms], axis=-1)

    def views(self, rows: mx.array) -> Tuple[Fields, Fields]:
        """(key fields, value fields) of `rows`, as the codecs' `encode` returns them."""
        kw, nw = self.key_words, self.norm_word
        norms = rows[..., nw : nw + 1].view(mx.float16)
        return ({"codes": rows[..., :kw], "norm": norms[..., 0:1]},
                {"codes": rows[..., kw:nw], "norm": norms[..., 1:2]})

    def encode(self, keys: mx.array, values: mx.array) -> mx.array:
        """Rows of new keys and values with the codecs' MLX ops (the kernels have their own)."""
        return self.pack(self.key_codec.encode(keys), self.value_codec.encode(values))


def supports(key_codec, value_codec) -> bool:
    """Both codecs turboquant_mse (one row of codes and a norm per token)."""
    from ..methods.turboquant_mse import MSECodec

    return type(key_codec) is MSECodec and type(value_codec) is MSECodec
