"""The CPU back end: decode attention on turboquant_mse rows in one C++ MLX primitive.

`csrc/mse_attention.cpp` builds into `veloxquant_mlx._native` (`scripts/build_native.sh`,
run by `make setup`). It reads the packed rows directly (no decoded keys or values
exist beyond one token's D floats inside the kernel) and returns per-split partials
with the contract of `portable.mse_partials`, so the merge, the fp16 sinks/window and
the value un-rotation are shared with the other back ends. Without the module the CPU
uses the portable path (`kernels.backend()` says which one runs).
"""

from __future__ import annotations

import functools
import os
import warnings

import mlx.core as mx

from ..settings import register_native_probe
from ..storage import FieldStore
from . import ops, portable

MIN_TOKENS_PER_SPLIT = 512


@functools.lru_cache(maxsize=1)
def module():
    """The compiled extension, or None where it was not built (or does not work with this
    MLX, e.g. built against another version: then with a warning)."""
    try:
        from .. import _native
    except ImportError:
        return None
    try:
        cent = mx.zeros((2,))
        mx.eval(_native.mse_attention_partials(mx.zeros((1, 1, 32)), mx.zeros((1, 1, 3), mx.uint32), cent, cent,
                                               1, 1, 1, 1, 0, 1, 2))
    except Exception as error:  # noqa: BLE001 - any failure means: do not use it
        warnings.warn(f"veloxquant_mlx._native does not work with this MLX ({error!r}); the CPU uses the "
                      "portable path. Rebuild it with scripts/build_native.sh.", RuntimeWarning, stacklevel=2)
        return None
    return _native


def available() -> bool:
    return module() is not None


register_native_probe(lambda: available())  # looked up when called, so that tests can replace `available`


@functools.lru_cache(maxsize=1)
def _threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


def mse_partials(queries: mx.array, key_codec, value_codec, layout, rows: mx.array, tokens: int, scale: float):
    """(o (BH, S, REP*L, Dv) value domain, ml (BH, S, REP*L, 2)) over rows [0, tokens) of
    `layout` (a `formats.RowLayout` of the mse family: the word offsets come from it)."""
    B, kv_heads, capacity, width = rows.shape
    q = portable.domain_queries(queries, key_codec, kv_heads, scale)
    key_codec = ops.codes_codec(key_codec)  # queries in the domain; the codes are its base's
    # About two (kv head, split) work items per core, no split shorter than MIN_TOKENS_PER_SPLIT.
    items = B * kv_heads
    splits = max(1, min(-(-2 * _threads() // items), tokens // MIN_TOKENS_PER_SPLIT))
    o, ml = module().mse_attention_partials(
        q.reshape(B * kv_heads, *q.shape[2:]), rows.reshape(B * kv_heads, capacity, width),
        ops.constants(key_codec)["centroids"], ops.constants(value_codec)["centroids"], tokens, key_codec.bits,
        value_codec.bits, splits, layout.slot("keys", "codes").start, layout.slot("values", "codes").start,
        layout.slot("keys", "norm").start // 2)
    return o, ml


def mse_partials_ragged(queries: mx.array, key_codec, value_codec, layout, rows: mx.array, lengths: mx.array,
                        tokens: int, scale: float):
    """`mse_partials` over a batch whose row b uses only its first `lengths[b]` (int32 (B,)) of
    [0, tokens): one kernel call for sequences of different lengths."""
    B, kv_heads, capacity, width = rows.shape
    q = portable.domain_queries(queries, key_codec, kv_heads, scale)
    key_codec = ops.codes_codec(key_codec)
    items = B * kv_heads
    splits = max(1, min(-(-2 * _threads() // items), tokens // MIN_TOKENS_PER_SPLIT))
    per_item = mx.repeat(lengths.astype(mx.int32), kv_heads)
    return module().mse_attention_partials_ragged(
        q.reshape(items, *q.shape[2:]), rows.reshape(items, capacity, width),
        ops.constants(key_codec)["centroids"], ops.constants(value_codec)["centroids"], per_item, tokens,
        key_codec.bits, value_codec.bits, splits, layout.slot("keys", "codes").start,
        layout.slot("values", "codes").start, layout.slot("keys", "norm").start // 2)


def kivi_supported(h) -> bool:
    """KIVI's two formats (per-channel key groups of G tokens, per-token value groups) in a
    field store, whole 32-code blocks, groups dividing the head dim, and a module that has
    the KIVI kernel."""
    kc, vc = h.key_codec, h.value_codec
    if (kc.format.name, vc.format.name) != ("affine_channel", "affine_token") or not isinstance(h.store, FieldStore):
        return False
    mod = module()
    return (mod is not None and hasattr(mod, "kivi_attention_partials") and kc.dim == vc.dim and kc.dim % 32 == 0
            and vc.padded == vc.dim)


def kivi_partials(queries: mx.array, h, scale: float):
    """(o (BH, S, REP*L, D), ml (BH, S, REP*L, 2)) over KIVI's codes [0, h.count)."""
    keys, values = h.store.buffers["keys"], h.store.buffers["values"]
    codes = keys["codes"]
    B, kv_heads, capacity, _ = codes.shape
    q = portable.domain_queries(queries, h.key_codec, kv_heads, scale)
    items = B * kv_heads
    splits = max(1, min(-(-2 * _threads() // items), h.count // MIN_TOKENS_PER_SPLIT))

    def rows(a):
        return a.reshape(items, *a.shape[2:])

    return module().kivi_attention_partials(
        q.reshape(items, *q.shape[2:]), rows(codes), rows(keys["channel_scale"]), rows(keys["channel_min"]),
        rows(values["codes"]), rows(values["scale"]), rows(values["min"]), h.count, h.key_codec.bits,
        h.value_codec.bits, h.key_codec.token_block, splits)
