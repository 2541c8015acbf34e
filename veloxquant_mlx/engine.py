"""The attention engine: a registry of attention paths over a read-only view of the history.

A path is a `(supports, run)` pair registered for a phase (torchao's quantized-linear
dispatch table):

* "decode": one query per head;
* "prefill": a chunk of queries;
* "decode_store": one query per head, and the cache's pending token is encoded,
  attended to and stored by the same kernels (returns `(out, rows)`); with a full fp16
  window the pending token may instead be one entering it (`History.window_slot`), and
  the path slides the window too.

Per-format kernels register their own paths in their own modules (`kernels/` for the
"mse" format family); this module registers the paths that serve every format:
a compiled decode step that decodes the codes with the codec's MLX ops, and GPU decode
and prefill paths that decode the history and run MLX's fused attention. The generic
blockwise path (`attention.attend`) is the fallback, always correct. A new method adds
a codec with a `Format`; it needs no change here, and a kernel for its format
registers itself.
"""

from __future__ import annotations

import functools
import math
import os
import threading
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import mlx.core as mx

from .attention import Segment, attend as generic_attend, max_and_weights, sink_scores
from .formats import RowLayout
from .methods.base import at_positions
from .settings import EngineSettings, cuda_available

PHASES = ("decode", "prefill", "decode_store")
DECODE_SPLIT = 4096  # tokens decoded at once by the compiled decode step


class History:
    """What an attention path may read. Paths never reach into the cache: they get this
    view (the store's codes, the fp16 sinks and window, the centering means, the settings)
    and return the attention output; a "decode_store" path also returns the rows it wrote."""

    def __init__(self, *, store, key_codec, value_codec, kv_heads: int, offset: int, sinks: int, window: int,
                 key_mean, value_mean, settings: EngineSettings, fp16: Callable[[], Optional[Tuple]],
                 segments: Callable[[int, int], Iterable[Segment]], band: bool, pending=None,
                 recent: Optional[Callable[[], Optional[Tuple]]] = None, fp16_from: Optional[Callable] = None,
                 fp16_parts: Optional[Callable[..., Tuple]] = None, window_slot: Optional[int] = None,
                 window_capacity: Optional[int] = None, kept: Optional[Callable[[], Tuple]] = None):
        self.store, self.key_codec, self.value_codec = store, key_codec, value_codec
        self.kv_heads, self.offset, self.sinks, self.window = kv_heads, offset, sinks, window
        self.key_mean, self.value_mean, self.settings = key_mean, value_mean, settings
        self._fp16, self.segments, self.band, self.pending = fp16, segments, band, pending
        self._recent, self.fp16_from = recent, fp16_from
        self._fp16_parts = fp16_parts
        # Set when `pending` is a token entering the full fp16 window rather than one to store:
        # the window (the last of `fp16_inputs`) is a ring whose oldest token, at this slot,
        # is the one to encode and store; a "decode_store" path that takes such a history
        # (`window_slot` is not None) returns (out, rows, (window keys, window values)), the
        # window after the new token took that slot.
        self.window_slot = window_slot
        # Set when the window is held in a buffer of this many tokens, `window` of them filled
        # (cache/window.py, `_tail_append`): `fp16_inputs(held=True)` hands over the whole buffer.
        self.window_capacity = window_capacity
        # Set when the history has fp16 tokens kept past the window (`kept.py`), their codes masked
        # out: `kept_slots` and `kept_code_bias` give them to paths registered with `takes_kept`;
        # the generic path reads them as a segment. (the cache's `KeptTokens`, its first code's position)
        self._kept = kept
        # Learned attention sinks of this call (GPT-OSS), (n_q_heads,): one logit per query head that joins
        # the softmax's denominator and adds no value; paths registered with `takes_sinks` add them
        # (`with_sink_split`), the others are not chosen.
        self.sink_logits: Optional[mx.array] = None

    @property
    def kept(self) -> bool:
        return self._kept is not None

    @functools.cached_property
    def kept_slots(self) -> Tuple[mx.array, mx.array, mx.array, mx.array]:
        """(keys (not centred), values, slot bias (slots,), code rows (slots,)): the kept tokens'
        slots, with 0 added to the scores of the slots that hold a token and -inf to the empty
        ones, and the store row of each slot's codes."""
        kept, first_code = self._kept
        keys, values, _ = kept.held()
        return keys, values, kept.slot_bias(), kept.code_rows(first_code)

    def kept_kernel_inputs(self) -> List[mx.array]:
        """[keys, values, positions, meta] of the kept slots as held, the spare one (EMPTY, never read)
        included, and meta = [stored rows, first code's position, rows' capacity, slots]: what
        `kernels.ops.kept_splits` takes."""
        kept, first_code = self._kept
        meta = small_array((self.count, first_code, self.store.rows.shape[2], kept.positions.shape[0]))
        return [kept.keys, kept.values, kept.positions, meta]

    def kept_code_bias(self) -> mx.array:
        """(store capacity,) -inf added to the scores of the kept tokens' codes, 0 to the others."""
        kept, first_code = self._kept
        return kept.code_bias(first_code, self.store.capacity)

    @property
    def count(self) -> int:
        """Tokens held as codes."""
        return self.store.count

    @property
    def layout(self):
        return getattr(self.store, "layout", None)

    @functools.cached_property
    def fp16(self) -> Optional[Tuple[mx.array, mx.array]]:
        """(keys, values) of the sinks and the window in position order (keys centered), or None."""
        return self._fp16()

    def fp16_inputs(self, held: bool = False) -> Tuple[int, List[mx.array]]:
        """(parts, arrays) for a compiled decode step: the fp16 sinks' and window's keys and
        values as held, which `fp16_tokens` centres and joins inside the step's graph (op by
        op outside it, as `fp16` does, they would cost launches on every step). parts: 0-2.
        `held`: for a path that reads a window buffer of fixed capacity whole (`window_capacity`
        set), its filled tokens being the first `window`: the buffer, not a view of them."""
        if self._fp16_parts is None:  # a history made without the raw parts
            fp16 = self.fp16
            return (0, []) if fp16 is None else (-1, list(fp16))
        parts = self._fp16_parts(held=held)
        return len(parts), [a for part in parts for a in part]

    def recent(self) -> Optional[Tuple[mx.array, mx.array, int]]:
        """With a band: (keys (centered), values, first position) of the tokens this update
        encoded followed by the window, in fp16; queries of the chunk see each of them either
        from its codes or from these, by `fp16_from` (cache/window.py)."""
        return self._recent()


