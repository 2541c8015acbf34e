"""The compressed KV cache: packed codes only, in a store that grows in steps.

Token positions of one layer are laid out as

    [0, sinks)                      fp16 attention sinks (config.sink_tokens)
    [sinks, sinks + encoded)        packed codes, the only copy of these tokens (`storage.py`)
    [sinks + encoded, offset)       fp16 recent window (config.residual_length)

A prefill chunk attends the way decoding would: a query at position p sees a
key in fp16 exactly when that key would still be in the sinks or the window
when p was the newest token. Tokens the chunk itself pushes out of the window
are therefore also scored from their fp16 values (held only for this call) by
queries for which they were still recent, so results do not depend on the
chunk size.

With `config.center`, codes hold k - mean_k and v - mean_v (one fp16 vector per
head, from the first encoded chunk). Attention scores fp16 keys as k - mean_k
too, a shift of every score of a query by the same q.mean_k, which softmax
ignores; encoded values get mean_v back before they are summed.

Tokens leave the window in multiples of the codecs' `token_block` once more
than `residual_length` of them wait there. `nbytes` is the sum of the live
buffers, unused capacity included.

Where a "decode_store" path can slide a full window (the turboquant_mse kernels), a
decode token waits in `incoming` for the attention call, whose kernel encodes and
stores the window's oldest token and writes the new one in its slot: the window is
then a ring starting at `window_start`. Anything else that reads the cache first
(`flush`) slides it op by op, and `window_keys` / `window_values` are always in
position order.

The cache keeps the positions (sinks, window, offset, trim) and hands attention a
read-only `engine.History`; the codes live in a `storage` class chosen from the
codecs' formats, and the attention path comes from the engine's registry, with the
settings (`settings.EngineSettings`) resolved once when the cache is made.
"""

from __future__ import annotations

import contextvars
import copy
import json
import math
from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache, create_attention_mask

from . import engine
from .artifacts import CodecSet, metadata_digest
from .attention import Segment
from .attention_hook import install_attention_hook
from .cache_integrity import seal, verify_sealed
from .config import KVCacheConfig
from .kept import KeptTokens, window_shares
from .methods.base import at_positions
from .settings import EngineSettings
from .storage import RowStore, grow, store_for

FORMAT_VERSION = 3  # 2: checksums, layer index, model identity; 3: checksums in `state` (cache_integrity)
_DENSE_STATE = ("sink_keys", "sink_values", "window_keys", "window_values", "key_mean", "value_mean")


class CacheFormatError(ValueError):
    """A saved cache that cannot be restored (corrupted, truncated or foreign)."""


FP16_MAX = 65504.0  # the window, sinks and the codes' scales are fp16 (or bf16 for bf16 models)


class CacheInputError(ValueError):
    """Keys, values, queries or a trim that this cache cannot take (named in the message)."""


class CompressedHistory:
    """Returned by `update_and_fetch` in place of fp16 keys/values.

    mlx-lm passes it on to `scaled_dot_product_attention`, which VeloxQuant
    routes to `CompressedKVCache.attend`. It holds no data.
    """

    def __init__(self, cache: "CompressedKVCache", role: str):
        self.cache, self.role = cache, role

    @property
    def shape(self):
        c = self.cache
        dim = c.key_dim if self.role == "keys" else c.value_dim
        return (c.batch, c.kv_heads, c.offset, dim)

    def __repr__(self):
        return f"CompressedHistory({self.role}, shape={self.shape}, {self.cache.config.describe()})"


