"""Saving and restoring a compressed cache layer (`state`), with every check a saved file must pass.

A saved layer is its arrays then its header JSON, which names them (`cache_integrity.flat_state`: mlx-lm's
caches put their arrays first too). The header holds the format version, the full config, the
model identity and layer index (when the cache was made for a model), the checksums of the codecs'
constant arrays, every tensor's checksums (`cache_integrity`), and a digest of itself: a flipped,
truncated, swapped or edited file is refused with the layer and tensor named.
"""

from __future__ import annotations

import contextvars
import json

import mlx.core as mx

from ..cache_integrity import flat_state, seal, split_state, verify_sealed
from ..checksums import metadata_digest
from ..codec_set import CodecSet
from ..config import KVCacheConfig
from .errors import CacheFormatError

# 2: checksums, layer index, model identity; 3: checksums in `state` (cache_integrity); 4: arrays first, named by
# the header (3 is still read).
FORMAT_VERSION = 4
READABLE_VERSIONS = (3, 4)
_DENSE_STATE = ("sink_keys", "sink_values", "window_keys", "window_values", "key_mean", "value_mean")

# (config, codecs) of the caller of `integration.load_prompt_cache`, for the layers it restores.
_LOADING: contextvars.ContextVar = contextvars.ContextVar("veloxquant_loading", default=None)
_ON_LOAD: list = []


def register_on_load(action) -> None:
    """Run `action()` whenever a layer is restored by `from_state` (the attention hook, a higher layer,
    registers its installer here, so mlx-lm's load_prompt_cache then its generate work in a fresh process)."""
    if action not in _ON_LOAD:
        _ON_LOAD.append(action)


def run_on_load() -> None:
    for action in _ON_LOAD:
        action()


