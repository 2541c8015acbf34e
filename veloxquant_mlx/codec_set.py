"""The codecs shared by a model's layers (`CodecSet`), built from the config's seed or loaded
from an artifact dir, and the artifact dir's files (`save_artifact_dir`, `load_artifact_dir`).

`artifacts.py` writes the artifact dirs a model needs (`veloxquant precompute`); a config with
`artifact_dir=` loads them here instead of recomputing, bit for bit the same.
"""

from __future__ import annotations

import functools
import json
import threading
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Dict, Mapping, Optional, Tuple

import mlx.core as mx

from .checksums import checksums, metadata_digest, verify_checksums
from .config import KVCacheConfig
from .method_registry import get_method
from .methods.fp16 import Fp16Codec

# Below this head dim every method's codes cost at least the values' own fp16 bits (a vector's fp16
# norm or scale alone is 16 bits), so such heads are held in fp16.
MIN_CODED_DIM = 3
ARTIFACT_FORMAT = 2  # 2: every tensor and the metadata carry a CRC32 (`save_artifact_dir`)
ARTIFACT_JSON = "artifacts.json"
ARTIFACT_ARRAYS = "codecs.safetensors"


class ArtifactError(ValueError):
    """An artifact dir that does not fit the model or config it is used with, or is corrupted."""


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
        if dim < MIN_CODED_DIM:
            warnings.warn(f"veloxquant_mlx: {role} of head dim {dim} are held in fp16, not coded with "
                          f"{self.config.method}: below head dim {MIN_CODED_DIM} a code costs as many bits as the "
                          "values", stacklevel=4)
            return Fp16Codec(dim)
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
    return CodecSet(KVCacheConfig.from_json(config_json))


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
