"""The reservoir: one flat file holding a quantized model's layers, loaded without recomputing.

Layout (little-endian):

    0   8 bytes   magic b"VQWRSV\\0\\1"
    8   uint32    format version
    12  uint32    header length h
    16  32 bytes  SHA-256 of the header
    48  h bytes   JSON header
    ... zero padding to a page boundary; then the data: every tensor of a page or more
              starts on a page boundary, smaller ones follow at 64-byte alignment.

The header names, for each layer path, its shape, bits, rotation blocks and every
tensor's dtype, shape, byte offset and length, plus the model fingerprint
(`model.fingerprint`) and the CRC-32 of each tensor's bytes. Version 2 adds norms that
rotate the input of the layers after them (`shared.RotatingRMSNorm`, kind
"rotating_norm": the norm's weight, its folded weight, the shared rotation and input
scales); a layer fed by one names it ("rotated_by") and stores no rotation of its own.
Version 1 files (no shared rotations) still load. Codes, scales,
codebooks and rotation signs/permutations are stored as they are in memory, so
loading is reading bytes into arrays: no codebook is solved, no rotation is
drawn. Rotations are O(n) numbers (`rotation.py`), so no dense rotation matrix is
stored or rebuilt (the published `persist_rotation` has nothing left to persist).
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import struct
import zlib
from pathlib import Path
from typing import Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

from .affine import GroupAffineLinear
from .embedding import QuantizedEmbedding
from .linear import QuantizedLinear
from .model import fingerprint, link_decode_paths, quantized_layers
from .rotation import StructuredRotation
from .shared import RotatingRMSNorm, rotating_norms

MAGIC = b"VQWRSV\x00\x01"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
PAGE = 4096
SMALL_ALIGN = 64
_PREFIX = struct.Struct("<8sII32s")

_NUMPY = {"uint32": np.uint32, "int8": np.int8, "float16": np.float16, "float32": np.float32,
          "uint16": np.uint16, "bfloat16": np.uint16}
_MLX = {"uint32": mx.uint32, "int8": mx.int8, "float16": mx.float16, "float32": mx.float32,
        "uint16": mx.uint16, "bfloat16": mx.bfloat16}

_MLX_NAMES = {dtype: name for name, dtype in _MLX.items()}
# A layer entry's "kind" (absent in files written before embeddings: linear).
_KINDS = {"linear": QuantizedLinear, "embedding": QuantizedEmbedding}


class ReservoirError(ValueError):
    """A reservoir that cannot be used: truncated, corrupted, another format or model."""


def _dtype_name(a: mx.array) -> str:
    for name, dtype in _MLX.items():
        if a.dtype == dtype:
            return name
    raise ReservoirError(f"cannot store dtype {a.dtype}")


def _raw(a: mx.array) -> bytes:
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.ascontiguousarray(np.array(a)).tobytes()


def _align(n: int) -> int:
    return -(-n // PAGE) * PAGE


def _layer_tensors(layer: QuantizedLinear) -> Dict[str, mx.array]:
    tensors = {"codes": layer.codes, "scales": layer.scales, "codebook": layer.codebook}
    if not layer.input_rotated:
        tensors.update(_rotation_tensors(layer.rotation))
    for optional in ("input_scales", "bias"):
        if optional in layer:
            tensors[optional] = layer[optional]
    return tensors


def _rotation_tensors(rotation: StructuredRotation) -> Dict[str, mx.array]:
    return {"rotation." + key: value for key, value in rotation.state().items()}


def _norm_tensors(norm: RotatingRMSNorm) -> Dict[str, mx.array]:
    tensors = {"weight": norm.weight, "folded_weight": norm.folded_weight, **_rotation_tensors(norm.rotation)}
    if "input_scales" in norm:
        tensors["input_scales"] = norm.input_scales
    return tensors


def save_reservoir(model: nn.Module, path, meta: Optional[dict] = None) -> Path:
    """Write every `QuantizedLinear`, `QuantizedEmbedding` and `GroupAffineLinear` of `model` to one
    reservoir file at `path`."""
    layers = quantized_layers(model)
    affine = [(path, m) for path, m in model.named_modules() if isinstance(m, GroupAffineLinear)]
    if not layers and not affine:
        raise ValueError("the model has no QuantizedLinear layers: run quantize_model first")
    norms = rotating_norms(model)
    norm_of_rotation = {id(norm.rotation): name for name, norm in norms}
    entries, pieces = {}, []
    for name, norm in norms:
        entries[name] = {"kind": "rotating_norm", "dim": norm.weight.shape[0], "eps": norm.eps,
                         "offset": norm.offset, "rotation": norm.rotation.meta(), "tensors": {}}
        for key, value in _norm_tensors(norm).items():
            pieces.append((name, key, value, _raw(value)))
    for name, layer in layers:
        entries[name] = {"in_features": layer.in_features, "out_features": layer.out_features,
                         "bits": layer.bits, "rotation": layer.rotation.meta(), "tensors": {}}
        if layer.input_rotated:
            if id(layer.rotation) not in norm_of_rotation:
                raise ValueError(f"{name} takes a rotated input, but no RotatingRMSNorm of the model rotates it")
            entries[name]["rotated_by"] = norm_of_rotation[id(layer.rotation)]
        if isinstance(layer, QuantizedEmbedding):
            entries[name]["kind"] = "embedding"
            entries[name]["dtype"] = _MLX_NAMES[layer.dtype]
        for key, value in _layer_tensors(layer).items():
            pieces.append((name, key, value, _raw(value)))
    for name, layer in affine:
        entries[name] = {"kind": "group_affine", "in_features": layer.in_features, "out_features": layer.out_features,
                         "bits": layer.bits, "group_size": layer.group_size, "scale_bits": layer.scale_bits,
                         "center_bits": layer.center_bits, "tensors": {}}
        tensors = {"codes": layer.codes, "scale_codes": layer.scale_codes, "center_codes": layer.center_codes,
                   "row_ranges": layer.row_ranges, **({"bias": layer.bias} if "bias" in layer else {})}
        for key, value in tensors.items():
            pieces.append((name, key, value, _raw(value)))
    # Tensors of a page or more start on a page (they come first); the small ones (scales,
    # codebooks, rotation signs, ...) follow, packed at SMALL_ALIGN, so padding stays small.
    pieces.sort(key=lambda p: len(p[3]) < PAGE)
    blobs, offset = [], 0
    for name, key, value, data in pieces:
        offset = _align(offset) if len(data) >= PAGE else -(-offset // SMALL_ALIGN) * SMALL_ALIGN
        entries[name]["tensors"][key] = {"dtype": _dtype_name(value), "shape": list(value.shape), "offset": offset,
                                         "nbytes": len(data), "crc32": zlib.crc32(data)}
        blobs.append((offset, data))
        offset += len(data)
    header = {"format_version": FORMAT_VERSION, "fingerprint": fingerprint(model), "meta": meta or {},
              "data_bytes": offset, "layers": entries}
    text = json.dumps(header, sort_keys=True).encode()
    data_start = _align(_PREFIX.size + len(text))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(_PREFIX.pack(MAGIC, FORMAT_VERSION, len(text), hashlib.sha256(text).digest()))
        f.write(text)
        for start, data in blobs:
            f.seek(data_start + start)
            f.write(data)
        f.truncate(data_start + offset)
    os.replace(tmp, path)
    return path


def read_header(path) -> Tuple[dict, int]:
    """(header, data start) of a reservoir, after checking magic, version, header checksum and size."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(_PREFIX.size)
        if len(prefix) < _PREFIX.size:
            raise ReservoirError(f"{path}: truncated ({size} bytes, not even the {_PREFIX.size}-byte prefix)")
        magic, version, length, digest = _PREFIX.unpack(prefix)
        if magic != MAGIC:
            raise ReservoirError(f"{path}: not a VeloxQuant weight reservoir (bad magic {magic!r})")
        if version not in READABLE_VERSIONS:
            raise ReservoirError(f"{path}: reservoir format version {version}; this VeloxQuant reads versions "
                                 f"{', '.join(map(str, READABLE_VERSIONS))}: quantize the model again with the "
                                 "VeloxQuant that reads it")
        text = f.read(length)
    if len(text) < length:
        raise ReservoirError(f"{path}: truncated inside the header ({size} bytes)")
    if hashlib.sha256(text).digest() != digest:
        raise ReservoirError(f"{path}: header corrupted (SHA-256 mismatch)")
    try:
        header = json.loads(text)
        _check_tensor_entries(header)
    except ReservoirError as error:
        raise ReservoirError(f"{path}: {error}") from None
    except (ValueError, TypeError, KeyError, AttributeError) as error:
        raise ReservoirError(f"{path}: unusable header ({error!r})") from None
    data_start = _align(_PREFIX.size + length)
    expected = data_start + header["data_bytes"]
    if size < expected:
        raise ReservoirError(f"{path}: truncated: {size} bytes, the header describes {expected}")
    return header, data_start


