"""Plugging compressed caches into mlx-lm: one cache per attention layer (`KVCacheBuilder`,
`compressed_caches`), patching a model, and prompt cache files. The attention hook that routes
mlx-lm's shared attention to these caches is `attention_hook.py`.
"""

from __future__ import annotations

import json
import warnings
from typing import List, Optional

import mlx.core as mx
import mlx_lm.models.cache as mlx_cache

from .artifacts import CodecSet, cache_identity, checksums, identity_difference, metadata_digest
from .attention_hook import (  # noqa: F401  (re-exported)
    KEY_TRANSFORMING_MODELS, _original_sdpa, attention_cache, base_caches, fetches_decoded, install_attention_hook,
    scaled_dot_product_attention, single_attention_member, uses_latent_attention)
from .settings import EngineSettings
from .calibration import AUTO, ensure_calibrated
from .cache import _LOADING, CacheFormatError, CompressedKVCache
from .cache.latent import CompressedLatentCache
from .cache_integrity import collecting_headers, saving_file, sealed_digest
from .config import KVCacheConfig, follow_bits
from .errors import UnsupportedModelError
from .methods import get_method
from .rotating import CompressedRotatingKVCache
from .sharding import codecs_for_model, mark_pipeline_tail, refuse_first_use_calibration


def compressed_caches(model, config: KVCacheConfig, codecs: Optional[CodecSet] = None,
                      settings: Optional[EngineSettings] = None, max_kv_size: Optional[int] = None,
                      tokenizer=None) -> list:
    """One compressed cache per attention layer (a `CompressedRotatingKVCache` where the model
    asks for mlx-lm's sliding-window `RotatingKVCache`, with its max_size and keep); `settings`
    (default: resolved now, once for every layer) choose the back end and attention paths.
    `max_kv_size`: as mlx-lm's `make_prompt_cache`, full-attention layers keep only the last
    `max_kv_size` tokens (and the first 4) in a rotating cache. `tokenizer`: for a config with
    `artifact_dir="auto"` that this model has not been calibrated for yet (`ensure_calibrated`)."""
    base = base_caches(model)
    own = sorted({type(cache).__name__ for cache in base if type(cache).__module__ != mlx_cache.__name__})
    if own == ["LayerCache"] and type(model).__module__ == "mlx_lm.models.deepseek_v41":
        return _microscaled_layer_caches(base, config)
    if own:
        raise UnsupportedModelError(
            f"{type(model).__module__} keeps its layers in its own cache class ({', '.join(own)}), not mlx-lm's, "
            "which VeloxQuant cannot replace")
    latent = uses_latent_attention(model)
    sparse_indexer = latent and any(hasattr(m, "indexer") for m in model.modules())
    if not latent and not any(attention_cache(cache) or single_attention_member(cache) is not None for cache in base):
        # No attention layer (Mamba 2): nothing to compress, and no attention to route; the model runs as it is.
        install_attention_hook()
        _warn_kept([f"{i}:{type(cache).__name__}" for i, cache in enumerate(base)])
        return base
    install_attention_hook(model)
    get_method(config.method).check_model(model)
    refuse_first_use_calibration(config, model)
    config = ensure_calibrated(config, model, tokenizer)
    codecs = codecs or codecs_for_model(config, model)
    settings = settings or EngineSettings.resolve()
    caches, kept = [], []
    identity = cache_identity(model)
    decoded = fetches_decoded(model)

    def compressed(cache, i: int):
        if type(cache) is mlx_cache.KVCache and max_kv_size is not None:
            cache = mlx_cache.RotatingKVCache(max_size=max_kv_size, keep=4)
        if type(cache) is mlx_cache.KVCache:
            made = CompressedKVCache(config, codecs.layer(i), settings)
            made.layer, made.model_identity, made.fetch_decoded = i, identity, decoded
            return made
        rotating = CompressedRotatingKVCache(config, cache.max_size, cache.keep, codecs.layer(i), settings)
        rotating.inner.layer, rotating.inner.model_identity, rotating.inner.fetch_decoded = i, identity, decoded
        return rotating

    for i, cache in enumerate(base):
        if latent and type(cache) is mlx_cache.KVCache and max_kv_size is None:
            caches.append(CompressedLatentCache(config))
            continue
        if latent and max_kv_size is None and sparse_indexer and type(cache) is mlx_cache.CacheList \
                and [type(c) for c in cache.caches] == [mlx_cache.KVCache, mlx_cache.KVCache]:
            # DeepSeek-V3.2's sparse attention: the latent, then the indexer's keys, which stay as they are.
            caches.append(mlx_cache.CacheList(CompressedLatentCache(config), cache.caches[1]))
            kept.append(f"{i}:indexer KVCache")
            continue
        if latent and not isinstance(cache, mlx_cache.ArraysCache):
            raise UnsupportedModelError(
                f"{type(model).__module__} caches an MLA latent, and its layer {i} "
                + ("keeps it in a rotating cache (max_kv_size), which the latent cache does not do"
                   if max_kv_size is not None else
                   f"holds a {type(cache).__name__}, which VeloxQuant's latent cache does not replace"))
        if attention_cache(cache):
            caches.append(compressed(cache, i))
        elif single_attention_member(cache) is not None:
            # A hybrid layer's CacheList (Falcon-H1, Baichuan-M1: a state cache and an attention cache).
            members = list(cache.caches)
            at = single_attention_member(cache)
            members[at] = compressed(members[at], i)
            caches.append(mlx_cache.CacheList(*members))
            others = [type(c).__name__ for j, c in enumerate(members) if j != at]
            if others:
                kept.append(f"{i}:{'+'.join(others)}")
        elif not hasattr(cache, "update_and_fetch"):
            caches.append(cache)
            kept.append(f"{i}:{type(cache).__name__}")
        else:
            raise UnsupportedModelError(
                f"layer {i} uses {type(cache).__name__}, which VeloxQuant cannot replace"
            )
    _warn_kept(kept)
    return mark_pipeline_tail(model, caches)


