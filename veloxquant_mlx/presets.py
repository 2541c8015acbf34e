"""Named cache configurations (`--kv vq3`, `KVCacheConfig.preset("vq3")`, the spec `vq3` in `veloxquant eval`),
so that a user need not know the options.

`vq4`, `vq3` and `vq2` are the configurations that measured best at 4, 3 and 2 effective bits per coordinate
on SmolLM2 (`benchmarks/results/presets-sweep`, tuned on WikiText-2 from token 200000 on; reported on the
text's first windows, `benchmarks/results/presets-ppl-3-windows`), with `unbiased_values`, which gained at
every budget on the tuning window (`benchmarks/results/unbiased-values-ppl`). Each one's
`PRESET_BITS` is an upper bound on the caches' bytes per coordinate at every context of 2048 tokens or more
(the fp16 sinks and window cost most at 2048 and less after), which `tests/test_presets.py` measures from the
caches' bytes. None needs calibration.

No preset is calibrated: CommVQ keys (llama family), the best at 3 and 2 bits when calibrated on WikiText-2,
lost to `vq3` / `vq2` when calibrated on the text shipped in the package, as a first-use calibration would be
(`benchmarks/results/calibrated-first-use-ppl`, docs/methods.md). `artifact_dir="auto"`
(`calibration.ensure_calibrated`) is that first-use calibration, for any calibrated config.
Change the table here; the CLI help and `describe_presets` list whatever it holds.
"""

from __future__ import annotations

import warnings
from typing import Dict

from .config import KVCacheConfig, register_presets

# Every preset: 4 fp16 sink tokens, a short fp16 window of the newest tokens, centred keys and values
# (means of the first 256 encoded tokens, so prompts sharing their first 260 tokens share them:
# docs/decisions.md, "Results independent of chunking"),
# TurboQuant-MSE's `renorm` for keys (norms rescaled so the decoded key keeps the true norm) and
# `unbiased_values` (each decoded value's projection on the true one is exact, so the errors of the
# attention's weighted sum average out instead of shrinking it).
_PROTECTED = dict(sink_tokens=4, center=True, mean_tokens=256, options={"renorm": True, "unbiased_values": True})

KV_PRESETS: Dict[str, dict] = {
    "vq4": dict(method="turboquant_mse", bits=4, value_bits=3, residual_length=32, **_PROTECTED),
    "vq3": dict(method="turboquant_mse", bits=3, value_bits=2, residual_length=32, **_PROTECTED),
    "vq2": dict(method="turboquant_mse", bits=2, value_bits=1, residual_length=24, **_PROTECTED),
    # MLX's own quantized format, rotated (`methods/mlxq.py`): every back end runs it on MLX's kernels, and
    # `FALLBACK_PRESET` maps each preset above to one of these where the custom kernels are unusable.
    "mlxq4": dict(method="mlxq", bits=4, value_bits=4, group_size=64, residual_length=32, sink_tokens=4, center=True,
                  mean_tokens=256),
    "mlxq8": dict(method="mlxq", bits=8, value_bits=8, group_size=64, residual_length=32, sink_tokens=4, center=True,
                  mean_tokens=256),
}

# The most bits per coordinate each preset's caches hold at any context >= MIN_CONTEXT tokens.
PRESET_BITS: Dict[str, float] = {"vq4": 4.0, "vq3": 3.0, "vq2": 2.0, "mlxq4": 4.75, "mlxq8": 8.75}
MIN_CONTEXT = 2048


def preset_config(name: str, **changes) -> KVCacheConfig:
    """The preset's config with `changes` on top (an unknown name is a ValueError naming the known ones)."""
    if name not in KV_PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(KV_PRESETS)}")
    fields = dict(KV_PRESETS[name])
    if "options" in changes:
        changes["options"] = {**fields.get("options", {}), **changes["options"]}
    fields.update(changes)
    return KVCacheConfig(**fields)


# What each kernel preset resolves to where the custom kernels are unusable (`kernels_usable`): MLX's own
# quantized kernels, not the portable MLX-ops decode of turboquant_mse's codes.
FALLBACK_PRESET: Dict[str, str] = {"vq4": "mlxq4", "vq3": "mlxq4", "vq2": "mlxq4"}
_ANNOUNCED: set = set()


