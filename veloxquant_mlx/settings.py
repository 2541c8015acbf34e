"""The engine's settings: one object, resolved once per cache, passed to every path.

Explicit arguments win; environment variables are only the defaults of the fields
that have one (so a benchmark or a test can flip a setting without code). Nothing
on the per-token path reads the environment.

| field | environment default | meaning |
|---|---|---|
| `backend` | `VELOXQUANT_KERNELS` (auto) | "cuda", "metal", "native" (the C++ CPU kernel), "portable" (compiled MLX ops), "emulator" (the kernels' C++ emulation, tests only); "auto" picks the fastest the device has |
| `kernels` | `VELOXQUANT_KERNELS=off` turns them off | False: every call takes the generic path (`attention.attend`) |
| `compile_step` | `VELOXQUANT_COMPILE_STEP` (1) | replay decode steps from `mx.compile`d graphs |
| `metal_kernels` | `VELOXQUANT_METAL_KERNELS` (1) | Metal kernels on an Apple GPU; each is checked against the portable path at first use |
| `tensor_cores` | `VELOXQUANT_TENSOR_CORES` (1) | turboquant_mse decode on tensor cores where the back end has them (CUDA `mma`: fp16 operands, fp32 sums; the emulator models it); otherwise, and for shapes it does not take (more than 8 query heads per kv head, head dim above 256), the fp32 SIMT kernel |
| `split_tokens` | `VELOXQUANT_SPLIT_TOKENS` (None) | tokens per decode split (None: planned from the GPU's size) |
| `check_inputs` | `VELOXQUANT_CHECK_INPUTS` (prefill) | refuse NaN, Inf and beyond-fp16 keys/values (and NaN/Inf queries) before the cache changes: "prefill" every chunk of more than one token (two syncs per layer and chunk, which idle a GPU while the host builds the next layer), "always" every update as well (two syncs per layer per decode step), "first" each cache's first update only (the chunk that sets the centering means), "off" none. Costs: docs/decisions.md |
| `prefill_sync` | `VELOXQUANT_PREFILL_SYNC` (pipelined) | how a GPU prefill bounds its peak memory: "pipelined" launches each layer's attention and then waits for the layer before, so the GPU always has one queued (two layers' decoded histories at a time); "layer" evaluates each layer before the next is built (one history at a time; the GPU idles while the host builds the next layer) |
| `prefill_rule` | `VELOXQUANT_PREFILL_RULE` (decode) | what a prefill chunk's queries see in fp16 where an fp16 window or multi-token blocks (KIVI) exist: "decode", exactly what token-by-token decoding would (a band per query), so results do not depend on how a prompt is cut into chunks or verify blocks (docs/decisions.md); "chunk", the chunk and the window before it (as an fp16 cache would; one fused attention call, but a query then sees a token in fp16 or from its codes depending on the chunking) |
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import mlx.core as mx

BACKENDS = ("cuda", "metal", "native", "portable", "emulator")
CPU_BACKENDS = ("native", "portable")
CHECK_INPUTS = ("always", "prefill", "first", "off")
PREFILL_RULES = ("chunk", "decode")
PREFILL_SYNCS = ("layer", "pipelined")
GPU_BACKENDS = ("cuda", "metal")


def _flag(value: Optional[str], default: bool) -> bool:
    if value is None or not value.strip():
        return default
    return value.strip().lower() not in ("0", "off", "false", "no")


@dataclass(frozen=True)
class EngineSettings:
    backend: str
    kernels: bool = True
    compile_step: bool = True
    metal_kernels: bool = True
    split_tokens: Optional[int] = None
    tensor_cores: bool = True
    gpu_device: Optional[bool] = None  # the default device is a GPU (None: a GPU back end implies it)
    check_inputs: str = "prefill"
    prefill_rule: str = "decode"
    prefill_sync: str = "pipelined"

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.split_tokens is not None and (not isinstance(self.split_tokens, int) or self.split_tokens < 1):
            raise ValueError(f"split_tokens must be a positive int, got {self.split_tokens!r}")
        if self.check_inputs not in CHECK_INPUTS:
            raise ValueError(f"check_inputs must be one of {', '.join(CHECK_INPUTS)}, got {self.check_inputs!r}")
        if self.prefill_rule not in PREFILL_RULES:
            raise ValueError(f"prefill_rule must be one of {', '.join(PREFILL_RULES)}, got {self.prefill_rule!r}")
        if self.prefill_sync not in PREFILL_SYNCS:
            raise ValueError(f"prefill_sync must be one of {', '.join(PREFILL_SYNCS)}, got {self.prefill_sync!r}")

    @property
    def gpu(self) -> bool:
        return self.backend in GPU_BACKENDS

    @property
    def gpu_kernels(self) -> bool:
        return self.gpu and self.kernels

    @property
    def on_gpu(self) -> bool:
        """Attention runs on a GPU device, with kernels of ours or not (the portable back end)."""
        return self.gpu if self.gpu_device is None else self.gpu_device

    def replace(self, **changes) -> "EngineSettings":
        return dataclasses.replace(self, **changes)

    @classmethod
    def resolve(cls, backend: str = "auto", **explicit) -> "EngineSettings":
        """Settings for a new cache: `explicit` fields as given, the rest from the environment."""
        forced = os.environ.get("VELOXQUANT_KERNELS", "").strip().lower()
        if "kernels" not in explicit:
            explicit["kernels"] = forced not in ("off", "generic")
        if "compile_step" not in explicit:
            explicit["compile_step"] = _flag(os.environ.get("VELOXQUANT_COMPILE_STEP"), True)
        if "metal_kernels" not in explicit:
            explicit["metal_kernels"] = _flag(os.environ.get("VELOXQUANT_METAL_KERNELS"), True)
        if "tensor_cores" not in explicit:
            explicit["tensor_cores"] = _flag(os.environ.get("VELOXQUANT_TENSOR_CORES"), True)
        if "split_tokens" not in explicit:
            env = os.environ.get("VELOXQUANT_SPLIT_TOKENS")
            explicit["split_tokens"] = int(env) if env else None
        if "check_inputs" not in explicit:
            explicit["check_inputs"] = (os.environ.get("VELOXQUANT_CHECK_INPUTS") or "prefill").strip().lower()
        if "prefill_rule" not in explicit:
            explicit["prefill_rule"] = (os.environ.get("VELOXQUANT_PREFILL_RULE") or "decode").strip().lower()
        if "prefill_sync" not in explicit:
            explicit["prefill_sync"] = (os.environ.get("VELOXQUANT_PREFILL_SYNC") or "pipelined").strip().lower()
        device = mx.default_device()
        if "gpu_device" not in explicit:
            explicit["gpu_device"] = device.type == mx.DeviceType.gpu
        if backend == "auto":
            backend = detect_backend(forced, explicit["metal_kernels"], device)
        return cls(backend=backend, **explicit)


# Whether the C++ CPU kernels (veloxquant_mlx._native) load: `kernels/native.py` registers its
# probe (`register_native_probe`), so that this ground module never imports the kernels.
_NATIVE_PROBE: Optional[Callable[[], bool]] = None


def register_native_probe(probe: Callable[[], bool]) -> None:
    global _NATIVE_PROBE
    _NATIVE_PROBE = probe


def _native_available() -> bool:
    if _NATIVE_PROBE is None:
        raise RuntimeError("no CPU kernel probe is registered: import veloxquant_mlx (kernels/native.py registers it)")
    return _NATIVE_PROBE()


@functools.lru_cache(maxsize=1)
def cuda_available() -> bool:
    """Whether MLX's CUDA back end is built and sees a device."""
    cuda = getattr(mx, "cuda", None)
    try:
        return bool(cuda is not None and cuda.is_available())
    except Exception:  # pragma: no cover
        return False