def _microscaled_layer_caches(base: list, config: KVCacheConfig) -> list:
    """DeepSeek-V4.1 rounds its own cache to FP8 and FP4; its layers keep exactly those values in MLX's
    microscaling formats (`cache/microscaled_layer.py`), whatever the spec."""
    from .cache.microscaled_layer import MicroscaledLayerCache

    warnings.warn(
        f"mlx_lm.models.deepseek_v41 rounds its own cache (an FP8 window, FP4 key groups): VeloxQuant stores "
        f"those values exactly in MLX's mxfp8/mxfp4 formats instead of the spec's codes ({config.method} at "
        f"{config.bits} bits does not apply)", stacklevel=3)
    return [MicroscaledLayerCache(cache.window_size) for cache in base]


def _warn_kept(kept: List[str]) -> None:
    if kept:
        warnings.warn(
            f"{len(kept)} layer(s) keep their own non-attention cache uncompressed: "
            + ", ".join(kept[:8])
            + (" ..." if len(kept) > 8 else ""),
            stacklevel=4,
        )


def patch_model(model, config: KVCacheConfig, settings: Optional[EngineSettings] = None, tokenizer=None,
                max_kv_size: Optional[int] = None):
    """Make `model.make_cache()` (and so plain `mlx_lm.generate`) return fresh compressed caches
    (`max_kv_size`: as `compressed_caches`)."""
    get_method(config.method).check_model(model)
    refuse_first_use_calibration(config, model)
    config = ensure_calibrated(config, model, tokenizer)
    codecs = codecs_for_model(config, model)
    compressed_caches(model, config, codecs, settings, max_kv_size)  # fail now, not at the first generate
    model.make_cache = lambda: compressed_caches(model, config, codecs, settings, max_kv_size)
    return model


def unpatch_model(model):
    if "make_cache" in vars(model):
        del model.make_cache
    return model


class SingleHeadCache:
    """One head's compressed cache: `append(k, v)`, `attend(q)`, `memory_bytes()`, `len()`."""

    def __init__(self, config: KVCacheConfig, head_dim: int):
        self.head_dim = head_dim
        self.cache = CompressedKVCache(config)
        install_attention_hook()

    @staticmethod
    def _as_4d(x: mx.array) -> mx.array:
        x = mx.array(x)
        return x.reshape(1, 1, -1, x.shape[-1])

    def append(self, keys, values) -> None:
        keys, values = self._as_4d(keys), self._as_4d(values)
        if keys.shape[-1] != self.head_dim:
            raise ValueError(f"expected head dim {self.head_dim}, got {keys.shape[-1]}")
        self.cache.update_and_fetch(keys, values)

    def attend(self, queries, scale: Optional[float] = None, causal: bool = False) -> mx.array:
        """Softmax attention of queries (D,) or (L, D) over every appended token."""
        q = mx.array(queries)
        single = q.ndim == 1
        q4 = self._as_4d(q)
        scale = self.head_dim**-0.5 if scale is None else scale
        out = self.cache.attend(q4, scale=scale, mask="causal" if causal else None)
        out = out.reshape(-1, out.shape[-1])
        return out[0] if single else out

    def memory_bytes(self) -> int:
        return self.cache.nbytes

    def __len__(self) -> int:
        return self.cache.offset


