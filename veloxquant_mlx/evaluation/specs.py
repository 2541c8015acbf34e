"""Method specs: the strings that name a KV cache under test.

    fp16                          mlx-lm's KVCache (the baseline)
    mlx-q8, mlx-q4:group=32       mlx-lm's QuantizedKVCache (group 64 by default)
    turboquant_prod:4             a registered VeloxQuant method at 4 key bits
    kivi:2:group=32,residual=32   ... with config fields or method options
    turboquant_mse:3:backend=portable   ... on another engine back end (`settings.EngineSettings`)
    turboquant_mse:3:check_inputs=off   ... without the prefill chunks' input check (one sync per layer)
    kivi:4:prefill_rule=decode          ... prefill chunks attend as token-by-token decoding would (`settings.py`)
    turboquant_mse:3:tensor_cores=off   ... decode partials on the fp32 SIMT kernel instead of tensor cores (CUDA)
    vq3, vq3:window=32            a preset (`veloxquant_mlx/presets.py`), with config fields on top
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional

from mlx_lm.models import cache as mlx_cache

from ..config import KVCacheConfig, parse_option_value
from ..integration import KVCacheBuilder, base_caches
from ..methods import available_methods

BASELINE = "baseline"
VELOXQUANT = "veloxquant"

MLX_QUANTIZED_BITS = (2, 3, 4, 5, 6, 8)
MLX_QUANTIZED_GROUPS = (32, 64, 128)

CONFIG_KEYS = {
    "group": "group_size",
    "group_size": "group_size",
    "residual": "residual_length",
    "residual_length": "residual_length",
    "window": "residual_length",
    "sinks": "sink_tokens",
    "mean_tokens": "mean_tokens",
    "sink_tokens": "sink_tokens",
    "vbits": "value_bits",
    "value_bits": "value_bits",
    "seed": "seed",
}


class MethodSpecError(ValueError):
    pass


@dataclass(frozen=True)
class MethodSpec:
    """A parsed spec. `make_caches(model)` returns fresh per-layer caches."""

    text: str
    label: str
    kind: str  # BASELINE or VELOXQUANT
    method: str
    bits: int
    value_bits: int
    group_size: Optional[int] = None
    config: Optional[KVCacheConfig] = None
    settings: Dict[str, Any] = field(default_factory=dict)
    engine: Dict[str, Any] = field(default_factory=dict)  # EngineSettings fields given in the spec

    @property
    def is_baseline(self) -> bool:
        return self.kind == BASELINE

    def make_caches(self, model, **engine_defaults) -> list:
        """`engine_defaults`: EngineSettings fields this evaluation wants unless the spec sets them."""
        if self.config is not None:
            from ..settings import EngineSettings

            settings = EngineSettings.resolve(**{**engine_defaults, **self.engine})
            return KVCacheBuilder(self.config).for_model(model).build(settings=settings)
        caches = base_caches(model)
        if self.method == "fp16":
            return caches
        return [
            mlx_cache.QuantizedKVCache(group_size=self.group_size, bits=self.bits)
            if type(c) is mlx_cache.KVCache
            else c
            for c in caches
        ]

    def describe(self) -> Dict[str, Any]:
        """JSON-ready description for results files."""
        info = {
            "spec": self.text,
            "label": self.label,
            "kind": self.kind,
            "method": self.method,
            "bits": self.bits,
            "value_bits": self.value_bits,
            "group_size": self.group_size,
        }
        if self.config is not None:
            info["config"] = {
                "residual_length": self.config.residual_length,
                "sink_tokens": self.config.sink_tokens,
                "center": self.config.center,
                "mean_tokens": self.config.mean_tokens,
                "seed": self.config.seed,
                "options": dict(self.config.options),
            }
        if self.engine:
            info["engine"] = dict(self.engine)
        return info


def _parse_settings(spec: str, text: str) -> Dict[str, str]:
    settings = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise MethodSpecError(f"{spec!r}: expected key=value settings, got {item!r}")
        if key in settings:
            raise MethodSpecError(f"{spec!r}: {key!r} is given twice")
        settings[key] = value
    return settings


def _split(spec: str):
    parts = spec.split(":")
    if len(parts) > 3:
        raise MethodSpecError(f"{spec!r}: expected name[:bits[:key=value,...]]")
    name = parts[0].strip()
    bits = settings = None
    if len(parts) >= 2:
        # `name:key=value` is allowed too (no bits)
        if "=" in parts[1] and len(parts) == 2:
            settings = parts[1]
        else:
            bits = parts[1].strip()
    if len(parts) == 3:
        settings = parts[2]
    return name, bits, _parse_settings(spec, settings) if settings else {}


def _int(spec: str, what: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise MethodSpecError(f"{spec!r}: {what} must be an integer, got {text!r}") from None


def _baseline(spec: str, name: str, bits: Optional[str], settings: Dict[str, str]) -> MethodSpec:
    if name == "fp16":
        if bits not in (None, "16") or settings:
            raise MethodSpecError(f"{spec!r}: the fp16 baseline takes no bits or settings")
        return MethodSpec(spec, "fp16", BASELINE, "fp16", 16, 16)
    match = re.fullmatch(r"mlx-q(\d+)", name)
    q_bits = int(match.group(1))
    if bits is not None:
        raise MethodSpecError(f"{spec!r}: the width is part of the name ({name}); drop ':{bits}'")
    if q_bits not in MLX_QUANTIZED_BITS:
        raise MethodSpecError(
            f"{spec!r}: mlx-lm's QuantizedKVCache supports bits {MLX_QUANTIZED_BITS}, not {q_bits}"
        )
    group = 64
    for key, value in settings.items():
        if key not in ("group", "group_size"):
            raise MethodSpecError(f"{spec!r}: mlx-lm baselines take only group=N, not {key!r}")
        group = _int(spec, "group", value)
    if group not in MLX_QUANTIZED_GROUPS:
        raise MethodSpecError(f"{spec!r}: group must be one of {MLX_QUANTIZED_GROUPS}, got {group}")
    label = name if group == 64 else f"{name}:group={group}"
    return MethodSpec(spec, label, BASELINE, name, q_bits, q_bits, group_size=group)


def _settings_fields(spec: str, method, settings: Dict[str, str]):
    """`key=value` settings as (config fields, method options, engine settings)."""
    fields: Dict[str, Any] = {}
    options, engine = {}, {}
    for key, value in settings.items():
        if key == "backend":
            from ..settings import BACKENDS

            if value not in BACKENDS:
                raise MethodSpecError(f"{spec!r}: backend must be one of {', '.join(BACKENDS)}, got {value!r}")
            engine["backend"] = value
        elif key == "check_inputs":
            from ..settings import CHECK_INPUTS

            if value not in CHECK_INPUTS:
                raise MethodSpecError(f"{spec!r}: check_inputs must be one of {', '.join(CHECK_INPUTS)}, got {value!r}")
            engine["check_inputs"] = value
        elif key == "prefill_rule":
            from ..settings import PREFILL_RULES

            if value not in PREFILL_RULES:
                raise MethodSpecError(f"{spec!r}: prefill_rule must be one of {', '.join(PREFILL_RULES)}, got {value!r}")
            engine["prefill_rule"] = value
        elif key == "prefill_sync":
            from ..settings import PREFILL_SYNCS

            if value not in PREFILL_SYNCS:
                raise MethodSpecError(f"{spec!r}: prefill_sync must be one of {', '.join(PREFILL_SYNCS)}, got {value!r}")
            engine["prefill_sync"] = value
        elif key == "tensor_cores":
            if value not in ("on", "off"):
                raise MethodSpecError(f"{spec!r}: tensor_cores must be on or off, got {value!r}")
            engine["tensor_cores"] = value == "on"
        elif key in CONFIG_KEYS:
            fields[CONFIG_KEYS[key]] = _int(spec, key, value)
        elif key == "center":
            fields["center"] = parse_option_value(value, bool)
        elif key in ("artifacts", "artifact_dir"):  # calibrated methods (`veloxquant calibrate`)
            fields["artifact_dir"] = value
        else:
            try:
                options[key] = parse_option_value(value, method.options.get(key))
            except ValueError as error:
                raise MethodSpecError(f"{spec!r}: option {key!r}: {error}") from None
    return fields, options, engine


def _veloxquant(spec: str, name: str, bits: Optional[str], settings: Dict[str, str]) -> MethodSpec:
    methods = available_methods()
    if name not in methods:
        known = ", ".join(["fp16", "mlx-q8", "mlx-q4", "mlx-q3", "mlx-q2"] + sorted(methods))
        raise MethodSpecError(f"{spec!r}: unknown method {name!r}; known: {known}")
    method = methods[name]
    fields: Dict[str, Any] = {"method": name}
    if bits is not None:
        fields["bits"] = _int(spec, "bits", bits)
    elif 4 not in method.key_bits:
        fields["bits"] = method.key_bits.stop - 1
    more, options, engine = _settings_fields(spec, method, settings)
    fields.update(more)
    try:
        config = KVCacheConfig(**fields, options=options)
    except (TypeError, ValueError) as error:
        raise MethodSpecError(f"{spec!r}: {error}") from None
    label = name if bits is None else f"{name}:{bits}"
    if settings:
        label += ":" + ",".join(f"{k}={v}" for k, v in settings.items())
    return MethodSpec(
        spec, label, VELOXQUANT, name, config.bits, config.value_bits,
        group_size=config.group_size, config=config, settings=dict(settings), engine=engine,
    )


def _preset(spec: str, name: str, bits: Optional[str], settings: Dict[str, str]) -> MethodSpec:
    from ..presets import KV_PRESETS

    if bits is not None:
        raise MethodSpecError(f"{spec!r}: a preset's widths are part of it; change them with {name}:vbits=N")
    method = available_methods()[KV_PRESETS[name]["method"]]
    fields, options, engine = _settings_fields(spec, method, settings)
    if options:
        fields["options"] = options
    try:
        config = KVCacheConfig.preset(name, **fields)
    except (TypeError, ValueError) as error:
        raise MethodSpecError(f"{spec!r}: {error}") from None
    label = name + (":" + ",".join(f"{k}={v}" for k, v in settings.items()) if settings else "")
    return MethodSpec(spec, label, VELOXQUANT, config.method, config.bits, config.value_bits,
                      group_size=config.group_size, config=config, settings=dict(settings), engine=engine)


def parse_method_spec(spec: str) -> MethodSpec:
    """Parse `name[:bits[:key=value,...]]` (see the module docstring)."""
    if not isinstance(spec, str) or not spec.strip():
        raise MethodSpecError("empty method spec")
    spec = spec.strip()
    name, bits, settings = _split(spec)
    if not name:
        raise MethodSpecError(f"{spec!r}: missing method name")
    if name == "fp16" or re.fullmatch(r"mlx-q\d+", name):
        return _baseline(spec, name, bits, settings)
    from ..presets import KV_PRESETS

    if name in KV_PRESETS:
        return _preset(spec, name, bits, settings)
    return _veloxquant(spec, name, bits, settings)


def calibrated_for(specs: List[MethodSpec], model, tokenizer) -> List[MethodSpec]:
    """`specs` with every config that calibrates on first use (`artifact_dir="auto"`) resolved for `model`,
    calibrating now where it has not been (`calibration.ensure_calibrated`)."""
    from ..calibration import AUTO, ensure_calibrated

    return [replace(s, config=ensure_calibrated(s.config, model, tokenizer))
            if s.config is not None and s.config.artifact_dir == AUTO else s for s in specs]


def parse_method_list(text: str) -> List[MethodSpec]:
    """Comma-separated specs. Commas inside `key=value,...` settings stay with their spec:
    an item containing '=' but no ':' continues the previous spec."""
    items: List[str] = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        if items and "=" in item and ":" not in item:
            items[-1] += "," + item
        else:
            items.append(item)
    if not items:
        raise MethodSpecError("no methods given")
    specs = [parse_method_spec(item) for item in items]
    labels = [s.label for s in specs]
    duplicates = sorted({label for label in labels if labels.count(label) > 1})
    if duplicates:
        raise MethodSpecError(f"methods given twice: {', '.join(duplicates)}")
    return specs


def with_fp16_first(specs: List[MethodSpec]) -> List[MethodSpec]:
    """The fp16 baseline first (adding it when missing): quality is measured against it."""
    rest = [s for s in specs if s.label != "fp16"]
    return [parse_method_spec("fp16")] + rest
