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

from ..method_registry import _REGISTRY, available_methods, get_method, register_method  # noqa: F401  (re-exported)
from .codec import POSITIONS, Codec, Fields, Params, at_positions, split_width_centroid  # noqa: F401  (re-exported)


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
        """Raise `errors.UnsupportedModelError` naming a model this method cannot serve
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