class KVCacheBuilder:
    """Builds caches from a config, for a whole model or for a single head.

        KVCacheBuilder(config).for_model(model).build()       # list for prompt_cache=
        KVCacheBuilder().with_method("turboquant_prod").with_head_dim(128) \\
            .with_bit_width(inlier=4).with_seed(42).build()   # SingleHeadCache
    """

    def __init__(self, config: Optional[KVCacheConfig] = None, **changes):
        if config is not None and not isinstance(config, KVCacheConfig):
            raise TypeError(f"KVCacheBuilder takes a KVCacheConfig, got {type(config).__name__}")
        self._fields = dict(vars(config)) if config is not None else {}
        self._fields.update(follow_bits(self._fields, changes))
        self._model = self._tokenizer = None
        self._head_dim = None

    def _with(self, **changes) -> "KVCacheBuilder":
        builder = KVCacheBuilder(**{**self._fields, **follow_bits(self._fields, changes)})
        builder._model, builder._tokenizer, builder._head_dim = self._model, self._tokenizer, self._head_dim
        return builder

    def with_method(self, method: str):
        return self._with(method=method)

    def with_bit_width(self, inlier: Optional[int] = None, values: Optional[int] = None):
        changes = {}
        if inlier is not None:
            changes["bits"] = inlier
        if values is not None:
            changes["value_bits"] = values
        return self._with(**changes)

    def with_seed(self, seed: int):
        return self._with(seed=seed)

    def with_options(self, **options):
        return self._with(options={**(self._fields.get("options") or {}), **options})

    def with_head_dim(self, head_dim: int):
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
            raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
        builder = self._with()
        builder._head_dim = head_dim
        return builder

    def for_model(self, model, tokenizer=None):
        """`tokenizer`: needed once per model by a config that calibrates on first use
        (`artifact_dir="auto"`)."""
        if not hasattr(model, "layers"):
            raise TypeError(f"for_model expects an mlx-lm model (with .layers), got {type(model).__name__}")
        builder = self._with()
        builder._model, builder._tokenizer = model, tokenizer
        return builder

    def config(self) -> KVCacheConfig:
        return KVCacheConfig(**self._fields)

    def build(self, settings: Optional[EngineSettings] = None, max_kv_size: Optional[int] = None):
        """The caches; `settings` override the engine's (`settings.EngineSettings`); `max_kv_size`
        as in `compressed_caches`."""
        config = self.config()
        if self._model is not None:
            return compressed_caches(self._model, config, settings=settings, max_kv_size=max_kv_size,
                                     tokenizer=self._tokenizer)
        if self._head_dim is not None:
            return SingleHeadCache(config, self._head_dim)
        raise ValueError("call for_model(model) or with_head_dim(d) before build()")


def make_prompt_cache(model, config: KVCacheConfig) -> List[CompressedKVCache]:
    return KVCacheBuilder(config).for_model(model).build()


INDEX_KEY = "veloxquant_index"  # file metadata: each layer's digest in order, and the metadata's (no dot: mlx-lm nests dotted keys)


def _layer_digest(cache) -> str:
    """A digest of one layer's saved state: its header's and checksums for our caches, a checksum
    of the arrays for any other (mlx-lm's own caches of layers we leave uncompressed)."""
    if isinstance(cache, CompressedKVCache):
        return sealed_digest(cache.state)
    from mlx.utils import tree_flatten

    arrays = {k: v for k, v in tree_flatten(cache.state) if isinstance(v, mx.array)}
    return f"{type(cache).__name__}:{metadata_digest(checksums(arrays))}"


def _saved_digest(cache) -> str:
    """`_layer_digest` as the file records it (headers that say the file has an index)."""
    with saving_file():
        return _layer_digest(cache)


def save_prompt_cache(path, caches: list, metadata: Optional[dict] = None) -> None:
    """mlx-lm's `save_prompt_cache`; each compressed layer records its config, checksums and
    index, and the file an index of every layer's digest (so swapped layers are refused) and a
    digest of `metadata` (string values; keys without dots, which mlx-lm would nest)."""
    metadata = dict(metadata or {})
    if INDEX_KEY in metadata:
        raise ValueError(f"metadata key {INDEX_KEY!r} is reserved")
    if any("." in str(key) or not isinstance(value, str) for key, value in metadata.items()):
        raise ValueError("prompt-cache metadata takes string values under keys without dots")
    with saving_file():
        index = {"layers": [_layer_digest(c) for c in caches], "metadata": metadata_digest(metadata)}
        metadata[INDEX_KEY] = json.dumps(index)
        mlx_cache.save_prompt_cache(str(path), caches, metadata)


