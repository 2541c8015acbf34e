"""The method protocol and its registry.

A method compresses two streams of head vectors, keys and values, each with a
`Codec`. A codec turns a chunk of vectors into packed *fields* (the only thing
the cache stores) and decodes fields back into a *domain* where attention is
computed:

    scores  = to_domain(q) . decode(key_fields)          (q.k = Rq.Rk for a rotation R)
    output  = from_domain(sum_i p_i decode(value_fields)_i)

`to_domain` is a linear map A and `from_domain` its adjoint A^T, so a method
that reconstructs x ~ A^T u only ever needs u, never the fp16 vector. Fields
are arrays shaped (B, H, rows, width); per-token fields have one row per token,
per-group fields (KIVI's per-channel key groups) one row per `token_block`
tokens.
"""

from __future__ import annotations

from typing import ClassVar, Dict, Optional

import mlx.core as mx

from ..formats import Format
from ..method_registry import available_methods, get_method, register_method  # noqa: F401  (re-exported)

Fields = Dict[str, mx.array]
Params = Dict[str, mx.array]

POSITIONS = "positions"  # the extra entry `at_positions` gives a positional codec's fields


def at_positions(codec: "Codec", fields: Fields, first: int) -> Fields:
    """`fields` of consecutive tokens at absolute positions first, first + 1, ... as `codec`
    decodes them: a positional codec (`Codec.positional`) reads the positions from an extra
    entry (the store does not hold them: a token's position is its place in the history);
    any other codec gets `fields` unchanged."""
    if not codec.positional:
        return fields
    count = next(iter(fields.values())).shape[2]
    return {**fields, POSITIONS: mx.arange(first, first + count)}


def split_width_centroid(a, parts, books) -> str:
    """The C expression of element j's centroid for codes stored in consecutive parts of several
    widths, `parts` = [(field, first, stop, bits)] and `books` {bits: codebook} (ratequant's and
    spectralquant's `kernel_decode`, `kernels/dequant.py`); each part's index is clamped so that
    every load stays in its field."""
    value = None
    for name, start, stop, bits in reversed(parts):  # the last part's term is innermost
        index = f"(j < {start} ? 0 : VQ_MINI(j - {start}, {stop - start - 1}))"
        term = f"{a.table(books[bits].centroids)}[{a.code(name, index)}]"
        value = term if value is None else f"(j < {stop} ? {term} : {value})"
    return value


class Codec:
    """Compresses one stream (keys or values) of vectors of size `dim`."""

    dim: int
    domain_dim: int
    format: Format  # what it stores (`formats.py`); set by each codec's constructor
    # A positional codec applies a position-dependent map itself (commvq: RoPE at attention
    # time): the cache hands `encode` `position_free(keys, first)`, and every reader passes the
    # fields through `at_positions`. Only for per-token formats whose tokens stay in position
    # order (no sliding-window eviction).
    positional: bool = False

    @property
    def token_block(self) -> int:
        return self.format.token_block

    def encode(self, x: mx.array) -> Fields:
        raise NotImplementedError

    def position_free(self, x: mx.array, first: int) -> mx.array:
        """A positional codec's input: tokens (B, H, T, D) at positions first.. with the
        position's map taken off (what `encode` codes)."""
        return x

    def decode(self, fields: Fields) -> mx.array:
        """Decoded vectors in the codec's domain, float32 (..., T, domain_dim)."""
        raise NotImplementedError

    def to_domain(self, x: mx.array) -> mx.array:
        """The linear map A into the domain. Value codecs need A^T A = I (an
        orthogonal or identity domain): the cache adds A mean_v to decoded values."""
        return x

    def from_domain(self, y: mx.array) -> mx.array:
        return y

    @property
    def domain(self) -> str:
        """What from_domain is, for kernels that leave the domain themselves: "identity",
        "rotation" (self.rotation.invert; codecs say so by overriding this), or "custom"."""
        return "identity" if type(self).from_domain is Codec.from_domain else "custom"

    def params(self) -> Params:
        """Constant arrays (codebooks, rotations) that rebuild this codec exactly."""
        return {}

    def bits_per_token(self) -> float:
        """Storage budget of one token of one head, in bits (its fields on their own)."""
        return self.format.bits_per_token

    def reconstruct(self, fields: Fields) -> mx.array:
        return self.from_domain(self.decode(fields))

    def score(self, queries: mx.array, fields: Fields) -> mx.array:
        """queries (B, H, M, domain_dim) float32 in the domain . decode(fields) (B, H, T) tokens
        -> scores (B, H, M, T): ggml's vec_dot. Codecs whose codes MLX can multiply without
        decoding them override this."""
        return queries @ self.decode(fields).astype(mx.float32).swapaxes(-1, -2)

    def weighted_sum(self, weights: mx.array, fields: Fields) -> mx.array:
        """sum_t weights[..., t] * decode(fields)[t]: attention's value sum in the domain.
        `weights` (B, H, R, L, T) float32 (R query heads per kv head), fields of (B, H, T)
        tokens -> (B, H, R, L, domain_dim). Codecs whose codes MLX can multiply without
        decoding them override this."""
        return weights @ mx.expand_dims(self.decode(fields).astype(mx.float32), 2)


