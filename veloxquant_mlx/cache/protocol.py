"""The mlx-lm cache protocol of a compressed cache: `update_and_fetch` (what a model calls each
forward), size, trim, the mask, batching (`merge`) and its bytes."""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import create_attention_mask

from ..config import KVCacheConfig
from ..methods.base import at_positions
from .errors import FP16_MAX, CacheInputError

# The batch cache class `merge` builds: `batch.py` registers it (`register_batch`), since it holds
# compressed caches itself.
_BATCH: Optional[type] = None


# The dtypes a cache takes: floating point and integers.
_NUMERIC = frozenset(d for d in vars(mx).values()
                     if isinstance(d, mx.Dtype) and (mx.issubdtype(d, mx.floating) or mx.issubdtype(d, mx.integer)))


def register_batch(cls: type) -> None:
    global _BATCH
    _BATCH = cls


class CompressedHistory:
    """Returned by `update_and_fetch` in place of fp16 keys/values.

    mlx-lm passes it on to `scaled_dot_product_attention`, which VeloxQuant
    routes to `CompressedKVCache.attend`. It holds no data.
    """

    def __init__(self, cache, role: str):
        self.cache, self.role = cache, role

    @property
    def shape(self):
        c = self.cache
        dim = c.key_dim if self.role == "keys" else c.value_dim
        return (c.batch, c.kv_heads, c.offset, dim)

    @property
    def dtype(self):
        return self.cache.window_dtype

    def astype(self, dtype) -> "CompressedHistory":
        """Itself: attention over it runs in float32 whatever the cast (Phi and StableLM cast keys first)."""
        return self

    def __mlx_array__(self) -> mx.array:
        """`mx.array(history)`: the tokens held, decoded (`MlxCacheProtocol.decoded`). Attention never calls it."""
        keys, values = self.cache.decoded()
        return keys if self.role == "keys" else values

    def __getattr__(self, name: str):
        """An array method attention does not use (`flatten`, `sum`, `tolist`, ...): that of the decoded tokens, as
        code written for mlx-lm's arrays expects of what `keys_and_values()` returns."""
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.__mlx_array__(), name)

    def __eq__(self, other):
        """Elementwise, on the decoded tokens, as an mx.array's `==` is."""
        return self.__mlx_array__() == (other.__mlx_array__() if isinstance(other, CompressedHistory) else other)

    __hash__ = object.__hash__

    def __repr__(self):
        return f"CompressedHistory({self.role}, shape={self.shape}, {self.cache.config.describe()})"


class DecodedReads:
    """mlx-lm's `keys` and `values` of a cache that holds codes: its `decoded()` arrays (None while empty), copies
    for reading; attention reads the codes (a mixin of every compressed cache class)."""

    @property
    def keys(self) -> Optional[mx.array]:
        return self.decoded()[0]

    @property
    def values(self) -> Optional[mx.array]:
        return self.decoded()[1]


