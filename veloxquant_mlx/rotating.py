"""A compressed sliding-window cache: mlx-lm's `RotatingKVCache`, holding codes.

mlx-lm's `RotatingKVCache(max_size, keep)` holds the first `keep` tokens and the most
recent ones: before it takes new tokens it drops the oldest non-kept ones down to
`max_size - 1` held, so a decode step sees `max_size` tokens and a prefill chunk's
queries see at least `max_size - 1` earlier ones. Its mask (`make_mask`) is written in
the index space of what it holds, in time order: `[keep | held | new]`.

`CompressedRotatingKVCache` keeps that contract exactly and stores the held tokens the
way `CompressedKVCache` does (`cache/`): it *is* one of those caches (the `inner`
one, with the `keep` tokens as its fp16 sinks and the config's `residual_length` as its
fp16 window) plus eviction. Evicting drops the oldest codes from the front of the
store (`drop_front`), so the inner cache's positions are mlx-lm's index space and
mlx-lm's masks apply to it unchanged. Attention goes through the inner cache, so the
engine's path registry serves it: decode with no mask, prefill with the causal mask
until the window is full, then the generic path with the window's mask array.

Formats with multi-token blocks (KIVI's key groups) can drop codes only in whole
blocks; the evicted tokens of a block still held ("stale", at most block - 1) are
masked out, which sends those calls to the generic path.

The config's `sink_tokens` does not apply here: a sliding layer's permanent tokens are
the cache's `keep`, which mlx-lm's model chose (0 for Gemma 3).
"""

from __future__ import annotations

import json
import warnings
from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache, create_causal_mask

from .cache import _LOADING, CacheFormatError, CompressedKVCache, DecodedReads, run_on_load
from .cache.protocol import quantized_config
from .cache_integrity import header_digest, split_state
from .codec_set import CodecSet
from .config import KVCacheConfig
from .methods import get_method
from .settings import EngineSettings
from .storage import STEP

ROTATING_FORMAT_VERSION = 2  # 2: the header's digest

# The batch cache class `merge` builds (`batch.py` registers it: it holds rotating caches itself).
_BATCH: Optional[type] = None


def register_rotating_batch(cls: type) -> None:
    global _BATCH
    _BATCH = cls


