"""Codecs shared by a model's layers, written for a model to an artifact dir.

`veloxquant precompute` writes every codebook and rotation a model's caches
need to `codecs.safetensors` + `artifacts.json`; a config with
`artifact_dir=` loads them instead of recomputing (`codec_set.py`), bit for bit the same.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import List, Optional, Tuple

import mlx.core as mx
import numpy as np

from .attention_hook import attention_cache, base_caches
from .checksums import checksums, metadata_digest, tensor_checksum, verify_checksums  # noqa: F401  (re-exported)
from .codec_set import (  # noqa: F401  (re-exported: where callers have always imported them)
    ARTIFACT_ARRAYS, ARTIFACT_FORMAT, ARTIFACT_JSON, ArtifactError, CodecSet, load_artifact_dir, load_artifacts,
    save_artifact_dir)


def layer_shapes(model) -> List[Tuple[int, int, int]]:
    """(kv_heads, key_dim, value_dim) of each attention layer (sliding-window ones included), read
    off a one-token forward; None for a layer without attention."""
    caches = base_caches(model)
    model(mx.array([[0]]), cache=caches)
    shapes = []
    for cache in caches:
        if attention_cache(cache) and cache.keys is not None:
            shapes.append((cache.keys.shape[1], cache.keys.shape[-1], cache.values.shape[-1]))
        else:
            shapes.append(None)
    return shapes


def model_identity(model) -> dict:
    """What names a model without running it (a saved cache records it): its type, layer
    count and a hash of its arguments."""
    args = getattr(model, "args", None)
    described = json.dumps(vars(args) if args is not None else {}, sort_keys=True, default=str)
    return {
        "model_type": getattr(args, "model_type", type(model).__module__),
        "num_layers": len(model.layers),
        "args_sha256": hashlib.sha256(described.encode()).hexdigest(),
    }


def weights_digest(model, samples: int = 4, elements: int = 4096) -> str:
    """SHA-256 of every parameter's name, dtype and shape (so the quantization, its bits and
    group size) and of the first `elements` values of `samples` parameters spread over the
    model: a 4-bit and a float copy of one model, or two fine-tunes of it, differ."""
    from mlx.utils import tree_flatten

    params = tree_flatten(model.parameters())
    digest = hashlib.sha256()
    for name, value in params:
        digest.update(f"{name}:{value.dtype}:{tuple(value.shape)};".encode())
    picks = sorted({round(i * (len(params) - 1) / max(samples - 1, 1)) for i in range(samples)}) if params else []
    for i in picks:
        value = params[i][1].reshape(-1)[:elements]
        digest.update(np.array(value.view(mx.uint8) if value.dtype == mx.bfloat16 else value).tobytes())
    return digest.hexdigest()


def cache_identity(model) -> dict:
    """What a saved cache records of its model: `model_identity` and its `weights_digest`."""
    return {**model_identity(model), "weights_sha256": weights_digest(model)}


def identity_difference(saved: dict, current: dict) -> str:
    """In words, how a saved cache's model identity differs from the loaded model's."""
    if saved.get("model_type") != current.get("model_type") or saved.get("num_layers") != current.get("num_layers"):
        return (f"a {saved.get('model_type')} of {saved.get('num_layers')} layers, not this "
                f"{current.get('model_type')} of {current.get('num_layers')} layers")
    if saved.get("args_sha256") != current.get("args_sha256"):
        return "a model of other arguments (e.g. another rope_theta or head count)"
    return "a model of other weights (another quantization, e.g. 4-bit against float, or another checkpoint)"


def model_fingerprint(model) -> dict:
    return {**model_identity(model), "layer_shapes": layer_shapes(model)}


def precompute(model, config, out_dir, layers: Optional[List[Optional[dict]]] = None,
               calibration: Optional[dict] = None) -> Path:
    """Write the codebooks and rotations `model`'s caches need under `config`. With `layers`
    (from `calibration.py`: per layer {"keys": params, "values": params} or None), each
    layer's params are stored under `layer.role.dim.` and `calibration` is recorded."""
    fingerprint = model_fingerprint(model)
    arrays, entries = {}, []
    dims = {("keys", s[1]) for s in fingerprint["layer_shapes"] if s} | {
        ("values", s[2]) for s in fingerprint["layer_shapes"] if s
    }
    if layers is not None:
        dims = set()
        for index, (shape, learned) in enumerate(zip(fingerprint["layer_shapes"], layers)):
            for role, dim in (("keys", shape[1]), ("values", shape[2])) if shape and learned else ():
                entries.append({"role": role, "dim": dim, "layer": index, "heads": shape[0]})
                for name, value in learned[role].items():
                    arrays[f"{index}.{role}.{dim}.{name}"] = value
    else:
        codecs = CodecSet(config.replace(artifact_dir=None))
    for role, dim in sorted(dims):
        entries.append({"role": role, "dim": dim})
        for name, value in codecs.get(role, dim).params().items():
            arrays[f"{role}.{dim}.{name}"] = value
    meta = {
        "config": json.loads(config.replace(artifact_dir=None).to_json()),
        "fingerprint": fingerprint,
        "codecs": entries,
    }
    if calibration is not None:
        meta["calibration"] = calibration
    return save_artifact_dir(out_dir, arrays, meta)