@dataclass(frozen=True)
class AttentionPath:
    name: str
    phase: str
    supports: Callable[[History, mx.array, object], bool]
    run: Callable
    priority: int = 0
    takes_kept: bool = False  # reads `History.kept_slots` (tokens kept in fp16 past the window)
    takes_sinks: bool = False  # adds `History.sink_logits` (learned attention sinks) to the softmax


_PATHS: Dict[str, List[AttentionPath]] = {phase: [] for phase in PHASES}


def register_path(name: str, phase: str, supports: Callable, priority: int = 0, takes_kept: bool = False,
                  takes_sinks: bool = False):
    """Decorator: register `run(history, queries, scale, mask)` for `phase`, tried before
    paths of lower `priority` (kernels for one format above the paths for every format);
    `takes_kept`: it attends to `History.kept_slots` too (and masks those tokens' codes);
    `takes_sinks`: it adds `History.sink_logits` (learned attention sinks) to the softmax."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")

    def register(run):
        paths = [p for p in _PATHS[phase] if p.name != name]
        paths.append(AttentionPath(name, phase, supports, run, priority, takes_kept, takes_sinks))
        _PATHS[phase] = sorted(paths, key=lambda p: -p.priority)
        return run

    return register


def paths(phase: str) -> List[AttentionPath]:
    return list(_PATHS[phase])


def choose(phase: str, history: History, queries: mx.array, mask=None) -> Optional[AttentionPath]:
    """The first registered path of `phase` that takes this call, or None (generic)."""
    if not history.settings.kernels:
        return None
    skipped = None  # a path that would have taken the call but does not read kept tokens
    for path in _PATHS[phase]:
        if history.sink_logits is not None and not path.takes_sinks:
            continue
        if path.supports(history, queries, mask):
            if history.kept and not path.takes_kept:
                skipped = skipped or path.name
                continue
            if skipped:
                _warn_kept(skipped, path.name)
            return path
    if skipped:
        _warn_kept(skipped, "generic")
    return None


@functools.lru_cache(maxsize=None)
def _warn_kept(skipped: str, used: str):
    """Once per pair of paths and process."""
    warnings.warn(f"veloxquant_mlx: keep_attended: the {skipped!r} attention path does not read tokens kept in fp16 "
                  f"past the window, so these calls run on the {used!r} path", RuntimeWarning, stacklevel=4)


def defers(history: History) -> bool:
    """Whether a decode token may wait for the attention call: some "decode_store" path takes
    this history (asked with queries=None: a path that says yes then must take the call)."""
    if not history.settings.kernels:
        return False
    return any(path.supports(history, None, None) for path in _PATHS["decode_store"]
               if path.takes_sinks or history.sink_logits is None)


def generic(history: History, queries: mx.array, scale: float, mask=None) -> mx.array:
    """The always-correct path: blockwise online softmax over decoded segments."""
    return generic_attend(
        queries, history.segments(queries.shape[1] * queries.shape[2], queries.shape[2]), scale=scale, mask=mask,
        key_codec=history.key_codec, value_codec=history.value_codec, kv_heads=history.kv_heads,
        total=history.offset, sink_logits=history.sink_logits, key_mean=history.key_mean,
    )


def plain_mask(mask) -> bool:
    """No mask, or the causal one (which a single query, or a history in position order, satisfies)."""
    return mask is None or (isinstance(mask, str) and mask == "causal")


# The most fp16 sink + window tokens a merge kernel attends to itself (4 bytes of shared memory each):
# the only way a path's `supports` depends on how many fp16 tokens there are, so a cache memoises
# its routes on which side of it the sinks and window are, not on the window's length.
FP16_HELD_LIMIT = 1024

# Entries of the caches keyed by codecs (compiled steps, kernel programs, encoders): calibrated
# methods have codecs per layer (80 layers in Llama-3.1-70B) and a decode step asks for every
# layer's, so a smaller cache would be evicted, and every entry built again, at each step.
CODEC_KEYED = 1024


# ---- encoding rows -------------------------------------------------------------------------------

_ENCODERS: List[Tuple[Callable, Callable]] = []


def register_encoder(supports: Callable):
    """Decorator: `make(layout, key_codec, value_codec, settings)` -> encode(keys, values), where
    `supports(layout, key_codec, value_codec, settings)`: a kernel that encodes a format in one
    launch. `layout` is the `RowStore`'s row layout (encode returns rows), or None for a
    `FieldStore` (encode returns (key fields, value fields)). The last registered that supports
    a store encodes for it; the codecs' MLX ops do where none does."""

    def register(make):
        _ENCODERS.insert(0, (supports, make))
        return make

    return register


def _registered_encoder(layout, key_codec, value_codec, settings: EngineSettings) -> Optional[Callable]:
    for supports, make in _ENCODERS:
        if settings.kernels and supports(layout, key_codec, value_codec, settings):
            return make(layout, key_codec, value_codec, settings)
    return None


class TokenEncoder:
    """`many(keys, values)`: a chunk's rows, or fields (already centered). `one(keys, values, key_mean,
    value_mean)`: one decode token's, centering included, replayed from one compiled graph (shared
    by every layer of those codecs) where the settings allow."""

    def __init__(self, encode: Callable, compiled: bool):
        def centered(keys, values, key_mean, value_mean):
            return encode(keys.astype(mx.float32) - key_mean, values.astype(mx.float32) - value_mean)

        self.many = encode
        self._plain = mx.compile(encode) if compiled else encode
        self._centered = mx.compile(centered) if compiled else centered

    def one(self, keys, values, key_mean=None, value_mean=None):
        if key_mean is None:
            return self._plain(keys, values)
        return self._centered(keys, values, key_mean, value_mean)