class CompressedRotatingKVCache(DecodedReads, _BaseCache):
    def __init__(self, config: KVCacheConfig, max_size: int, keep: int = 0, codecs: Optional[CodecSet] = None,
                 settings: Optional[EngineSettings] = None):
        if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 1:
            raise ValueError(f"max_size must be a positive int, got {max_size!r}")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
            raise ValueError(f"keep must be an int >= 0, got {keep!r}")
        if keep > max_size - 1:
            # mlx-lm's own cache takes it but then has no slot left for a new token (its decode step writes past
            # the buffer): the newest token takes the last kept one's place.
            warnings.warn(f"a sliding window of {max_size} tokens keeps at most {max_size - 1} first tokens "
                          f"(asked for {keep}): it keeps {max_size - 1}", stacklevel=2)
            keep = max_size - 1
        if get_method(config.method).positional:
            raise ValueError(f"{config.method} codes each key at its position (RoPE applied at attention time), "
                             "which a sliding window's eviction would shift: a rotating cache (sliding-window "
                             "layers, --max-kv-size) cannot hold it")
        if config.options.get("keep_attended"):
            raise ValueError("keep_attended keeps tokens at their positions, which a sliding window's eviction would "
                             "shift: a rotating cache (sliding-window layers, --max-kv-size) does not take it")
        self.config, self.max_size, self.keep = config, max_size, keep
        self.inner = CompressedKVCache(config.replace(sink_tokens=keep), codecs, settings)
        self.offset = 0  # tokens seen (RoPE positions); the inner cache's offset counts those held
        self.stale = 0  # evicted tokens still at the front of the codes (part of a block)

    # ---- what the engine and mlx-lm read -------------------------------------------------------
    @property
    def settings(self) -> EngineSettings:
        return self.inner.settings

    @settings.setter
    def settings(self, settings: EngineSettings):
        self.inner.settings = settings

    @property
    def last_path(self) -> Optional[str]:
        return self.inner.last_path

    @property
    def held(self) -> int:
        """Tokens in the cache, stale ones included (the inner cache's index space)."""
        return self.inner.offset

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes

    @property
    def used_nbytes(self) -> int:
        return self.inner.used_nbytes

    def size(self):
        return min(self.offset, self.max_size)

    def empty(self):
        return self.offset == 0

    # ---- eviction -----------------------------------------------------------------------------
    def _plan(self):
        """(tokens to evict, codes to drop from the store, stale codes after) before the next update."""
        evict = max(0, self.held - self.stale - (self.max_size - 1))
        if evict == 0:
            return 0, 0, self.stale
        block = self.inner.block
        codes = self.inner.encoded
        if self.stale + evict > codes:
            raise RuntimeError(
                f"the sliding window would evict fp16 window tokens ({self.stale + evict} > {codes} codes); "
                "residual_length is checked against max_size when the cache is set up"
            )
        dropped = (self.stale + evict) // block * block
        return evict, dropped, self.stale + evict - dropped

    def _evict(self):
        if self.inner.store is not None:
            self.inner.flush()  # a decode token still waiting for its attention call counts as held
        _, dropped, stale = self._plan()
        if dropped:
            self.inner.store.drop_front(dropped)
            self.inner.offset -= dropped
        self.stale = stale

    def _fit_window(self, keys: mx.array, values: mx.array):
        """The fp16 window must leave codes to evict: up to residual_length + block - 1 tokens wait in
        it, and eviction keeps keep + max_size - 1 - keep. A window too long for this sliding window
        shrinks to what fits, with a warning (one per shape); a token block that cannot fit is refused."""
        block, window = self.inner.block, self.inner.config.residual_length
        room = self.max_size - self.keep - block
        if window <= room:
            return
        if room < 0:
            raise ValueError(
                f"{self.config.method} codes tokens in blocks of {block}, which (with keep {self.keep}) do not fit "
                f"a sliding window of {self.max_size} tokens: use a format that codes tokens one by one")
        warnings.warn(
            f"the fp16 window of {window} tokens (residual_length) does not fit a sliding window of {self.max_size} "
            f"tokens (keep {self.keep}, token block {block}): such a layer holds {room} recent tokens in fp16",
            stacklevel=3)
        self.inner.config = self.inner.config.replace(residual_length=room)
        self.inner._setup(keys, values)  # again: what depends on the window (`_immediate`)

    # ---- mlx-lm cache protocol ----------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.inner._check_update(keys, values)  # before eviction: a refused chunk leaves the cache unchanged
        if self.inner.key_codec is None:
            self.inner._setup(keys, values)
            self._fit_window(keys, values)
            # Grow by at most the window, as mlx-lm's RotatingKVCache does.
            self.inner.store.step = min(self.inner.store.step, self.max_size)
        self._evict()
        self.offset += keys.shape[2]
        history = self.inner._update_checked(keys, values)
        return self.decoded() if self.inner.fetch_decoded else history

    def fresh_means(self, first_chunk: int) -> bool:
        """`CompressedKVCache.fresh_means` over the tokens this cache has taken: evicted ones made its means too."""
        return self.inner.fresh_means(first_chunk, seen=self.offset)

    def keys_and_values(self):
        """What mlx-lm's KV-sharing layers read (`CompressedKVCache.keys_and_values`)."""
        return self.inner.history()

    @property
    def step(self) -> int:
        """Tokens the code buffers grow by: mlx-lm's `RotatingKVCache.step`, at most the window."""
        return min(STEP, self.max_size)

    def decoded(self):
        """(keys, values) held in time order, decoded into the window's float type (`CompressedKVCache.decoded`)."""
        if self.inner.empty():
            return None, None
        dtype = self.inner.window_dtype
        return tuple(x.astype(dtype) for x in self.dequantized())

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        """mlx-lm's `--kv-bits` (`CompressedKVCache.to_quantized`): the tokens held, re-encoded in a
        sliding-window cache of the config nearest `bits`, at the same positions; or itself."""
        target = quantized_config(bits)
        if self.config.same_encoding(target):
            return self
        new = type(self)(target, self.max_size, self.keep, settings=self.settings)
        new.inner.layer, new.inner.model_identity = self.inner.layer, self.inner.model_identity
        if self.offset:
            keys, values = self.dequantized()
            dtype = self.inner.window_dtype
            new.update_and_fetch(keys.astype(dtype), values.astype(dtype))
            new.offset = self.offset
        return new

    def attend(self, queries: mx.array, scale: float, mask=None, sinks=None) -> mx.array:
        return self.inner.attend(queries, scale=scale, mask=mask, sinks=sinks)

    def make_mask(self, N: int, window_size: Optional[int] = None, return_array: bool = False):
        """mlx-lm's `RotatingKVCache.make_mask`, with the planned stale codes masked out."""
        _, _, stale = self._plan() if self.inner.key_codec is not None else (0, 0, 0)
        held = min(self.max_size - 1, self.offset)  # what mlx-lm holds after its trim
        window_size = window_size or self.max_size
        if N > 1:
            if not stale and not return_array and held + N <= window_size:
                return "causal"
            mask = create_causal_mask(N, held, window_size=window_size)
        else:
            if window_size < self.max_size and self.offset >= window_size:
                size = min(self.offset + 1, self.max_size)
                mask = (mx.arange(size) >= size - window_size)[None]
            elif stale or return_array:
                mask = mx.ones((1, held + 1), dtype=mx.bool_)
            else:
                return None
        if stale:
            sinks = min(self.keep, self.offset)
            mask = mx.concatenate(
                [mask[:, :sinks], mx.zeros((N, stale), dtype=mx.bool_), mask[:, sinks:]], axis=1
            )
        return mask

    def is_trimmable(self):
        return self.offset < self.max_size

    def trim(self, n: int) -> int:
        """Drop the last `n` tokens; like mlx-lm's, only before anything was evicted."""
        if not self.is_trimmable():
            return 0
        n = self.inner.trim(n)
        self.offset -= n
        return n

    @classmethod
    def merge(cls, caches):
        """mlx-lm's `BatchRotatingKVCache.merge`: a `batch.BatchCompressedKVCache` of copies of `caches`."""
        if _BATCH is None:
            raise RuntimeError("no batch cache class is registered: import veloxquant_mlx (batch.py registers it)")
        return _BATCH.merge(caches)

    def dequantized(self):
        """(keys, values) held, in time order, as attention sees them (fp32; for tests)."""
        keys, values = self.inner.dequantized()
        if self.stale:
            sinks = self.inner.sinks
            keep = lambda x: mx.concatenate([x[..., :sinks, :], x[..., sinks + self.stale :, :]], axis=2)  # noqa: E731
            keys, values = keep(keys), keep(values)
        return keys, values

    def __deepcopy__(self, memo):
        import copy

        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for name, value in vars(self).items():
            setattr(new, name, copy.deepcopy(value, memo) if name == "inner" else value)
        return new

    # ---- save / load ----------------------------------------------------------------------------
    @property
    def state(self):
        header = {"format": ROTATING_FORMAT_VERSION, "max_size": self.max_size, "keep": self.keep,
                  "offset": self.offset, "stale": self.stale, "config": self.config.to_json()}
        header["digest"] = header_digest(header)
        return [*self.inner.state, json.dumps(header)]  # the inner layer's arrays and header, then this one's

    @state.setter
    def state(self, state):
        try:
            header_text, inner_state = _split(state)
            header = json.loads(header_text)
            version = header["format"]
            config = KVCacheConfig.from_json(header["config"])
        except Exception as error:
            raise CacheFormatError(f"not a VeloxQuant rotating cache layer (unreadable header: {error})") from None
        if version != ROTATING_FORMAT_VERSION:
            raise CacheFormatError(f"rotating cache format {version} is not supported")
        if header.get("digest") != header_digest(header):
            raise CacheFormatError("rotating cache layer: the header fails its digest (corrupted or edited)")
        self.__init__(config.replace(artifact_dir=None), header["max_size"], header["keep"])
        caller = _LOADING.get()
        if caller is not None:  # the caller's config, with the sinks this cache gives its inner one
            caller_config, codecs = caller
            if not config.same_encoding(caller_config):
                raise CacheFormatError(f"rotating cache layer was written with {config.describe()}, "
                                       f"not {caller_config.describe()}")
            # The inner cache's fp16 window may be shorter than the config's (`_fit_window`), never longer.
            window = _inner_window(split_state(inner_state)[0], caller_config.residual_length)
            token = _LOADING.set((caller_config.replace(sink_tokens=header["keep"], residual_length=window), codecs))
        try:
            self.inner.state = inner_state
        finally:
            if caller is not None:
                _LOADING.reset(token)
        self.offset, self.stale = header["offset"], header["stale"]
        # No bound by max_size: right after a chunk of n tokens on a full window, mlx-lm's rotating
        # cache (and this one) holds max_size - 1 + n of them until the next update evicts.
        if self.offset < self.held - self.stale:
            raise CacheFormatError(
                f"corrupted rotating cache layer: {self.held} held ({self.stale} stale) for offset {self.offset}, "
                f"max_size {self.max_size}"
            )

    @classmethod
    def from_state(cls, state):
        cache = cls.__new__(cls)
        cache.state = state
        run_on_load()  # the attention hook (cache.register_on_load)
        return cache


def _split(state) -> tuple:
    """(this cache's header text, the inner layer's state) of a saved rotating layer: [inner state..., header];
    or, as written before, [header, inner header, inner arrays] ([header, inner header] when empty)."""
    last = json.loads(state[-1]) if isinstance(state[-1], str) else None
    if isinstance(last, dict) and "max_size" in last:
        return state[-1], list(state[:-1])
    return state[0], list(state[1:])


def _inner_window(inner_header: str, config_window: int) -> int:
    """The fp16 window the inner cache's header records, where it is a shorter one than the config's
    (`_fit_window`); the config's otherwise (the inner cache's own check then names any mismatch)."""
    try:
        window = json.loads(inner_header)["config"]["residual_length"]
    except Exception:
        return config_window
    return window if isinstance(window, int) and 0 <= window < config_window else config_window
