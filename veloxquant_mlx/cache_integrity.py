"""Checksums carried by a compressed cache's own `state`, so that a saved layer is verified
whichever API wrote it: the library's `save_prompt_cache` or mlx-lm's.

`seal` lists every tensor of a layer (name, dtype, shape) in the header, which its digest
covers, and adds one more tensor, "checksums": per tensor, two 32-bit sums of its words, one
plain and one weighted by odd factors (2i + 1). An odd factor is invertible modulo 2^32, so a
change of one byte (or of any one word) always changes the weighted sum. The sums are MLX
operations, computed lazily with the rest of `state`: mlx-lm evaluates `state` after every
prefill chunk, and a host-side CRC there would read the whole cache on every chunk.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import zlib
from typing import Dict, List, Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

CHECKSUMS = "checksums"

# Within `saving_file()`, headers say the file holds a layer index (`integration.save_prompt_cache`):
# a file whose index key was damaged is then refused instead of loading as one written by mlx-lm.
_FILE_SAVE: contextvars.ContextVar = contextvars.ContextVar("veloxquant_file_save", default=False)
_LOADED: contextvars.ContextVar = contextvars.ContextVar("veloxquant_loaded_headers", default=None)


@contextlib.contextmanager
def saving_file():
    token = _FILE_SAVE.set(True)
    try:
        yield
    finally:
        _FILE_SAVE.reset(token)


@contextlib.contextmanager
def collecting_headers():
    """Within it, the verified header of every layer restored is appended to the list it yields."""
    headers: List[dict] = []
    token = _LOADED.set(headers)
    try:
        yield headers
    finally:
        _LOADED.reset(token)


def flat_tensors(arrays) -> Dict[str, mx.array]:
    """{"keys.codes": array, "window_keys": array, ...} of a layer's (nested) arrays."""
    flat = {}
    for name, value in (arrays or {}).items():
        if isinstance(value, dict):
            flat.update({f"{name}.{k}": v for k, v in value.items()})
        else:
            flat[name] = value
    return flat


def _words(x: mx.array) -> mx.array:
    flat = x.reshape(-1)
    if flat.nbytes % 4 == 0:
        return flat.view(mx.uint32)
    if flat.nbytes % 2 == 0:
        return flat.view(mx.uint16).astype(mx.uint32)
    return flat.view(mx.uint8).astype(mx.uint32)


def tensor_sums(x: mx.array) -> mx.array:
    """[plain sum, sum of word i times 2i + 1] of `x`'s words, modulo 2^32 (lazy)."""
    words = _words(x)
    odd = mx.arange(words.size, dtype=mx.uint32) * 2 + 1
    return mx.stack([mx.sum(words), mx.sum(words * odd)]).astype(mx.uint32)


def _sums(flat: Dict[str, mx.array]) -> mx.array:
    return mx.stack([tensor_sums(flat[name]) for name in sorted(flat)])


def _describe(x: mx.array) -> list:
    return [str(x.dtype), *x.shape]


def seal(header: dict, arrays: dict) -> None:
    """Record `arrays`' tensors in `header` and add their checksums to `arrays` (call before the
    header's digest is taken)."""
    flat = flat_tensors(arrays)
    header["tensors"] = {name: _describe(flat[name]) for name in sorted(flat)}
    if _FILE_SAVE.get():
        header["indexed"] = True
    if flat:
        arrays[CHECKSUMS] = _sums(flat)


def verify_sealed(header: dict, arrays: dict, where: str, error) -> dict:
    """`arrays` without their checksums, once verified: raise `error` naming the first tensor
    missing, unexpected, of another dtype or shape, or whose checksum differs."""
    listed = header.get("tensors")
    arrays = dict(arrays)
    stored = arrays.pop(CHECKSUMS, None)
    flat = flat_tensors(arrays)
    if not isinstance(listed, dict) or any(not isinstance(v, list) for v in listed.values()):
        raise error(f"{where}: the header lists no tensors with checksums")
    missing, extra = sorted(set(listed) - set(flat)), sorted(set(flat) - set(listed))
    if missing or extra:
        raise error(f"{where}: tensors {missing} are missing and {extra} unexpected")
    for name in sorted(flat):
        if _describe(flat[name]) != listed[name]:
            raise error(f"{where}: tensor {name!r} is {_describe(flat[name])}, the header says {listed[name]}")
    if flat:
        if not isinstance(stored, mx.array) or stored.shape != (len(flat), 2) or stored.dtype != mx.uint32:
            raise error(f"{where}: its checksums are missing or malformed")
        try:
            differs = (_sums(flat) != stored).any(axis=1).tolist()
        except Exception as problem:  # an unreadable tensor
            raise error(f"{where}: its tensors are unreadable ({problem})") from None
        for name, bad in zip(sorted(flat), differs):
            if bad:
                raise error(f"{where}: tensor {name!r} fails its checksum: corrupted")
    elif stored is not None:
        raise error(f"{where}: checksums of tensors it does not hold")
    collected: Optional[list] = _LOADED.get()
    if collected is not None:
        collected.append(header)
    return arrays


def flat_state(header: dict, arrays: dict, digest) -> list:
    """A sealed layer's `state` as mlx-lm lays its caches' out, arrays first: the tensors in the order
    `header["arrays"]` names them, then the header (with its digest, `digest(header)`) as JSON text."""
    flat = tree_flatten(arrays)
    header["arrays"] = [name for name, _ in flat]
    header["digest"] = digest(header)
    return [*(array for _, array in flat), json.dumps(header)]


def split_state(state) -> tuple:
    """(header text, arrays) of a layer's `state`: `flat_state`'s layout, or the [header, arrays] of format 3.
    Raises ValueError where neither fits."""
    if not isinstance(state, (list, tuple)) or not state:
        raise ValueError(f"a layer's state is a list, got {type(state).__name__}")
    if not isinstance(state[-1], str):
        header_text, arrays = state  # format 3: [header, arrays]
        return header_text, arrays
    header_text, values = state[-1], list(state[:-1])
    names = json.loads(header_text).get("arrays", [])
    if not isinstance(names, list) or len(names) != len(values):
        raise ValueError(f"the header names {names!r} for {len(values)} arrays")
    return header_text, tree_unflatten(list(zip(names, values))) if values else {}


def sealed_digest(state) -> str:
    """A digest of a sealed layer's `state` (`split_state`): its header's digest and checksums
    (the index a file keeps, so that swapped layers are refused)."""
    header_text, arrays = split_state(state)
    digest = json.loads(header_text)["digest"]
    stored = (arrays or {}).get(CHECKSUMS)
    sums = "" if stored is None else f"{zlib.crc32(np.array(stored).tobytes()):08x}"
    return f"{digest}:{sums}"


def header_digest(header: dict) -> str:
    """CRC32 of a header without its own "digest" key (canonical JSON: sorted keys)."""
    body = {k: v for k, v in header.items() if k != "digest"}
    return f"{zlib.crc32(json.dumps(body, sort_keys=True).encode()):08x}"
