"""Routing mlx-lm's shared attention to compressed caches.

mlx-lm models call `update_and_fetch` on their cache, then the shared
`mlx_lm.models.base.scaled_dot_product_attention`. The hook routes that function to the cache's
`attend` when the cache is one of the classes registered with `attend_through` and leaves every
other cache untouched. Model modules import the function by name, so the hook is installed in
each loaded `mlx_lm.models.*` module, `base` included (modules imported later take it from
there). A restored cache installs it too, so mlx-lm's `load_prompt_cache` followed by its
`generate` works without building a cache or patching a model first.
"""

from __future__ import annotations

import sys

import mlx_lm.models.base as mlx_base


class UnsupportedModelError(ValueError):
    pass


_original_sdpa = mlx_base.scaled_dot_product_attention
_ATTENDING: tuple = ()


def attend_through(*classes) -> None:
    """Route attention over caches of `classes` to their `attend` method."""
    global _ATTENDING
    _ATTENDING = tuple(dict.fromkeys(_ATTENDING + classes))


def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
    if isinstance(cache, _ATTENDING):
        if sinks is not None:
            raise UnsupportedModelError(
                "this model uses learned attention sinks, which VeloxQuant caches do not support"
            )
        return cache.attend(queries, scale=scale, mask=mask)
    return _original_sdpa(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def install_attention_hook(model=None) -> None:
    """Route mlx-lm's shared attention to compressed caches (idempotent)."""
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm.models") and getattr(module, "scaled_dot_product_attention", None) is _original_sdpa:
            module.scaled_dot_product_attention = scaled_dot_product_attention
    if model is not None:
        module = sys.modules.get(type(model).__module__)
        if getattr(module, "scaled_dot_product_attention", None) is not scaled_dot_product_attention:
            raise UnsupportedModelError(
                f"{type(model).__module__} computes attention without mlx-lm's shared "
                "scaled_dot_product_attention, so a compressed cache cannot attach to it"
            )
