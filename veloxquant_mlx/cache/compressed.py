"""The compressed KV cache class: its parts are mixins of their own modules (positions,
the mlx-lm protocol, attention, saved state); this one holds its fields and encodes."""

from __future__ import annotations

import copy
import math
import warnings
from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache

from .. import engine
from ..codec_set import CodecSet
from ..config import KVCacheConfig
from ..kept import KeptTokens
from ..settings import EngineSettings
from ..storage import STEP, RowStore, store_for
from .attending import CacheAttention
from .errors import CacheInputError
from .persistence import CacheState
from .protocol import MlxCacheProtocol
from .window import WindowPositions


class CompressedKVCache(WindowPositions, MlxCacheProtocol, CacheAttention, CacheState, _BaseCache):
    """One layer's keys and values as packed codes, with fp16 sinks and window (`cache/__init__.py`)."""

    step = STEP  # tokens the code buffers grow by (mlx-lm's `KVCache.step`)

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
        self.mean_count = 0  # the tokens the means came from (`config.mean_tokens`)
        self.just_encoded = None  # (keys, values, first position) flushed by the last update
        self.shadow = None  # (keys, values, n): fp16 arrays whose first n tokens last left the window (`trim`)
        self.last_path: Optional[str] = None  # the attention path of the last call
        self._routes = {}  # (phase, call shape) -> registered path or None: chosen once, not per token
        self.layer: Optional[int] = None  # index in the model, when made for one (recorded when saved)
        self.model_identity: Optional[dict] = None  # `artifacts.model_identity` of that model
        self.kept = KeptTokens.for_config(config)  # `keep_attended`: tokens kept in fp16 past the window (`kept.py`)

    # Immutable or shared by every cache of a config (codebooks, compiled encoders): not copied.
    _SHARED_ON_COPY = ("config", "codecs", "key_codec", "value_codec", "_token_encoder", "_settings",
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
        # The uncompressed sinks and window keep the model's float type, as mlx-lm's KVCache does: rounding a float32
        # model's keys to float16 turns its float noise (matmul order, batch shape) into float16 ulp flips, and a
        # sequence's answer would depend on what it was batched with (docs/decisions.md).
        self.window_dtype = keys.dtype if keys.dtype in (mx.float16, mx.bfloat16, mx.float32) else mx.float16
        if mx.issubdtype(keys.dtype, mx.integer):
            warnings.warn(f"veloxquant_mlx: integer keys and values ({keys.dtype}) are held as float16, exact up "
                          "to 2048 in magnitude", stacklevel=3)
        self.key_codec, self.value_codec = self.codecs.get("keys", self.key_dim), self.codecs.get("values", self.value_dim)
        self.block = math.lcm(self.key_codec.token_block, self.value_codec.token_block)
        self._immediate = (self.block == 1 and self.config.sink_tokens == 0 and self.config.residual_length == 0)
        if self.kept is not None and (self.block != 1 or self.batch != 1):
            raise CacheInputError(
                f"keep_attended needs a format that codes each token on its own and a cache of batch 1 (batches "
                f"hold one cache per sequence, `batch.py`); {self.config.method} codes tokens in blocks of "
                f"{self.block}, and this cache is of batch {self.batch}")
        self.store = store_for(self.key_codec, self.value_codec, self._encode)
        self._token_encoder = (
            engine.row_encoder(self.store.layout, self.key_codec, self.value_codec, self.settings)
            if isinstance(self.store, RowStore) else engine.field_encoder(self.key_codec, self.value_codec, self.settings))

    # ---- encoding (called by the store) ---------------------------------------
    @property
    def mean_span(self) -> Optional[int]:
        """The fewest tokens after the sinks that the means come from: the tokens the first flush
        encodes (the first prefill chunk's, less the window; R + 1 when decoding token by token).
        So codes depend on the first chunk's size, and on no later chunking (docs/decisions.md).
        None without a window: the first update's tokens."""
        return self.config.residual_length + self.block if self.config.residual_length else None

    def _centered_inputs(self, keys: mx.array, values: mx.array):
        if not self.config.center:
            return keys, values
        if self.key_mean is None:
            head_keys, head_values = keys[..., : self.config.mean_tokens, :], values[..., : self.config.mean_tokens, :]
            self.key_mean, self.value_mean = _finite_mean(head_keys), _finite_mean(head_values)
            self.mean_count = head_keys.shape[2]
        return keys.astype(mx.float32) - self.key_mean, values.astype(mx.float32) - self.value_mean

    def _position_free(self, keys: mx.array) -> mx.array:
        """What a positional key codec encodes: the keys about to be stored (at positions from
        sinks + encoded on) with their position's map taken off (`Codec.positional`)."""
        if not self.key_codec.positional:
            return keys
        return self.key_codec.position_free(keys, self.sinks + self.store.count)

    def _encode(self, keys: mx.array, values: mx.array):
        """The store's rows (a `RowStore`) or fields (a `FieldStore`) of `keys` / `values`."""
        keys = self._position_free(keys)
        if keys.shape[2] == 1 and (self.key_mean is not None or not self.config.center):
            return self._token_encoder.one(keys, values, self.key_mean, self.value_mean)
        return self._token_encoder.many(*self._centered_inputs(keys, values))


def _finite_mean(x: mx.array) -> mx.array:
    """The mean over tokens (axis 2) of the finite entries: one NaN or Inf token (let through
    with check_inputs off or on a decode step) must not make the means, and so every later
    code, non-finite for good; trimming that token then leaves a healthy cache."""
    x = x.astype(mx.float32)
    finite = mx.isfinite(x)
    kept = mx.sum(mx.where(finite, x, 0.0), axis=2, keepdims=True) / mx.maximum(
        mx.sum(finite, axis=2, keepdims=True), 1)
    return mx.where(mx.all(finite), mx.mean(x, axis=2, keepdims=True), kept).astype(x.dtype)
