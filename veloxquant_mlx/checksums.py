"""CRC32 checksums of tensors and JSON documents: what artifact dirs and saved caches record, so
that they are never read back corrupted or with other arrays than they were written with."""

from __future__ import annotations

import json
import zlib
from typing import Dict, Mapping

import mlx.core as mx
import numpy as np


def tensor_checksum(array: mx.array) -> str:
    """CRC32 (zlib) of an array's dtype, shape and bytes, as 8 hex digits. The dtype and shape
    are included so that a header edit reinterpreting the same bytes is caught too."""
    data = np.ascontiguousarray(np.array(array.astype(mx.float32) if array.dtype == mx.bfloat16 else array))
    crc = zlib.crc32(f"{array.dtype}{tuple(array.shape)}".encode())
    return f"{zlib.crc32(data.tobytes(), crc):08x}"


def checksums(arrays: Mapping[str, mx.array]) -> Dict[str, str]:
    return {name: tensor_checksum(arrays[name]) for name in sorted(arrays)}


def metadata_digest(meta: Mapping) -> str:
    """CRC32 of a JSON document without its own "digest" key (canonical: sorted keys)."""
    body = {k: v for k, v in meta.items() if k != "digest"}
    return f"{zlib.crc32(json.dumps(body, sort_keys=True).encode()):08x}"


def verify_checksums(arrays: Mapping[str, mx.array], expected: Mapping[str, str], where: str,
                     error=ValueError) -> None:
    """Raise `error` naming the first tensor that is missing, unexpected or whose checksum differs."""
    missing = sorted(set(expected) - set(arrays))
    extra = sorted(set(arrays) - set(expected))
    if missing or extra:
        raise error(f"{where}: tensors {missing} are missing and {extra} unexpected")
    for name in sorted(expected):
        try:
            got = tensor_checksum(arrays[name])
        except Exception as problem:  # an unreadable tensor
            raise error(f"{where}: tensor {name!r} is unreadable ({problem})") from None
        if got != expected[name]:
            raise error(f"{where}: tensor {name!r} fails its checksum ({got} != {expected[name]}): corrupted")
