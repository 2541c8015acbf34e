"""How many KV coordinates a model stores per token (a cache's size in bytes and bits: `footprint`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List

import mlx.core as mx

from .attention_hook import base_caches


@dataclass(frozen=True)
class KVLayout:
    """Per attention layer: (kv_heads, key_dim, value_dim), read from a real forward."""

    layers: List[tuple]

    @property
    def coordinates_per_token(self) -> int:
        return sum(heads * (dk + dv) for heads, dk, dv in self.layers)

    def describe(self) -> Dict[str, Any]:
        heads = sorted({h for h, _, _ in self.layers})
        key_dims = sorted({k for _, k, _ in self.layers})
        value_dims = sorted({v for _, _, v in self.layers})
        one = lambda xs: xs[0] if len(xs) == 1 else xs  # noqa: E731
        return {
            "kv_layers": len(self.layers),
            "kv_heads": one(heads),
            "key_dim": one(key_dims),
            "value_dim": one(value_dims),
            "kv_coordinates_per_token": self.coordinates_per_token,
        }


def kv_layout(model) -> KVLayout:
    """Run one token through the model's own caches and read the key/value shapes."""
    caches = base_caches(model)
    mx.eval(model(mx.array([[0]]), cache=caches))
    layers = []
    for cache in caches:
        keys, values = getattr(cache, "keys", None), getattr(cache, "values", None)
        if isinstance(keys, mx.array) and isinstance(values, mx.array) and keys.ndim == 4:
            layers.append((keys.shape[1], keys.shape[3], values.shape[3]))
    if not layers:
        raise ValueError(f"{type(model).__module__} keeps no key/value cache to measure")
    return KVLayout(layers)


def cache_arrays(caches) -> list:
    """Every array a cache holds, to force pending updates with `mx.eval`."""
    from mlx.utils import tree_flatten

    arrays = []
    for cache in caches:
        state = cache.state
        arrays += [x for _, x in tree_flatten(state) if isinstance(x, mx.array)]
    return arrays
