"""Attention over a compressed history, one segment at a time.

The history is a sequence of segments (fp16 sinks, blocks of decoded codes, the
fp16 recent window). Each block is decoded into its codec's domain, scored and
folded into an online softmax (Milakov & Gimelshein 2018; flash-decoding), so
the whole history never exists in fp16 at once. Encoded blocks are scored with
the query mapped into the key codec's domain once (q.k = Rq.Rk), and their
value sum is mapped back from the value codec's domain once at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
import math
from typing import Dict, Iterable, List, Optional, Tuple, Union

import mlx.core as mx

# 2^f for |f| <= 1/2 by the Taylor series of exp(f ln 2) to degree 6 (Horner order): relative error at most
# (ln 2 / 2)^7 / 7! < 1.2e-7, about float32's rounding step.
_EXP2_TAYLOR = tuple(math.log(2) ** k / math.factorial(k) for k in range(6, -1, -1))


def softmax_exp(x: mx.array) -> mx.array:
    """exp(x) of a softmax's shifted scores (x <= 0, float32). On the CPU, where MLX's `mx.exp` is a large share of
    a decode step over a long history (docs/decisions.md), this is a range reduction: exp(x) = 2^n 2^f with
    n = round(x log2 e), 2^f a polynomial and 2^n written as float32 exponent bits, in elementwise float32 ops (the
    product x log2 e is rounded once, hence the error's 1e-7 |x| term). It gives float32 denormals down to about
    e^-87.7 and 0 below; a NaN stays NaN (`mx.clip` keeps it). Its `mx.view` takes no `shapeless` compile."""
    if mx.default_device() != mx.cpu:
        return mx.exp(x)
    y = mx.clip(x.astype(mx.float32) * math.log2(math.e), -127.0, 0.0)
    n = mx.floor(y + 0.5)
    f = y - n
    power = _EXP2_TAYLOR[0]
    for c in _EXP2_TAYLOR[1:]:
        power = power * f + c
    return power * mx.view((n.astype(mx.int32) + 127) << 23, mx.float32)


def max_and_weights(scores: mx.array) -> Tuple[mx.array, mx.array]:
    """A block's online-softmax terms: the row max m over the last axis and exp(scores - m). A row of only masked
    (-inf) scores keeps m = -inf and is shifted by 0, so its weights are 0, not NaN."""
    m = mx.max(scores, axis=-1, keepdims=True)
    return m, softmax_exp(scores - mx.where(m == -mx.inf, 0.0, m))


@dataclass
class Segment:
    keys: mx.array  # (B, H, T, Dk) or, when encoded, (B, H, T, key domain dim)
    values: Optional[mx.array]  # (B, H, T, Dv); None when encoded (see value_fields)
    start: int  # absolute position of the first token
    encoded: bool
    extra_mask: Optional[mx.array] = None  # bool (L, T): which of these keys each query may use
    value_fields: Optional[Dict[str, mx.array]] = None  # encoded values, for value_codec.weighted_sum
    value_shift: Optional[mx.array] = None  # (B, H, 1, domain dim) added to every decoded value
    query_rows: Optional[Tuple[int, int]] = None  # only queries [a, b) score this segment (extra_mask: (b - a, T))
    positions: Optional[mx.array] = None  # (T,) the tokens' positions when not start.. in order (kept tokens)

    def decoded_values(self, value_codec) -> mx.array:
        """The values in fp32 (in the value codec's domain when encoded)."""
        if self.value_fields is None:
            return self.values.astype(mx.float32)
        values = value_codec.decode(self.value_fields)
        return values if self.value_shift is None else values + self.value_shift


def _block_mask(mask, start: int, stop: int, total: int, L: int, heads: int, repeats: int,
                positions: Optional[mx.array] = None):
    """The mask restricted to key positions [start, stop), or to `positions` when given, shaped
    for (B, H, rep, L, T) scores."""
    if mask is None:
        return None
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unsupported attention mask {mask!r}")
        first_query = total - L
        query_pos = mx.arange(first_query, total)[:, None]
        if positions is not None:
            return query_pos >= positions[None]
        if stop - 1 <= first_query:
            return None
        return query_pos >= mx.arange(start, stop)[None]
    if positions is not None:  # positions past the mask's columns are masked by the segment's own extra_mask
        block = mx.take(mask, mx.clip(positions, 0, mask.shape[-1] - 1), axis=-1)
    else:
        block = mask[..., start:stop]
    if block.ndim == 4:
        if block.shape[1] == heads * repeats and heads * repeats > 1:
            block = block.reshape(block.shape[0], heads, repeats, *block.shape[2:])
        else:
            block = mx.expand_dims(block, 2)
    return block


def _take(state: Optional[mx.array], rows: Optional[Tuple[int, int]]) -> Optional[mx.array]:
    return state if state is None or rows is None else state[..., rows[0] : rows[1], :]


def _put(state: Optional[mx.array], parts: List[Tuple[Tuple[int, int], Optional[mx.array]]], L: int):
    """`state` (L query rows) with each (rows, part) of `parts` (disjoint rows) written in,
    in one concatenation."""
    parts = sorted((rows, part) for rows, part in parts if part is not None)
    if not parts:
        return state
    if state is None:  # an accumulator that only these rows have reached so far
        state = mx.zeros((*parts[0][1].shape[:-2], L, parts[0][1].shape[-1]), parts[0][1].dtype)
    pieces, row = [], 0
    for (a, b), part in parts:
        pieces += [state[..., row:a, :], part]
        row = b
    pieces.append(state[..., row:, :])
    return mx.concatenate(pieces, axis=-2)


def sink_scores(sink_logits: mx.array, queries: mx.array, key_mean: Optional[mx.array], scale: float) -> mx.array:
    """The learned sinks' logits as the scores of keys centred by `key_mean` meet them, per query row:
    (B, n_heads, L, 1). Centring takes q.mean off every score of a query, which its softmax
    over keys alone does not see, but a sink's fixed logit does: it loses as much."""
    B, n_heads, L, dim = queries.shape
    sinks = sink_logits.astype(mx.float32).reshape(1, n_heads, 1, 1)
    if key_mean is None:
        return mx.broadcast_to(sinks, (B, n_heads, L, 1))
    kv_heads = key_mean.shape[1]
    q = (queries.astype(mx.float32) * scale).reshape(B, kv_heads, n_heads // kv_heads * L, dim)
    shift = (q @ key_mean.astype(mx.float32).swapaxes(-1, -2)).reshape(B, n_heads, L, 1)
    return sinks - shift


def attend(
    queries: mx.array,
    segments: Iterable[Segment],
    *,
    scale: float,
    mask: Optional[Union[str, mx.array]],
    key_codec,
    value_codec,
    kv_heads: int,
    total: int,
    sink_logits: Optional[mx.array] = None,
    key_mean: Optional[mx.array] = None,
) -> mx.array:
    """`sink_logits` (n_q_heads,): learned attention sinks (GPT-OSS), one logit per query head that joins
    the softmax's denominator and adds no value; `key_mean`: what the segments' keys are centred by
    (`sink_scores`)."""
    B, n_q_heads, L, _ = queries.shape
    repeats = n_q_heads // kv_heads
    q = (queries.astype(mx.float32) * scale).reshape(B, kv_heads, repeats, L, -1)
    q_domain = None
    running_max = running_sum = plain_acc = domain_acc = None
    # Results of consecutive row-limited segments (disjoint rows), written in together.
    pending: Dict[str, list] = {"max": [], "sum": [], "plain": [], "domain": []}

    def write_pending():
        nonlocal running_max, running_sum, plain_acc, domain_acc
        running_max, running_sum = _put(running_max, pending["max"], L), _put(running_sum, pending["sum"], L)
        plain_acc, domain_acc = _put(plain_acc, pending["plain"], L), _put(domain_acc, pending["domain"], L)
        for parts in pending.values():
            parts.clear()

    for seg in segments:
        rows = seg.query_rows
        if rows is None and pending["max"]:
            write_pending()
        if seg.encoded:
            if q_domain is None:
                q_domain = key_codec.to_domain(q)
            q_seg = q_domain
        else:
            q_seg = q
        if rows is not None:
            q_seg = q_seg[..., rows[0] : rows[1], :]
            if running_max is None:  # the other rows' state must exist to be kept
                running_max = mx.full((B, kv_heads, repeats, L, 1), -mx.inf)
                running_sum = mx.zeros((B, kv_heads, repeats, L, 1))
        keys = mx.expand_dims(seg.keys.astype(mx.float32), 2)
        scores = q_seg @ keys.swapaxes(-1, -2)
        block = _block_mask(mask, seg.start, seg.start + keys.shape[-2], total, L, kv_heads, repeats, seg.positions)
        if block is not None and rows is not None and block.shape[-2] == L:
            block = block[..., rows[0] : rows[1], :]
        if seg.extra_mask is not None:
            if block is None:
                block = seg.extra_mask
            elif block.dtype == mx.bool_:
                block = block & seg.extra_mask
            else:
                block = mx.where(seg.extra_mask, block, -mx.inf)
        if block is not None:
            if block.dtype == mx.bool_:
                scores = mx.where(block, scores, -mx.inf)
            else:
                scores = scores + block.astype(mx.float32)

        # The online-softmax state of the rows this segment updates (all rows unless query_rows).
        old_max, old_sum = _take(running_max, rows), _take(running_sum, rows)
        old_plain, old_domain = _take(plain_acc, rows), _take(domain_acc, rows)
        block_max = mx.max(scores, axis=-1, keepdims=True)
        new_max = block_max if old_max is None else mx.maximum(old_max, block_max)
        # A row that has seen only masked keys keeps max -inf; shift by 0 so exp gives 0, not nan.
        shift = mx.where(new_max == -mx.inf, 0.0, new_max)
        probs = softmax_exp(scores - shift)
        block_sum = mx.sum(probs, axis=-1, keepdims=True)
        if seg.value_fields is None:
            weighted = probs @ mx.expand_dims(seg.values.astype(mx.float32), 2)
        else:
            weighted = value_codec.weighted_sum(probs, seg.value_fields)
            if seg.value_shift is not None:
                weighted = weighted + block_sum * mx.expand_dims(seg.value_shift, 2)
        if old_max is None:
            new_sum = block_sum
        else:
            correction = mx.exp(old_max - shift)
            new_sum = old_sum * correction + block_sum
            old_plain = None if old_plain is None else old_plain * correction
            old_domain = None if old_domain is None else old_domain * correction
        if seg.encoded:
            old_domain = weighted if old_domain is None else old_domain + weighted
        else:
            old_plain = weighted if old_plain is None else old_plain + weighted
        if rows is None:
            running_max, running_sum, plain_acc, domain_acc = new_max, new_sum, old_plain, old_domain
        else:
            for name, part in (("max", new_max), ("sum", new_sum), ("plain", old_plain), ("domain", old_domain)):
                pending[name].append((rows, part))
    write_pending()

    if running_max is None:
        raise ValueError("attention over an empty cache")
    out = value_codec.from_domain(domain_acc) if domain_acc is not None else 0.0
    if plain_acc is not None:
        out = out + plain_acc
    if sink_logits is not None:
        sink = sink_scores(sink_logits, queries, key_mean, scale).reshape(B, kv_heads, repeats, L, 1)
        # The sink's term at the running max; a row that saw only masked keys takes it at 0 (its output stays 0).
        running_sum = running_sum + mx.exp(sink - mx.where(running_max == -mx.inf, 0.0, running_max))
    out = out / mx.maximum(running_sum, 1e-30)
    return out.reshape(B, n_q_heads, L, -1).astype(queries.dtype)
