"""Routing mlx-lm's shared attention to compressed caches, and the caches a model makes for itself.

mlx-lm models call `update_and_fetch` on their cache, then the shared
`mlx_lm.models.base.scaled_dot_product_attention`. We route that function to
`CompressedKVCache.attend` when the cache is ours and leave every other cache
untouched. Model modules import the function by name, so the hook is installed
in each loaded `mlx_lm.models.*` module; a model whose module does not use the
shared function is refused with a clear error instead of crashing inside.
"""

from __future__ import annotations

import sys

import mlx_lm.models.base as mlx_base
import mlx_lm.models.cache as mlx_cache

from .batch import BatchCompressedKVCache
from .cache import CompressedKVCache
from .errors import UnsupportedModelError
from .rotating import CompressedRotatingKVCache

_original_sdpa = mlx_base.scaled_dot_product_attention


def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
    if isinstance(cache, (CompressedKVCache, BatchCompressedKVCache, CompressedRotatingKVCache)):
        if sinks is not None:
            raise UnsupportedModelError(
                "this model uses learned attention sinks, which VeloxQuant caches do not support"
            )
        return cache.attend(queries, scale=scale, mask=mask)
    return _original_sdpa(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


# mlx-lm's load_prompt_cache finds cache classes by name in its own module: known from import on.
mlx_cache.CompressedKVCache = CompressedKVCache
mlx_cache.CompressedRotatingKVCache = CompressedRotatingKVCache


def install_attention_hook(model=None) -> None:
    """Route mlx-lm's shared attention to compressed caches (idempotent)."""
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm.models") and getattr(module, "scaled_dot_product_attention", None) is _original_sdpa:
            module.scaled_dot_product_attention = scaled_dot_product_attention
    # mlx-lm's load_prompt_cache finds cache classes by name in its own module.
    mlx_cache.CompressedKVCache = CompressedKVCache
    mlx_cache.CompressedRotatingKVCache = CompressedRotatingKVCache
    if model is not None:
        module = sys.modules.get(type(model).__module__)
        if getattr(module, "scaled_dot_product_attention", None) is not scaled_dot_product_attention:
            raise UnsupportedModelError(
                f"{type(model).__module__} computes attention without mlx-lm's shared "
                "scaled_dot_product_attention, so a compressed cache cannot attach to it"
            )


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