class CacheState:
    """`state` and `from_state` of a `CompressedKVCache` (its mixin)."""

    @property
    def state(self):
        if self.store is not None:
            self.flush()  # before counting: a token waiting for its attention call is held
        header = {
            "format": FORMAT_VERSION,
            "config": json.loads(self.config.to_json()),
            "offset": self.offset,
            "encoded": self.encoded,
            "layer": self.layer,
            "model": self.model_identity,
            "artifact": self.codecs.source,
        }
        arrays = {}
        if self.key_codec is not None:
            header.update(
                shape=[self.batch, self.kv_heads, self.key_dim, self.value_dim],
                window_dtype=str(self.window_dtype),
                tokens_per_row=self.tokens_per_row,
                mean_count=self.mean_count,
                codecs={"keys": self.codecs.checksum("keys", self.key_dim),
                        "values": self.codecs.checksum("values", self.value_dim)},
            )
            for group in ("keys", "values"):
                if self.encoded:
                    arrays[group] = self.store.fields(group, 0, self.encoded)
            for name in _DENSE_STATE:
                if getattr(self, name) is not None and getattr(self, name).shape[2]:
                    arrays[name] = getattr(self, name)
            if self.kept is not None:
                header["kept"], kept_arrays = self.kept.state()
                arrays.update(kept_arrays)
        seal(header, arrays)  # checksums in `state` itself: mlx-lm's save_prompt_cache is checked too
        return flat_state(header, arrays, metadata_digest)

    @state.setter
    def state(self, state):
        header, arrays = _read_state(state)
        where = "cache layer" if header.get("layer") is None else f"cache layer {header['layer']}"
        try:
            written_with = KVCacheConfig(**header["config"])
        except Exception as error:
            raise CacheFormatError(f"{where}: unusable config in the header ({error})") from None
        caller = _LOADING.get()
        if caller is not None:
            # The caller's config decides; the header only has to agree with it.
            config, codecs = caller
            if not written_with.same_encoding(config):
                raise CacheFormatError(f"{where} was written with {written_with.describe()}, "
                                       f"not {config.describe()}")
        else:
            # No config given: the codecs come from where the file says they did (the seed or
            # its artifact dir), and must match the checksums it recorded.
            config = written_with.replace(artifact_dir=header.get("artifact") or None)
            try:
                codecs = CodecSet.for_config(config)
            except ValueError as error:
                raise CacheFormatError(f"{where} was written with codecs from {config.artifact_dir}: {error}") from None
        arrays = verify_sealed(header, arrays, where, CacheFormatError)
        if codecs.per_layer:  # calibrated per layer: this layer's codecs
            if not isinstance(header.get("layer"), int):
                raise CacheFormatError(f"{where}: per-layer codecs, but the header names no layer")
            codecs = codecs.layer(header["layer"])
        self.__init__(config, codecs)
        self.layer, self.model_identity = header.get("layer"), header.get("model")
        if "shape" not in header:
            if header.get("offset") != 0:
                raise CacheFormatError(f"{where}: offset {header.get('offset')} without any stored token")
            return
        try:
            self.batch, self.kv_heads, self.key_dim, self.value_dim = (int(n) for n in header["shape"])
            dtype = {str(d): d for d in (mx.float16, mx.bfloat16, mx.float32)}[header["window_dtype"]]
            self.offset, encoded = int(header["offset"]), int(header["encoded"])
            mean_count = int(header.get("mean_count", 0))
            expected_codecs = dict(header["codecs"])
        except Exception as error:
            raise CacheFormatError(f"{where}: unusable header ({error!r})") from None
        self._setup(mx.zeros((self.batch, self.kv_heads, 0, self.key_dim), dtype=dtype),
                    mx.zeros((self.batch, self.kv_heads, 0, self.value_dim), dtype=dtype))
        for role, dim in (("keys", self.key_dim), ("values", self.value_dim)):
            if expected_codecs.get(role) != codecs.checksum(role, dim):
                source = f"artifact dir {codecs.source}" if codecs.source else f"seed {config.seed}"
                raise CacheFormatError(
                    f"{where}: the {role} codebooks/rotations differ from those it was written with "
                    f"(written from {header.get('artifact') or 'the seed'}; these come from {source})")
        if header.get("tokens_per_row") != self.tokens_per_row:
            raise CacheFormatError(f"corrupted {where}: tokens per row {header.get('tokens_per_row')} "
                                   f"!= the format's {self.tokens_per_row}")
        for name in _DENSE_STATE:
            if name in arrays:
                setattr(self, name, arrays[name])
        self.mean_count = mean_count if self.key_mean is not None else 0
        saved = {group: dict(arrays.get(group) or {}) for group in ("keys", "values")}
        problems = self._check_fields(saved, encoded)
        if self.kept is not None:
            if not isinstance(header.get("kept"), dict):
                raise CacheFormatError(f"{where}: keep_attended, but the header holds no kept tokens")
            problems += self.kept.load(header["kept"], arrays, (self.batch, self.kv_heads, self.key_dim,
                                                               self.value_dim), dtype, self.offset)
        if not problems:
            self.store.load(saved["keys"], saved["values"], encoded)
        self._check_restored(problems, where)

    def _check_fields(self, saved, encoded: int):
        """What does not fit the codecs' formats in saved fields of `encoded` tokens."""
        problems = []
        for group, codec in (("keys", self.key_codec), ("values", self.value_codec)):
            fields = saved[group]
            expected = {f.name: f for f in codec.format.fields}
            if encoded and set(fields) != set(expected):
                problems.append(f"{group} fields {sorted(fields)} != {sorted(expected)}")
                continue
            for name, buf in fields.items():
                f = expected.get(name)
                if f is None:
                    problems.append(f"{group} has no field {name!r}")
                    continue
                rows = -(-encoded // f.tokens_per_row)
                width = f.words if f.kind == "packed" else f.width
                if buf.shape != (self.batch, self.kv_heads, rows, width):
                    problems.append(f"{group}.{name} has shape {buf.shape}, expected "
                                    f"{(self.batch, self.kv_heads, rows, width)}")
        return problems

    def _check_restored(self, problems, where="cache layer"):
        if self.config.center and self.encoded and self.key_mean is None:
            problems.append("centered codes without their means")
        for name in _DENSE_STATE:
            arr = getattr(self, name)
            dim = self.key_dim if "key" in name else self.value_dim
            if arr is None:
                continue
            if arr.ndim != 4 or arr.shape[:2] != (self.batch, self.kv_heads) or arr.shape[3] != dim:
                problems.append(f"{name} has shape {arr.shape}")
            elif name.endswith("mean") and arr.shape[2] != 1:
                problems.append(f"{name} has shape {arr.shape}")
            elif not name.endswith("mean") and arr.dtype != self.window_dtype:
                problems.append(f"{name} has dtype {arr.dtype}, expected {self.window_dtype}")
        if not problems and self.sinks + self.encoded + self.window != self.offset:
            problems.append(
                f"sinks {self.sinks} + codes {self.encoded} + window {self.window} != offset {self.offset}"
            )
        if problems:
            raise CacheFormatError(f"corrupted {where}: " + "; ".join(problems))

    @classmethod
    def from_state(cls, state):
        cache = cls.__new__(cls)
        cache.state = state
        run_on_load()  # mlx-lm's load_prompt_cache, then its generate, in a fresh process
        return cache


def _read_state(state):
    """(header, arrays) of a saved layer, its header's digest verified."""
    try:
        header_text, arrays = split_state(state)
        header = json.loads(header_text)
        version = header["format"]
    except Exception as error:
        raise CacheFormatError(f"not a VeloxQuant cache layer (unreadable header: {error!r})") from None
    if version not in READABLE_VERSIONS:
        raise CacheFormatError(f"cache format {version!r} is not supported (this version reads "
                               f"{', '.join(map(str, READABLE_VERSIONS))}); save the cache again with this version")
    if header.get("digest") != metadata_digest(header):
        layer = header.get("layer")
        raise CacheFormatError(f"cache layer{'' if layer is None else f' {layer}'}: the header fails its digest "
                               "(corrupted or edited)")
    if arrays is None:
        arrays = {}
    if not isinstance(arrays, dict) or not all(isinstance(v, (dict, mx.array)) for v in arrays.values()):
        raise CacheFormatError("corrupted cache layer: its arrays are not a mapping of tensors")
    for value in arrays.values():
        if isinstance(value, dict) and not all(isinstance(v, mx.array) for v in value.values()):
            raise CacheFormatError("corrupted cache layer: its fields are not tensors")
    return header, arrays