def _check_tensor_entries(header: dict) -> None:
    """Every tensor's dtype, shape, size and place must fit the data the header describes (a
    header with a 2^60-element shape is refused here, not in NumPy)."""
    data_bytes = header["data_bytes"]
    if not isinstance(data_bytes, int) or data_bytes < 0:
        raise ReservoirError(f"data size {data_bytes!r} is not a byte count")
    for name, entry in header["layers"].items():
        for key, t in entry["tensors"].items():
            shape, offset, nbytes = t["shape"], t["offset"], t["nbytes"]
            if t["dtype"] not in _NUMPY or not isinstance(shape, list) or not all(
                    isinstance(n, int) and n >= 0 for n in shape):
                raise ReservoirError(f"tensor {name}.{key}: unusable dtype {t['dtype']!r} or shape {shape!r}")
            if not (isinstance(offset, int) and isinstance(nbytes, int) and 0 <= offset <= offset + nbytes <= data_bytes):
                raise ReservoirError(f"tensor {name}.{key}: bytes {offset}..+{nbytes} outside the {data_bytes}-byte data")
            if math.prod(shape) * np.dtype(_NUMPY[t["dtype"]]).itemsize != nbytes:
                raise ReservoirError(f"tensor {name}.{key}: shape {shape} of {t['dtype']} is not {nbytes} bytes")


