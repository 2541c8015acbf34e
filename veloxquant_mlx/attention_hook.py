"""Routing mlx-lm's shared attention to compressed caches, and the caches a model makes for itself.

mlx-lm models call `update_and_fetch` on their cache, then the shared
`mlx_lm.models.base.scaled_dot_product_attention`. We route that function to
`CompressedKVCache.attend` when the cache is ours and leave every other cache
untouched. Model modules import the function by name, so the hook is installed
in each loaded `mlx_lm.models.*` module. A file that calls MLX's own
`mx.fast.scaled_dot_product_attention` on what its cache returned (`DIRECT_ATTENTION_MODELS`)
gets a module-local `mx` whose attention routes a compressed history the same way. A model
whose module uses neither is refused with a clear error instead of crashing inside. A restored cache installs
the hook too (`cache.register_on_load`), so mlx-lm's `load_prompt_cache` followed by its `generate`
works without building a cache or patching a model first.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import mlx_lm.models.base as mlx_base
import mlx_lm.models.cache as mlx_cache

from .batch import BatchCompressedKVCache, BatchHistory
from .batch_latent import BatchLatentCache
from .cache import CompressedHistory, CompressedKVCache, register_on_load
from .cache.latent import CompressedLatentCache
from .errors import UnsupportedModelError
from .rotating import CompressedRotatingKVCache

_original_sdpa = mlx_base.scaled_dot_product_attention


def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
    if isinstance(cache, (CompressedKVCache, BatchCompressedKVCache, CompressedRotatingKVCache)):
        if isinstance(keys, mx.array):  # the model attends over arrays of its own, not this cache's
            return _original_sdpa(queries, keys, values, cache=None, scale=scale, mask=mask, sinks=sinks)
        # Keys fetched from another layer's cache (IQuest-Loop's second loop attends over the first's).
        owner = keys.cache if isinstance(keys, CompressedHistory) else cache
        return owner.attend(queries, scale=scale, mask=mask, sinks=sinks)
    if isinstance(keys, CompressedHistory):  # a KV-shared layer (Gemma 4) attends over an earlier layer's cache
        return scaled_dot_product_attention(queries, keys, values, keys.cache, scale, mask, sinks)
    if isinstance(keys, BatchHistory):
        return keys.batch.attend(queries, scale=scale, mask=mask, sinks=sinks)
    return _original_sdpa(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


# mlx-lm's load_prompt_cache finds cache classes by name in its own module: known from import on.
mlx_cache.CompressedKVCache = CompressedKVCache
mlx_cache.CompressedRotatingKVCache = CompressedRotatingKVCache
mlx_cache.BatchCompressedKVCache = BatchCompressedKVCache
mlx_cache.CompressedLatentCache = CompressedLatentCache
mlx_cache.BatchLatentCache = BatchLatentCache


# Model files that compute on the fetched keys/values before attention, which a compressed cache cannot give.
# gemma3n's KV-shared layers hand another layer's `keys_and_values()` to attention, which the hook routes to
# that cache. afm7's KV-reuse layers do the same, but on the matrix's random afm7 `kivi:4` measured a KL over its
# threshold (docs/models.md), unexplained: refused until it is.
KEY_TRANSFORMING_MODELS = {
    "mlx_lm.models.afm7": "attends its KV-reuse layers over the last layer's cache (keys_and_values), where kivi:4 "
                          "measured a KL over the model matrix's threshold on a random afm7",
}

# Model files that compute on the fetched keys and values themselves (gemma2 its soft-capped scores, phi3small its
# block-sparse layers, plamo tiles them over its shared heads): their caches hand back the held tokens decoded, for
# that call only (`fetch_decoded`), and hold only codes between calls.
DECODED_FETCH_MODELS = ("mlx_lm.models.gemma2", "mlx_lm.models.phi3small", "mlx_lm.models.plamo")


def fetches_decoded(model) -> bool:
    return bool(_module_names(model) & set(DECODED_FETCH_MODELS))


def _module_names(model) -> set:
    """The modules of the model's class and of its layers' (a wrapper attends in its language model's)."""
    return {type(model).__module__} | {type(m).__module__ for m in model.modules()}


# Model files that call `mx.fast.scaled_dot_product_attention` on their cache's keys and values.
DIRECT_ATTENTION_MODELS = ("mlx_lm.models.plamo2",)


class _RoutedFast:
    """`mx.fast`, but its attention hands a compressed history to its cache (`scaled_dot_product_attention`)."""

    def __getattr__(self, name):
        return getattr(mx.fast, name)

    @staticmethod
    def scaled_dot_product_attention(queries, keys, values, *, scale, mask=None, sinks=None):
        return scaled_dot_product_attention(queries, keys, values, None, scale, mask, sinks)


class _RoutedMx:
    """`mlx.core` for a module of `DIRECT_ATTENTION_MODELS`: everything MLX's, but `fast` is `_RoutedFast`."""

    fast = _RoutedFast()

    def __getattr__(self, name):
        return getattr(mx, name)


_ROUTED_MX = _RoutedMx()


def _hooked(module) -> bool:
    return (getattr(module, "scaled_dot_product_attention", None) is scaled_dot_product_attention
            or getattr(module, "mx", None) is _ROUTED_MX)


def install_attention_hook(model=None) -> None:
    """Route mlx-lm's shared attention to compressed caches (idempotent)."""
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm.models") and getattr(module, "scaled_dot_product_attention", None) is _original_sdpa:
            module.scaled_dot_product_attention = scaled_dot_product_attention
        if name in DIRECT_ATTENTION_MODELS and getattr(module, "mx", None) is mx:
            module.mx = _ROUTED_MX
    # mlx-lm's load_prompt_cache finds cache classes by name in its own module.
    mlx_cache.CompressedKVCache = CompressedKVCache
    mlx_cache.CompressedRotatingKVCache = CompressedRotatingKVCache
    mlx_cache.BatchCompressedKVCache = BatchCompressedKVCache
    mlx_cache.CompressedLatentCache = CompressedLatentCache
    mlx_cache.BatchLatentCache = BatchLatentCache
    if model is not None:
        names = _module_names(model)
        for name in sorted(names & set(KEY_TRANSFORMING_MODELS)):
            raise UnsupportedModelError(f"{name} {KEY_TRANSFORMING_MODELS[name]}")
        if not any(_hooked(sys.modules.get(name)) for name in names) and not fetches_decoded(model):
            raise UnsupportedModelError(
                f"{type(model).__module__} computes attention without mlx-lm's shared "
                "scaled_dot_product_attention, so a compressed cache cannot attach to it"
            )


register_on_load(install_attention_hook)


def uses_latent_attention(model) -> bool:
    """Whether the model attends in the absorbed form of multi-head latent attention (DeepSeek-V3, Kimi-K2,
    GLM-4-MoE-Lite, ...): its cache holds one latent per token and a RoPE part, not per-head keys and values
    (`cache/latent.py`)."""
    from mlx_lm.models.mla import MultiLinear

    return any(isinstance(module, MultiLinear) for module in model.modules())


def base_caches(model) -> list:
    """The caches the model would make for itself (ignoring any VeloxQuant patch)."""
    if hasattr(type(model), "make_cache"):
        return type(model).make_cache(model)
    return [mlx_cache.KVCache() for _ in model.layers]


def attention_cache(cache) -> bool:
    """Whether a model's own cache belongs to an attention layer that VeloxQuant compresses
    (`integration.compressed_caches`: mlx-lm's KVCache, or RotatingKVCache for a sliding window)."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    return type(cache) in (KVCache, RotatingKVCache)


def single_attention_member(cache):
    """The index of the one attention cache (`attention_cache`) in a hybrid layer's `CacheList` (Falcon-H1,
    Baichuan-M1: a state cache beside it), which VeloxQuant compresses; None for any other cache, and for a
    CacheList of several (MiniMax-M3's sparse layers read the cached keys of their indexer cache)."""
    if type(cache) is not mlx_cache.CacheList:
        return None
    found = [i for i, member in enumerate(cache.caches) if attention_cache(member)]
    return found[0] if len(found) == 1 else None
