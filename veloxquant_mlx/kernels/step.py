"""The per-token decode step of a turboquant_mse cache on the kernel back ends, replayed
under `mx.compile`.

Building a decode step op by op costs 75-110 us of host time per layer on MLX's
CUDA back end (three custom-kernel calls, four slice updates, Python) against
12-16 us for mlx-lm's fp16 KVCache + SDPA (docs/kernels.md), and decoding there
is host-bound. A compiled function replays the graph it traced instead, which
only pays off if that trace stays valid from one token to the next, so every
shape and constant in it is fixed between steps:

* the store grows in 256-token steps (`storage.RowStore`), so its shapes change
  once every 256 tokens;
* the decode kernel's grid is planned from the buffers' capacity, not the token
  count: splits that start past the last token write an empty (o, m, l) and the
  merge skips them;
* the token count reaches the kernels through a small int32 array shared by all
  layers of a step;
* the fp16 sinks and window (a fixed number of tokens once the window is full) are
  a plain partial inside the same graph, merged by the merge kernel; they enter as
  held, and are centred and joined inside the graph (`engine.fp16_tokens`);
* the new row is stored outside the compiled graph (`store`), at a constant
  position: MLX's CUDA back end copies the whole buffer for a slice update at an
  array-valued position
  and updates it in place at a constant one.

One compiled function per layout (codecs, shapes, capacity) serves every layer.
Smoothed keys (`methods/smoothing.py`) take their base codec's, with the layer's scales
as one more input, which the kernels apply themselves (queries as q * s, the new key
encoded as k / s).
"""

from __future__ import annotations

import functools

import mlx.core as mx

from ..engine import CODEC_KEYED, attention_dtype, fp16_tokens, plain_partial, small_array, with_sink_split
from . import launch, ops


def store(rows: mx.array, new: mx.array, start: int) -> mx.array:
    """`rows` (the same array object) with `new` (B, H, n, W) written at token `start`."""
    rows[..., start : start + new.shape[2], :] = new
    return rows


@functools.lru_cache(maxsize=CODEC_KEYED)
def _step_fn(kind: str, runner_name: str, key_codec, value_codec, out_shape, out_dtype, q_dtype: str,
             scale: float, kv_rows: int, capacity: int, centered: bool, fp16_parts: int = 0, mma: bool = False,
             chunk=None, key_scale_heads: int = 0, kept: bool = False, sinks: bool = False):
    """(plan, function) of a decode step: "attend" reads the stored tokens; "fused" also
    encodes, attends to and stores the new one (`fused`). `chunk`: tokens per split (None: planned).
    `key_scale_heads`: smoothed keys (`key_codec` the base's), whose scales are the `key_scale` input.
    `kept`: the step reads tokens kept in fp16 past the window (`kept.py`), `kept_inputs` (slot keys,
    values and positions, and `ops.kept_splits`' meta): two more splits take their codes' terms out
    and add them in fp16 (`ops.kept_splits`). `sinks`: learned attention sinks (`sink_logits` input), one
    more split after the others (`engine.with_sink_split`)."""
    run = ops.runner(runner_name)
    rep = out_shape[1] // (kv_rows // out_shape[0])
    rotate_query = ops.constants(key_codec)["signs"] is not None
    plan = launch.decode_partial_plan(mma, kv_rows, rep, key_codec.dim, key_codec.bits, value_codec.bits, capacity,
                                      capacity, rotate_query=rotate_query,
                                      q_dtype=q_dtype if rotate_query else "float32", chunk=chunk,
                                      key_scale_heads=key_scale_heads if rotate_query else 0)

    def partials(queries, rows, meta, key_mean, value_mean, key_scale, sink_logits, kept_inputs, slide=None):
        key_scale = key_scale if key_scale_heads else None
        o, ml = ops.run_partials(run, plan, queries, key_codec, value_codec, rows, scale, meta, key_scale)
        if kept:
            o, ml, slide = ops.kept_splits(run, o, ml, queries, rows, key_codec, value_codec, *kept_inputs, scale,
                                           key_mean if centered else None, value_mean if centered else None,
                                           key_scale, slide)
        if sinks:
            o, ml = with_sink_split(o, ml, sink_logits, value_codec, value_mean if centered else None, queries,
                                    key_mean if centered else None, scale)
        return o, ml, slide

    def attend(queries, rows, meta, key_mean, value_mean, key_scale, sink_logits, fp16, kept_inputs=()):
        o, ml, _ = partials(queries, rows, meta, key_mean, value_mean, key_scale, sink_logits, kept_inputs)
        tokens = fp16_tokens(fp16_parts, fp16, key_mean if centered else None)
        plain = None if tokens is None else plain_partial(queries, *tokens, scale)
        return ops.merge(run, o, ml, value_codec, out_shape, out_dtype, plain=plain,
                         value_mean=value_mean if centered else None)

    def fused(queries, rows, meta, key_mean, value_mean, key_scale, sink_logits, fp16, keys, values, slide=None,
              kept_inputs=()):
        # The fp16 tokens go to merge_encode as held: it centres and attends to them itself. Kept
        # tokens: the one this step encodes has no row yet, so its codes are not taken out; if it was
        # kept, merge_encode does not attend to it from its codes (`ops.kept_splits` sets slide[4]).
        o, ml, slide = partials(queries, rows, meta, key_mean, value_mean, key_scale, sink_logits, kept_inputs, slide)
        return ops.merge_encode(run, o, ml, queries, keys, values, key_codec, value_codec, scale, out_dtype,
                                key_mean if centered else None, value_mean if centered else None, fp16=fp16,
                                slide=slide, key_scale=key_scale if key_scale_heads else None)

    step = attend if kind == "attend" else fused
    # The emulator runs kernels through numpy, which cannot be traced: tests call it uncompiled.
    return plan, (step if runner_name == "emulator" else mx.compile(step))


