"""The portable path: the kernels' maths in MLX ops (any device, the CPU included).

Same contract as the kernels in `ops.py`: `mse_partials` returns per-split
(o, m, l) in the value codec's domain, `merge` merges them with the fp16
sinks/window partial (`engine.merge_partials`), un-rotates once and divides. The per-split
softmax step is compiled with `mx.compile`; codes are decoded one split at a
time, so at most `chunk` tokens exist in float at once.
"""

from __future__ import annotations

from typing import Optional, Tuple

import functools
import math

import mlx.core as mx
import numpy as np

from ..attention import softmax_exp
from ..engine import CODEC_KEYED, kept_splits, merge_partials, plain_partial, with_sink_split
from ..packing import unpack

PORTABLE_CHUNK = 4096


@mx.compile
def _codes_step(q: mx.array, keys: mx.array, knorm: mx.array, values: mx.array, vnorm: mx.array):
    """Like `_split_step` with unit-norm decoded codes and their norms (B, H, n, 1):
    the norms scale the n scores and the n weights instead of n x D coordinates."""
    scores = (q @ keys.swapaxes(-1, -2)) * knorm.astype(mx.float32).swapaxes(-1, -2)
    m = mx.max(scores, axis=-1, keepdims=True)
    p = softmax_exp(scores - m)
    weights = p * vnorm.astype(mx.float32).swapaxes(-1, -2)
    return weights @ values, m, mx.sum(p, axis=-1, keepdims=True)


# ---- decoding codes with a lookup table of code groups -----------------------------

_LUT_BYTES = 4 << 20


def _group(dim: int, bits: int):
    """Codes per table row g (g * bits <= 16, dim % g == 0, table <= 4 MB) and the
    repeating pattern of g*bits-bit fields over whole uint32 words, or None."""
    if dim * bits % 32:
        return None
    for g in range(16 // bits, 0, -1):
        field = g * bits
        if dim % g or (1 << field) * g * 4 > _LUT_BYTES:
            continue
        period = math.lcm(field, 32)
        words = period // 32
        if (dim * bits // 32) % words == 0:
            return g, field, words, period // field
    return None


def _codebook_table(codec, g: int):
    """(2^(g*b), g) float32: the centroids of the g codes packed in each g*b-bit value."""
    table = getattr(codec, "_vq_group_table", None)
    if table is None or table.shape[1] != g:
        cent = np.array(codec.centroids, dtype=np.float32)
        idx = np.arange(1 << (g * codec.bits))
        mask = (1 << codec.bits) - 1
        table = mx.array(np.stack([cent[(idx >> (codec.bits * k)) & mask] for k in range(g)], axis=1))
        codec._vq_group_table = table
    return table


def decode_unit(codec, codes: mx.array) -> mx.array:
    """centroids[codes] without the norm, (..., T, D) float32. One gather per g codes
    (a g*b-bit field of the packed stream indexes a table of centroid g-tuples):
    gathers cost per index on the CPU."""
    plan = _group(codec.dim, codec.bits)
    if plan is None:
        return mx.take(codec.centroids.astype(mx.float32), unpack(codes, codec.bits, codec.dim))
    g, field, nw, nf = plan
    *lead, w = codes.shape
    blocks = codes.reshape(*lead, w // nw, nw)
    words = [blocks[..., i] for i in range(nw)]
    mask = (1 << field) - 1
    fields = []
    for f in range(nf):
        start = f * field
        w0, s = start >> 5, start & 31
        v = words[w0] >> s if s else words[w0]
        if s + field > 32:
            v = v | (words[w0 + 1] << (32 - s))
        fields.append(v & mask if field < 32 else v)
    index = mx.stack(fields, axis=-1).reshape(-1)
    return mx.take(_codebook_table(codec, g), index, axis=0).reshape(*lead, codec.dim)


def _rows(fields, start: int, stop: int):
    return {name: buf[..., start:stop, :] for name, buf in fields.items()}


def domain_queries(queries: mx.array, key_codec, kv_heads: int, scale: float) -> mx.array:
    """(B, Hq, L, D) queries -> (B, kv_heads, REP*L, D) float32, scaled and in the key domain."""
    B, n_heads, L, dim = queries.shape
    q = (queries.astype(mx.float32) * scale).reshape(B, kv_heads, n_heads // kv_heads * L, dim)
    return key_codec.to_domain(q)


def mse_partials(queries: mx.array, key_codec, value_codec, key_fields, value_fields, tokens: int,
                 scale: float, chunk: Optional[int] = None):
    """(o (BH, S, REP, Dv) value domain, ml (BH, S, REP, 2)) over rows [0, tokens) of the buffers."""
    B, n_heads, L, dim = queries.shape
    kv_heads = key_fields["codes"].shape[1]
    rep = n_heads // kv_heads
    q = domain_queries(queries, key_codec, kv_heads, scale)
    chunk = chunk or PORTABLE_CHUNK
    outs, stats = [], []
    for start in range(0, tokens, chunk):
        stop = min(start + chunk, tokens)
        k = _rows(key_fields, start, stop)
        v = _rows(value_fields, start, stop)
        o, m, l = _codes_step(q, decode_unit(key_codec, k["codes"]), k["norm"],
                              decode_unit(value_codec, v["codes"]), v["norm"])
        outs.append(o)
        stats.append(mx.concatenate([m, l], axis=-1))
    o = mx.stack(outs, axis=2).reshape(B * kv_heads, len(outs), rep * L, -1)
    ml = mx.stack(stats, axis=2).reshape(B * kv_heads, len(outs), rep * L, 2)
    return o, ml


def merge(o: mx.array, ml: mx.array, h, queries: mx.array, scale: float) -> mx.array:
    """The partials merged with the history's fp16 sinks/window (if any), un-rotated and
    divided, in one compiled graph on the CPU (a decode step's ~25 small ops, fused; the
    shapes repeat from one step to the next once the window is full). Tokens kept in fp16 past the
    window (`kept.py`): two more splits take their codes' share out and add their fp16
    (`engine.kept_splits`)."""
    fp16 = h.fp16
    if h.kept:
        o, ml = kept_splits(h, queries, scale, o, ml)
    o, ml = with_sink_split(o, ml, h.sink_logits, h.value_codec, h.value_mean, queries, h.key_mean, scale)
    if fp16 is None:
        return merge_partials(o, ml, h.value_codec, queries.shape, queries.dtype, value_mean=h.value_mean)
    fn = _merge_with_plain_fn(h.value_codec, tuple(queries.shape), queries.dtype, float(scale),
                              h.value_mean is not None)
    return fn(o, ml, queries, *fp16, h.value_mean if h.value_mean is not None else ml)  # unused when None


@functools.lru_cache(maxsize=CODEC_KEYED)
def _merge_with_plain_fn(value_codec, out_shape: Tuple[int, ...], out_dtype, scale: float, centered: bool):
    def merged(o, ml, queries, keys, values, value_mean):
        plain = plain_partial(queries, keys, values, scale)
        return merge_partials(o, ml, value_codec, out_shape, out_dtype, plain=plain,
                              value_mean=value_mean if centered else None)

    return mx.compile(merged)