class Method:
    """A registered compression method: a key codec and a value codec."""

    name: ClassVar[str]
    key_bits: ClassVar[range] = range(1, 9)
    value_bits: ClassVar[range] = range(1, 9)
    options: ClassVar[Dict[str, type]] = {}
    # options that change how tokens are encoded, not the codecs' constant arrays (so not
    # what an artifact dir is keyed on, `KVCacheConfig.codec_key`)
    encode_options: ClassVar[frozenset] = frozenset()
    calibrated: ClassVar[bool] = False
    # its key codec is positional (`Codec.positional`): caches that evict tokens refuse it
    positional: ClassVar[bool] = False
    # "recommended", "baseline" (a published method, for comparison), "reference" (fp16) or
    # "experimental" (works and is tested, but worse than the recommended method); `status_note`
    # says why. A method registered without one is "experimental".
    status: ClassVar[str] = "experimental"
    status_note: ClassVar[str] = "no status given by its author"
    summary: ClassVar[str] = ""
    values_summary: ClassVar[str] = ""
    # Options every method takes: int8 channels peeled off before the codec (`methods/outliers.py`),
    # per-channel key scales traded with the queries (`methods/smoothing.py`), tokens kept in fp16
    # past the window by the attention they got there (`kept.py`, cache options: `CACHE_OPTIONS`).
    generic_options: ClassVar[Dict[str, type]] = {"outliers": int, "value_outliers": int, "smooth_keys": float,
                                                  "keep_attended": float, "keep_most": float}

    @classmethod
    def validate(cls, config) -> None:
        if config.bits not in cls.key_bits:
            raise ValueError(
                f"{cls.name} supports key bits {cls.key_bits.start}..{cls.key_bits.stop - 1}, "
                f"got bits={config.bits}"
            )
        if config.value_bits not in cls.value_bits:
            raise ValueError(
                f"{cls.name} supports value bits {cls.value_bits.start}..{cls.value_bits.stop - 1}, "
                f"got value_bits={config.value_bits}"
            )
        accepted = {**cls.generic_options, **cls.options}
        for key, value in config.options.items():
            if key not in accepted:
                from ..config import ALIASES

                known = ", ".join(sorted(accepted)) or "none"
                field_name = ALIASES.get(key, key)
                hint = (f"; {field_name} is a KVCacheConfig field (--{field_name.replace('_', '-')}), "
                        "not a method option" if field_name in _config_fields() else "")
                raise ValueError(f"{cls.name} has no option {key!r} (options: {known}){hint}")
            numeric = accepted[key] is float and isinstance(value, int)  # a spec's "2" for a float option
            if not (isinstance(value, accepted[key]) or numeric) or (accepted[key] is float and isinstance(value, bool)):
                raise TypeError(
                    f"{cls.name} option {key!r} must be {accepted[key].__name__}, got {value!r}"
                )
        for key in cls.generic_options:
            if config.options.get(key, 0) < 0:
                raise ValueError(f"option {key} must be >= 0, got {config.options[key]}")
        if "keep_most" in config.options and not 0 < config.options["keep_most"] <= 1:
            raise ValueError(f"option keep_most (a fraction of the tokens) must be in (0, 1], got "
                             f"{config.options['keep_most']}")
        if "keep_most" in config.options and not config.options.get("keep_attended"):
            raise ValueError("option keep_most bounds keep_attended's tokens: give keep_attended too")
        if config.options.get("keep_attended") and config.residual_length == 0:
            raise ValueError("option keep_attended chooses tokens by the attention they get in the fp16 window: "
                             "it needs residual_length (--residual-length, spec window=) > 0")
        if config.options.get("smooth_keys", 0) > 1:
            raise ValueError(f"option smooth_keys (SmoothQuant's alpha) must be in (0, 1], got {config.options['smooth_keys']}")

    # options that `widths_label` already names
    width_options: ClassVar[frozenset] = frozenset()

    @classmethod
    def widths_label(cls, config) -> str:
        """The widths as `KVCacheConfig.describe` names them."""
        return f"K{config.bits}/V{config.value_bits}"

    @classmethod
    def check_model(cls, model) -> None:
        """Raise `integration.UnsupportedModelError` naming a model this method cannot serve
        (called before calibrating and when caches are built for a model)."""

    @classmethod
    def calibration_inputs(cls, model) -> Optional[list]:
        """Per layer, extra arrays of the model itself that `calibrate` needs (commvq: the RoPE
        frequencies), merged into that layer's captured activations; None for none."""
        return None

    @classmethod
    def key_codec(cls, config, dim: int, params: Optional[Params] = None) -> Codec:
        raise NotImplementedError

    @classmethod
    def value_codec(cls, config, dim: int, params: Optional[Params] = None) -> Codec:
        raise NotImplementedError

    @classmethod
    def calibrate(cls, config, layers, progress=None) -> Optional[list]:
        """Per-layer codec params learned from captured activations (`calibration.py`):
        `layers[i]` holds float32 "queries" (Hq, N, D), "keys" (H, N, D), "values" (H, N, Dv)
        of layer i (None for layers without a KV cache). Returns one {"keys": params,
        "values": params} per layer, or None for a method that learns nothing."""
        return None

    @classmethod
    def codec(cls, role: str, config, dim: int, params: Optional[Params] = None) -> Codec:
        """The codec of `role` with the generic options applied: `outliers=K` (keys) and
        `value_outliers=K` (values) wrap it in `outliers.OutlierCodec`, then `smooth_keys=ALPHA`
        wraps the key codec in `smoothing.SmoothedKeyCodec` (both need calibration)."""
        from .outliers import OUTLIER_PREFIX, outlier_codec
        from .smoothing import SMOOTH_PREFIX, smoothed_key_codec

        alpha = config.options.get("smooth_keys", 0) if role == "keys" else 0
        inner = {k: v for k, v in (params or {}).items() if not k.startswith(SMOOTH_PREFIX)} or None
        count = config.options.get("outliers" if role == "keys" else "value_outliers", 0)
        if not count:
            make = cls.key_codec if role == "keys" else cls.value_codec
            codec = make(config, dim, inner)
        else:
            base_params = {k: v for k, v in (inner or {}).items() if not k.startswith(OUTLIER_PREFIX)} or None
            codec = outlier_codec(cls, role, config, dim, count, inner, base_params)
        return smoothed_key_codec(codec, alpha, params) if alpha else codec


def _config_fields():
    import dataclasses

    from ..config import KVCacheConfig

    return {f.name for f in dataclasses.fields(KVCacheConfig)}