@functools.lru_cache(maxsize=CODEC_KEYED)
def row_encoder(layout, key_codec, value_codec, settings: EngineSettings) -> TokenEncoder:
    encode = _registered_encoder(layout, key_codec, value_codec, settings)
    if encode is None:
        def encode(keys, values):
            return layout.pack(key_codec.encode(keys), value_codec.encode(values))
    return TokenEncoder(encode, _compiles_encoder(settings))


@functools.lru_cache(maxsize=CODEC_KEYED)
def field_encoder(key_codec, value_codec, settings: EngineSettings) -> TokenEncoder:
    """(keys, values) -> (key fields, value fields) for a `FieldStore`."""
    encode = _registered_encoder(None, key_codec, value_codec, settings)
    if encode is None:
        def encode(keys, values):
            return key_codec.encode(keys), value_codec.encode(values)
    return TokenEncoder(encode, _compiles_encoder(settings))


def _compiles_encoder(settings: EngineSettings) -> bool:
    return settings.compile_step and settings.backend != "emulator"


# ---- small shared constants ----------------------------------------------------------------

_SMALL: Dict[tuple, mx.array] = {}


def attention_dtype(queries: mx.array):
    """The float dtype attention runs in for these queries: theirs, or float32 for others."""
    return queries.dtype if queries.dtype in (mx.float16, mx.bfloat16, mx.float32) else mx.float32


def small_array(values: Tuple, dtype=mx.int32) -> mx.array:
    """A tiny constant array shared by every call with the same values (all layers of a
    decoding step pass the same token count): one host-to-device copy, not one per layer."""
    key = (values, dtype)
    arr = _SMALL.get(key)
    if arr is None:
        if len(_SMALL) > 1024:
            _SMALL.clear()
        arr = _SMALL[key] = mx.array(list(values), dtype=dtype)
    return arr


# ---- decode for every format: one compiled graph per layout ------------------------------------

def merge_partials(o: mx.array, ml: mx.array, value_codec, out_shape: Tuple[int, ...], out_dtype,
                   plain: Optional[Tuple[mx.array, mx.array]] = None,
                   value_mean: Optional[mx.array] = None) -> mx.array:
    """Softmax-merge per-split partials o (BH, S, REP, Dv) in the value domain and
    ml (BH, S, REP, 2) = (max, sum), with an optional `plain` partial over fp16 tokens
    (o (BH*REP, Dv), ml (BH*REP, 2)); un-map the value domain once, add the value mean."""
    bh, splits, rep, dim = o.shape
    m, l = ml[..., 0:1], ml[..., 1:2]
    big = mx.max(m, axis=1, keepdims=True)
    safe = mx.where(big == -mx.inf, 0.0, big)
    e = mx.where(m == -mx.inf, 0.0, mx.exp(m - safe))
    total = mx.sum(e * l, axis=1)  # (BH, REP, 1)
    acc = value_codec.from_domain(mx.sum(e * o, axis=1))  # (BH, REP, Dv)
    if value_mean is not None:
        acc = acc + total * value_mean.astype(mx.float32).reshape(bh, 1, -1)
    if plain is not None:
        po, pml = plain
        po = po.reshape(bh, rep, -1)
        pm, pl = pml[:, 0:1].reshape(bh, rep, 1), pml[:, 1:2].reshape(bh, rep, 1)
        big = big.reshape(bh, rep, 1)
        top = mx.maximum(big, pm)
        top = mx.where(top == -mx.inf, 0.0, top)
        ec = mx.where(big == -mx.inf, 0.0, mx.exp(big - top))
        ep = mx.where(pm == -mx.inf, 0.0, mx.exp(pm - top))
        acc = acc * ec + po * ep
        total = total * ec + pl * ep
    out = acc / mx.maximum(total, 1e-30)
    return out.reshape(*out_shape[:-1], -1).astype(out_dtype)  # the values' dim (DeepSeek-V2: keys 192, values 128)