class CompressedKVCache(_BaseCache):
    attention_block = 4096  # most tokens decoded per generic attention block
    score_tile = 1 << 21  # most query-by-key scores per generic block: bounds prefill memory
    band_queries = 64  # prefill queries per group scoring the recent tokens in fp16 (`_recent_fp16`): ~ the window

    def __init__(self, config: KVCacheConfig, codecs: Optional[CodecSet] = None,
                 settings: Optional[EngineSettings] = None):
        self.config = config
        self.codecs = codecs or CodecSet.for_config(config)
        self._settings = settings or EngineSettings.resolve()
        self.offset = 0
        self.key_codec = self.value_codec = None
        self.store = None
        self.sink_keys = self.sink_values = None
        self._window_keys = self._window_values = None
        self.window_start = 0  # where the oldest window token is held: decode kernels slide it as a ring
        self.window_fill = None  # tokens of a fixed-capacity window buffer that hold tokens (`_tail_append`)
        self.incoming = None  # (keys, values) of a decode token that waits to enter the window (`flush`)
        self.key_mean = self.value_mean = None
        self.just_encoded = None  # (keys, values, first position) flushed by the last update
        self.last_path: Optional[str] = None  # the attention path of the last call
        self._routes = {}  # (phase, call shape) -> registered path or None: chosen once, not per token
        self.layer: Optional[int] = None  # index in the model, when made for one (recorded when saved)
        self.model_identity: Optional[dict] = None  # `artifacts.model_identity` of that model
        self.kept = KeptTokens.for_config(config)  # `keep_attended`: tokens kept in fp16 past the window (`kept.py`)

    # Immutable or shared by every cache of a config (codebooks, compiled encoders): not copied.
    _SHARED_ON_COPY = ("config", "codecs", "key_codec", "value_codec", "_row_encoder", "_field_encoder", "_settings",
                       "window_dtype", "_routes")

    def __deepcopy__(self, memo):
        """An independent cache holding the same tokens (mlx-lm's server deep-copies prompt caches)."""
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for name, value in vars(self).items():
            setattr(new, name, value if name in self._SHARED_ON_COPY else copy.deepcopy(value, memo))
        new._routes = {}
        return new

    @property
    def settings(self) -> EngineSettings:
        return self._settings

    @settings.setter
    def settings(self, settings: EngineSettings):
        self._settings = settings
        self._routes = {}

    # ---- shapes -------------------------------------------------------------
    def _setup(self, keys: mx.array, values: mx.array):
        self.batch, self.kv_heads, _, self.key_dim = keys.shape
        self.value_dim = values.shape[-1]
        self.window_dtype = keys.dtype if keys.dtype in (mx.float16, mx.bfloat16) else mx.float16
        self.key_codec = self.codecs.get("keys", self.key_dim)
        self.value_codec = self.codecs.get("values", self.value_dim)
        self.block = math.lcm(self.key_codec.token_block, self.value_codec.token_block)
        self._immediate = (self.block == 1 and self.config.sink_tokens == 0 and self.config.residual_length == 0)
        if self.kept is not None and (self.block != 1 or self.batch != 1):
            raise CacheInputError(
                f"keep_attended needs a format that codes each token on its own and a cache of batch 1 (batches "
                f"hold one cache per sequence, `batch.py`); {self.config.method} codes tokens in blocks of "
                f"{self.block}, and this cache is of batch {self.batch}")
        self.store = store_for(self.key_codec, self.value_codec, self._encode_rows, self._encode_fields)
        if isinstance(self.store, RowStore):
            self._row_encoder = engine.row_encoder(self.store.layout, self.key_codec, self.value_codec, self.settings)
        else:
            self._field_encoder = engine.field_encoder(self.key_codec, self.value_codec, self.settings)

    @property
    def encoded(self) -> int:
        return 0 if self.store is None else self.store.count

    @property
    def key_fields(self):
        """The key codec's fields of the encoded tokens (views of the store)."""
        return {} if self.store is None else self.store.fields("keys")

    @property
    def value_fields(self):
        return {} if self.store is None else self.store.fields("values")

    @property
    def tokens_per_row(self):
        return self.store.tokens_per_row

    @property
    def sinks(self) -> int:
        return 0 if self.sink_keys is None else self.sink_keys.shape[2]

    @property
    def window(self) -> int:
        if self.window_fill is not None:
            return self.window_fill
        return 0 if self._window_keys is None else self._window_keys.shape[2]

    # The window in position order, for everything but a decode step's kernels: a token waiting
    # to enter it enters, and a ring slid by the kernels is put back in order (one copy).
    @property
    def window_keys(self) -> Optional[mx.array]:
        self._window_in_order()
        return self._held(self._window_keys)

    @window_keys.setter
    def window_keys(self, keys: Optional[mx.array]):
        self._settle_window()
        self._window_keys = keys

    @property
    def window_values(self) -> Optional[mx.array]:
        self._window_in_order()
        return self._held(self._window_values)

    @window_values.setter
    def window_values(self, values: Optional[mx.array]):
        self._settle_window()
        self._window_values = values

    def _held(self, window: Optional[mx.array]) -> Optional[mx.array]:
        """The tokens of a window array (a view of the filled part of a fixed-capacity buffer)."""
        return window if self.window_fill is None else window[..., : self.window_fill, :]

    def _settle_window(self):
        """Both roles' window as exactly its tokens (before either is replaced), no buffer (copies:
        a view would keep the buffer alive, out of `nbytes`)."""
        if self.window_fill is not None:
            self._window_keys = mx.contiguous(self._held(self._window_keys))
            self._window_values = mx.contiguous(self._held(self._window_values))
            self.window_fill = None

    def _window_in_order(self):
        self._enter_window()
        if self.window_start:
            start, self.window_start = self.window_start, 0
            self._window_keys = mx.roll(self._window_keys, -start, axis=2)
            self._window_values = mx.roll(self._window_values, -start, axis=2)

    def _enter_window(self):
        """The waiting decode token enters the window, its oldest token going to the store (op
        by op: what the "decode_store" kernels would have done in the attention call)."""
        if self.incoming is not None:
            (keys, values), self.incoming = self.incoming, None
            self._slide_window(keys, values, 1)

    def flush(self):
        """Store what waits for the next attention call: a token waiting to enter the window,
        a token waiting to be encoded (`storage.RowStore.defer`)."""
        self._enter_window()
        self.store.flush()

    # ---- encoding (called by the store) ---------------------------------------
    def _centered_inputs(self, keys: mx.array, values: mx.array):
        if not self.config.center:
            return keys, values
        if self.key_mean is None:
            self.key_mean, self.value_mean = _finite_mean(keys), _finite_mean(values)
        return keys.astype(mx.float32) - self.key_mean, values.astype(mx.float32) - self.value_mean

    def _position_free(self, keys: mx.array) -> mx.array:
        """What a positional key codec encodes: the keys about to be stored (at positions from
        sinks + encoded on) with their position's map taken off (`Codec.positional`)."""
        if not self.key_codec.positional:
            return keys
        return self.key_codec.position_free(keys, self.sinks + self.store.count)

    def _encode_rows(self, keys: mx.array, values: mx.array) -> mx.array:
        keys = self._position_free(keys)
        if keys.shape[2] == 1 and (self.key_mean is not None or not self.config.center):
            return self._row_encoder.one(keys, values, self.key_mean, self.value_mean)
        return self._row_encoder.many(*self._centered_inputs(keys, values))

    def _encode_fields(self, keys: mx.array, values: mx.array):
        return self._field_encoder(*self._centered_inputs(self._position_free(keys), values))

    # ---- mlx-lm cache protocol ---------------------------------------------
    def _check_update(self, keys, values):
        """Refuse what would crash deep inside or corrupt the cache for good (see README, "Trust")."""
        if not isinstance(keys, mx.array) or not isinstance(values, mx.array):
            raise TypeError(f"keys and values must be mx.array, got {type(keys).__name__} and {type(values).__name__}")
        if keys.ndim != 4 or values.ndim != 4 or keys.shape[:3] != values.shape[:3]:
            raise CacheInputError(f"keys and values must be (batch, kv_heads, tokens, head_dim) with the same first "
                                  f"three sizes, got {tuple(keys.shape)} and {tuple(values.shape)}")
        if not (mx.issubdtype(keys.dtype, mx.floating) and mx.issubdtype(values.dtype, mx.floating)):
            raise CacheInputError(f"keys and values must be floating point, got {keys.dtype} and {values.dtype}")
        if self.key_codec is not None:
            got = (keys.shape[0], keys.shape[1], keys.shape[3], values.shape[3])
            held = (self.batch, self.kv_heads, self.key_dim, self.value_dim)
            if got != held:
                raise CacheInputError(
                    f"this cache holds (batch, kv_heads, key dim, value dim) = {held} since its first update; got "
                    f"{got}: a cache serves one layer of one model; make a new one")
        check = self.settings.check_inputs
        if keys.shape[2] and (check == "always" or (check == "prefill" and keys.shape[2] > 1)
                              or (check == "first" and self.offset == 0)):
            # Norms, not elements: the codes keep fp16 norms and scales. `<=` is False for NaN too,
            # so one reduction and one sync cover NaN, Inf and overflow.
            limit = FP16_MAX * FP16_MAX
            healthy = (mx.all(mx.sum(mx.square(keys.astype(mx.float32)), axis=-1) <= limit)
                       & mx.all(mx.sum(mx.square(values.astype(mx.float32)), axis=-1) <= limit))
            if not healthy.item():
                raise CacheInputError(
                    f"keys or values hold NaN, Inf or a vector whose norm exceeds fp16's range ({FP16_MAX:g}), "
                    "which the fp16 window, the means and the codes' fp16 norms and scales cannot hold; the cache "
                    "is unchanged. (EngineSettings(check_inputs='off') or "
                    "VELOXQUANT_CHECK_INPUTS=off skips this check)")

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self._check_update(keys, values)
        if self.key_codec is None:
            self._setup(keys, values)
        keys = keys.astype(self.window_dtype)
        values = values.astype(self.window_dtype)
        if self.kept is not None:  # tokens that left the window with no attention call since: settled now
            self.kept.settle(self.sinks + self.encoded, self.just_encoded)
        self.offset += keys.shape[2]
        self.just_encoded = None
        if self._immediate and keys.shape[2]:
            # No sinks, no window, one token per block: every token is encoded at once
            # (what the general path below does in that case, with less per-step work).
            if keys.shape[2] == 1 and self._route("defer", None, None) is not None:
                # The attention call that follows encodes and stores it (a "decode_store"
                # path); anything else that reads the codes stores it first.
                self.store.defer(keys, values)
            else:
                self.store.append(keys, values)
            return self.history()

        # Positions below count the codes, so a token still waiting for its attention call
        # (an update with no attention between, as in tests or a prefill after decode) is stored first.
        self.flush()
        to_sinks = min(self.config.sink_tokens - self.sinks, keys.shape[2])
        if to_sinks > 0:
            # Copies: a view would keep the whole chunk alive (and out of `nbytes`).
            self.sink_keys = _concat(self.sink_keys, mx.contiguous(keys[..., :to_sinks, :]))
            self.sink_values = _concat(self.sink_values, mx.contiguous(values[..., :to_sinks, :]))
            keys, values = keys[..., to_sinks:, :], values[..., to_sinks:, :]
        if keys.shape[2] == 0:
            return self.history()

        held = self.window
        flush = ((held + keys.shape[2] - self.config.residual_length) // self.block) * self.block
        if 0 < flush <= held and self.block == 1 and self.config.residual_length > 0:
            if flush == 1 and self._route("slide", None, None) is not None:
                # The attention call that follows slides the window in its kernels: they encode
                # and store its oldest token and put this one in its slot (a "decode_store" path).
                self.incoming = (keys, values)
                return self.history()
            # A decode step with a full window: the oldest token leaves and the window stays one
            # contiguous array (a view of a longer one would be copied by every kernel reading it).
            self._slide_window(keys, values, flush)
            return self.history()
        if keys.shape[2] == 1 and self.block > 1:
            self._tail_append(keys, values, flush)
            return self.history()
        self.window_keys = _concat(self.window_keys, keys)
        self.window_values = _concat(self.window_values, values)
        if flush > 0:
            if self.config.residual_length or self.block > 1:
                self.just_encoded = (
                    self.window_keys[..., :flush, :],
                    self.window_values[..., :flush, :],
                    self.sinks + self.encoded,
                )
            store = self._store_for(flush)
            if flush == self.window:  # all of it (the usual decode step without a window): no slicing
                store(self.window_keys, self.window_values)
                self.window_keys = self.window_values = None
            else:
                store(self.window_keys[..., :flush, :], self.window_values[..., :flush, :])
                kept_keys, kept_values = self.window_keys[..., flush:, :], self.window_values[..., flush:, :]
                if flush > kept_keys.shape[2]:
                    # A view would keep the whole flushed span alive (and out of `nbytes`): copy the rest.
                    kept_keys, kept_values = mx.contiguous(kept_keys), mx.contiguous(kept_values)
                self.window_keys, self.window_values = kept_keys, kept_values
        return self.history()

    def _tail_append(self, keys: mx.array, values: mx.array, flush: int):
        """A decode token of a block format (KIVI) joins the window, held in a buffer of fixed
        capacity (residual_length + block, the most it holds before a block leaves) that it fills
        in part: one in-place slice update per role, and the decode step's shapes stay the same
        from token to token. A window that grew by concatenation instead changed them on every
        token, and a compiled decode step traced itself again for each new length (64 traces per
        256 tokens of `kivi:4`). The kernel path reads the buffer and the fill
        (`_fp16_parts(held=True)`), every other reader a view of the filled part."""
        capacity = self.config.residual_length + self.block
        if self.window_fill is None:  # into a buffer (the first decode token, or after a prefill or trim)
            held = self.window
            self._window_keys = grow(self._window_keys, capacity, keys, capacity)
            self._window_values = grow(self._window_values, capacity, values, capacity)
            self.window_fill = held
        fill = self.window_fill
        self._window_keys[..., fill : fill + 1, :] = keys
        self._window_values[..., fill : fill + 1, :] = values
        self.window_fill = fill + 1
        if flush > 0:
            leaving_keys, leaving_values = self._window_keys[..., :flush, :], self._window_values[..., :flush, :]
            self.just_encoded = (leaving_keys, leaving_values, self.sinks + self.encoded)
            self._store_for(flush)(leaving_keys, leaving_values)
            kept = fill + 1 - flush
            if kept:  # the residual tokens move to the front (once per block)
                self._window_keys = grow(self._window_keys[..., flush : fill + 1, :], capacity, keys, capacity)
                self._window_values = grow(self._window_values[..., flush : fill + 1, :], capacity, values, capacity)
            self.window_fill = kept

    def _store_for(self, flush: int):
        """How `flush` tokens leaving the window reach the store. A decode step pushes one token
        out: like a token of the plain cache, it may wait for the attention call's "decode_store"
        path, which encodes, attends to and stores it in one kernel (the query no longer sees it
        in fp16)."""
        return self.store.defer if flush == 1 and self._route("defer", None, None) else self.store.append

    def _slide_window(self, keys: mx.array, values: mx.array, flush: int):
        """The first `flush` window tokens (no more than it holds) leave for the store, as the
        general path of `update_and_fetch` sends them, and `keys` / `values` join the window."""
        self._window_in_order()
        leaving_keys, leaving_values = self._window_keys[..., :flush, :], self._window_values[..., :flush, :]
        self.just_encoded = (leaving_keys, leaving_values, self.sinks + self.encoded)
        self._store_for(flush)(leaving_keys, leaving_values)
        self._window_keys = mx.concatenate([self._window_keys[..., flush:, :], keys], axis=2)
        self._window_values = mx.concatenate([self._window_values[..., flush:, :], values], axis=2)

    def history(self):
        return CompressedHistory(self, "keys"), CompressedHistory(self, "values")

    def _history(self, pending=None, slide: bool = False) -> engine.History:
        """The read-only view attention paths get; with `slide`, `pending` is the token that
        enters the window, whose oldest token is at `window_start`."""
        return engine.History(
            store=self.store, key_codec=self.key_codec, value_codec=self.value_codec, kv_heads=self.kv_heads,
            offset=self.offset, sinks=self.sinks, window=self.window, key_mean=self.key_mean,
            value_mean=self.value_mean, settings=self.settings, fp16=self._fp16_tokens, segments=self.segments,
            fp16_parts=self._fp16_parts,
            band=self.just_encoded is not None, pending=pending, recent=self._recent_tokens,
            fp16_from=self._fp16_from, window_slot=self.window_start if slide else None,
            window_capacity=None if self.window_fill is None else self._window_keys.shape[2],
            kept=(self.kept, self.sinks) if self.kept is not None and self.kept.capacity else None,
        )

    def _recent_tokens(self):
        """(keys (centered), values, first position) of the tokens this update encoded followed by
        the window: one fp16 span, which the chunk's earlier queries still see in fp16."""
        if self.just_encoded is None:
            return None
        keys, values, first = self.just_encoded
        if self.window:
            keys = mx.concatenate([keys, self.window_keys], axis=2)
            values = mx.concatenate([values, self.window_values], axis=2)
        return self._centered(keys), values, first

    def _fp16_parts(self, held: bool = False):
        """The sinks' and the window's (keys, values) as held (keys not centered), present ones only,
        for decode paths: the window in its ring order (one query's attention does not depend
        on the order of its keys), not settled (a "decode_store" path may slide it). `held`: a
        window buffer of fixed capacity whole (`window_fill` tokens of it filled), else its
        filled part."""
        parts = ((self.sink_keys, self.sink_values),) if self.sinks else ()
        if self.window:
            window = (self._window_keys, self._window_values)
            parts += (window if held else tuple(self._held(a) for a in window),)
        return parts

    def _fp16_tokens(self):
        parts = [(self.sink_keys, self.sink_values), (self.window_keys, self.window_values)]
        parts = [(self._centered(k), v) for k, v in parts if k is not None and k.shape[2]]
        if not parts:
            return None
        if len(parts) == 1:
            return parts[0]
        return (mx.concatenate([k.astype(mx.float32) for k, _ in parts], axis=2),
                mx.concatenate([v for _, v in parts], axis=2))

    def _fp16_from(self, query_pos):
        """First non-sink position still in fp16 when `query_pos` (an int or an array) was
        the newest token."""
        sinks, window = self.config.sink_tokens, self.config.residual_length
        blocks = (query_pos + 1 - sinks - window) // self.block
        blocks = max(0, blocks) if isinstance(blocks, int) else mx.maximum(0, blocks)
        return sinks + blocks * self.block

    def _chunk_sees_fp16(self, query_len: int) -> bool:
        """Whether `query_len` queries see the whole recent fp16 span (the "chunk" prefill rule)."""
        return self.settings.prefill_rule == "chunk" and query_len > 1

    def _prefill_fp16_from(self, query_pos, first: int, last: int, query_len: int):
        """First position of the recent fp16 span [first, offset) that one of `query_len` queries,
        at `query_pos` (an int or an array), sees in fp16; it sees the span's earlier tokens,
        encoded at [first, last), from their codes. The "decode" rule: what token-by-token
        decoding would show it (a band about one window wide); the "chunk" rule: the whole span,
        for the queries of a prefill chunk (more than one)."""
        if self._chunk_sees_fp16(query_len):
            return first if isinstance(query_pos, int) else mx.full(query_pos.shape, first)
        pos = self._fp16_from(query_pos)
        return min(max(pos, first), last) if isinstance(pos, int) else mx.clip(pos, first, last)

    def segments(self, query_rows: int = 1, query_len: int = 0):
        """The history as attention consumes it; encoded blocks are decoded lazily and
        sized so that `query_rows` (queries x query heads) x block scores fit a tile.
        With `query_len`, tokens this update encoded are scored in fp16 by the queries
        that would still have seen them in the window."""
        self.flush()
        if query_len and self.just_encoded is not None:
            just, _, first = self.just_encoded
            last = first + just.shape[2]
            query_pos = mx.arange(self.offset - query_len, self.offset)
            fp16_from = self._prefill_fp16_from(query_pos, first, last, query_len)[:, None]
        value_shift = None
        if self.value_mean is not None:
            value_shift = self.value_codec.to_domain(self.value_mean.astype(mx.float32))
        block = min(self.attention_block, max(256, self.score_tile // max(query_rows, 1)))
        block = math.ceil(block / self.block) * self.block
        encoded = self.encoded
        # The kept tokens' codes, masked out of every block (`kept.py`): -inf at their rows.
        kept_codes = self.kept.code_bias(self.sinks, encoded) if self.kept is not None and self.kept.capacity else None
        if query_len and self.just_encoded is not None and self._chunk_sees_fp16(query_len):
            # Every query sees this update's tokens in fp16: their codes would be masked out whole.
            encoded = max(0, first - self.sinks)
        for start in range(0, encoded, block):
            stop = min(start + block, encoded)
            only_codes = None
            if query_len and self.just_encoded is not None and self.sinks + stop > first:
                only_codes = mx.arange(self.sinks + start, self.sinks + stop)[None] < fp16_from
            if kept_codes is not None:
                coded = (kept_codes[start:stop] == 0)[None]
                only_codes = coded if only_codes is None else only_codes & coded
            yield Segment(
                self.key_codec.decode(at_positions(self.key_codec, self.store.fields("keys", start, stop),
                                                   self.sinks + start)),
                None,
                self.sinks + start,
                encoded=True,
                extra_mask=only_codes,
                value_fields=self.store.fields("values", start, stop),
                value_shift=value_shift,
            )
        # The fp16 segments come after the codes: until the first of them there is no fp16
        # accumulator for every block of codes to rescale (a prefill chunk's (L, D) per block).
        if self.sinks:
            yield Segment(self._centered(self.sink_keys), self.sink_values, 0, encoded=False)
        kept = None if self.kept is None else self.kept.held()
        if kept is not None:
            # A query sees a kept token here when it no longer sees it in its fp16 band (below);
            # empty slots sit at a position after every query.
            keys, values, positions = kept
            sees_from = fp16_from if query_len and self.just_encoded is not None else self.sinks + self.encoded
            yield Segment(self._centered(keys), values, 0, encoded=False, extra_mask=positions[None] < sees_from,
                          positions=positions)
        if query_len and self.just_encoded is not None:
            yield from self._recent_fp16(*self._recent_tokens(), query_len, fp16_from)
        elif self.window:
            yield Segment(
                self._centered(self.window_keys), self.window_values, self.sinks + self.encoded, encoded=False
            )

    def _recent_fp16(self, keys: mx.array, values: mx.array, first: int, query_len: int, fp16_from: mx.array):
        """Positions [first, offset) in fp16 (the tokens this update encoded, then the
        window; keys centered) for the queries that still see them so: query i sees keys [fp16_from[i], i]
        in fp16 (a band about one window wide), so the queries go in groups of
        `band_queries`, each scoring only its band's keys, not every query the whole span."""
        first_query = self.offset - query_len
        last = first + keys.shape[2]
        if self._chunk_sees_fp16(query_len):  # every query sees the whole span
            yield Segment(keys, values, first, encoded=False)
            return
        for a in range(0, query_len, self.band_queries):
            b = min(a + self.band_queries, query_len)
            lo = self._prefill_fp16_from(first_query + a, first, last, query_len)
            hi = min(max(first_query + b, first), last)  # causal: no key after the group's last query
            if hi <= lo:
                continue
            yield Segment(
                keys[..., lo - first : hi - first, :], values[..., lo - first : hi - first, :], lo,
                encoded=False, extra_mask=mx.arange(lo, hi)[None] >= fp16_from[a:b], query_rows=(a, b),
            )

    def _centered(self, keys: mx.array) -> mx.array:
        return keys if self.key_mean is None else keys.astype(mx.float32) - self.key_mean

    def attend(self, queries: mx.array, scale: float, mask=None) -> mx.array:
        """Attention of `queries` (B, n_heads, L, D) over everything this cache holds, through
        the first registered path that takes the call (`engine.py`); `last_path` names it."""
        if self.store is None or self.offset == 0:
            raise CacheInputError("attend() on an empty cache: it holds no tokens (none added, or all trimmed)")
        if not isinstance(queries, mx.array) or queries.ndim != 4:
            raise CacheInputError(f"queries must be an mx.array (batch, heads, tokens, head_dim), got "
                                  f"{getattr(queries, 'shape', type(queries).__name__)}")
        B, heads, L, dim = queries.shape
        if B != self.batch or heads % self.kv_heads or dim != self.key_dim:
            raise CacheInputError(
                f"queries {tuple(queries.shape)} do not fit this cache: batch {self.batch}, a multiple of "
                f"{self.kv_heads} heads, head dim {self.key_dim}")
        if L == 0:
            return mx.zeros((B, heads, 0, self.value_dim), dtype=queries.dtype)
        if self.kept is not None:
            self._keep_attended(queries, scale)
        store = self.store
        if store.pending is not None or self.incoming is not None:
            path = self._route("decode_store", queries, mask)
            if path is not None:
                if self.incoming is None:
                    out, rows = path.run(self._history(pending=store.take_pending()), queries, scale, mask)
                else:
                    incoming, self.incoming = self.incoming, None
                    store.reserve(1)
                    out, rows, window = path.run(self._history(pending=incoming, slide=True), queries, scale, mask)
                    self._window_keys, self._window_values = window
                    self.window_start = (self.window_start + 1) % self.window
                store.put_row(rows)
                self.last_path = path.name
                return out
            self.flush()
        path = self._route("decode" if queries.shape[2] == 1 else "prefill", queries, mask)
        history = self._history()
        if path is None:
            out, self.last_path = engine.generic(history, queries, scale, mask), "generic"
        else:
            out, self.last_path = path.run(history, queries, scale, mask), path.name
        self.just_encoded = None  # only the call after the update scores them in fp16
        return out

    def _keep_attended(self, queries: mx.array, scale: float):
        """`keep_attended`: add this call's window shares (`kept.window_shares`) and settle the
        tokens that have left the window, before any path scores, so that the later queries of a
        prefill chunk see the tokens its earlier ones kept."""
        L = queries.shape[2]
        band = self.config.residual_length
        if self.incoming is not None:  # a "decode_store" kernel slides the window after this
            ring = (self._window_keys, self._window_values, self.window_start)
            if self.kept.decode_step_sliding(self.settings.backend, queries, scale, self.sink_keys, ring,
                                             self.incoming[0], self._fp16_from(self.offset - 1), self.offset,
                                             self.sinks + self.encoded, band):
                return
            self._enter_window()  # the shares do not line up (a cache just loaded or trimmed): slide op by op
        if L == 1 and self.just_encoded is not None and self.window and self.kept.decode_step(
                queries, scale, self.sink_keys, self.window_keys, self._fp16_from(self.offset - 1), self.offset,
                self.sinks + self.encoded, band, self.just_encoded):
            return  # a decode step: shares and settling in one compiled graph
        if self.just_encoded is not None:
            span, _, first = self.just_encoded
            if self.window:
                span = mx.concatenate([span, self.window_keys], axis=2)
        else:
            span, first = (self.window_keys if self.window else None), self.sinks + self.encoded
        if span is not None:
            query_pos = mx.arange(self.offset - L, self.offset)
            shares = window_shares(queries, scale, self.sink_keys, span, first, self._fp16_from(query_pos),
                                   self.offset - L, band)
            self.kept.add_shares(shares, first, self.offset)
        self.kept.settle(self.sinks + self.encoded, self.just_encoded)

    def _route(self, phase: str, queries, mask):
        """The registered path for this kind of call (`engine.choose`), memoised on what the
        paths' `supports` look at (shapes, dtypes, the mask's kind, the fp16 spans against
        `engine.FP16_HELD_LIMIT`, whether codes exist and means are fixed), so a decode step does
        not re-run the checks.
        "defer": whether a decode token may wait for a "decode_store" path; "slide": whether
        one may wait to enter a full window, which a "decode_store" path slides (`incoming`)."""
        if mask is not None and not isinstance(mask, str):
            return None  # an explicit mask array: the generic path applies it
        if self.kept is not None and phase == "defer":
            return None  # a token leaves the window in the update: `_keep_attended` needs its fp16 copy
        slide = phase == "slide" or (phase == "decode_store" and self.incoming is not None)
        key = (phase, None if queries is None else (tuple(queries.shape), queries.dtype), mask, self.sinks,
               self._fp16_route_key(), self.just_encoded is not None, self.encoded > 0, self.key_mean is None, slide,
               self.kept is not None and self.kept.capacity > 0)
        if key not in self._routes:
            history = self._history(pending=self.incoming or self.store.pending, slide=slide)
            if phase in ("defer", "slide"):
                self._routes[key] = True if engine.defers(history) else None
            else:
                self._routes[key] = engine.choose(phase, history, queries, mask)
        return self._routes[key]

    def _fp16_route_key(self) -> tuple:
        """What of the fp16 window the paths' `supports` look at: whether it holds tokens, and whether
        the sinks with the window's tokens, and with its buffer whole, fit `engine.FP16_HELD_LIMIT`.
        Keyed on the window's length itself, a group format (KIVI's tokens waiting for a whole group)
        would choose its path again on every decode step until each length had been seen once."""
        capacity = 0 if self.window_fill is None else self._window_keys.shape[2]
        limit = engine.FP16_HELD_LIMIT
        return self.window > 0, self.sinks + self.window <= limit, self.sinks + capacity <= limit

    def dequantized(self):
        """(keys, values) as the attention sees them, in fp32. For tests and debugging:
        this materialises the whole history, which attention itself never does."""
        parts = []
        for seg in self.segments():
            if seg.positions is not None:
                continue  # the kept tokens: written over their codes below
            values = seg.decoded_values(self.value_codec)
            if seg.encoded:
                parts.append((seg.start, self.key_codec.from_domain(seg.keys), self.value_codec.from_domain(values)))
            else:
                parts.append((seg.start, seg.keys.astype(mx.float32), values))
        parts.sort(key=lambda part: part[0])  # segments come in attention's order, not by position
        keys = mx.concatenate([k for _, k, _ in parts], axis=2)
        if self.key_mean is not None:
            keys = keys + self.key_mean
        values = mx.concatenate([v for _, _, v in parts], axis=2)
        kept = None if self.kept is None else self.kept.held()
        if kept is not None:
            kept_keys, kept_values, positions = kept
            held = [i for i, p in enumerate(positions.tolist()) if p < self.offset]
            if held:
                slots, at = mx.array(held), positions[mx.array(held)]
                keys[:, :, at] = kept_keys[:, :, slots].astype(mx.float32)
                values[:, :, at] = kept_values[:, :, slots].astype(mx.float32)
        return keys, values

    def size(self):
        return self.offset

    def empty(self):
        return self.offset == 0

    def is_trimmable(self):
        return True

    def trim(self, n: int) -> int:
        """Drop the last `n` tokens.

        Without an fp16 window this equals never having seen them. With one, tokens
        that already left the window stay encoded (their fp16 originals are gone), so
        the window refills from new tokens only. If the trim cuts into a multi-token
        block of codes (KIVI key groups), the block's surviving tokens move back to
        the window in decoded form, which leaves attention unchanged."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise CacheInputError(f"trim takes a number of tokens >= 0, got {n!r}")
        if self.store is None:
            return 0
        self.flush()
        n = min(n, self.offset)
        if self.kept is not None:
            self.kept.settle(self.sinks + self.encoded, self.just_encoded)
        self.just_encoded = None
        left = n
        window = self.window
        cut = min(left, window)
        if cut:
            self.window_keys = self.window_keys[..., : window - cut, :]
            self.window_values = self.window_values[..., : window - cut, :]
            left -= cut
        if left and self.encoded:
            cut = min(left, self.encoded)
            left -= cut
            kept = self.encoded - cut
            whole = (kept // self.block) * self.block
            if whole < kept:
                self.window_keys = self._restore("keys", whole, kept)
                self.window_values = self._restore("values", whole, kept)
            self.store.truncate(whole)
        if left:
            sinks = self.sinks
            self.sink_keys = self.sink_keys[..., : sinks - left, :]
            self.sink_values = self.sink_values[..., : sinks - left, :]
        self.offset -= n
        if self.kept is not None:  # shares the trimmed queries gave the window's tokens stay counted
            self.kept.truncate(self.sinks + self.encoded, self.offset)
        return n

    def _restore(self, role: str, block_start: int, stop: int) -> mx.array:
        """Decode the first tokens of a block back into fp16 (their originals are gone)."""
        codec, mean = (self.key_codec, self.key_mean) if role == "keys" else (self.value_codec, self.value_mean)
        rows = at_positions(codec, self.store.fields(role, block_start, block_start + self.block),
                            self.sinks + block_start)
        decoded = codec.reconstruct(rows)[..., : stop - block_start, :]
        if mean is not None:
            decoded = decoded + mean
        return decoded.astype(self.window_dtype)

    def make_mask(self, *args, **kwargs):
        return create_attention_mask(*args, offset=self.offset, **kwargs)

    # ---- batching (mlx-lm's BatchGenerator: batch_generate, mlx_lm.server) ---
    @classmethod
    def merge(cls, caches):
        """A `batch.BatchCompressedKVCache` of copies of `caches` (each of batch 1)."""
        from .batch import BatchCompressedKVCache

        return BatchCompressedKVCache.merge(caches)

    def _dense_nbytes(self, used: bool = False) -> int:
        """Bytes of the arrays beside the store (sinks, window, means), a waiting token stored first;
        `used`: of a fixed-capacity window buffer, only its filled part."""
        if self.store is not None:
            self.flush()
        window = (self._window_keys, self._window_values)
        if used:
            window = tuple(self._held(a) for a in window if a is not None)
        arrays = (self.sink_keys, self.sink_values, *window, self.key_mean, self.value_mean)
        kept = 0 if self.kept is None else self.kept.nbytes
        return sum(a.nbytes for a in arrays if a is not None) + kept

    @property
    def nbytes(self) -> int:
        return self._dense_nbytes() + (0 if self.store is None else self.store.nbytes)

    @property
    def used_nbytes(self) -> int:
        """`nbytes` without the unused capacity of the store and of the window buffer: the bytes
        the tokens held take."""
        return self._dense_nbytes(used=True) + (0 if self.store is None else self.store.used_nbytes)

    # ---- save / load --------------------------------------------------------
    # A saved layer is [header JSON, arrays]. The header holds the format version, the full
    # config, the model identity and layer index (when the cache was made for a model), the
    # checksums of the codecs' constant arrays, every tensor's checksums (`cache_integrity`), and a digest of itself:
    # a flipped, truncated, swapped or edited file is refused with the layer and tensor named.
    @property
    def state(self):
        if self.store is not None:
            self.flush()  # before counting: a token waiting for its attention call is held
        header = {
            "format": FORMAT_VERSION,
            "config": json.loads(self.config.to_json()),
            "offset": self.offset,
            "encoded": self.encoded,
            "layer": self.layer,
            "model": self.model_identity,
            "artifact": self.codecs.source,
        }
        arrays = {}
        if self.key_codec is not None:
            header.update(
                shape=[self.batch, self.kv_heads, self.key_dim, self.value_dim],
                window_dtype=str(self.window_dtype),
                tokens_per_row=self.tokens_per_row,
                codecs={"keys": self.codecs.checksum("keys", self.key_dim),
                        "values": self.codecs.checksum("values", self.value_dim)},
            )
            for group in ("keys", "values"):
                if self.encoded:
                    arrays[group] = self.store.fields(group, 0, self.encoded)
            for name in _DENSE_STATE:
                if getattr(self, name) is not None and getattr(self, name).shape[2]:
                    arrays[name] = getattr(self, name)
            if self.kept is not None:
                header["kept"], kept_arrays = self.kept.state()
                arrays.update(kept_arrays)
        seal(header, arrays)  # checksums in `state` itself: mlx-lm's save_prompt_cache is checked too
        header["digest"] = metadata_digest(header)
        return [json.dumps(header), arrays]

    @state.setter
    def state(self, state):
        header, arrays = _read_state(state)
        where = "cache layer" if header.get("layer") is None else f"cache layer {header['layer']}"
        try:
            written_with = KVCacheConfig(**header["config"])
        except Exception as error:
            raise CacheFormatError(f"{where}: unusable config in the header ({error})") from None
        caller = _LOADING.get()
        if caller is not None:
            # The caller's config decides; the header only has to agree with it.
            config, codecs = caller
            if not written_with.same_encoding(config):
                raise CacheFormatError(f"{where} was written with {written_with.describe()}, "
                                       f"not {config.describe()}")
        else:
            # No config given: the codecs come from where the file says they did (the seed or
            # its artifact dir), and must match the checksums it recorded.
            config = written_with.replace(artifact_dir=header.get("artifact") or None)
            try:
                codecs = CodecSet.for_config(config)
            except ValueError as error:
                raise CacheFormatError(f"{where} was written with codecs from {config.artifact_dir}: {error}") from None
        arrays = verify_sealed(header, arrays, where, CacheFormatError)
        if codecs.per_layer:  # calibrated per layer: this layer's codecs
            if not isinstance(header.get("layer"), int):
                raise CacheFormatError(f"{where}: per-layer codecs, but the header names no layer")
            codecs = codecs.layer(header["layer"])
        self.__init__(config, codecs)
        self.layer, self.model_identity = header.get("layer"), header.get("model")
        if "shape" not in header:
            if header.get("offset") != 0:
                raise CacheFormatError(f"{where}: offset {header.get('offset')} without any stored token")
            return
        try:
            self.batch, self.kv_heads, self.key_dim, self.value_dim = (int(n) for n in header["shape"])
            dtype = {str(d): d for d in (mx.float16, mx.bfloat16, mx.float32)}[header["window_dtype"]]
            self.offset, encoded = int(header["offset"]), int(header["encoded"])
            expected_codecs = dict(header["codecs"])
        except Exception as error:
            raise CacheFormatError(f"{where}: unusable header ({error!r})") from None
        self._setup(mx.zeros((self.batch, self.kv_heads, 0, self.key_dim), dtype=dtype),
                    mx.zeros((self.batch, self.kv_heads, 0, self.value_dim), dtype=dtype))
        for role, dim in (("keys", self.key_dim), ("values", self.value_dim)):
            if expected_codecs.get(role) != codecs.checksum(role, dim):
                source = f"artifact dir {codecs.source}" if codecs.source else f"seed {config.seed}"
                raise CacheFormatError(
                    f"{where}: the {role} codebooks/rotations differ from those it was written with "
                    f"(written from {header.get('artifact') or 'the seed'}; these come from {source})")
        if header.get("tokens_per_row") != self.tokens_per_row:
            raise CacheFormatError(f"corrupted {where}: tokens per row {header.get('tokens_per_row')} "
                                   f"!= the format's {self.tokens_per_row}")
        for name in _DENSE_STATE:
            if name in arrays:
                setattr(self, name, arrays[name])
        saved = {group: dict(arrays.get(group) or {}) for group in ("keys", "values")}
        problems = self._check_fields(saved, encoded)
        if self.kept is not None:
            if not isinstance(header.get("kept"), dict):
                raise CacheFormatError(f"{where}: keep_attended, but the header holds no kept tokens")
            problems += self.kept.load(header["kept"], arrays, (self.batch, self.kv_heads, self.key_dim,
                                                               self.value_dim), dtype, self.offset)
        if not problems:
            self.store.load(saved["keys"], saved["values"], encoded)
        self._check_restored(problems, where)

    def _check_fields(self, saved, encoded: int):
        """What does not fit the codecs' formats in saved fields of `encoded` tokens."""
        problems = []
        for group, codec in (("keys", self.key_codec), ("values", self.value_codec)):
            fields = saved[group]
            expected = {f.name: f for f in codec.format.fields}
            if encoded and set(fields) != set(expected):
                problems.append(f"{group} fields {sorted(fields)} != {sorted(expected)}")
                continue
            for name, buf in fields.items():
                f = expected.get(name)
                if f is None:
                    problems.append(f"{group} has no field {name!r}")
                    continue
                rows = -(-encoded // f.tokens_per_row)
                width = f.words if f.kind == "packed" else f.width
                if buf.shape != (self.batch, self.kv_heads, rows, width):
                    problems.append(f"{group}.{name} has shape {buf.shape}, expected "
                                    f"{(self.batch, self.kv_heads, rows, width)}")
        return problems

    def _check_restored(self, problems, where="cache layer"):
        if self.config.center and self.encoded and self.key_mean is None:
            problems.append("centered codes without their means")
        for name in _DENSE_STATE:
            arr = getattr(self, name)
            dim = self.key_dim if "key" in name else self.value_dim
            if arr is None:
                continue
            if arr.ndim != 4 or arr.shape[:2] != (self.batch, self.kv_heads) or arr.shape[3] != dim:
                problems.append(f"{name} has shape {arr.shape}")
            elif name.endswith("mean") and arr.shape[2] != 1:
                problems.append(f"{name} has shape {arr.shape}")
            elif not name.endswith("mean") and arr.dtype != self.window_dtype:
                problems.append(f"{name} has dtype {arr.dtype}, expected {self.window_dtype}")
        if not problems and self.sinks + self.encoded + self.window != self.offset:
            problems.append(
                f"sinks {self.sinks} + codes {self.encoded} + window {self.window} != offset {self.offset}"
            )
        if problems:
            raise CacheFormatError(f"corrupted {where}: " + "; ".join(problems))

    @classmethod
    def from_state(cls, state):
        cache = cls.__new__(cls)
        cache.state = state
        install_attention_hook()  # mlx-lm's load_prompt_cache, then its generate, in a fresh process
        return cache


# (config, codecs) of the caller of `integration.load_prompt_cache`, for the layers it restores.
_LOADING: contextvars.ContextVar = contextvars.ContextVar("veloxquant_loading", default=None)


def _finite_mean(x: mx.array) -> mx.array:
    """The mean over tokens (axis 2) of the finite entries: one NaN or Inf token (let through
    with check_inputs off or on a decode step) must not make the means, and so every later
    code, non-finite for good; trimming that token then leaves a healthy cache."""
    x = x.astype(mx.float32)
    finite = mx.isfinite(x)
    kept = mx.sum(mx.where(finite, x, 0.0), axis=2, keepdims=True) / mx.maximum(
        mx.sum(finite, axis=2, keepdims=True), 1)
    return mx.where(mx.all(finite), mx.mean(x, axis=2, keepdims=True), kept).astype(x.dtype)


def _read_state(state):
    """(header, arrays) of a saved layer, its header's digest verified."""
    try:
        if isinstance(state, (list, tuple)) and len(state) == 1:
            state = [state[0], {}]  # an empty cache: mlx-lm's save drops its empty arrays
        header_text, arrays = state
        header = json.loads(header_text)
        version = header["format"]
    except Exception as error:
        raise CacheFormatError(f"not a VeloxQuant cache layer (unreadable header: {error!r})") from None
    if version != FORMAT_VERSION:
        raise CacheFormatError(f"cache format {version!r} is not supported (expected {FORMAT_VERSION}); "
                               "save the cache again with this version")
    if header.get("digest") != metadata_digest(header):
        layer = header.get("layer")
        raise CacheFormatError(f"cache layer{'' if layer is None else f' {layer}'}: the header fails its digest "
                               "(corrupted or edited)")
    if arrays is None:
        arrays = {}
    if not isinstance(arrays, dict) or not all(isinstance(v, (dict, mx.array)) for v in arrays.values()):
        raise CacheFormatError("corrupted cache layer: its arrays are not a mapping of tensors")
    for value in arrays.values():
        if isinstance(value, dict) and not all(isinstance(v, mx.array) for v in value.values()):
            raise CacheFormatError("corrupted cache layer: its fields are not tensors")
    return header, arrays


def _concat(a: Optional[mx.array], b: mx.array) -> mx.array:
    return b if a is None else mx.concatenate([a, b], axis=2)

