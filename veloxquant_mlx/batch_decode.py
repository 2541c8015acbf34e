"""One attention call per layer for a batch's decode step, on the codes, rows of different lengths.

A `BatchCompressedKVCache` keeps one cache per sequence. On decode steps (one new token
per sequence) this module holds the batch's state in shared batch-shaped buffers instead,
as mlx-lm's `BatchKVCache` holds its fp16 keys: the packed code rows (B, H, capacity, words),
row b's first `count[b]` in use; the fp16 sinks (B, H, sinks, D); the fp16 window as a ring
(B, H, residual_length, D) with `fill[b]` slots in use from `start[b]`; the means (B, H, 1, D).
A step writes every row's token into its window slot, encodes every row's leaving token in
one call of the layout's row encoder and scatters it to `count[b]` (rows whose window is not
full yet do not advance `count`), and attends with every row's length masked: scores of code
rows at or past `count[b]` and of empty window slots are -inf. Nothing is dequantized to
fp16 and nothing loops over sequences. The codes are scored split by split with the codecs'
MLX ops in one compiled graph (`engine.compiled_decode`'s math with a per-row count); on the
CPU, where `veloxquant_mlx._native` has the ragged kernel, that kernel scores them
(`kernels.native.mse_partials_ragged`); on a GPU the partial kernel's ragged form does, one
launch per layer with one token count per sequence (`kernels.step.ragged`).

What a decode step of the per-sequence caches would do, it does: the same encoder, the same
window rule (a token leaves once `residual_length` wait), the same means. The buffers are
written back into the rows (`release`) before anything else reads or changes them
(a prefill chunk, `trim`, `state`); `filter`, `extend` with rows that can join, and `extract`
(a copy of one row) keep them.

It takes the rows of a batch that are plain caches of one row-store format coding tokens one
by one (turboquant_mse, the presets), with a fp16 window, full sinks, fixed means (codes exist
where centring is on) and no positional codec or kept tokens (`eligible`); a row joins the
buffers on the first decode step it qualifies, and the others decode row by row.
"""

from __future__ import annotations

import copy
import functools
from typing import List, Optional

import mlx.core as mx

from . import engine
from .attention import max_and_weights
from .cache import CompressedKVCache
from .kernels import kernel_ragged_supported, native, native_ragged_supported, step
from .storage import STEP, RowStore


# The batch-shaped arrays a `BatchDecoder` holds while active.
_STATE = ("codes", "window_keys", "window_values", "sink_keys", "sink_values", "key_mean", "value_mean", "count", "fill",
          "start")


