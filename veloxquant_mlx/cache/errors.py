"""What a compressed cache refuses: a saved file it cannot restore, inputs it cannot take."""

from __future__ import annotations


class CacheFormatError(ValueError):
    """A saved cache that cannot be restored (corrupted, truncated or foreign)."""


class CacheInputError(ValueError):
    """Keys, values, queries or a trim that this cache cannot take (named in the message)."""


FP16_MAX = 65504.0  # the window, sinks and the codes' scales are fp16 (or bf16 for bf16 models)
