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
* the token count reaches the kernels through a small int32 array shared by all
  layers of a step;
* the new row is stored outside the compiled graph (`store`), at a constant
  position: MLX's CUDA back end copies the whole buffer for a slice update at an
  array-valued position (62 us per layer for K3/V4 rows at 32K, results/gpu/run10)
  and updates it in place at a constant one.

One compiled function per layout (codecs, shapes, capacity) serves every layer;
the codes are stored as rows (`rows.py`), so a token is one slice update.
Used for single-token steps of caches without sinks or an fp16 window, on the
kernel back ends (`append` also on the CPU ones). `VELOXQUANT_COMPILE_STEP=0`
turns it off (the op-by-op path, for comparison) for caches created after it is set.
"""

from __future__ import annotations

import functools
import os

import mlx.core as mx

from . import launch, ops
from .rows import RowLayout


def enabled() -> bool:
    return os.environ.get("VELOXQUANT_COMPILE_STEP", "1").strip().lower() not in ("0", "off", "false", "no")


def store(rows: mx.array, new: mx.array, start: int) -> mx.array:
    """`rows` (the same array object) with `new` (B, H, n, W) written at token `start`."""
    rows[..., start : start + new.shape[2], :] = new
    return rows


@functools.lru_cache(maxsize=64)
def _append_fn(runner_name: str, key_codec, value_codec, centered: bool):
    run = None if runner_name in ops.CPU_BACKENDS else ops.runner(runner_name)
    layout = RowLayout(key_codec, value_codec)

    def encode(keys, values, key_mean, value_mean):
        if centered:
            keys = keys.astype(mx.float32) - key_mean
            values = values.astype(mx.float32) - value_mean
        if run is None:
            return layout.encode(keys, values)
        return ops.mse_encode_rows(run, layout.key_codec, layout.value_codec, keys, values)

    return mx.compile(encode)


def append(runner_name: str, cache, keys: mx.array, values: mx.array, start: int) -> mx.array:
    """`cache.rows` with `keys` / `values` (B, H, 1, D) encoded into row `start` (the
    buffer must already have room): a compiled encode and one slice update."""
    centered = cache.key_mean is not None
    fn = _append_fn(runner_name, cache.key_codec, cache.value_codec, centered)
    none = ops.small_array((0.0,), mx.float32)
    new = fn(keys, values, cache.key_mean if centered else none, cache.value_mean if centered else none)
    return store(cache.rows, new, start)


@functools.lru_cache(maxsize=64)
def _step_fn(kind: str, runner_name: str, key_codec, value_codec, out_shape, out_dtype, q_dtype: str,
             scale: float, kv_rows: int, capacity: int, centered: bool):
    """(plan, function) of a decode step: "attend" reads the stored tokens; "fused" also
    encodes, attends to and stores the new one (`fused`)."""
    run = ops.runner(runner_name)
    rep = out_shape[1] // (kv_rows // out_shape[0])
    rotate_query = ops.constants(key_codec)["signs"] is not None
    plan = launch.partial_plan(kv_rows, rep, key_codec.dim, key_codec.bits, value_codec.bits, capacity, capacity,
                               rotate_query=rotate_query, q_dtype=q_dtype if rotate_query else "float32")

    def attend(queries, rows, meta, key_mean, value_mean):
        o, ml = ops.run_partials(run, plan, queries, key_codec, value_codec, rows, scale, meta)
        return ops.merge(run, o, ml, value_codec, out_shape, out_dtype,
                         value_mean=value_mean if centered else None)

    def fused(queries, rows, meta, key_mean, value_mean, keys, values):
        o, ml = ops.run_partials(run, plan, queries, key_codec, value_codec, rows, scale, meta)
        return ops.merge_encode(run, o, ml, queries, keys, values, key_codec, value_codec, scale, out_dtype,
                                key_mean if centered else None, value_mean if centered else None)

    step = attend if kind == "attend" else fused
    # The emulator runs kernels through numpy, which cannot be traced: tests call it uncompiled.
    return plan, (step if runner_name == "emulator" else mx.compile(step))


def _run_step(kind: str, runner_name: str, cache, queries: mx.array, scale: float, *extra):
    rows = cache.rows
    q_dtype = queries.dtype if queries.dtype in (mx.float16, mx.float32, mx.bfloat16) else mx.float32
    centered = cache.key_mean is not None
    plan, fn = _step_fn(kind, runner_name, cache.key_codec, cache.value_codec, tuple(queries.shape), queries.dtype,
                        launch.dtype_name(q_dtype), float(scale), rows.shape[0] * rows.shape[1], rows.shape[2],
                        centered)
    _, chunk, capacity, splits = plan.meta["meta"]
    meta = ops.small_array((cache.encoded, chunk, capacity, splits))
    none = ops.small_array((0.0,), mx.float32)
    return fn(queries.astype(q_dtype), rows, meta, cache.key_mean if centered else none,
              cache.value_mean if centered else none, *extra)


def attend(runner_name: str, cache, queries: mx.array, scale: float) -> mx.array:
    """Decode attention of `queries` (B, Hq, 1, D) over the cache's codes (no sinks or
    window), through one compiled graph planned from the buffers' capacity."""
    return _run_step("attend", runner_name, cache, queries, scale)


def fused_applies(cache, queries: mx.array, mask) -> bool:
    """Whether `fused` can take this decode step: one query per head, turboquant_mse rows
    whose roles both rotate in-kernel (power-of-two dim); the caller checks the back end
    and the decode kernel's limits."""
    if queries.shape[2] != 1 or cache.rows is None or not cache.mode.compiled:
        return False
    if mask is not None and not (isinstance(mask, str) and mask == "causal"):
        return False
    kc, vc = cache.key_codec, cache.value_codec
    return kc.dim == vc.dim and ops.constants(kc)["signs"] is not None and ops.constants(vc)["signs"] is not None


def fused(runner_name: str, cache, queries: mx.array, keys: mx.array, values: mx.array, scale: float):
    """One decode step in three ops: the partial kernel over the stored tokens, a merge that
    also encodes the new token (`keys` / `values` (B, H, 1, D)) and attends to it from its
    codes, and one slice update storing its row. (attention output, new rows)."""
    out, row = _run_step("fused", runner_name, cache, queries, scale, keys, values)
    return out, store(cache.rows, row, cache.encoded)
