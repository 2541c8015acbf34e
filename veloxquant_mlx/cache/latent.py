"""The compressed cache of multi-head latent attention (MLA: DeepSeek-V3, Kimi-K2, GLM-4-MoE-Lite, Mistral 4).

An absorbed MLA layer caches, per token, one latent of width `kv_lora_rank` (shared by every head: it is
both the keys and the values of a single-head attention after the query is absorbed through `embed_q`)
and one RoPE key part of width `qk_rope_head_dim` (DeepSeek-V2 paper, arXiv 2405.04434, Sec. 2.1.2-2.1.3).
mlx-lm calls `update_and_fetch(latent, rope)` and computes on the returned arrays itself (the RoPE scores,
then `embed_q` / `unembed_out` in a prefill, the latent as keys and values in a decode step), so this cache
returns arrays: the layer's history is decoded from its codes at each call, one layer at a time, and only
the codes stay between calls.

Token positions of one layer are laid out as in `CompressedKVCache`:

    [0, sinks)                      fp16 sinks (config.sink_tokens), latent and RoPE part
    [sinks, sinks + encoded)        codes, the only copy of these tokens
    [sinks + encoded, offset)       fp16 recent window (config.residual_length)

Latent format: the latent (less its mean over the first encoded tokens when `config.center`) is rotated by a
seeded random rotation over its whole width and coded with the Lloyd-Max codebook of a random unit vector's
coordinate at `config.bits`, with one fp16 scale per token (`MSECodec`, renorm: the decoded latent keeps
its length). The latent is not per head, so the rotation spans all `kv_lora_rank` coordinates. The RoPE
part is kept as int8 with one fp16 absmax scale per token (`rope_bits=8`, the default) or in fp16
(`rope_bits=None`). This one format serves every
method's config: its bits, sinks, window and centring are read from the config, its codecs are not.

The tokens of the current call are returned as given (a prefill chunk attends over itself exactly); older
tokens come back decoded.
"""

from __future__ import annotations

import copy
from typing import Dict, Optional

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache, create_attention_mask

from ..config import KVCacheConfig
from ..methods.turboquant_mse import MSECodec

STEP = 256
# The RoPE part's codes by default; why 8 bits and not the latent's bits or fp16: docs/models.md.
ROPE_BITS = 8
ROPE_FORMATS = (None, 8)

# The batch class `merge` builds (mlx-lm's `BatchGenerator`): `batch_latent.py` registers it, since it holds
# latent caches itself.
_BATCH: Optional[type] = None


def register_latent_batch(cls: type) -> None:
    global _BATCH
    _BATCH = cls


