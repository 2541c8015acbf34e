"""`--kv PRESET`: named cache configurations, so a user need not know the options.

Every preset is a zero-calibration configuration whose quality this project has
measured (README "Results", `benchmarks/results/ppl-all-methods-smollm2-cpu`):
`turboquant_mse` at 4/3/2 bits with the recommended protections (4 fp16 sink
tokens, a 64-token fp16 window, centering, `renorm`). Change the table here; the
CLI help and the README list whatever it holds.
"""

from __future__ import annotations

from typing import Dict

from .config import KVCacheConfig

_PROTECTED = dict(sink_tokens=4, residual_length=64, center=True, options={"renorm": True})

KV_PRESETS: Dict[str, dict] = {
    "vq4": dict(method="turboquant_mse", bits=4, **_PROTECTED),
    "vq3": dict(method="turboquant_mse", bits=3, **_PROTECTED),
    "vq2": dict(method="turboquant_mse", bits=2, **_PROTECTED),
}


def preset_config(name: str, **changes) -> KVCacheConfig:
    """The preset's config with `changes` on top (an unknown name is a ValueError naming the known ones)."""
    if name not in KV_PRESETS:
        raise ValueError(f"unknown --kv preset {name!r}; known: {', '.join(KV_PRESETS)}")
    fields = dict(KV_PRESETS[name])
    if "options" in changes:
        changes["options"] = {**fields.get("options", {}), **changes["options"]}
    fields.update(changes)
    return KVCacheConfig(**fields)


def describe_presets() -> str:
    return "; ".join(f"{name} = {preset_config(name).describe()}" for name in KV_PRESETS)
