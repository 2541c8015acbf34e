"""Codecs shared by a model's layers, built fresh or loaded from an artifact dir.

`veloxquant precompute` writes every codebook and rotation a model's caches
need to `codecs.safetensors` + `artifacts.json`; a config with
`artifact_dir=` loads them instead of recomputing, bit for bit the same.
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple

import mlx.core as mx
import numpy as np

from .methods import get_method

ARTIFACT_FORMAT = 2  # 2: every tensor and the metadata carry a CRC32 (`save_artifact_dir`)
ARTIFACT_JSON = "artifacts.json"
ARTIFACT_ARRAYS = "codecs.safetensors"


class ArtifactError(ValueError):
    """An artifact dir that does not fit the model or config it is used with, or is corrupted."""


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


def save_artifact_dir(out_dir, arrays: Mapping[str, mx.array], meta: dict) -> Path:
    """Write an artifact dir: `arrays` to codecs.safetensors and `meta` (plus the format, each
    tensor's checksum and a digest of the whole) to artifacts.json. Every kind of artifact
    (precomputed codecs, calibrated ones) goes through here and `load_artifact_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / ARTIFACT_ARRAYS), dict(arrays))
    meta = {**meta, "format": ARTIFACT_FORMAT, "tensors": checksums(arrays)}
    meta["digest"] = metadata_digest(meta)
    (out / ARTIFACT_JSON).write_text(json.dumps(meta, indent=2))
    return out


def load_artifact_dir(root) -> Tuple[dict, Dict[str, mx.array]]:
    """(meta, arrays) of an artifact dir, every checksum verified; ArtifactError names what is wrong."""
    root = Path(root)
    try:
        meta = json.loads((root / ARTIFACT_JSON).read_text())
        arrays = mx.load(str(root / ARTIFACT_ARRAYS))
    except FileNotFoundError as error:
        raise ArtifactError(f"artifact dir {root} is incomplete: {error.filename} is missing") from None
    except (ValueError, RuntimeError, UnicodeDecodeError) as error:
        raise ArtifactError(f"artifact dir {root} is unreadable: {error}") from None
    if not isinstance(meta, dict):
        raise ArtifactError(f"artifact dir {root}: {ARTIFACT_JSON} is not a JSON object")
    if meta.get("format") != ARTIFACT_FORMAT:
        raise ArtifactError(f"artifact dir {root} has format {meta.get('format')!r}, expected {ARTIFACT_FORMAT}"
                            " (rewrite it with the current version)")
    if meta.get("digest") != metadata_digest(meta):
        raise ArtifactError(f"artifact dir {root}: {ARTIFACT_JSON} fails its digest: corrupted or edited")
    tensors = meta.get("tensors")
    if not isinstance(tensors, dict):
        raise ArtifactError(f"artifact dir {root}: {ARTIFACT_JSON} lists no tensor checksums")
    verify_checksums(arrays, tensors, f"artifact dir {root}", ArtifactError)
    return meta, arrays


class CodecSet:
    """The key and value codecs of one config, one per head dim, shared by all layers."""

    def __init__(self, config, params: Optional[Dict[tuple, dict]] = None, source: str = "",
                 layer: Optional[int] = None):
        self.config = config
        self._params = params
        self._source = source
        self._codecs = {}
        self._checksums = {}
        self._layer = layer  # calibrated artifacts hold params per layer: keys (role, dim, layer)
        self._layers: Dict[int, "CodecSet"] = {}
        # Caches of several threads share a CodecSet: one thread builds each codec, and its
        # arrays are evaluated before any other thread sees them (a lazy array made in one
        # thread names that thread's stream, which other threads do not have).
        self._lock = threading.Lock()

    @property
    def source(self) -> str:
        """The artifact dir the codecs came from ("" when built from the config's seed)."""
        return self._source

    @property
    def per_layer(self) -> bool:
        return self._params is not None and any(len(key) == 3 for key in self._params)

    def layer(self, index: int) -> "CodecSet":
        """The codecs of layer `index`: this set itself unless the artifact is per layer."""
        if not self.per_layer:
            return self
        with self._lock:  # one set per layer, so that caches built again get the same codec objects
            if index not in self._layers:
                self._layers[index] = CodecSet(self.config, self._params, self._source, layer=index)
            return self._layers[index]

    def _key(self, role: str, dim: int) -> tuple:
        if not self.per_layer:
            return (role, dim)
        if self._layer is None:
            raise ArtifactError(f"artifact dir {self._source} is calibrated per layer: build caches for "
                                f"a whole model (KVCacheBuilder(config).for_model(model)), not a lone cache")
        return (role, dim, self._layer)

    @classmethod
    def for_config(cls, config, fingerprint: Optional[dict] = None) -> "CodecSet":
        if config.artifact_dir is None:
            return _fresh_codec_set(config.to_json())
        return load_artifacts(config, fingerprint)

    def get(self, role: str, dim: int):
        key = self._key(role, dim)
        codec = self._codecs.get(key)
        if codec is not None:
            return codec
        with self._lock:
            if key not in self._codecs:
                self._codecs[key] = self._build(key)
        return self._codecs[key]

    def checksum(self, role: str, dim: int) -> str:
        """CRC32 of the codec's constant arrays: what a saved cache records, so that it is never
        read back with other codebooks or rotations than it was written with."""
        key = self._key(role, dim)
        if key not in self._checksums:
            params = self.get(role, dim).params()
            self._checksums[key] = metadata_digest(checksums(params))
        return self._checksums[key]

    def _build(self, key: tuple):
        role, dim = key[:2]
        params = None
        if self._params is not None:
            if key not in self._params:
                have = ", ".join(" ".join(map(str, k)) for k in sorted(self._params)[:6])
                raise ArtifactError(
                    f"artifact dir {self._source} has no {role} codec for head dim {dim}"
                    f"{'' if len(key) == 2 else f' in layer {self._layer}'} "
                    f"(it has: {have}...); rerun `veloxquant precompute` / `calibrate` for this model"
                )
            params = self._params[key]
        codec = get_method(self.config.method).codec(role, self.config, dim, params)
        mx.eval(_arrays_of(codec))
        return codec

    def overhead_bytes(self) -> int:
        """Bytes of the constant arrays (codebooks, rotations) shared by all layers."""
        return sum(a.nbytes for c in self._codecs.values() for a in c.params().values())


def _arrays_of(obj, seen=None) -> list:
    """Every mx.array a codec holds, in nested codecs and containers too (to evaluate them)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, mx.array):
        return [obj]
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("veloxquant_mlx"):
        items = list(vars(obj).values())
    else:
        return []
    return [a for item in items for a in _arrays_of(item, seen)]


@functools.lru_cache(maxsize=64)
def _fresh_codec_set(config_json: str) -> CodecSet:
    from .config import KVCacheConfig

    return CodecSet(KVCacheConfig.from_json(config_json))


def layer_shapes(model) -> List[Tuple[int, int, int]]:
    """(kv_heads, key_dim, value_dim) of each attention layer (sliding-window ones included), read
    off a one-token forward; None for a layer without attention."""
    from .calibration import attention_cache
    from .integration import base_caches

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


# Artifact dirs loaded in this process (`load_artifacts`), least recently used first.
_LOADED: "OrderedDict[tuple, CodecSet]" = OrderedDict()
_LOADED_MAX = 8
_LOADED_LOCK = threading.Lock()


def load_artifacts(config, fingerprint: Optional[dict] = None) -> CodecSet:
    """The codecs of `config.artifact_dir`, every check run on each load. Loads of the same dir
    whose metadata digest (which covers every tensor's checksum, all verified) is the one of an
    earlier load in this process, for the same config and model fingerprint, return that load's
    codecs. Caches built again from the same artifacts (a cache list per request, per benchmark
    run) then get the same codec objects, and so reuse the compiled steps, encoders and kernel
    programs keyed by codecs, instead of tracing and rendering them again and keeping the old
    ones in those caches."""
    root = Path(config.artifact_dir)
    digest, params = _load_artifacts(config, fingerprint)
    key = (str(root), digest, config.to_json(), json.dumps(fingerprint, sort_keys=True, default=str))
    with _LOADED_LOCK:
        if key not in _LOADED:
            _LOADED[key] = CodecSet(config, params, source=str(root))
            while len(_LOADED) > _LOADED_MAX:
                _LOADED.popitem(last=False)
        _LOADED.move_to_end(key)
        return _LOADED[key]


def _load_artifacts(config, fingerprint: Optional[dict] = None) -> Tuple[str, Dict[tuple, dict]]:
    """(metadata digest, params by (role, dim[, layer])) of a checked artifact dir."""
    from .config import KVCacheConfig

    root = Path(config.artifact_dir)
    meta, arrays = load_artifact_dir(root)
    try:
        made_for = KVCacheConfig(**meta["config"])
        entries = [dict(e, role=str(e["role"]), dim=int(e["dim"])) for e in meta["codecs"]]
    except Exception as error:
        raise ArtifactError(f"artifact dir {root} has an unusable description: {error}") from None
    # keyed on what the dir holds (codebooks, rotations): sinks, a window or centering may differ
    if made_for.codec_key() != config.codec_key():
        differ = [k for k, v in made_for.codec_key().items() if config.codec_key()[k] != v]
        raise ArtifactError(
            f"artifact dir {root} was made for {made_for.describe()} (seed {made_for.seed}), "
            f"not {config.describe()} (seed {config.seed}); its codecs differ in {', '.join(differ)}"
        )
    if fingerprint is not None:
        stored = meta["fingerprint"]
        stored["layer_shapes"] = [tuple(s) if s else None for s in stored["layer_shapes"]]
        if stored != fingerprint:
            diffs = [k for k in fingerprint if stored.get(k) != fingerprint[k]]
            raise ArtifactError(
                f"artifact dir {root} was made for another model ({stored['model_type']}, "
                f"{stored['num_layers']} layers); differs in: {', '.join(diffs)}"
            )
    params = {}
    for entry in entries:
        prefix = f"{entry['role']}.{entry['dim']}."
        key = (entry["role"], entry["dim"])
        if "layer" in entry:
            prefix, key = f"{entry['layer']}.{prefix}", key + (entry["layer"],)
        params[key] = {
            k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)
        }
        _check_layer_entry(root, entry, params[key], meta["fingerprint"])
    return meta["digest"], params


def _check_layer_entry(root, entry: dict, params: dict, fingerprint: dict) -> None:
    """A calibrated layer's arrays hold one slice per kv head of that layer (axis 0)."""
    if "layer" not in entry:
        return
    shapes = fingerprint["layer_shapes"]
    layer = entry["layer"]
    shape = shapes[layer] if 0 <= layer < len(shapes) else None
    if shape is None or shape[0] != entry["heads"] or entry["dim"] != shape[1 if entry["role"] == "keys" else 2]:
        raise ArtifactError(f"artifact dir {root}: layer {layer} {entry['role']} entry (heads {entry['heads']}, "
                            f"dim {entry['dim']}) does not match the model's layer shape {shape}")
    for name, value in params.items():
        if name.startswith(("heads.", "outliers.", "smooth.")) and value.shape[0] != entry["heads"]:
            raise ArtifactError(f"artifact dir {root}: layer {layer} {entry['role']} {name} has shape "
                                f"{value.shape}, expected {entry['heads']} heads first")