class BatchDecoder:
    """The shared decode buffers of one layer's batch, or nothing (`active`)."""

    # Immutable or shared by every cache of a config (codecs, the compiled encoder): not copied.
    _SHARED_ON_COPY = ("key_codec", "value_codec", "layout", "encoder", "settings")

    def __init__(self):
        self.active = False
        self.nbytes = 0
        # "batch_kernel" (the GPU kernels' ragged form), "batch_native" (the C++ one) or "batch_ops"
        self.last_path: Optional[str] = None

    def __deepcopy__(self, memo):
        """Independent buffers holding the same rows (mlx-lm's `PromptProcessingBatch.split` deep-copies its
        batch caches); the rows are the copies the batch's own copy makes (`memo`)."""
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for name, value in vars(self).items():
            setattr(new, name, value if name in self._SHARED_ON_COPY else copy.deepcopy(value, memo))
        return new

    # ---- taking the rows over and giving them back ---------------------------------------
    def takes(self, rows: List) -> bool:
        """Whether this decode step runs batched (taking the rows over if not yet done)."""
        if self.active:
            return True
        if not rows or not _compatible(rows):
            return False
        first = rows[0]
        self.key_codec, self.value_codec, self.layout = first.key_codec, first.value_codec, first.store.layout
        self.encoder, self.settings, self.residual = first._token_encoder, first.settings, first.config.residual_length
        self.path: Optional[str] = None  # `last_path`'s value, decided at the first attend while the buffers are held
        self.steps = 0
        self.rows, offsets, stacked = _stacked(rows, 0)
        self._set_offsets(offsets)
        for name, array in stacked.items():
            setattr(self, name, array)
        self.capacity = self.codes.shape[2]
        self.most = max(self.count.tolist())  # a bound on max(count), known without reading it back
        self.active = True
        self._count_bytes()
        return True

    def extend(self, rows: List) -> bool:
        """Take `rows` into the buffers (a request joining a running batch) without writing the
        others back; False when they cannot join (then the caller releases)."""
        if not self.active or not rows or not _compatible(rows, self.rows[0]):
            return False
        joined, offsets, stacked = _stacked(rows, self.steps)
        capacity = max(self.capacity, stacked["codes"].shape[2])
        self.codes = mx.concatenate([_padded(self.codes, capacity), _padded(stacked.pop("codes"), capacity)])
        for name, array in stacked.items():
            if array is not None:
                setattr(self, name, mx.concatenate([getattr(self, name), array]))
        self.rows, self.capacity = self.rows + joined, capacity
        self._set_offsets(self.offsets + offsets)
        self.most = max(self.most, int(self.count.max().item()))
        self._count_bytes()
        return True

    def release(self):
        """Write the buffers back into the rows (each row's codes, window in order, offset)."""
        if not self.active:
            return
        self.active = False
        host = self.count.tolist(), self.fill.tolist(), self.start.tolist()
        for b, cache in enumerate(self.rows):
            self._write_back(b, cache, *host)
        self.rows = None
        # The rows hold their own copies now: the shared buffers go too (kept, they would hold a second
        # copy of the whole batch, out of `nbytes`, until the next decode step took the rows over again).
        self._drop_buffers()

    def extract(self, b: int) -> CompressedKVCache:
        """An independent cache holding row `b` (the buffers stay in use)."""
        row = copy.deepcopy(self.rows[b])
        self._write_back(b, row, self.count.tolist(), self.fill.tolist(), self.start.tolist())
        # Until evaluated, the row's slices hold the whole batch's buffers as they are now, and the copy may be
        # kept for long (mlx-lm's server pools it), while the next decode step writes new buffers.
        mx.async_eval([a for a in (row.store.rows, row._window_keys, row._window_values) if a is not None])
        return row

    def _write_back(self, b: int, cache: CompressedKVCache, counts, fills, starts):
        n, fill = counts[b], fills[b]
        cache.store.rows = mx.contiguous(self.codes[b : b + 1, :, :n, :])
        cache.store.count = n
        ring = [mx.roll(self.window_keys[b : b + 1], -starts[b], axis=2),
                mx.roll(self.window_values[b : b + 1], -starts[b], axis=2)]
        cache._window_keys = mx.contiguous(ring[0][..., :fill, :]) if fill else None
        cache._window_values = mx.contiguous(ring[1][..., :fill, :]) if fill else None
        cache.window_start, cache.window_fill, cache.incoming, cache.just_encoded = 0, None, None, None
        cache.offset = self.offsets[b] + self.steps

    def filter(self, indices: List[int]):
        """Keep rows `indices` (in that order) without writing the buffers back."""
        if not self.active:
            return
        take = mx.array(indices, dtype=mx.int32)
        self.rows = [self.rows[i] for i in indices]
        self._set_offsets([self.offsets[i] for i in indices])
        if not self.rows:
            self.active, self.rows = False, None
            self._drop_buffers()
            return
        self.count = self.count[take]
        # `most` bounds the kept rows' counts only, so the capacity follows the rows held while rows leave and
        # join, not the longest row there ever was plus every step since.
        self.most = int(self.count.max().item())
        self.capacity = min(self.capacity, self.most + STEP)
        self.codes = self.codes[:, :, : self.capacity][take]  # one gather, of the capacity kept
        for name in _STATE:
            if name not in ("codes", "count") and getattr(self, name) is not None:
                setattr(self, name, getattr(self, name)[take])
        self._count_bytes()

    def _drop_buffers(self):
        for name in _STATE:
            setattr(self, name, None)
        self.nbytes = 0

    def _count_bytes(self):
        arrays = (self.codes, self.window_keys, self.window_values, self.sink_keys, self.sink_values, self.key_mean,
                  self.value_mean)
        self.nbytes = sum(a.nbytes for a in arrays if a is not None)

    # ---- a decode step -------------------------------------------------------------------------
    def _set_offsets(self, offsets: List[int]):
        self.offsets, self._offsets_array = offsets, None

    def row_offset(self, b: int) -> int:
        return self.offsets[b] + self.steps

    def positions(self) -> mx.array:
        """Every row's `row_offset`, as one array (what RoPE reads twice per layer and step)."""
        if self._offsets_array is None:
            self._offsets_array = mx.array(self.offsets)
        return self._offsets_array + self.steps

    def step(self, keys: mx.array, values: mx.array):
        """Every row's new token (keys, values (B, H, 1, D)) into its window; the leaving ones encoded."""
        if self.most + 1 > self.capacity:
            self.capacity += STEP
            self.codes = _padded(self.codes, self.capacity)
            self._count_bytes()
        window_step = _window_step_fn(self.encoder, self.residual, self.key_mean is not None,
                                      self.settings.compile_step)
        means = () if self.key_mean is None else (self.key_mean, self.value_mean)
        self.window_keys, self.window_values, rows, count, self.start, self.fill = window_step(
            keys, values, self.window_keys, self.window_values, self.count, self.start, self.fill, *means)
        self.codes[mx.arange(rows.shape[0]), :, self.count] = rows[:, :, 0, :]
        self.count = count
        self.steps += 1
        self.most += 1

    def attend(self, queries: mx.array, scale: float) -> mx.array:
        """Every row's one query over its codes, sinks and window: (B, heads, 1, Dv)."""
        key_mean = self.key_mean if self.key_mean is not None else engine.small_array((0.0,), mx.float32)
        value_mean = self.value_mean if self.value_mean is not None else engine.small_array((0.0,), mx.float32)
        sinks = () if self.sink_keys is None else (self.sink_keys, self.sink_values)
        if self.path is None:  # asked per layer and step otherwise
            self.path = self._choose_path(queries.shape[1] // self.codes.shape[1])
        self.last_path = self.path
        window = (self.window_keys, self.window_values, self.fill, key_mean, *sinks)
        if self.path == "batch_native":
            o, ml = native.mse_partials_ragged(queries, self.key_codec, self.value_codec, self.layout, self.codes,
                                               self.count, self.most, scale)
            return _merge_fn(self.value_codec, tuple(queries.shape), queries.dtype, float(scale),
                             self.key_mean is not None, len(sinks) > 0)(o, ml, queries, value_mean, *window)
        fp16 = _fp16_fn(len(sinks) > 0, self.key_mean is not None)(*window)
        if self.path == "batch_kernel":
            return step.ragged(self.settings, self.key_codec, self.value_codec, self.codes, self.count, queries,
                               scale, fp16, value_mean if self.key_mean is not None else None)
        fn = _ragged_decode_fn(self.key_codec, self.value_codec, self.layout, self.capacity, tuple(queries.shape),
                               queries.dtype, float(scale), self.key_mean is not None,
                               self.settings.compile_step)
        return fn(queries, self.codes, self.count, *fp16, value_mean)

    def _choose_path(self, rep: int) -> str:
        if kernel_ragged_supported(self.settings, self.key_codec, self.value_codec, self.layout, rep):
            return "batch_kernel"
        if self.settings.backend == "native" and native_ragged_supported(self.key_codec, self.value_codec,
                                                                         self.layout):
            return "batch_native"
        return "batch_ops"


def _compatible(rows: List, first: Optional[CompressedKVCache] = None) -> bool:
    """Whether `rows` can share buffers (with `first`'s, when given): each eligible, one config,
    codecs, layout and shape."""
    if not all(eligible(cache) for cache in rows):
        return False
    first = first or rows[0]
    shape = (first.kv_heads, first.key_dim, first.value_dim, first.window_dtype)
    return all(c.codecs is first.codecs and c.config == first.config and c.store.layout == first.store.layout
               and (c.kv_heads, c.key_dim, c.value_dim, c.window_dtype) == shape for c in rows)


def _stacked(rows: List[CompressedKVCache], steps: int):
    """(rows, their offsets less `steps`, the batch-shaped arrays of their state); the rows give their
    code and window buffers up to the arrays (`BatchDecoder.release` gives them back)."""
    for cache in rows:
        cache.flush()
        cache._window_in_order()
        cache._settle_window()
    first, residual = rows[0], rows[0].config.residual_length
    counts = [cache.encoded for cache in rows]
    capacity = max(counts) + STEP
    stacked = {
        "codes": mx.concatenate([_padded(c.store.rows[..., :n, :], capacity) for c, n in zip(rows, counts)]),
        "window_keys": mx.concatenate([_padded(c._window_keys, residual) for c in rows]),
        "window_values": mx.concatenate([_padded(c._window_values, residual) for c in rows]),
        "sink_keys": mx.concatenate([c.sink_keys for c in rows]) if first.sinks else None,
        "sink_values": mx.concatenate([c.sink_values for c in rows]) if first.sinks else None,
        "key_mean": mx.concatenate([c.key_mean for c in rows]) if first.key_mean is not None else None,
        "value_mean": mx.concatenate([c.value_mean for c in rows]) if first.key_mean is not None else None,
        "count": mx.array(counts, dtype=mx.int32),
        "fill": mx.array([c.window for c in rows], dtype=mx.int32),
        "start": mx.zeros((len(rows),), dtype=mx.int32),
    }
    offsets = [cache.offset - steps for cache in rows]
    for cache in rows:
        cache.store.rows = cache._window_keys = cache._window_values = None
    return list(rows), offsets, stacked


def eligible(cache) -> bool:
    """Whether a row can join the shared buffers (its own state and format alone decide)."""
    return (type(cache) is CompressedKVCache and cache.key_codec is not None and isinstance(cache.store, RowStore)
            and cache.block == 1 and cache.kept is None and not cache.key_codec.positional
            and cache.config.residual_length > 0 and cache.sinks == cache.config.sink_tokens
            and 0 < cache.window <= cache.config.residual_length and cache.encoded > 0
            and (cache.key_mean is not None or not cache.config.center)
            and cache.settings.backend != "emulator" and cache.settings.check_inputs != "always")


def _padded(x: mx.array, length: int) -> mx.array:
    """`x` (B, H, n, W) zero-padded to `length` along the tokens (None: an empty window)."""
    if x is None:
        raise ValueError("no window")
    if x.shape[2] >= length:
        return x[..., :length, :]
    return mx.pad(x, [(0, 0), (0, 0), (0, length - x.shape[2]), (0, 0)])


@functools.lru_cache(maxsize=64)
def _window_step_fn(encoder, residual: int, centered: bool, compiled: bool):
    """Every row's new token into its window ring, and the rows of the tokens leaving full windows, encoded:
    (window keys, window values, encoded rows (B, H, 1, words), count, start, fill) after the step."""
    def window_step(keys, values, window_keys, window_values, count, start, fill, key_mean=None, value_mean=None):
        dtype = window_keys.dtype
        full = fill == residual
        slot = mx.where(full, start, fill)
        at = start[:, None, None, None]
        leaving_keys = mx.take_along_axis(window_keys, at, axis=2)
        leaving_values = mx.take_along_axis(window_values, at, axis=2)
        into = mx.arange(residual)[None, None, :, None] == slot[:, None, None, None]
        window_keys = mx.where(into, keys.astype(dtype), window_keys)
        window_values = mx.where(into, values.astype(dtype), window_values)
        rows = encoder.one(leaving_keys, leaving_values, key_mean, value_mean)
        return (window_keys, window_values, rows, count + full.astype(mx.int32),
                mx.where(full, (start + 1) % residual, start), mx.minimum(fill + 1, residual))

    return mx.compile(window_step) if compiled else window_step


def _fp16_tokens(has_sinks: bool, centered: bool):
    """(keys (centred), values, bias) of the sinks then the window ring, the ring's empty slots at -inf."""
    def fp16(window_keys, window_values, fill, key_mean, sink_keys=None, sink_values=None):
        slots = window_keys.shape[2]
        keys, values = window_keys, window_values
        bias = mx.where(mx.arange(slots)[None] < fill[:, None], 0.0, -mx.inf)
        if has_sinks:
            keys = mx.concatenate([sink_keys, keys], axis=2)
            values = mx.concatenate([sink_values, values], axis=2)
            bias = mx.concatenate([mx.zeros((fill.shape[0], sink_keys.shape[2])), bias], axis=1)
        if centered:
            keys = keys.astype(mx.float32) - key_mean
        return keys, values, bias[:, None, None, :]

    return fp16


@functools.lru_cache(maxsize=64)
def _fp16_fn(has_sinks: bool, centered: bool):
    return mx.compile(_fp16_tokens(has_sinks, centered))


@functools.lru_cache(maxsize=engine.CODEC_KEYED)
def _merge_fn(value_codec, out_shape, out_dtype, scale: float, centered: bool, has_sinks: bool):
    """The native kernel's partials (o, ml) merged with the fp16 sinks and window's, in one compiled graph."""
    fp16 = _fp16_tokens(has_sinks, centered)

    def merge(o, ml, queries, value_mean, window_keys, window_values, fill, key_mean, *sinks):
        keys, values, bias = fp16(window_keys, window_values, fill, key_mean, *sinks)
        plain = engine.plain_partial(queries, keys, values, scale, bias)
        return engine.merge_partials(o, ml, value_codec, out_shape, out_dtype, plain=plain,
                                     value_mean=value_mean if centered else None)

    return mx.compile(merge)


@functools.lru_cache(maxsize=engine.CODEC_KEYED)
def _ragged_decode_fn(key_codec, value_codec, layout, capacity: int, out_shape, out_dtype, scale: float,
                      centered: bool, compiled: bool):
    """`engine._decode_fn`'s split-by-split softmax over the code rows, row b's past `count[b]` masked."""
    split = engine.DECODE_SPLIT

    def step(queries, codes, count, keys, values, bias, value_mean):
        B, n_heads, _, dim = queries.shape
        kv_heads = codes.shape[1]
        rep = n_heads // kv_heads
        q = key_codec.to_domain((queries.astype(mx.float32) * scale).reshape(B, kv_heads, rep, dim))
        outs, stats = [], []
        for start in range(0, capacity, split):
            stop = min(start + split, capacity)
            key_fields, value_fields = layout.views(codes[..., start:stop, :])
            scores = key_codec.score(q, key_fields)  # (B, H, REP, n)
            valid = (mx.arange(start, stop)[None] < count[:, None])[:, None, None, :]
            scores = mx.where(valid, scores, -mx.inf)
            m, p = max_and_weights(scores)
            o = value_codec.weighted_sum(mx.expand_dims(p, 3), value_fields)
            outs.append(o.squeeze(3))
            stats.append(mx.concatenate([m, mx.sum(p, axis=-1, keepdims=True)], axis=-1))
        o = mx.stack(outs, axis=2).reshape(B * kv_heads, len(outs), rep, -1)
        ml = mx.stack(stats, axis=2).reshape(B * kv_heads, len(outs), rep, 2)
        plain = engine.plain_partial(queries, keys, values, scale, bias)
        return engine.merge_partials(o, ml, value_codec, out_shape, out_dtype, plain=plain,
                                     value_mean=value_mean if centered else None)

    return mx.compile(step) if compiled else step