def kernels_usable(settings=None) -> bool:
    """Whether the custom attention kernels may run here: a kernel back end (CUDA, Metal, the C++ CPU
    extension) that passed its first-use check (`kernels/check.py`)."""
    from .kernels import check
    from .settings import EngineSettings

    settings = settings or EngineSettings.resolve()
    if not settings.kernels or settings.backend == "portable":
        return False
    return check.usable(settings.backend)


def resolved_preset(name: str, settings=None) -> str:
    """`name`, or its `FALLBACK_PRESET` where the custom kernels are unusable, said once per process on stderr."""
    fallback = FALLBACK_PRESET.get(name)
    if fallback is None or kernels_usable(settings):
        return name
    if name not in _ANNOUNCED:
        _ANNOUNCED.add(name)
        warnings.warn(f"veloxquant_mlx: the custom attention kernels are unusable here (no kernel back end, or its "
                      f"first-use check failed), so preset {name} resolves to {fallback} "
                      f"({preset_config(fallback).describe()}: MLX's own quantized kernels)", RuntimeWarning,
                      stacklevel=2)
    return fallback


def usable_preset_config(name: str, **changes) -> KVCacheConfig:
    """`preset_config` of `resolved_preset(name)`: what `KVCacheConfig.preset` and `--kv` build."""
    return preset_config(resolved_preset(name), **changes)


register_presets(usable_preset_config)


def qk_norm_hint(name, config: KVCacheConfig, model) -> "str | None":
    """A line for a user who picked preset `name` for a model whose attention normalises its keys (Gemma 3,
    Qwen3, ...) without smoothed keys, which such models need (docs/methods.md). The presets do not add them
    themselves: they need a calibration, and so a tokenizer, wherever a cache is built. None where it does not apply."""
    if name not in KV_PRESETS or "smooth_keys" in config.options:
        return None
    if not any(hasattr(getattr(layer, "self_attn", None), "k_norm") for layer in getattr(model, "layers", ())):
        return None
    return (f"[{name} on a model that normalises its keys (QK-norm): adding `--option smooth_keys=0.5 --artifact-dir "
            f"auto` (spec `{name}:smooth_keys=0.5,artifacts=auto`; calibrated once per model) cut the presets' error "
            f"on such models (Gemma 3: docs/methods.md)]")


def describe_presets() -> str:
    return "; ".join(f"{name} = {preset_config(name).describe()} (<= {PRESET_BITS[name]:g} bits/coord from "
                     f"{MIN_CONTEXT} tokens at head dim >= 64)" for name in KV_PRESETS)


def measured_bits(config: KVCacheConfig, model, contexts, chunk: int = 512, seed: int = 0) -> Dict[int, float]:
    """Bits per coordinate of `config`'s caches for `model` at each of `contexts` (token counts), as every command
    counts them (`footprint`: the bytes the held tokens take, the store's spare capacity left out).

    The caches are filled with random keys and values of the model's shapes, `chunk` tokens at a time, each
    chunk attended to by as many random queries as a prefill would: a `keep_attended` cache allocates its
    slots as its tokens settle, in attention calls. Byte counts depend on the token count, never on the values."""
    import mlx.core as mx

    from .kvlayout import kv_layout
    from .footprint import footprint
    from .integration import KVCacheBuilder

    layout = kv_layout(model)
    caches = KVCacheBuilder(config).for_model(model).build()
    key = mx.random.key(seed)
    held, bits = 0, {}
    for target in sorted(contexts):
        while held < target:
            step = min(chunk, target - held)
            for cache, (heads, key_dim, value_dim) in zip(caches, layout.layers):
                key, k1, k2, k3 = mx.random.split(key, 4)
                keys = mx.random.normal((1, heads, step, key_dim), key=k1).astype(mx.float16)
                values = mx.random.normal((1, heads, step, value_dim), key=k2).astype(mx.float16)
                queries = mx.random.normal((1, heads, step, key_dim), key=k3).astype(mx.float16)
                cache.update_and_fetch(keys, values)
                mx.eval(cache.attend(queries, key_dim ** -0.5, mask="causal"))
            held += step
        bits[target] = footprint(caches).bits
    return bits
