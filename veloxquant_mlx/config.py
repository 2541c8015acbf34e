"""Validated configuration of a compressed KV cache."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from .method_registry import get_method

# Keyword spellings of published code, accepted as their KVCacheConfig names: TurboQuant
# examples (algorithm, bit_width_inlier), KIVI's (k_bits, v_bits, kivi_group_size) and
# mlx-lm's (kv_bits: keys and, by default, values; kv_group_size).
ALIASES = {
    "algorithm": "method",
    "bit_width_inlier": "bits",
    "k_bits": "bits",
    "kv_bits": "bits",
    "v_bits": "value_bits",
    "kivi_group_size": "group_size",
    "kv_group_size": "group_size",
}


# Resolves a preset's name to its config: `presets.py` registers it (`register_presets`), so that
# this ground module never imports the layer that holds the table.
_PRESETS: Optional[Callable[..., "KVCacheConfig"]] = None


def register_presets(resolver: Callable[..., "KVCacheConfig"]) -> None:
    global _PRESETS
    _PRESETS = resolver


# Options the cache applies, not the codecs (`kept.py`): no part of what an artifact dir holds.
CACHE_OPTIONS = frozenset({"keep_attended", "keep_most"})


@dataclass(frozen=True)
class KVCacheConfig:
    """What to compress the KV cache with.

    `bits` is the key width, `value_bits` the value width (defaults to `bits`).
    `sink_tokens` (the first tokens) and `residual_length` (the most recent
    tokens) are kept in fp16; they are counted in `nbytes` like everything else.
    `center` subtracts each head's mean key and value (estimated on the first
    tokens that get encoded) before encoding; attention is unchanged by it in
    exact arithmetic, since softmax ignores a per-query shift of all scores and
    the probabilities sum to one, but the codes spend their range on what varies.
    `mean_tokens` caps the tokens the means are estimated on: the first `mean_tokens`
    encoded ones (None: all the first flush encodes), so that prompts sharing their first
    `sink_tokens + mean_tokens` tokens, cut into any prefill chunks that reach that far past the
    window, get the same means (docs/decisions.md, "Results independent of chunking").
    Method-specific settings go in `options` and are checked by the method.
    `artifact_dir` names a calibrated method's artifacts (`veloxquant calibrate`); "auto"
    calibrates once per model on first use and keeps them (`calibration.ensure_calibrated`).

    Published spellings are accepted as aliases (`ALIASES`: `algorithm=` for `method=`,
    `bit_width_inlier=`/`k_bits=`/`kv_bits=` for `bits=`, `v_bits=` for `value_bits=`,
    `kivi_group_size=`/`kv_group_size=` for `group_size=`, ...); any other unknown keyword
    is a TypeError that names the closest keyword.
    """

    method: str = "turboquant_mse"
    bits: int = 4
    value_bits: Optional[int] = None
    group_size: int = 64
    residual_length: int = 0
    sink_tokens: int = 0
    center: bool = False
    seed: int = 0
    artifact_dir: Optional[str] = None
    options: Mapping[str, Any] = field(default_factory=dict)
    mean_tokens: Optional[int] = None

    def __post_init__(self):
        if self.value_bits is None:
            object.__setattr__(self, "value_bits", self.bits)
        if not isinstance(self.method, str):
            raise TypeError(f"method must be a method name (str), got {self.method!r}")
        if not isinstance(self.options, Mapping):
            raise TypeError(f"options must be a mapping of option names to values, e.g. {{'renorm': True}}, "
                            f"got {self.options!r}")
        object.__setattr__(self, "options", dict(self.options))
        for key in self.options:
            if not isinstance(key, str):
                raise TypeError(f"option names must be str, got {key!r}")
        if self.artifact_dir is not None:
            if not isinstance(self.artifact_dir, (str, os.PathLike)):
                raise TypeError(f"artifact_dir must be a path, got {self.artifact_dir!r}")
            object.__setattr__(self, "artifact_dir", str(self.artifact_dir))
        for name in ("bits", "value_bits", "group_size", "residual_length", "sink_tokens", "seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {value!r}")
        if not isinstance(self.center, bool):
            raise TypeError(f"center must be a bool, got {self.center!r}")
        if self.mean_tokens is not None and (not isinstance(self.mean_tokens, int)
                                             or isinstance(self.mean_tokens, bool) or self.mean_tokens < 1):
            raise ValueError(f"mean_tokens must be a positive int or None, got {self.mean_tokens!r}")
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        for name in ("residual_length", "sink_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

        get_method(self.method).validate(self)

    @classmethod
    def preset(cls, name: str, **changes) -> "KVCacheConfig":
        """A named configuration (`vq4`, `vq3`, `vq2`: see `veloxquant_mlx/presets.py`) with `changes` on top."""
        if _PRESETS is None:
            raise RuntimeError("no presets are registered: import veloxquant_mlx (presets.py registers them)")
        return _PRESETS(name, **changes)

    def replace(self, **changes) -> "KVCacheConfig":
        """A copy with `changes`. A new `bits` (or `bit_width_inlier`) also sets `value_bits`
        unless the two widths differed or `value_bits` is given too: K4/V4 with bits=2 is
        K2/V2, K4/V8 with bits=2 is K2/V8."""
        return dataclasses.replace(self, **follow_bits(vars(self), changes))

    def to_json(self) -> str:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return json.dumps(fields, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "KVCacheConfig":
        return cls(**json.loads(text))

    def same_encoding(self, other: "KVCacheConfig") -> bool:
        """True when caches built from both configs store identical codes."""
        ignore = {"artifact_dir"}
        mine = {k: v for k, v in json.loads(self.to_json()).items() if k not in ignore}
        theirs = {k: v for k, v in json.loads(other.to_json()).items() if k not in ignore}
        return mine == theirs

    def codec_key(self) -> dict:
        """What shapes the codecs' constant arrays (codebooks, rotations, sketches), which is
        all an artifact dir holds: sinks, the fp16 window and centering act in the cache, the
        group size only in codecs without constant arrays (KIVI's, QJL's values), and options a
        method lists in `encode_options` (e.g. `renorm`) at encode time."""
        method = get_method(self.method)
        options = {k: v for k, v in self.options.items() if k not in method.encode_options | CACHE_OPTIONS}
        return {"method": self.method, "bits": self.bits, "value_bits": self.value_bits,
                "seed": self.seed, "options": options}

    def describe(self) -> str:
        """A short label naming every setting that changes the codes (the defaults' group
        size and seed left out), so that two configs that encode differently never read the same."""
        method = get_method(self.method)
        text = f"{self.method} {method.widths_label(self)}"
        if self.sink_tokens:
            text += f" sinks={self.sink_tokens}"
        if self.residual_length:
            text += f" window={self.residual_length}"
        if self.center:
            text += " centered" if self.mean_tokens is None else f" centered(means of {self.mean_tokens})"
        for key, value in sorted(self.options.items()):
            if key not in method.width_options:
                text += f" {key}={value}"
        if self.group_size != KVCacheConfig.group_size:
            text += f" group={self.group_size}"
        if self.seed != KVCacheConfig.seed:
            text += f" seed={self.seed}"
        return text


_dataclass_init = KVCacheConfig.__init__
_FIELDS = tuple(f.name for f in dataclasses.fields(KVCacheConfig))


def unknown_keyword_error(name: str) -> TypeError:
    """A TypeError for a keyword KVCacheConfig does not have, naming the closest one."""
    close = difflib.get_close_matches(name, [*_FIELDS, *ALIASES], n=1, cutoff=0.6)
    hint = f"; did you mean {ALIASES.get(close[0], close[0])}=?" if close else ""
    return TypeError(f"KVCacheConfig has no keyword {name!r}{hint} (keywords: {', '.join(_FIELDS)}; "
                     f"also accepted: {', '.join(f'{a}= for {n}=' for a, n in ALIASES.items())})")


@functools.wraps(_dataclass_init)
def _init_with_aliases(self, *args, **kwargs):
    given = dict(zip(_FIELDS, args))
    for alias, name in ALIASES.items():
        if alias not in kwargs:
            continue
        value = kwargs.pop(alias)
        if name in kwargs or name in given:
            mine = kwargs.get(name, given.get(name))
            if mine != value:
                raise ValueError(f"{name}={mine!r} and {alias}={value!r} disagree; give one of them")
            continue
        kwargs[name] = value
    for name in kwargs:
        if name not in _FIELDS:
            raise unknown_keyword_error(name)
    _dataclass_init(self, *args, **kwargs)


KVCacheConfig.__init__ = _init_with_aliases


def follow_bits(fields: Mapping[str, Any], changes: Mapping[str, Any]) -> dict:
    """`changes` to a config's `fields`, with value_bits following a new key width when the
    two widths were equal and no value width is given."""
    changes = dict(changes)
    new_bits = changes.get("bits", changes.get("bit_width_inlier"))
    if new_bits is not None and changes.get("value_bits") is None and fields.get("value_bits") in (
            None, fields.get("bits", KVCacheConfig.bits)):
        changes["value_bits"] = None
    return changes


def parse_option_value(text: str, wanted: Optional[type] = None):
    """A method option's value from the command line: `wanted` (the method's declared type)
    if given, else a bool ("true"/"false"), an int, a float or the text itself."""
    lowered = text.strip().lower()
    if wanted is bool or (wanted is None and lowered in ("true", "false")):
        if lowered in ("true", "yes", "1", "on"):
            return True
        if lowered in ("false", "no", "0", "off"):
            return False
        raise ValueError(f"expected a boolean, got {text!r}")
    if wanted is not None and wanted is not object:
        return wanted(text)
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text