def load_prompt_cache(path, config: Optional[KVCacheConfig] = None, return_metadata: bool = False,
                      model=None):
    """Load a prompt cache, verifying every layer's checksums and the layer order, and refusing
    truncated, corrupted or edited files (`CacheFormatError` names the layer and tensor).

    With `config`, files written with another method or settings are refused and the codecs
    come from `config` (its artifact dir included), never from what the file says; without
    it, from the seed or artifact dir the file names, checked against the checksums it
    recorded. With `model`, files saved from another model's caches are refused."""
    install_attention_hook()
    codecs = None
    if config is not None and config.artifact_dir == AUTO:
        if model is None:
            raise CacheFormatError(f"cannot load {path} with {config.describe()}: a config that calibrates on "
                                   f"first use needs the model (load_prompt_cache(..., model=model))")
        config = ensure_calibrated(config, model)
    if config is not None:
        try:
            codecs = (codecs_for_model(config, model) if model is not None
                      else CodecSet.for_config(config, None))
        except ValueError as error:
            raise CacheFormatError(f"cannot load {path} with {config.describe()}: {error}") from None
    token = _LOADING.set(None if config is None else (config, codecs))
    try:
        with collecting_headers() as headers:
            caches, metadata = mlx_cache.load_prompt_cache(str(path), return_metadata=True)
    except CacheFormatError as error:
        raise CacheFormatError(f"{path}: {error}") from None
    except Exception as error:
        raise CacheFormatError(f"cannot read prompt cache {path}: {error!r}") from None
    finally:
        _LOADING.reset(token)
    metadata = dict(metadata or {})
    index = _verified_index(path, metadata, len(caches), headers)
    identity = None if model is None else cache_identity(model)
    decoded = model is not None and fetches_decoded(model)
    for i, cache in enumerate(caches):
        if index is not None and _saved_digest(cache) != index["layers"][i]:
            raise CacheFormatError(f"{path} layer {i} is not the layer saved in that position "
                                   "(layers swapped, or the file corrupted)")
        latent = next((c for c in getattr(cache, "caches", (cache,)) if isinstance(c, CompressedLatentCache)), None)
        if latent is not None:  # an MLA layer's latent (DeepSeek-V3.2's beside its indexer's keys)
            if config is not None and latent.config != config:
                raise CacheFormatError(f"{path} layer {i} holds a latent cache made with {latent.config.describe()}, "
                                       f"not {config.describe()}")
            continue
        compressed = _compressed_of(cache)
        # A hybrid model's state caches (no update_and_fetch: `compressed_caches` keeps them) load as they are.
        state = not hasattr(compressed, "update_and_fetch") and single_attention_member(compressed) is None
        if config is not None and not isinstance(compressed, CompressedKVCache) and not state:
            raise CacheFormatError(
                f"{path} layer {i} holds a {type(cache).__name__}, not a cache made with {config.describe()}"
            )
        if not isinstance(compressed, CompressedKVCache):
            continue
        if compressed.layer is not None and compressed.layer != i:
            raise CacheFormatError(f"{path} layer {i} holds the cache of layer {compressed.layer} (layers swapped)")
        if (identity is not None and compressed.model_identity is not None
                and compressed.model_identity != identity):
            raise CacheFormatError(f"{path} was saved from the caches of another model: "
                                   f"{identity_difference(compressed.model_identity, identity)}")
        compressed.fetch_decoded = decoded
    if model is not None and len(caches) != len(model.layers):
        raise CacheFormatError(f"{path} holds {len(caches)} layers; the model has {len(model.layers)}")
    if model is not None:
        mark_pipeline_tail(model, caches)
    return (caches, metadata) if return_metadata else caches


def _compressed_of(cache):
    """The `CompressedKVCache` a loaded layer's cache holds: itself, a rotating cache's, or a hybrid layer's
    `CacheList` member's (the layer's state cache beside it); the cache itself where it holds none."""
    if isinstance(cache, mlx_cache.CacheList):
        members = [_compressed_of(member) for member in cache.caches]
        found = [member for member in members if isinstance(member, CompressedKVCache)]
        return found[0] if len(found) == 1 else cache
    return cache.inner if isinstance(cache, CompressedRotatingKVCache) else cache


def _verified_index(path, metadata: dict, layers: int, headers: List[dict]) -> Optional[dict]:
    """The layer index of a file the library wrote (popped from `metadata`, whose digest it
    checks); None for a file mlx-lm's own save wrote, whose layer headers say so."""
    index = metadata.pop(INDEX_KEY, None)
    if index is None:
        if any(header.get("indexed") for header in headers):
            raise CacheFormatError(f"{path}: its layer index is missing (corrupted metadata)")
        return None
    try:
        index = json.loads(index)
        listed, digest = index["layers"], index["metadata"]
    except (ValueError, TypeError, KeyError):
        raise CacheFormatError(f"{path}: its layer index is unreadable (corrupted)") from None
    if not isinstance(listed, list) or len(listed) != layers:
        raise CacheFormatError(f"{path}: its layer index does not list its {layers} layers (corrupted)")
    if digest != metadata_digest(metadata):
        raise CacheFormatError(f"{path}: its metadata fails its digest (corrupted or edited)")
    return index