class CompressedLatentCache(_BaseCache):
    """One MLA layer's cache: fp16 sinks, codes, fp16 window (module docstring)."""

    def __init__(self, config: KVCacheConfig, rope_bits: Optional[int] = ROPE_BITS):
        self.config = config
        if rope_bits not in ROPE_FORMATS:
            raise ValueError(f"rope_bits must be one of {ROPE_FORMATS}, got {rope_bits!r}")
        self.rope_bits = rope_bits
        self.offset = 0
        self.encoded = 0
        self.sinks: Dict[str, mx.array] = {}
        self.window: Dict[str, mx.array] = {}
        self.coded: Dict[str, mx.array] = {}
        self.mean: Optional[mx.array] = None
        self.dtype = mx.float16
        self._codecs = None

    # Immutable or shared by every cache of a config: not copied.
    _SHARED_ON_COPY = ("config", "dtype", "_codecs", "widths")

    def __deepcopy__(self, memo):
        """An independent cache holding the same tokens (mlx-lm's server deep-copies prompt caches)."""
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for name, value in vars(self).items():
            setattr(new, name, value if name in self._SHARED_ON_COPY else copy.deepcopy(value, memo))
        return new

    # Codecs, built from the widths of the first tokens.
    def _build(self, latent_dim: int, rope_dim: int) -> None:
        self.widths = (latent_dim, rope_dim)
        # A model without a RoPE part (Kimi-Linear's NoPE latent attention) passes zero-width keys.
        self._codecs = (MSECodec(latent_dim, self.config.bits, self.config.seed, renorm=True),
                        self.rope_bits if rope_dim else None)

    def _encode(self, latent: mx.array, rope: mx.array) -> Dict[str, mx.array]:
        latent_codec, rope_bits = self._codecs
        if self.config.center and self.mean is None:
            span = latent[..., : self.config.mean_tokens, :]
            self.mean = mx.mean(span.astype(mx.float32), axis=-2, keepdims=True).astype(mx.float16)
        if self.mean is not None:
            latent = latent.astype(mx.float32) - self.mean.astype(mx.float32)
        fields = {f"latent_{k}": v for k, v in latent_codec.encode(latent).items()}
        if rope_bits is None:
            fields["rope"] = rope.astype(mx.float16)
        else:
            scale = mx.max(mx.abs(rope.astype(mx.float32)), axis=-1, keepdims=True) / 127
            scale = scale.astype(mx.float16)
            safe = mx.maximum(scale.astype(mx.float32), 1e-30)
            fields["rope_int8"] = mx.clip(mx.round(rope.astype(mx.float32) / safe), -127, 127).astype(mx.int8)
            fields["rope_scale"] = scale
        return fields

    def _decoded(self) -> tuple:
        latent_codec, rope_bits = self._codecs
        n = self.encoded
        part = {k: v[..., :n, :] for k, v in self.coded.items()}
        # decode gives the rotated coordinates (the codec's domain); from_domain rotates them back.
        latent = latent_codec.from_domain(
            latent_codec.decode({k[7:]: v for k, v in part.items() if k.startswith("latent_")}))
        if self.mean is not None:
            latent = latent + self.mean.astype(mx.float32)
        if rope_bits is None:
            rope = part["rope"]
        else:
            rope = part["rope_int8"].astype(mx.float32) * part["rope_scale"].astype(mx.float32)
        return latent.astype(self.dtype), rope.astype(self.dtype)

    def _store_coded(self, fields: Dict[str, mx.array]) -> None:
        n = next(iter(fields.values())).shape[-2]
        capacity = next(iter(self.coded.values())).shape[-2] if self.coded else 0
        if self.encoded + n > capacity:
            grow = (self.encoded + n - capacity + STEP - 1) // STEP * STEP
            for name, value in fields.items():
                extra = mx.zeros((*value.shape[:-2], grow, value.shape[-1]), value.dtype)
                old = self.coded.get(name)
                self.coded[name] = extra if old is None else mx.concatenate([old[..., :self.encoded, :], extra], -2)
        for name, value in fields.items():
            self.coded[name][..., self.encoded:self.encoded + n, :] = value
        self.encoded += n

    def fetch(self) -> Optional[tuple]:
        """(latent, rope) of every cached token in position order, decoded, in the model's dtype."""
        if self.offset == 0:
            return None
        parts = []
        if self.sinks:
            parts.append((self.sinks["latent"], self.sinks["rope"]))
        if self.encoded:
            parts.append(self._decoded())
        if self.window and self.window["latent"].shape[-2]:
            parts.append((self.window["latent"], self.window["rope"]))
        latent = mx.concatenate([p[0].astype(self.dtype) for p in parts], axis=-2)
        rope = mx.concatenate([p[1].astype(self.dtype) for p in parts], axis=-2)
        return latent, rope

    def update_and_fetch(self, latent: mx.array, rope: mx.array):
        if self._codecs is None:
            self._build(latent.shape[-1], rope.shape[-1])
        self.dtype = latent.dtype
        previous = self.fetch()
        self._store(latent, rope)
        if previous is None:
            return latent, rope
        return (mx.concatenate([previous[0], latent], axis=-2),
                mx.concatenate([previous[1], rope.astype(previous[1].dtype)], axis=-2))

    def _store(self, latent: mx.array, rope: mx.array) -> None:
        n = latent.shape[-2]
        held = self.sinks["latent"].shape[-2] if self.sinks else 0
        take = min(n, self.config.sink_tokens - held)
        if take > 0:
            new = {"latent": latent[..., :take, :].astype(mx.float16), "rope": rope[..., :take, :].astype(mx.float16)}
            self.sinks = new if not self.sinks else {k: mx.concatenate([self.sinks[k], new[k]], -2) for k in new}
            latent, rope = latent[..., take:, :], rope[..., take:, :]
        if latent.shape[-2]:
            new = {"latent": latent.astype(mx.float16), "rope": rope.astype(mx.float16)}
            window = new if not self.window else {k: mx.concatenate([self.window[k], new[k]], -2) for k in new}
            overflow = window["latent"].shape[-2] - self.config.residual_length
            if overflow > 0:
                # Encode from the input's own precision where the tokens are the ones just given.
                self._store_coded(self._encode(window["latent"][..., :overflow, :], window["rope"][..., :overflow, :]))
                window = {k: v[..., overflow:, :] for k, v in window.items()}
            self.window = window
        self.offset += n

    def _newest_slot(self):
        if self.window and self.window["latent"].shape[-2]:
            return self.window, "latent"
        if self.encoded:
            return self.coded, "latent_codes"
        return self.sinks, "latent"

    @property
    def keys(self) -> Optional[mx.array]:
        """The array holding the newest token (its latent, or its codes): DeepSeek-V3.2 ties the indexer cache's
        arrays to `cache[0].keys` with `mx.depends`, so that they are evaluated with the latent."""
        holder, name = self._newest_slot()
        return holder.get(name)

    @keys.setter
    def keys(self, value: mx.array) -> None:
        holder, name = self._newest_slot()
        if name not in holder:
            raise ValueError("the latent cache is empty: it has no keys to replace")
        holder[name] = value

    def make_mask(self, *args, **kwargs):
        return create_attention_mask(*args, offset=self.offset, **kwargs)

    @classmethod
    def merge(cls, caches):
        """A `batch_latent.BatchLatentCache` of copies of `caches` (each of batch 1)."""
        if _BATCH is None:
            raise RuntimeError("no latent batch class is registered: import veloxquant_mlx (batch_latent.py registers it)")
        return _BATCH.merge(caches)

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        left = n
        if self.window:
            cut = min(left, self.window["latent"].shape[-2])
            end = self.window["latent"].shape[-2] - cut
            self.window = {k: v[..., :end, :] for k, v in self.window.items()}
            left -= cut
        cut = min(left, self.encoded)
        self.encoded -= cut
        left -= cut
        if left and self.sinks:
            end = self.sinks["latent"].shape[-2] - left
            self.sinks = {k: v[..., :end, :] for k, v in self.sinks.items()}
        self.offset -= n
        return n

    @property
    def nbytes(self) -> int:
        arrays = [*self.sinks.values(), *self.window.values(), *self.coded.values()]
        if self.mean is not None:
            arrays.append(self.mean)
        return sum(a.nbytes for a in arrays)

    @property
    def used_nbytes(self) -> int:
        """The bytes the cached tokens hold (the code buffers' spare capacity left out)."""
        arrays = [*self.sinks.values(), *self.window.values(), *(v[..., :self.encoded, :] for v in self.coded.values())]
        return sum(a.nbytes for a in arrays) + (self.mean.nbytes if self.mean is not None else 0)

    @property
    def batch(self) -> Optional[int]:
        """The sequences this cache holds (None while it holds no array)."""
        held = next(iter({**self.sinks, **self.window, **self.coded}.values()), None)
        return None if held is None else held.shape[0]

    @property
    def held_coordinates(self) -> int:
        """Cached coordinates (latent and RoPE part of every token), as mlx-lm's cache of this layer holds them."""
        if self._codecs is None or self.batch is None:
            return 0
        return self.offset * self.batch * sum(self.widths)

    @property
    def state(self):
        out = {"config": self.config.to_json(), "rope_bits": self.rope_bits or 0,
               "offset": self.offset, "dtype": str(self.dtype).split(".")[-1]}
        if self._codecs is not None:
            out["latent_dim"], out["rope_dim"] = self.widths
        out.update({f"sinks_{k}": v for k, v in self.sinks.items()})
        out.update({f"window_{k}": v for k, v in self.window.items()})
        out.update({f"coded_{k}": v[..., :self.encoded, :] for k, v in self.coded.items()})
        if self.mean is not None:
            out["mean"] = self.mean
        return out

    @state.setter
    def state(self, value):
        self.__init__(KVCacheConfig.from_json(value["config"]), int(value["rope_bits"]) or None)
        self.offset = int(value["offset"])
        self.dtype = getattr(mx, value["dtype"])
        self.sinks = {k[6:]: v for k, v in value.items() if k.startswith("sinks_")}
        self.window = {k[7:]: v for k, v in value.items() if k.startswith("window_")}
        self.coded = {k[6:]: v for k, v in value.items() if k.startswith("coded_")}
        self.encoded = next(iter(self.coded.values())).shape[-2] if self.coded else 0
        self.mean = value.get("mean")
        if "latent_dim" in value:
            self._build(int(value["latent_dim"]), int(value["rope_dim"]))