class MlxCacheProtocol(DecodedReads):
    """What mlx-lm calls on a cache (a mixin of `CompressedKVCache`)."""

    def _check_update(self, keys, values):
        """Refuse what would crash deep inside or corrupt the cache for good (see README, "Trust")."""
        if not isinstance(keys, mx.array) or not isinstance(values, mx.array):
            raise TypeError(f"keys and values must be mx.array, got {type(keys).__name__} and {type(values).__name__}")
        if keys.ndim != 4 or values.ndim != 4 or keys.shape[:3] != values.shape[:3]:
            raise CacheInputError(f"keys and values must be (batch, kv_heads, tokens, head_dim) with the same first "
                                  f"three sizes, got {tuple(keys.shape)} and {tuple(values.shape)}")
        if keys.dtype not in _NUMERIC or values.dtype not in _NUMERIC:
            raise CacheInputError(f"keys and values must be floating point or integers, got {keys.dtype} and "
                                  f"{values.dtype}")
        if self.key_codec is not None:
            got = (keys.shape[0], keys.shape[1], keys.shape[3], values.shape[3])
            held = (self.batch, self.kv_heads, self.key_dim, self.value_dim)
            if got != held:
                raise CacheInputError(
                    f"this cache holds (batch, kv_heads, key dim, value dim) = {held} since its first update; got "
                    f"{got}: a cache serves one layer of one model; make a new one")
        if self._checks(keys.shape[2], first=self.offset == 0):
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

    def _checks(self, tokens: int, first: bool) -> bool:
        """Whether `settings.check_inputs` checks a call of `tokens` tokens (`first`: the cache's first)."""
        check = self.settings.check_inputs
        return tokens > 0 and (check == "always" or (check == "prefill" and tokens > 1) or (check == "first" and first))

    def _check_queries(self, queries: mx.array):
        """Queries are checked where their keys are (`_checks`): a NaN or Inf query makes its call's output
        non-finite (and, with keep_attended, the shares it adds), though never the codes."""
        L = queries.shape[2]
        if self._checks(L, first=self.offset == L) and not mx.all(mx.isfinite(queries)).item():
            raise CacheInputError("queries hold NaN or Inf: attention over them would be non-finite; the cache is "
                                  "unchanged. (EngineSettings(check_inputs='off') or VELOXQUANT_CHECK_INPUTS=off "
                                  "skips this check)")

    # Set for a model that computes on the fetched keys itself (`attention_hook.DECODED_FETCH_MODELS`):
    # `update_and_fetch` then returns the held tokens decoded, for this call only.
    fetch_decoded = False

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self._check_update(keys, values)
        history = self._update_checked(keys, values)
        return self.decoded() if self.fetch_decoded else history

    def _update_checked(self, keys: mx.array, values: mx.array):
        """`update_and_fetch` of keys and values `_check_update` took."""
        if self.key_codec is None:
            self._setup(keys, values)
        keys = keys.astype(self.window_dtype)
        values = values.astype(self.window_dtype)
        if self.kept is not None:  # tokens that left the window with no attention call since: settled now
            self.kept.settle(self.sinks + self.encoded, self.just_encoded)
        self.offset += keys.shape[2]
        self.just_encoded = self.shadow = None
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
            self._keep_shadow(self.window_keys[..., :flush, :], self.window_values[..., :flush, :])
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

    def history(self):
        return CompressedHistory(self, "keys"), CompressedHistory(self, "values")

    def decoded(self):
        """(keys, values) held, decoded into the window's float type: what mlx-lm's `KVCache.keys` and `.values`
        hold. A copy of the whole history, for reading and comparing; attention reads the codes."""
        if self.empty():
            return None, None
        keys, values = self.dequantized()
        return keys.astype(self.window_dtype), values.astype(self.window_dtype)

    def keys_and_values(self):
        """What mlx-lm's KV-sharing layers read from another layer's cache (gemma3n's shared layers, afm7's
        KV-reuse layers) and hand to attention: this cache's `history()`, which the attention hook
        attends over (`attention_hook.py`); `mx.array(history)` gives the arrays."""
        return self.history()

    @property
    def bits(self) -> int:
        """The keys' bits: what mlx-lm reads of a quantized cache (`QuantizedKVCache.bits`; its server and
        `--kv-bits` compare it)."""
        return self.config.bits

    @property
    def group_size(self) -> int:
        return self.config.group_size

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        """mlx-lm's `--kv-bits` (`maybe_quantize_kv_cache`, `KVCache.to_quantized`): this cache re-encoded as the
        library's config nearest `bits` (`quantized_config`), or itself where it already is one. Its codes are
        decoded and coded again, so their error adds to the new one's; the fp16 sinks and window move exactly.
        `group_size` is mlx-lm's affine group, which these formats do not have."""
        target = quantized_config(bits)
        if self.config.same_encoding(target):
            return self
        new = type(self)(target, settings=self.settings)
        new.layer, new.model_identity = self.layer, self.model_identity
        if self.offset:
            keys, values = self.dequantized()
            new.update_and_fetch(keys.astype(self.window_dtype), values.astype(self.window_dtype))
        return new

    def size(self):
        return self.offset

    def empty(self):
        return self.offset == 0

    def is_trimmable(self):
        return True

    def trim(self, n: int) -> int:
        """Drop the last `n` tokens.

        Without an fp16 window this equals never having seen them. With one, so does a
        trim of no more than the tokens that left the window in the last update: their fp16
        copies (`shadow`) move back into it. Tokens that left it before stay encoded (their
        fp16 originals are gone), so the window refills from new tokens only; `refill_span`
        says how many tokens to trim and feed again to hold a fresh cache's. If the trim cuts into a multi-token
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
        if 0 < n < self.offset - self.sinks and self._trim_from_shadow(n):
            self.offset -= n
            self._after_trim()
            return n
        if n:
            self.shadow = None
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
        self._after_trim()
        return n

    def _after_trim(self):
        if self.kept is not None:  # shares the trimmed queries gave the window's tokens stay counted
            self.kept.truncate(self.sinks + self.encoded, self.offset)
        span = self.mean_span
        if self.encoded == 0 and (span is None or self.offset < self.sinks + span):
            # A fresh cache this long would have no means yet: they come from tokens it lacks.
            self.key_mean = self.value_mean = None
            self.mean_count = 0

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
        if _BATCH is None:
            raise RuntimeError("no batch cache class is registered: import veloxquant_mlx (batch.py registers it)")
        return _BATCH.merge(caches)

    def _dense_nbytes(self, used: bool = False) -> int:
        """Bytes of the arrays beside the store (sinks, window, means), a waiting token stored first;
        `used`: of a fixed-capacity window buffer, only its filled part."""
        if self.store is not None:
            self.flush()
        window = (self._window_keys, self._window_values)
        if used:
            window = tuple(self._held(a) for a in window if a is not None)
        # The shadow (fp16 copies for `trim`, at most a window's worth until the next update) holds no
        # token of its own: like the store's spare capacity, `used` leaves it out.
        shadow = () if used or self.shadow is None else self.shadow[:2]
        plain = [a for a in (self.sink_keys, self.sink_values, *window, *shadow) if a is not None]
        means = [a for a in (self.key_mean, self.value_mean) if a is not None]
        kept = 0 if self.kept is None else self.kept.nbytes
        # Held bytes count the fp16 tokens at 2 bytes a value whatever the model's float type (footprint.py: as in a
        # float16 run), so that a float32 model's footprint is the one its float16 twin would have.
        plain_bytes = sum(a.size * min(a.itemsize, 2) if used else a.nbytes for a in plain)
        return plain_bytes + sum(a.nbytes for a in means) + kept

    @property
    def nbytes(self) -> int:
        return self._dense_nbytes() + (0 if self.store is None else self.store.nbytes)

    @property
    def used_nbytes(self) -> int:
        """`nbytes` without the unused capacity of the store and of the window buffer: the bytes
        the tokens held take."""
        return self._dense_nbytes(used=True) + (0 if self.store is None else self.store.used_nbytes)


def quantized_config(bits: int):
    """The library's config nearest mlx-lm's `--kv-bits`: the presets vq2, vq3, vq4 for 2, 3, 4 bits, vq4's
    recipe (sinks, window, centering, renorm, unbiased values) with keys and values at `bits` for 5 to 8;
    any other width is refused (mlx-lm's own quantized cache takes 2-8)."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 8:
        raise CacheInputError(f"--kv-bits / to_quantized(bits={bits!r}): the library's caches take 2 to 8 bits "
                              "(2, 3, 4: the presets vq2, vq3, vq4; 5 to 8: vq4's recipe at that width)")
    if bits <= 4:
        return KVCacheConfig.preset(f"vq{bits}")
    return KVCacheConfig.preset("vq4", bits=bits, value_bits=bits)


def _concat(a: Optional[mx.array], b: mx.array) -> mx.array:
    return b if a is None else mx.concatenate([a, b], axis=2)
