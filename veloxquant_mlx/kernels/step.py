"""The per-token decode step of a turboquant_mse cache, replayed under `mx.compile`.

Building a decode step op by op costs 75-110 us of host time per layer on MLX's
CUDA back end (three custom-kernel calls, four slice updates, Python) against
12-16 us for mlx-lm's fp16 KVCache + SDPA (docs/kernels.md), and decoding there
is host-bound. A compiled function replays the graph it traced instead, which
only pays off if that trace stays valid from one token to the next, so every
shape and constant in it is fixed between steps:

* the buffers grow in 256-token steps (`CompressedKVCache.step`), so their
  shapes change once every 256 tokens;
* the decode kernel's grid is planned from the buffers' capacity, not the token
  count: splits that start past the last token write an empty (o, m, l) and the
  merge skips them;
* the token count reaches the kernels, and the append position reaches
  `mx.slice_update`, through small int32 arrays shared by all layers of a step.

One compiled function per layout (codecs, shapes, capacity) serves every layer.
Used for single-token steps of caches without sinks or an fp16 window, on the
kernel back ends (`append` also on the portable one). `VELOXQUANT_COMPILE_STEP=0`
turns it off (the op-by-op path, for comparison).
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import mlx.core as mx

from . import launch, ops


def enabled() -> bool:
    return os.environ.get("VELOXQUANT_COMPILE_STEP", "1").strip().lower() not in ("0", "off", "false", "no")


def position(n: int) -> mx.array:
    """int32 [n], shared by every layer of a step (one small array per distinct n)."""
    return ops.small_array((int(n),))


@functools.lru_cache(maxsize=64)
def _append_fn(runner_name: str, key_codec, value_codec, centered: bool):
    run = None if runner_name == "portable" else ops.runner(runner_name)

    def append(kcodes, knorm, vcodes, vnorm, keys, values, start, key_mean, value_mean):
        if centered:
            keys = keys.astype(mx.float32) - key_mean
            values = values.astype(mx.float32) - value_mean
        if run is None:
            kf, vf = key_codec.encode(keys), value_codec.encode(values)
        else:
            kf, vf = ops.mse_encode_kv(run, key_codec, value_codec, keys, values)
        put = lambda buf, new: mx.slice_update(buf, new.astype(buf.dtype), start, axes=(2,))  # noqa: E731
        return put(kcodes, kf["codes"]), put(knorm, kf["norm"]), put(vcodes, vf["codes"]), put(vnorm, vf["norm"])

    return mx.compile(append)


def append(runner_name: str, cache, keys: mx.array, values: mx.array, start: int):
    """Encode `keys`/`values` (B, H, 1, D) into rows [start, start + 1) of the cache's
    buffers (which must already have room): the new (kcodes, knorm, vcodes, vnorm)."""
    kf, vf = cache.key_fields, cache.value_fields
    centered = cache.key_mean is not None
    fn = _append_fn(runner_name, cache.key_codec, cache.value_codec, centered)
    none = ops.small_array((0.0,), mx.float32)
    return fn(kf["codes"], kf["norm"], vf["codes"], vf["norm"], keys, values, position(start),
              cache.key_mean if centered else none, cache.value_mean if centered else none)


@functools.lru_cache(maxsize=64)
def _attend_fn(runner_name: str, key_codec, value_codec, out_shape, out_dtype, q_dtype, scale: float,
               kv_rows: int, kcap: int, vcap: int, centered: bool):
    run = ops.runner(runner_name)
    rep = out_shape[1] // (kv_rows // out_shape[0])
    plan = _plan(key_codec, value_codec, kv_rows, rep, kcap, vcap, q_dtype)

    def attend(queries, kcodes, knorm, vcodes, vnorm, meta, value_mean):
        o, ml = ops.run_partials(run, plan, queries, key_codec, value_codec, kcodes, knorm, vcodes, vnorm,
                                 scale, meta)
        return ops.merge(run, o, ml, value_codec, out_shape, out_dtype,
                         value_mean=value_mean if centered else None)

    # The emulator runs kernels through numpy, which cannot be traced: tests call it uncompiled.
    return plan, (attend if runner_name == "emulator" else mx.compile(attend))


def _plan(key_codec, value_codec, kv_rows, rep, kcap, vcap, q_dtype):
    rotate_query = ops.constants(key_codec)["signs"] is not None
    if not rotate_query:
        q_dtype = "float32"
    plan = launch.partial_plan(kv_rows, rep, key_codec.dim, key_codec.bits, value_codec.bits, kcap, kcap, vcap,
                               rotate_query=rotate_query, q_dtype=q_dtype)
    return plan


def attend(runner_name: str, cache, queries: mx.array, scale: float) -> Optional[mx.array]:
    """Decode attention of `queries` (B, Hq, 1, D) over the cache's codes (no sinks or
    window), through one compiled graph planned from the buffers' capacity."""
    kf, vf = cache.key_fields, cache.value_fields
    kcodes, vcodes = kf["codes"], vf["codes"]
    kv_rows = kcodes.shape[0] * kcodes.shape[1]
    q_dtype = queries.dtype if queries.dtype in (mx.float16, mx.float32, mx.bfloat16) else mx.float32
    centered = cache.value_mean is not None
    plan, fn = _attend_fn(runner_name, cache.key_codec, cache.value_codec, tuple(queries.shape), queries.dtype,
                          launch.dtype_name(q_dtype), float(scale), kv_rows, kcodes.shape[2], vcodes.shape[2],
                          centered)
    _, chunk, kcap, vcap, splits = plan.meta["meta"]
    meta = ops.small_array((cache.encoded, chunk, kcap, vcap, splits))
    none = ops.small_array((0.0,), mx.float32)
    return fn(queries.astype(q_dtype), kcodes, kf["norm"], vcodes, vf["norm"], meta,
              cache.value_mean if centered else none)