def with_sink_split(o: mx.array, ml: mx.array, sink_logits: Optional[mx.array], value_codec,
                    value_mean: Optional[mx.array], queries: Optional[mx.array] = None,
                    key_mean: Optional[mx.array] = None, scale: float = 1.0) -> Tuple[mx.array, mx.array]:
    """The splits o (BH, S, REP, Dv), ml (BH, S, REP, 2) of a decode path with one more for the learned
    attention sinks `sink_logits` (n_q_heads,) (GPT-OSS): one more term of the online softmax, of max the
    sink's logit (`sink_scores`: less q.mean where keys are centred) and sum 1 at it, that adds no value.
    Its o is 0, or, where the merge adds the value mean back to every split's sum (centred values), minus
    that mean in the value domain, so that it adds nothing there either. Every merge (`merge_partials`,
    the merge kernels) takes it as any split."""
    if sink_logits is None:
        return o, ml
    bh, _, rep, dim = o.shape
    if key_mean is None:
        kv_heads = sink_logits.shape[0] // rep
        m = mx.broadcast_to(sink_logits.astype(mx.float32).reshape(1, kv_heads, rep, 1),
                            (bh // kv_heads, kv_heads, rep, 1))
    else:
        m = sink_scores(sink_logits, queries, key_mean, scale)  # one query: (B, n_heads, 1, 1)
    m = m.reshape(bh, 1, rep, 1)
    if value_mean is None:
        sink_o = mx.zeros((bh, 1, rep, dim), mx.float32)
    else:
        shift = value_codec.to_domain(value_mean.astype(mx.float32)).reshape(bh, 1, 1, dim)
        sink_o = mx.broadcast_to(-shift, (bh, 1, rep, dim))
    return (mx.concatenate([o, sink_o.astype(o.dtype)], axis=1),
            mx.concatenate([ml, mx.concatenate([m, mx.ones_like(m)], axis=-1).astype(ml.dtype)], axis=1))


def fp16_tokens(parts: int, arrays: List[mx.array], key_mean: Optional[mx.array]):
    """Inside a compiled step: the (keys (centred), values) of `History.fp16_inputs`, as
    `History.fp16` gives them; None for no fp16 tokens."""
    if parts == 0:
        return None
    if parts < 0:  # already joined and centred
        return arrays[0], arrays[1]
    keys = [arrays[2 * i] if key_mean is None else arrays[2 * i].astype(mx.float32) - key_mean for i in range(parts)]
    values = [arrays[2 * i + 1] for i in range(parts)]
    if parts == 1:
        return keys[0], values[0]
    return mx.concatenate([k.astype(mx.float32) for k in keys], axis=2), mx.concatenate(values, axis=2)


def plain_partial(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                  bias: Optional[mx.array] = None):
    """A partial over fp16 tokens (sinks + window): (o (B*Hq, Dv), ml (B*Hq, 2)), float32;
    `bias` (T,) is added to every query's scores."""
    B, n_heads, L, dim = queries.shape
    kv_heads = keys.shape[1]
    q = (queries.astype(mx.float32) * scale).reshape(B, kv_heads, n_heads // kv_heads * L, dim)
    scores = q @ keys.astype(mx.float32).swapaxes(-1, -2)
    if bias is not None:
        scores = scores + bias
    m, p = max_and_weights(scores)
    o = p @ values.astype(mx.float32)
    ml = mx.concatenate([m, mx.sum(p, axis=-1, keepdims=True)], axis=-1)
    return o.reshape(B * n_heads * L, -1), ml.reshape(B * n_heads * L, 2)


def kept_splits(h: History, queries: mx.array, scale: float, o: mx.array, ml: mx.array) -> Tuple[mx.array, mx.array]:
    """The splits (o (BH, S, REP, Dv), ml (BH, S, REP, 2)) of a decode path whose partials scored
    every stored code, the kept tokens' among them, with the two of `kept_partials` after them, so
    that merged, the kept tokens count once, in fp16. One compiled graph per layout and slot count."""
    if h.layout is not None:  # one row per token: the kept tokens' rows, then their fields
        h.store.flush()
        fields, key_bufs, value_bufs = h.layout, [h.store.rows], []
    else:
        fields, _, key_bufs, value_bufs = h.store.capacity_inputs()
    centered = h.key_mean is not None, h.value_mean is not None
    none = small_array((0.0,), mx.float32)
    fn = _kept_splits_fn(h.key_codec, h.value_codec, fields, h.kv_heads, float(scale), tuple(queries.shape),
                         centered)
    o_kept, ml_kept = fn(queries, key_bufs, value_bufs, *h.kept_slots, h.key_mean if centered[0] else none,
                         h.value_mean if centered[1] else none)
    return mx.concatenate([o, o_kept], axis=1), mx.concatenate([ml, ml_kept], axis=1)


@functools.lru_cache(maxsize=CODEC_KEYED)
def _kept_splits_fn(key_codec, value_codec, fields, kv_heads: int, scale: float, query_shape: Tuple[int, ...],
                    centered: Tuple[bool, bool]):
    def splits(queries, key_bufs, value_bufs, keys, values, slot_bias, rows, key_mean, value_mean):
        return kept_partials(key_codec, value_codec, fields, kv_heads, scale, queries, key_bufs, value_bufs, keys,
                             values, slot_bias, rows, key_mean if centered[0] else None,
                             value_mean if centered[1] else None)

    return mx.compile(splits)


def kept_partials(key_codec, value_codec, fields, kv_heads: int, scale: float, queries: mx.array, key_bufs,
                  value_bufs, keys: mx.array, values: mx.array, slot_bias: mx.array, rows: mx.array,
                  key_mean: Optional[mx.array], value_mean: Optional[mx.array]):
    """Two splits over the kept tokens (`History.kept_slots`: keys, values, slot bias, code rows) for
    one decode query per head, in the codecs' value domain (values centred where the cache centres
    them): (o (BH, 2, REP, Dv), ml (BH, 2, REP, 2)).

    The first holds minus their codes' terms, scored as the partials scored them (a difference of
    sums of positive terms in fp32: a relative error of the order of the kept codes' share of the
    codes' mass times fp32's epsilon), the second the tokens in fp16. `fields`: a `RowLayout`
    (`key_bufs` [the store's rows]) or the (key, value) field names of `capacity_inputs`. (The kernel
    back ends: `kernels.ops.kept_splits`, one kernel.)"""
    B, n_heads, _, dim = queries.shape
    rep = n_heads // kv_heads
    if isinstance(fields, RowLayout):
        key_fields, value_fields = fields.views(mx.take(key_bufs[0], rows, axis=2))
    else:
        key_fields = {n: mx.take(b, rows, axis=2) for n, b in zip(fields[0], key_bufs)}
        value_fields = {n: mx.take(b, rows, axis=2) for n, b in zip(fields[1], value_bufs)}
    q = (queries.astype(mx.float32) * scale).reshape(B, kv_heads, rep, dim)
    codes = key_codec.score(key_codec.to_domain(q), key_fields) + slot_bias  # (B, H, REP, slots)
    keys = keys.astype(mx.float32) - key_mean if key_mean is not None else keys.astype(mx.float32)
    fp16 = q @ keys.swapaxes(-1, -2) + slot_bias
    values = values.astype(mx.float32)
    values = value_codec.to_domain(values - value_mean if value_mean is not None else values)

    m_codes, p_codes = max_and_weights(codes)
    m_fp16, p_fp16 = max_and_weights(fp16)
    o = mx.stack([-value_codec.weighted_sum(mx.expand_dims(p_codes, 3), value_fields).squeeze(3), p_fp16 @ values],
                 axis=2)  # (B, H, 2, REP, Dv)
    ml = mx.stack([mx.concatenate([m_codes, -mx.sum(p_codes, axis=-1, keepdims=True)], axis=-1),
                   mx.concatenate([m_fp16, mx.sum(p_fp16, axis=-1, keepdims=True)], axis=-1)], axis=2)
    return o.reshape(B * kv_heads, 2, rep, -1), ml.reshape(B * kv_heads, 2, rep, 2)


def with_kept_fp16(tokens: Optional[Tuple[mx.array, mx.array]], kept_keys: mx.array, kept_values: mx.array,
                   slot_bias: mx.array, key_mean: Optional[mx.array]):
    """(keys, values, bias) of `tokens` (the fp16 sinks/window, keys centred, or None) with the kept
    tokens' fp16 slots (`History.kept_slots`) after them, and the bias (0 or -inf per slot) that
    masks the empty slots."""
    kept_keys = kept_keys.astype(mx.float32) - key_mean if key_mean is not None else kept_keys
    if tokens is None:
        return kept_keys, kept_values, slot_bias
    bias = mx.concatenate([mx.zeros((tokens[0].shape[2],)), slot_bias])
    return (mx.concatenate([tokens[0].astype(mx.float32), kept_keys.astype(mx.float32)], axis=2),
            mx.concatenate([tokens[1], kept_values.astype(tokens[1].dtype)], axis=2), bias)


def _slice_fields(fields, per_row, start: int, stop: int):
    return {name: buf[..., start // per_row[name] : stop // per_row[name], :] for name, buf in fields.items()}


@functools.lru_cache(maxsize=CODEC_KEYED)
def _decode_fn(key_codec, value_codec, names: Tuple[Tuple[str, ...], Tuple[str, ...]], per_row, capacity: int,
               out_shape: Tuple[int, ...], out_dtype, scale: float, fp16_parts: int, centered: bool,
               compiled: bool = True, first_position: int = 0, kept: bool = False, sinks: bool = False):
    key_names, value_names = names
    key_per_row, value_per_row = dict(per_row[0]), dict(per_row[1])
    block = math.lcm(key_codec.token_block, value_codec.token_block)
    split = -(-DECODE_SPLIT // block) * block

    def step(queries, key_bufs, value_bufs, count, fp16, key_mean, value_mean, sink_logits, kept_inputs=()):
        # kept_inputs: (keys, values, slot bias) of `History.kept_slots`, then `History.kept_code_bias()`
        key_fields, value_fields = dict(zip(key_names, key_bufs)), dict(zip(value_names, value_bufs))
        B, n_heads, _, dim = queries.shape
        kv_heads = key_bufs[0].shape[1]
        rep = n_heads // kv_heads
        q = key_codec.to_domain((queries.astype(mx.float32) * scale).reshape(B, kv_heads, rep, dim))
        outs, stats = [], []
        for start in range(0, capacity, split):
            stop = min(start + split, capacity)
            fields = at_positions(key_codec, _slice_fields(key_fields, key_per_row, start, stop), first_position + start)
            scores = key_codec.score(q, fields)  # (B, H, REP, n)
            scores = mx.where(mx.arange(start, stop) < count, scores, -mx.inf)
            if kept:
                scores = scores + kept_inputs[3][start:stop]
            m, p = max_and_weights(scores)
            o = value_codec.weighted_sum(mx.expand_dims(p, 3), _slice_fields(value_fields, value_per_row, start, stop))
            outs.append(o)  # (B, H, REP, 1, Dv)
            stats.append(mx.concatenate([m, mx.sum(p, axis=-1, keepdims=True)], axis=-1))
        if len(outs) == 1:  # reshaped as it is: a stack of one adds nodes that every step replays
            o, ml = outs[0].reshape(B * kv_heads, 1, rep, -1), stats[0].reshape(B * kv_heads, 1, rep, 2)
        else:
            o = mx.stack([x.squeeze(3) for x in outs], axis=2).reshape(B * kv_heads, len(outs), rep, -1)
            ml = mx.stack(stats, axis=2).reshape(B * kv_heads, len(outs), rep, 2)
        if sinks:
            o, ml = with_sink_split(o, ml, sink_logits, value_codec, value_mean if centered else None, queries,
                                    key_mean if centered else None, scale)
        tokens = fp16_tokens(fp16_parts, fp16, key_mean if centered else None)
        bias = None
        if kept:
            *tokens, bias = with_kept_fp16(tokens, *kept_inputs[:3], key_mean if centered else None)
        plain = None if tokens is None else plain_partial(queries, *tokens, scale, bias)
        return merge_partials(o, ml, value_codec, out_shape, out_dtype, plain=plain,
                              value_mean=value_mean if centered else None)

    return mx.compile(step) if compiled else step


def _compiled_decode_supports(h: History, queries: mx.array, mask) -> bool:
    return (queries.shape[2] == 1 and h.count > 0 and h.settings.compile_step and plain_mask(mask)
            and h.settings.backend != "emulator")


@register_path("compiled_decode", "decode", _compiled_decode_supports, priority=0, takes_kept=True, takes_sinks=True)
def compiled_decode(h: History, queries: mx.array, scale: float, mask=None, compiled: bool = True) -> mx.array:
    """Decode for every format: the codes of the whole capacity are decoded split by split
    with the codecs' MLX ops, tokens past `count` masked, and the fp16 sinks/window merged,
    in one `mx.compile`d graph whose shapes change only when the store grows. Tokens kept in
    fp16 past the window (`kept.py`) join the fp16 partial and their codes are masked out."""
    names, per_row, key_bufs, value_bufs = h.store.capacity_inputs()
    parts, fp16 = h.fp16_inputs()
    centered = h.value_mean is not None
    fn = _decode_fn(h.key_codec, h.value_codec, names, per_row, h.store.capacity, tuple(queries.shape),
                    queries.dtype, float(scale), parts, centered, compiled, h.sinks if h.key_codec.positional else 0,
                    h.kept, h.sink_logits is not None)
    none = small_array((0.0,), mx.float32)
    return fn(queries, key_bufs, value_bufs, small_array((h.count,)), fp16, h.key_mean if centered else none,
              h.value_mean if centered else none, none if h.sink_logits is None else h.sink_logits,
              [*h.kept_slots[:3], h.kept_code_bias()] if h.kept else [])


def _sdpa_decode_supports(h: History, queries: mx.array, mask) -> bool:
    return (h.settings.on_gpu and queries.shape[2] == 1 and h.count > 0 and plain_mask(mask)
            and h.settings.compile_step and h.settings.backend != "emulator" and not h.key_codec.positional
            and h.key_codec.format.orthogonal_domain and h.value_codec.format.orthogonal_domain)


@register_path("sdpa_decode", "decode", _sdpa_decode_supports, priority=1, takes_sinks=True)
def sdpa_decode(h: History, queries: mx.array, scale: float, mask=None) -> mx.array:
    """Decode on a GPU for formats without a kernel (and the portable back end): the whole
    capacity decoded to the queries' dtype by one compiled call, the fp16 sinks/window mapped
    into the domains in front of it, then MLX's fused attention over the rows in use. A
    handful of launches per layer, where the split-by-split softmax of `compiled_decode`
    takes dozens. The decoded history is a transient of the layer's attention, freed once it
    has run (docs/kernels.md gives the step's measured peak)."""
    names, _, key_bufs, value_bufs = h.store.capacity_inputs()
    parts, fp16 = h.fp16_inputs()
    centered = h.value_mean is not None
    dtype = attention_dtype(queries)
    none = small_array((0.0,), mx.float32)
    keys, values = _decoded_history_fn(h.key_codec, h.value_codec, names, parts, centered, dtype)(
        key_bufs, value_bufs, fp16, h.key_mean if centered else none, h.value_mean if centered else none)
    fp16_held = fp16[0].shape[2] if parts < 0 else sum(keys_part.shape[2] for keys_part in fp16[::2])
    held = fp16_held + h.count
    q = _into_key_domain_fn(h.key_codec, dtype)(queries)
    return _fused_attention(h, q, keys[..., :held, :], values[..., :held, :], scale, None, queries)


def fp16_into_domains(key_codec, value_codec, keys: mx.array, values: mx.array, value_mean, dtype):
    """fp16 sinks/window tokens (keys as held, centred) into the codecs' domains, values centred
    first where the cache centres them (`value_mean`, else None), so they join decoded codes.
    `key_codec` None: the keys stay as held (`keys_in_query_space`)."""
    values = values.astype(mx.float32)
    if value_mean is not None:
        values = values - value_mean
    keys = keys if key_codec is None else key_codec.to_domain(keys.astype(mx.float32))
    return keys.astype(dtype), value_codec.to_domain(values).astype(dtype)


@functools.lru_cache(maxsize=CODEC_KEYED)
def _decoded_history_fn(key_codec, value_codec, names: Tuple[Tuple[str, ...], Tuple[str, ...]], fp16_parts: int,
                        centered: bool, dtype):
    def decoded(key_bufs, value_bufs, fp16, key_mean, value_mean):
        keys = key_codec.decode(dict(zip(names[0], key_bufs))).astype(dtype)
        values = value_codec.decode(dict(zip(names[1], value_bufs))).astype(dtype)
        tokens = fp16_tokens(fp16_parts, fp16, key_mean if centered else None)
        if tokens is None:
            return keys, values
        # In front: one query's attention does not depend on the order of the keys.
        fp16_keys, fp16_values = fp16_into_domains(key_codec, value_codec, *tokens,
                                                   value_mean if centered else None, dtype)
        return mx.concatenate([fp16_keys, keys], axis=2), mx.concatenate([fp16_values, values], axis=2)

    return mx.compile(decoded)


@functools.lru_cache(maxsize=32)
def _into_key_domain_fn(key_codec, dtype):
    return mx.compile(lambda queries: key_codec.to_domain(queries.astype(mx.float32)).astype(dtype))


@functools.lru_cache(maxsize=32)
def _out_of_value_domain_fn(value_codec, kv_heads: int, centered: bool, out_dtype):
    def out_of_domain(out, value_mean):
        out = value_codec.from_domain(out.astype(mx.float32))
        if centered:
            B, n_heads, L, dv = out.shape
            out = out.reshape(B, kv_heads, n_heads // kv_heads, L, dv) + value_mean.astype(mx.float32)[:, :, None]
            out = out.reshape(B, n_heads, L, dv)
        return out.astype(out_dtype)

    return mx.compile(out_of_domain)


@functools.lru_cache(maxsize=CODEC_KEYED)
def _attend_decoded_fn(key_codec, value_codec, out_shape: Tuple[int, ...], out_dtype, scale: float,
                       fp16_parts: int, centered: bool, sinks: bool = False):
    def step(queries, keys, values, count, fp16, key_mean, value_mean, sink_logits):
        B, n_heads, _, dim = queries.shape
        kv_heads = keys.shape[1]
        rep = n_heads // kv_heads
        q = key_codec.to_domain((queries.astype(mx.float32) * scale).reshape(B, kv_heads, rep, dim))
        scores = q @ keys.astype(mx.float32).swapaxes(-1, -2)
        scores = mx.where(mx.arange(keys.shape[2]) < count, scores, -mx.inf)
        m, p = max_and_weights(scores)
        o = (p @ values.astype(mx.float32)).reshape(B * kv_heads, 1, rep, -1)
        ml = mx.concatenate([m, mx.sum(p, axis=-1, keepdims=True)], axis=-1).reshape(B * kv_heads, 1, rep, 2)
        if sinks:
            o, ml = with_sink_split(o, ml, sink_logits, value_codec, value_mean if centered else None, queries,
                                    key_mean if centered else None, scale)
        tokens = fp16_tokens(fp16_parts, fp16, key_mean if centered else None)
        plain = None if tokens is None else plain_partial(queries, *tokens, scale)
        return merge_partials(o, ml, value_codec, out_shape, out_dtype, plain=plain,
                              value_mean=value_mean if centered else None)

    return mx.compile(step)


def attend_decoded(h: History, queries: mx.array, scale: float, keys: mx.array, values: mx.array) -> mx.array:
    """Decode attention over decoded keys / values (B, H, capacity, domain) of which the first
    `h.count` are tokens, with the fp16 sinks/window merged: one compiled graph whose shapes
    change only when the store grows (for domains that MLX's fused attention cannot take)."""
    parts, fp16 = h.fp16_inputs()
    centered = h.value_mean is not None
    fn = _attend_decoded_fn(h.key_codec, h.value_codec, tuple(queries.shape), queries.dtype, float(scale),
                            parts, centered, h.sink_logits is not None)
    none = small_array((0.0,), mx.float32)
    return fn(queries, keys, values, small_array((h.count,)), fp16, h.key_mean if centered else none,
              h.value_mean if centered else none, none if h.sink_logits is None else h.sink_logits)


# ---- prefill on a GPU: decode the history once, MLX's fused attention -------------------------------

def decode_with_codec(h: History, role: str, dtype, tokens: int) -> mx.array:
    """The first `tokens` codes of `role`, decoded into the codec's domain."""
    codec = h.key_codec if role == "keys" else h.value_codec
    return codec.decode(at_positions(codec, h.store.fields(role, 0, tokens), h.sinks)).astype(dtype)


SDPA_MASK_BYTES = 256 << 20  # scores an explicit-mask SDPA call may hold (queries x keys x heads x 4 bytes)


@functools.lru_cache(maxsize=1)
def _cudnn_attention_device() -> bool:
    """A CUDA device on which MLX's attention may run cuDNN's fused kernel: compute capability 8 or later, and
    MLX_CUDA_USE_CUDNN_SDPA not 0 (mlx/backend/cuda/scaled_dot_product_attention.cpp, supports_sdpa_cudnn)."""
    if not cuda_available():
        return False
    if os.environ.get("MLX_CUDA_USE_CUDNN_SDPA", "1").strip() == "0":
        return False
    return int(mx.device_info().get("compute_capability_major", 0)) >= 8


def masked_attention_is_fused(settings, queries: mx.array, values: mx.array) -> bool:
    """Whether `mx.fast.scaled_dot_product_attention` runs these queries with an additive mask inside a fused
    kernel, without materialising the scores: MLX's CUDA attention does through cuDNN for float16/bfloat16 and
    head dims that are multiples of 8 up to 128 (benchmarks/results/band-mask-attention-h100); otherwise it
    falls back to the unfused form, as Metal's may (unmeasured) and the CPU's does."""
    dims = (queries.shape[-1], values.shape[-1])
    return (settings.on_gpu and queries.dtype in (mx.float16, mx.bfloat16) and all(d % 8 == 0 and d <= 128 for d in dims)
            and _cudnn_attention_device())


def sdpa_prefill_applies(h: History, queries: mx.array, mask) -> bool:
    """Codes to attend to and a value domain in which fp16 values can join the decoded ones (an
    orthogonal map); any key domain does (`keys_in_query_space`)."""
    return (queries.shape[2] > 1 and h.count > 0 and plain_mask(mask)
            and h.value_codec.format.orthogonal_domain)


def keys_in_query_space(key_codec) -> bool:
    """Whether a prefill takes decoded keys out of their domain rather than queries into it:
    where the domain is not orthogonal (a sketch, smoothing scales), fp16 keys mapped into it
    would not score as they are. from_domain is to_domain's adjoint (methods/base.py), so
    q . from_domain(u) = to_domain(q) . u exactly: decoded keys mapped back score as in their
    domain, and the fp16 ones and the queries take part as they are."""
    return not key_codec.format.orthogonal_domain


@functools.lru_cache(maxsize=32)
def _out_of_key_domain_fn(key_codec, dtype):
    return mx.compile(lambda keys: key_codec.from_domain(keys).astype(dtype))


def sdpa_prefill_supports(h: History, queries: mx.array, mask) -> bool:
    """On a GPU device (any back end, the portable one too), where the fused attention beats
    the generic blockwise path."""
    return h.settings.on_gpu and sdpa_prefill_applies(h, queries, mask)


def sdpa_prefill(h: History, queries: mx.array, scale: float, mask=None,
                 decode: Callable[[History, str, object, int], mx.array] = decode_with_codec) -> mx.array:
    """Prefill over the decoded history with `mx.fast.scaled_dot_product_attention`: the query
    goes into the key domain once, fp16 sinks/window tokens are mapped into the domains and
    placed in position order (so the causal mask stays the plain one), the output comes back
    from the value domain once. At most two layers' decoded histories exist at a time: on a GPU
    each layer waits for the one before it before the next is built (`bound_prefill_memory`), so
    peak memory stays below an fp16 cache's (whose every layer holds that much). Tokens a chunk encoded stay in fp16 for its
    queries under the "chunk" rule (`settings.prefill_rule`), still one causal call; under the
    "decode" rule each query sees them as decoding would (a band), which needs an explicit
    mask. Where the fused kernel takes that mask (`masked_attention_is_fused`) it is one call;
    elsewhere the queries go in groups whose scores fit SDPA_MASK_BYTES even where MLX
    materialises them."""
    kc, vc = h.key_codec, h.value_codec
    dtype = attention_dtype(queries)
    s = h.sinks
    fp16 = h.fp16
    band = h.band and queries.shape[2] > 1  # a single query sees every flushed token from its codes
    chunk_rule = band and h.settings.prefill_rule == "chunk"
    recent = h.recent() if band else None
    # Under the "chunk" rule every query sees the tokens this update encoded in fp16: their codes,
    # the last `count - (first - sinks)`, are not decoded (a whole chunk's worth at each prefill step).
    tokens = recent[2] - s if chunk_rule else h.count
    keys = values = None
    if tokens:
        keys, values = decode(h, "keys", dtype, tokens), decode(h, "values", dtype, tokens)
    query_space = keys_in_query_space(kc)
    if query_space and keys is not None:
        keys = _out_of_key_domain_fn(kc, dtype)(keys)
    q = queries.astype(dtype) if query_space else _into_key_domain_fn(kc, dtype)(queries)

    def into_domains(fk, fv):
        return fp16_into_domains(None if query_space else kc, vc, fk, fv, h.value_mean, dtype)

    if keys is not None and h.kept:
        keys, values = kept_over_codes(h, keys, values, into_domains)

    if band:
        # "chunk": keys [sinks | codes before first | the recent span in fp16], in position order,
        # so the causal mask holds. "decode": keys [sinks | every code | the recent span in fp16];
        # each query sees a recent token from its codes before fp16_from(query) and from fp16
        # after it (cache/window.py's rule), through an explicit mask.
        rk, rv, first = recent
        rk, rv = into_domains(rk, rv)
        parts_k, parts_v = ([rk], [rv]) if keys is None else ([keys, rk], [values, rv])
        if s:
            sk, sv = into_domains(fp16[0][..., :s, :], fp16[1][..., :s, :])
            parts_k, parts_v = [sk] + parts_k, [sv] + parts_v
        keys, values = mx.concatenate(parts_k, axis=2), mx.concatenate(parts_v, axis=2)
    if band and not chunk_rule:
        B, n_heads, L, _ = queries.shape
        keys, values, centered = _sink_ready(h, keys, values, query_space)
        group = L if masked_attention_is_fused(h.settings, q, values) else \
            max(1, min(L, SDPA_MASK_BYTES // (4 * B * n_heads * keys.shape[2])))
        outs = []
        for a in range(0, L, group):
            qpos = mx.arange(h.offset - L + a, h.offset - L + min(a + group, L))[:, None]
            fp16_from = h.fp16_from(qpos)
            codes_pos = mx.arange(s, s + h.count)[None]
            recent_pos = mx.arange(first, h.offset)[None]
            band_mask = mx.concatenate([mx.arange(s)[None] <= qpos, (codes_pos < fp16_from) & (codes_pos <= qpos),
                                        (recent_pos >= fp16_from) & (recent_pos <= qpos)], axis=1)
            # Additive, not boolean: MLX's CUDA attention runs an additive mask fused and a boolean one
            # several times slower (docs/decisions.md, "The band mask is additive").
            band_bias = mx.where(band_mask, mx.array(0.0, q.dtype), mx.array(-mx.inf, q.dtype))
            outs.append(mx.fast.scaled_dot_product_attention(q[..., a : a + group, :], keys, values, scale=scale,
                                                             mask=band_bias, sinks=_sdpa_sinks(h, q)))
            if len(outs) > 1 and h.settings.on_gpu:
                mx.eval(outs[-1])  # one group's scores at a time
        return _from_value_domain(h, mx.concatenate(outs, axis=2) if len(outs) > 1 else outs[0], queries, centered)
    if not band and fp16 is not None:
        fk, fv = into_domains(*fp16)
        keys = mx.concatenate([fk[..., :s, :], keys, fk[..., s:, :]], axis=2)
        values = mx.concatenate([fv[..., :s, :], values, fv[..., s:, :]], axis=2)
    return _fused_attention(h, q, keys, values, scale, mask, queries, query_space)


def _sdpa_sinks(h: History, q: mx.array) -> Optional[mx.array]:
    return None if h.sink_logits is None else h.sink_logits.astype(q.dtype)


def _sink_ready(h: History, keys: mx.array, values: mx.array, query_space: bool = False):
    """(keys, values, whether the output still needs the value mean added) for MLX's fused attention with
    learned sinks, whose logits are fixed per head: where the cache centres keys and values, the means
    go back into every key and value (in the codecs' domains; keys in the queries' space with
    `query_space`) first. Centred keys would shift each query's scores, not the sink's logit, and the
    sink's share of the softmax adds no value, so the value mean cannot be added to the output after."""
    centered = h.value_mean is not None
    if h.sink_logits is None or not centered:
        return keys, values, centered
    key_mean = h.key_mean.astype(mx.float32)
    key_shift = key_mean if query_space else h.key_codec.to_domain(key_mean)
    value_shift = h.value_codec.to_domain(h.value_mean.astype(mx.float32))
    return keys + key_shift.astype(keys.dtype), values + value_shift.astype(values.dtype), False


def _fused_attention(h: History, q: mx.array, keys: mx.array, values: mx.array, scale: float, mask,
                     queries: mx.array, query_space: bool = False) -> mx.array:
    """MLX's fused attention over keys / values in the codecs' domains, the learned sinks passed on, and
    the output out of the value domain."""
    keys, values, centered = _sink_ready(h, keys, values, query_space)
    out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask, sinks=_sdpa_sinks(h, q))
    return _from_value_domain(h, out, queries, centered)


def kept_over_codes(h: History, keys: mx.array, values: mx.array, into_domains: Callable) -> Tuple[mx.array, mx.array]:
    """Decoded codes (B, H, T, D) of the first T coded positions with the kept tokens' fp16 copies
    (`History.kept_slots`, mapped by `into_domains` as the sinks and window are) written over their
    rows: a query that would see a kept token from its codes sees it in fp16, as the generic path's
    kept segment shows it (the codes a query sees in its band it sees in fp16 either way)."""
    kept_keys, kept_values, slot_bias, rows = h.kept_slots
    T = keys.shape[2]
    rows = mx.where((slot_bias == 0) & (rows < T), rows, T)  # empty slots, and rows past T, to a spare row
    if h.key_mean is not None:
        kept_keys = kept_keys.astype(mx.float32) - h.key_mean
    fk, fv = into_domains(kept_keys, kept_values)

    def over(decoded, fp16):
        spare = mx.zeros((*decoded.shape[:2], 1, decoded.shape[3]), decoded.dtype)
        decoded = mx.concatenate([decoded, spare], axis=2)
        decoded[:, :, rows] = fp16.astype(decoded.dtype)
        return decoded[:, :, :T]

    return over(keys, fk), over(values, fv)


def _from_value_domain(h: History, out: mx.array, queries: mx.array, centered: Optional[bool] = None) -> mx.array:
    """`centered`: whether to add the value mean (default: where the cache centres values)."""
    centered = h.value_mean is not None if centered is None else centered
    out = _out_of_value_domain_fn(h.value_codec, h.kv_heads, centered, queries.dtype)(
        out, h.value_mean if centered else small_array((0.0,), mx.float32))
    if h.settings.on_gpu and queries.shape[2] > 1:
        bound_prefill_memory(out, h.settings.prefill_sync)
    return out


_LAUNCHED = threading.local()  # .layer: a scalar of this thread's last prefill layer launched ("pipelined")


def bound_prefill_memory(out: mx.array, sync: str):
    """Keep a GPU prefill's decoded histories from piling up. Without a sync per layer the whole
    chunk's graph is evaluated at once and its transients made the peak exceed fp16's
    (docs/kernels.md). "pipelined" (the default): launch this layer, then wait for
    the layer launched before, so the GPU has the next layer queued while the host builds the
    one after; "layer": evaluate this layer before the next is built (`settings.prefill_sync`)."""
    if sync == "layer":
        mx.eval(out)
        return
    # What is remembered is a scalar computed from the output, not the output: evaluated, it holds
    # none of it (the last layer's output would otherwise stay alive until the next prefill).
    launched = mx.sum(out[..., -1:, :1])
    mx.async_eval(out, launched)
    previous, _LAUNCHED.layer = getattr(_LAUNCHED, "layer", None), launched
    if previous is not None:
        mx.eval(previous)


register_path("sdpa_prefill", "prefill", sdpa_prefill_supports, priority=0, takes_kept=True,
              takes_sinks=True)(sdpa_prefill)
