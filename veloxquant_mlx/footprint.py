"""One definition of a KV cache's size, which every command reports.

* **Held bytes**: the bytes the held tokens take. Capacity allocated ahead of them is left out (mlx-lm's
  caches and ours grow in 256-token steps, so at a short context most of a buffer can be spare), and a
  floating-point element counts 2 bytes, as in a float16 run: on the CPU the model computes in float32 and
  mlx-lm's caches then hold float32, while ours keep float16 either way.
* **Bits per coordinate** = 8 x held bytes / coordinates, where the coordinates are those of the held
  tokens' keys and values: tokens x batch x KV heads x (key dim + value dim), summed over the layers. So
  mlx-lm's fp16 `KVCache` is 16.00 at every context, and a layer that keeps only its last tokens (a
  sliding-window layer, `--max-kv-size`) counts only those.
* **N x smaller** = fp16 bytes / held bytes, fp16 bytes being 2 bytes per coordinate of the same tokens:
  an fp16 cache is 1.00x.
* **Allocated bytes**: the buffers as allocated, spare capacity included, at their real dtype: the memory
  in use, reported beside the held bytes, never turned into bits.
* **State bytes**: a hybrid model's linear-attention and state-space layers hold a state (mlx-lm's
  `ArraysCache`), not keys and values; VeloxQuant keeps it as mlx-lm makes it. Counted as held bytes are
  (floating elements 2 bytes), outside the bits and "N x smaller" of the KV coordinates, and in the
  **whole cache's** "N x smaller" = (fp16 bytes + state bytes) / (held bytes + state bytes): the memory
  saved as a share of every layer's cache, not only of the attention layers'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

FP16_BYTES = 2


def _element_bytes(array) -> int:
    import mlx.core as mx

    return FP16_BYTES if mx.issubdtype(array.dtype, mx.floating) else array.dtype.size


def _token_bytes(buffer) -> float:
    """Bytes per token slot of one role's buffer (an array, or mlx-lm's quantized (codes, scales, biases))."""
    parts = buffer if isinstance(buffer, (tuple, list)) else (buffer,)
    return sum(p.size // p.shape[2] * _element_bytes(p) for p in parts if p is not None)


@dataclass(frozen=True)
class Footprint:
    held: int  # bytes the held tokens take (see the module's docstring)
    allocated: int  # bytes of the buffers as allocated
    coordinates: int  # key and value coordinates of the held tokens
    tokens: int  # tokens seen by the longest layer (its offset)
    state: int = 0  # bytes of the state caches of layers without keys and values (see the module's docstring)

    @property
    def fp16_bytes(self) -> int:
        return FP16_BYTES * self.coordinates

    @property
    def bits(self) -> Optional[float]:
        return 8 * self.held / self.coordinates if self.coordinates else None

    @property
    def smaller(self) -> Optional[float]:
        """How many times fewer bytes than an fp16 cache of the same tokens."""
        return self.fp16_bytes / self.held if self.held else None

    @property
    def whole_smaller(self) -> Optional[float]:
        """How many times fewer bytes than an fp16 KV cache of the same tokens with the same state caches."""
        return (self.fp16_bytes + self.state) / (self.held + self.state) if self.held + self.state else None

    def __add__(self, other: "Footprint") -> "Footprint":
        return Footprint(self.held + other.held, self.allocated + other.allocated,
                         self.coordinates + other.coordinates, max(self.tokens, other.tokens), self.state + other.state)

    def describe(self) -> str:
        """One line: tokens, held and allocated MB, bits per coordinate, and against fp16."""
        bits = "n/a" if self.bits is None else f"{self.bits:.2f}"
        smaller = "n/a" if self.smaller is None else f"{self.smaller:.2f}x"
        line = (f"{self.tokens} tokens, {self.held / 1e6:.3f} MB held ({self.allocated / 1e6:.3f} MB allocated), "
                f"{bits} bits/coord; fp16 {self.fp16_bytes / 1e6:.3f} MB: {smaller} smaller")
        if self.state and self.whole_smaller is not None:
            saved = 1 - 1 / self.whole_smaller
            line += (f"; with {self.state / 1e6:.3f} MB of state caches kept as they are, the whole cache "
                     f"{self.whole_smaller:.2f}x smaller ({saved:.0%} saved)")
        return line


def layer_footprint(cache) -> Footprint:
    """The footprint of one layer's cache: ours (a codec'd cache, or one wrapped as `.inner`), or one of
    mlx-lm's with `keys`/`values` buffers (KVCache, RotatingKVCache, QuantizedKVCache). A cache without
    keys (an SSM layer's, say) holds no KV coordinates: all zero."""
    from mlx_lm.models.cache import ArraysCache, CacheList

    if isinstance(cache, CacheList):  # a hybrid layer: a state cache beside an attention cache
        return footprint(cache.caches)
    if isinstance(cache, ArraysCache):
        arrays = [a for a in cache.cache if a is not None]
        return Footprint(0, int(cache.nbytes), 0, 0, sum(a.size * _element_bytes(a) for a in arrays))
    inner = getattr(cache, "inner", cache)
    if hasattr(cache, "held_coordinates"):  # an MLA latent cache (cache/latent.py), DeepSeek-V4.1's layers
        return Footprint(int(cache.used_nbytes), int(cache.nbytes), cache.held_coordinates, int(cache.offset))
    if getattr(inner, "key_codec", None) is not None:
        held_tokens = cache.size()
        coordinates = held_tokens * inner.batch * inner.kv_heads * (inner.key_dim + inner.value_dim)
        return Footprint(int(cache.used_nbytes), int(cache.nbytes), coordinates, int(cache.offset))
    keys, values = getattr(cache, "keys", None), getattr(cache, "values", None)
    if keys is None or values is None:
        return Footprint(0, int(getattr(cache, "nbytes", 0) or 0), 0, int(getattr(cache, "offset", 0) or 0))
    quantized = isinstance(keys, (tuple, list))
    first = keys[0] if quantized else keys
    held_tokens = min(int(cache.offset), first.shape[2])  # a rotating cache holds its last max_size tokens
    if quantized:
        key_dim, value_dim = keys[1].shape[3] * cache.group_size, values[1].shape[3] * cache.group_size
    else:
        key_dim, value_dim = keys.shape[3], values.shape[3]
    held = round(held_tokens * (_token_bytes(keys) + _token_bytes(values)))
    allocated = sum(p.nbytes for p in (*(keys if quantized else (keys,)), *(values if quantized else (values,)))
                    if p is not None)
    coordinates = held_tokens * first.shape[0] * first.shape[1] * (key_dim + value_dim)
    return Footprint(held, allocated, coordinates, int(cache.offset))


def footprint(caches: Iterable) -> Footprint:
    """The footprint of a model's caches (one per layer)."""
    total = Footprint(0, 0, 0, 0)
    for cache in caches:
        total = total + layer_footprint(cache)
    return total