def uses_tensor_cores(runner_name: str, h, queries) -> bool:
    """Whether a decode call on `runner_name`'s kernels runs `mse_partial_mma` (fp16 operands)."""
    key_codec = ops.codes_codec(h.key_codec)
    return launch.use_mma(runner_name, h.settings.tensor_cores, key_codec.dim,
                          queries.shape[1] // h.kv_heads, key_codec.bits, h.value_codec.bits)


def _run_step(kind: str, runner_name: str, h, queries: mx.array, scale: float, *extra, slide: bool = False):
    if kind == "fused" and h.kept and not slide:
        raise ValueError("a fused decode step reads kept tokens only as it slides the window (`kept.py`)")
    rows = h.store.rows
    q_dtype = attention_dtype(queries)
    centered = h.key_mean is not None
    parts, fp16 = h.fp16_inputs()
    key_codec = ops.codes_codec(h.key_codec)
    key_scale = None if key_codec is h.key_codec else h.key_codec.scale
    plan, fn = _step_fn(kind, runner_name, key_codec, h.value_codec, tuple(queries.shape), queries.dtype,
                        launch.dtype_name(q_dtype), float(scale), rows.shape[0] * rows.shape[1], rows.shape[2],
                        centered, parts, uses_tensor_cores(runner_name, h, queries), h.settings.split_tokens,
                        0 if key_scale is None else key_scale.shape[0], h.kept, h.sink_logits is not None)
    _, chunk, capacity, splits = plan.meta["meta"]
    if slide:  # merge_encode_slide's meta: [splits (the learned sinks' one included), sinks, window, the slot
        # of the window's oldest token, whether that token was kept (set in the step)]
        merged = splits + (h.sink_logits is not None)
        extra += (small_array((merged, fp16[0].shape[2] if parts == 2 else 0, h.window, h.window_slot, 0)),)
    if h.kept:
        extra += (h.kept_kernel_inputs(),)
    meta = small_array((h.count, chunk, capacity, splits))
    none = small_array((0.0,), mx.float32)
    return fn(queries.astype(q_dtype), rows, meta, h.key_mean if centered else none,
              h.value_mean if centered else none, none if key_scale is None else key_scale,
              none if h.sink_logits is None else h.sink_logits, fp16, *extra)


def attend(runner_name: str, h, queries: mx.array, scale: float) -> mx.array:
    """Decode attention of `queries` (B, Hq, 1, D) over the history's codes and fp16 tokens,
    through one compiled graph planned from the store's capacity."""
    return _run_step("attend", runner_name, h, queries, scale)


def fused(runner_name: str, h, queries: mx.array, keys: mx.array, values: mx.array, scale: float):
    """One decode step in three ops: the partial kernel over the stored tokens, a merge that
    also encodes the new token (`keys` / `values` (B, H, 1, D)) and attends to it from its
    codes (and merges the fp16 sinks / window, if any), and one slice update storing its
    row. (attention output, new rows).

    With an fp16 window the token encoded here is the one that just left the window, which
    the decode query sees from its codes: either the cache slid the window and deferred
    that token (`cache/window.py`), or, with `h.window_slot` set, `keys` / `values` are the token
    entering the window and the merge slides it (the window is a ring): the oldest token,
    at that slot, is encoded and stored and the new one takes its slot. (attention output,
    new rows, (window keys, window values)) then: the slide costs no launch of its own."""
    if h.window_slot is None:
        out, row = _run_step("fused", runner_name, h, queries, scale, keys, values)
        return out, store(h.store.rows, row, h.count)
    out, row, window_keys, window_values = _run_step("fused", runner_name, h, queries, scale, keys, values, slide=True)
    return out, store(h.store.rows, row, h.count), (window_keys, window_values)


@functools.lru_cache(maxsize=CODEC_KEYED)
def _ragged_fn(runner_name: str, key_codec, value_codec, out_shape, out_dtype, q_dtype: str, scale: float,
               kv_rows: int, capacity: int, centered: bool, mma: bool, chunk=None):
    """(plan, function) of `ragged`'s attention, planned from the buffers' capacity."""
    run = ops.runner(runner_name)
    batch = out_shape[0]
    rotate_query = ops.constants(key_codec)["signs"] is not None
    plan = launch.decode_partial_plan(mma, kv_rows, out_shape[1] // (kv_rows // batch), key_codec.dim,
                                      key_codec.bits, value_codec.bits, capacity, capacity,
                                      rotate_query=rotate_query, q_dtype=q_dtype if rotate_query else "float32",
                                      chunk=chunk, ragged_heads=kv_rows // batch)

    def attend(queries, rows, meta, counts, keys, values, bias, value_mean):
        o, ml = ops.run_partials(run, plan, queries, key_codec, value_codec, rows, scale,
                                 mx.concatenate([meta, counts]))
        return ops.merge(run, o, ml, value_codec, out_shape, out_dtype, plain=plain_partial(queries, keys, values,
                                                                                            scale, bias),
                         value_mean=value_mean if centered else None)

    return plan, (attend if runner_name == "emulator" else mx.compile(attend))


def ragged(settings, key_codec, value_codec, rows: mx.array, counts: mx.array, queries: mx.array, scale: float,
           fp16, value_mean) -> mx.array:
    """Decode attention of a batch of sequences of different lengths (`batch_decode.py`) in one
    launch of the partial kernel: sequence b's query (`queries` (B, Hq, 1, D)) over the first
    `counts[b]` code rows of `rows` (B, H, capacity, RW) and its fp16 tokens `fp16` = (keys
    centred, values, additive bias (B, 1, 1, n): -inf on empty slots)."""
    runner_name = settings.backend
    q_dtype = attention_dtype(queries)
    kv_rows, capacity = rows.shape[0] * rows.shape[1], rows.shape[2]
    mma = launch.use_mma(runner_name, settings.tensor_cores, key_codec.dim, queries.shape[1] // rows.shape[1],
                         key_codec.bits, value_codec.bits)
    plan, fn = _ragged_fn(runner_name, key_codec, value_codec, tuple(queries.shape), queries.dtype,
                          launch.dtype_name(q_dtype), float(scale), kv_rows, capacity, value_mean is not None, mma,
                          settings.split_tokens)
    _, chunk, _, splits = plan.meta["meta"]
    none = small_array((0.0,), mx.float32)
    return fn(queries.astype(q_dtype), rows, small_array((capacity, chunk, capacity, splits)), counts, *fp16,
              none if value_mean is None else value_mean)