def load_reservoir(path, verify: bool = True) -> Tuple[Dict[str, nn.Module], dict]:
    """The layers (and rotating norms) of a reservoir by path, and its header. `verify` checks
    every tensor's CRC-32.

    The bytes are copied into MLX buffers: MLX 0.32.4 has no zero-copy path from a file
    mapping on the CPU (`mx.array`, `mx.asarray` and `mx.from_dlpack` of a NumPy view all copy),
    so processes do not share these pages.
    """
    try:
        return _load_reservoir(path, verify)
    except ReservoirError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError) as error:
        raise ReservoirError(f"{path}: unusable layer description ({error!r})") from None


def _load_reservoir(path, verify: bool) -> Tuple[Dict[str, nn.Module], dict]:
    header, data_start = read_header(path)
    tensors = {}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        for name, entry in header["layers"].items():
            arrays = tensors[name] = {}
            for key, t in entry["tensors"].items():
                start = data_start + t["offset"]
                with memoryview(mm)[start:start + t["nbytes"]] as view:
                    if verify and zlib.crc32(view) != t["crc32"]:
                        raise ReservoirError(f"{path}: data corrupted in {name}.{key} (CRC-32 mismatch)")
                    host = np.frombuffer(view, dtype=_NUMPY[t["dtype"]]).reshape(t["shape"])
                    array = mx.array(host)  # copies, so the mapping can close
                    del host
                if t["dtype"] == "bfloat16":
                    array = array.view(mx.bfloat16)
                arrays[key] = array
    layers = {}
    # norms first: the layers they feed take their rotation and input scales
    for name, entry in sorted(header["layers"].items(), key=lambda kv: kv[1].get("kind") != "rotating_norm"):
        arrays = tensors.pop(name)
        kind = entry.get("kind", "linear")
        if kind == "rotating_norm":
            layers[name] = RotatingRMSNorm(arrays["weight"], entry["eps"], _rotation(arrays, entry["rotation"]),
                                           arrays.get("input_scales"), entry["offset"],
                                           folded_weight=arrays["folded_weight"])
            continue
        if kind == "group_affine":
            layers[name] = GroupAffineLinear(entry["in_features"], entry["out_features"], entry["bits"],
                                             codes=arrays["codes"], scale_codes=arrays["scale_codes"],
                                             center_codes=arrays["center_codes"], row_ranges=arrays["row_ranges"],
                                             group_size=entry["group_size"], scale_bits=entry["scale_bits"],
                                             center_bits=entry["center_bits"], bias=arrays.get("bias"))
            continue
        if kind not in _KINDS:
            raise ReservoirError(f"{path}: layer {name} is of unknown kind {kind!r}")
        extra = {"dtype": _MLX[entry["dtype"]]} if kind == "embedding" else {}
        if "rotated_by" in entry:
            norm = layers.get(entry["rotated_by"])
            if not isinstance(norm, RotatingRMSNorm):
                raise ReservoirError(f"{path}: layer {name} is fed by {entry['rotated_by']!r}, which the file lacks")
            rotation, input_scales = norm.rotation, norm.column_scales
            extra["input_rotated"] = True
        else:
            rotation, input_scales = _rotation(arrays, entry["rotation"]), arrays.get("input_scales")
        layers[name] = _KINDS[kind](entry["in_features"], entry["out_features"], entry["bits"],
                                    codes=arrays["codes"], scales=arrays["scales"], codebook=arrays["codebook"],
                                    rotation=rotation, bias=arrays.get("bias"), input_scales=input_scales, **extra)
    return layers, header


def _rotation(arrays: Dict[str, mx.array], meta: dict) -> StructuredRotation:
    return StructuredRotation.from_state({"signs": arrays["rotation.signs"], "perms": arrays.get("rotation.perms")},
                                         meta)


def graft_reservoir(model: nn.Module, path, verify: bool = True) -> nn.Module:
    """Put a reservoir's layers into `model` (the unquantized model it was made from), in place."""
    header, _ = read_header(path)
    have = fingerprint(model)
    if header["fingerprint"] != have:
        raise ReservoirError(f"{path}: written for another model (fingerprint {header['fingerprint'][:12]}, "
                             f"this model's is {have[:12]})")
    modules = dict(model.named_modules())
    missing = [name for name in header["layers"] if name not in modules]
    if missing:
        raise ReservoirError(f"{path}: layers {missing[:3]} are not in this model")
    layers, _ = load_reservoir(path, verify=verify)
    del modules
    model.update_modules(tree_unflatten(list(layers.items())))
    return link_decode_paths(model)