@functools.lru_cache(maxsize=32)
def detect_backend(forced: str, metal_kernels: bool, device) -> str:
    """The fastest back end for `device`: `forced` is VELOXQUANT_KERNELS (or "")."""
    if forced in ("portable", "off", "generic", "0", "none"):
        return "portable"
    if forced == "emulator":
        return "emulator"
    if forced == "native" and not _native_available():
        raise RuntimeError("VELOXQUANT_KERNELS=native, but veloxquant_mlx._native was not built "
                           "(scripts/build_native.sh)")
    try:
        on_gpu = device.type == mx.DeviceType.gpu
    except Exception:  # pragma: no cover
        on_gpu = False
    if not on_gpu:
        if _native_available():
            return "native"
        warnings.warn("veloxquant_mlx: the C++ CPU kernels (veloxquant_mlx._native) are not built, so "
                      "turboquant_mse and KIVI decode on the CPU through the portable MLX-ops path (slower). "
                      "Reinstall with cmake and a C++ compiler present, or run scripts/build_native.sh; "
                      "VELOXQUANT_KERNELS=portable chooses it without this warning.", RuntimeWarning, stacklevel=3)
        return "portable"
    if cuda_available() and forced in ("", "auto", "cuda"):
        return "cuda"
    if mx.metal.is_available() and (metal_kernels or forced == "metal"):
        return "metal"
    return "portable"
