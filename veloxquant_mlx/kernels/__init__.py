"""Attention and encoding on packed codes, with kernels chosen at run time.

Back ends (`backend()`):

* ``cuda``: `mx.fast.cuda_kernel`, when MLX's CUDA back end is available and
  the default device is the GPU;
* ``metal``: `mx.fast.metal_kernel`, generated from the same templates, only
  with ``VELOXQUANT_METAL_KERNELS=1`` (not yet run on a Mac; see docs/kernels.md);
* ``native``: on the CPU, one C++ MLX primitive (`native.py`, `csrc/mse_attention.cpp`)
  where the optional extension was built (`make setup` builds it);
* ``portable``: MLX ops compiled with `mx.compile`, everywhere else.

``VELOXQUANT_KERNELS=portable`` forces the portable path (``=native`` insists on the
C++ one on the CPU and fails where it was not built); ``VELOXQUANT_KERNELS=off``
sends all attention to the generic blockwise path of `veloxquant_mlx.attention`. Kernels exist for
turboquant_mse keys and values (1-8 bits, head dims that are multiples of 32;
seeded Hadamard rotations of power-of-two dims are applied inside the kernels,
other rotations by MLX ops around them); other methods use the generic
attention in `veloxquant_mlx.attention`.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from . import launch, native, ops, portable, rows, step, templates

__all__ = ["attention", "backend", "decode_attention", "prefill_attention", "encode_rows", "kernel_supported",
           "launch", "native", "ops", "portable", "rows", "step", "templates"]


CPU_BACKENDS = ops.CPU_BACKENDS
SHARED_LIMIT = 44 * 1024  # static shared memory a CUDA block may use is 48 KB


@dataclass(frozen=True)
class Mode:
    """The settings a cache decodes with, read once when it first receives tokens (so
    that a decode step does no environment look-ups): the back end, whether kernels are
    off (VELOXQUANT_KERNELS=off), whether the compiled step is on (VELOXQUANT_COMPILE_STEP)
    and whether GPU prefill may dequantize the history (VELOXQUANT_PREFILL_DEQUANT=1)."""

    backend: str
    off: bool
    compiled: bool
    prefill_dequant: bool

    @property
    def gpu_kernels(self) -> bool:
        return self.backend in ("cuda", "metal") and not self.off


def mode() -> Mode:
    return Mode(backend(), _off(os.environ.get("VELOXQUANT_KERNELS")), step.enabled(),
                os.environ.get("VELOXQUANT_PREFILL_DEQUANT") == "1")


def backend() -> str:
    """The active back end (see the module docstring); cheap enough to call per layer."""
    key = (os.environ.get("VELOXQUANT_KERNELS"), os.environ.get("VELOXQUANT_METAL_KERNELS"),
           mx.default_device())
    return _backend(key)


@functools.lru_cache(maxsize=32)
def _backend(key) -> str:
    forced = (key[0] or "auto").strip().lower()
    if forced in ("portable", "off", "generic", "0", "none"):
        return "portable"
    if forced == "emulator":  # the kernels' C++ emulation on the CPU: slow, for tests
        return "emulator"
    try:
        on_gpu = key[2].type == mx.DeviceType.gpu
    except Exception:  # pragma: no cover
        on_gpu = False
    if forced == "native" and not native.available():
        raise RuntimeError("VELOXQUANT_KERNELS=native, but veloxquant_mlx._native was not built "
                           "(scripts/build_native.sh)")
    if not on_gpu:
        return "native" if native.available() else "portable"
    if forced in ("auto", "cuda") and _cuda_available():
        return "cuda"
    metal_flag = (key[1] or "0").strip().lower() in ("1", "true", "yes", "on")
    if (forced == "metal" or metal_flag) and mx.metal.is_available():
        return "metal"
    return "portable"


def _cuda_available() -> bool:
    cuda = getattr(mx, "cuda", None)
    try:
        return bool(cuda is not None and cuda.is_available())
    except Exception:  # pragma: no cover
        return False


def _is_mse(codec) -> bool:
    global _MSECodec
    if _MSECodec is None:
        from ..methods.turboquant_mse import MSECodec

        _MSECodec = MSECodec
    return type(codec) is _MSECodec


_MSECodec = None


@functools.lru_cache(maxsize=256)
def _decode_kernel_ok(key_codec, value_codec, rep: int) -> bool:
    return kernel_supported(key_codec, value_codec) and launch.partial_shared_bytes(
        key_codec.dim, rep, key_codec.bits, value_codec.bits) <= SHARED_LIMIT


def kernel_supported(key_codec, value_codec=None) -> bool:
    """Whether the decode kernels take these codecs."""
    codecs = [key_codec] + ([value_codec] if value_codec is not None else [])
    if not all(_is_mse(c) for c in codecs):
        return False
    if value_codec is not None and key_codec.dim != value_codec.dim:
        return False
    if key_codec.dim % 32 or key_codec.dim > 1024:
        return False
    try:
        launch.value_group(key_codec.dim, launch.PARTIAL_THREADS, (value_codec or key_codec).bits)
    except ValueError:
        return False
    return True


def encode_rows(layout, keys: mx.array, values: mx.array, *, using: Optional[str] = None) -> mx.array:
    """Rows (`rows.py`) of new keys and values: one kernel launch where the back end has
    kernels, else the codecs' MLX ops."""
    name = using or backend()
    if name not in CPU_BACKENDS and keys.shape[-2] > 0 and max(layout.key_codec.dim, layout.value_codec.dim) <= 1024:
        return ops.mse_encode_rows(ops.runner(name), layout.key_codec, layout.value_codec, keys, values)
    return layout.encode(keys, values)


def compiled_append_applies(cache) -> bool:
    """Whether a one-token append can take the compiled step (`step.append`): turboquant_mse
    buffers already exist, centering means (if any) are fixed, and the back end's encoder
    can be traced (MLX ops or mx.fast kernels, not the emulator)."""
    mode = cache.mode
    if not (cache.encoded and mode.compiled and mode.backend in ("cuda", "metal") + CPU_BACKENDS):
        return False
    if cache.config.center and cache.key_mean is None:
        return False
    return _kernel_layout(cache)


def defers_tokens(cache) -> bool:
    """Whether a one-token update may be left for the attention call (`step.fused`, GPU
    kernel back ends only)."""
    return cache.mode.gpu_kernels and compiled_append_applies(cache)


def fused_runner(cache, queries: mx.array, mask=None) -> Optional[str]:
    """The runner with which the cache's pending token can be attended and stored in one
    step (`step.fused`), or None."""
    if not (cache.mode.gpu_kernels and step.fused_applies(cache, queries, mask)
            and _decode_kernel_ok(cache.key_codec, cache.value_codec, queries.shape[1] // cache.kv_heads)):
        return None
    return cache.mode.backend


def _kernel_layout(cache) -> bool:
    """Codes stored as turboquant_mse rows (`rows.py`), which the kernels read."""
    return cache.layout is not None and cache.rows is not None


@functools.lru_cache(maxsize=8)
def _off(value) -> bool:
    return (value or "").strip().lower() in ("off", "generic")


def attention(cache, queries: mx.array, scale: float, mask=None) -> Optional[mx.array]:
    """`decode_attention` or `prefill_attention`, whichever applies, else None
    (also with VELOXQUANT_KERNELS=off: everything then takes the generic path)."""
    if cache.mode.off:
        return None
    out = decode_attention(cache, queries, scale, mask)
    if out is None and cache.mode.prefill_dequant:
        # Opt-in: faster GPU prefill, but one layer's whole history exists in fp16
        # for the duration of the call, so peak memory can exceed an fp16 cache's.
        out = prefill_attention(cache, queries, scale, mask)
    return out


def prefill_attention(cache, queries: mx.array, scale: float, mask=None, *,
                      using: Optional[str] = None) -> Optional[mx.array]:
    """Prefill chunks on a GPU back end: the codes are decoded once per chunk into
    the codecs' domains (one kernel each, fp16) and attended with MLX's fused SDPA
    (q rotated in, output un-rotated once). Only where every history token is
    scored from its codes (no sinks, no fp16 window); None otherwise."""
    cache.flush()
    if queries.shape[2] < 2 or cache.encoded == 0:
        return None
    name = using or cache.mode.backend
    if name in CPU_BACKENDS:
        return None
    if cache.sinks or cache.window or cache.just_encoded is not None or cache.encoded != cache.offset:
        return None
    if mask is not None and not (isinstance(mask, str) and mask == "causal"):
        return None
    if not _kernel_layout(cache):
        return None
    kc, vc = cache.key_codec, cache.value_codec
    run = ops.runner(name)
    dtype = queries.dtype if queries.dtype in (mx.float16, mx.bfloat16, mx.float32) else mx.float32
    keys = ops.mse_dequant(run, cache.layout, "keys", cache.rows, cache.encoded, dtype)
    values = ops.mse_dequant(run, cache.layout, "values", cache.rows, cache.encoded, dtype)
    q = kc.to_domain(queries.astype(mx.float32)).astype(dtype)
    out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
    out = vc.from_domain(out.astype(mx.float32))
    if cache.value_mean is not None:
        B, n_heads, L, dv = out.shape
        kv_heads = cache.kv_heads
        out = out.reshape(B, kv_heads, n_heads // kv_heads, L, dv) + cache.value_mean.astype(mx.float32)[:, :, None]
        out = out.reshape(B, n_heads, L, dv)
    return out.astype(queries.dtype)


def decode_attention(cache, queries: mx.array, scale: float, mask=None, *, using: Optional[str] = None,
                     chunk: Optional[int] = None) -> Optional[mx.array]:
    """Attention of one new query per head over `cache`, reading only packed codes
    (plus the fp16 sinks / window), or None where the generic path must run.
    `using` overrides `backend()` ("cuda", "metal", "emulator", "native", "portable")."""
    cache.flush()
    if queries.shape[2] != 1 or cache.encoded == 0:
        return None
    if mask is not None and not (isinstance(mask, str) and mask == "causal"):
        return None  # an explicit mask array: the generic path applies it
    if not _kernel_layout(cache):
        return None
    kc, vc = cache.key_codec, cache.value_codec

    fp16 = None  # the sinks and the window: (keys, values)
    parts_k, parts_v = [], []
    if cache.sinks:
        parts_k.append(cache._centered(cache.sink_keys))
        parts_v.append(cache.sink_values)
    if cache.window:
        parts_k.append(cache._centered(cache.window_keys))
        parts_v.append(cache.window_values)
    if parts_k:
        keys = parts_k[0] if len(parts_k) == 1 else mx.concatenate([p.astype(mx.float32) for p in parts_k], axis=2)
        values = parts_v[0] if len(parts_v) == 1 else mx.concatenate(parts_v, axis=2)
        fp16 = (keys, values)
    value_mean = cache.value_mean

    def merged(o, ml):  # the CPU paths: with the fp16 partial, one compiled graph
        if fp16 is None:
            return portable.merge_partials(o, ml, vc, queries.shape, queries.dtype, value_mean=value_mean)
        return portable.merge_with_plain(o, ml, vc, queries, *fp16, scale, value_mean=value_mean)

    name = using or cache.mode.backend
    if name in ("cuda", "metal") and fp16 is None and chunk is None and cache.mode.compiled \
            and _decode_kernel_ok(kc, vc, queries.shape[1] // cache.kv_heads):
        return step.attend(name, cache, queries, scale)
    if name == "native" and kernel_supported(kc, vc):
        return merged(*native.mse_partials(queries, kc, vc, cache.rows, cache.encoded, scale))
    if name != "portable" and _decode_kernel_ok(kc, vc, queries.shape[1] // cache.kv_heads):
        run = ops.runner(name)
        plain = None if fp16 is None else portable.plain_partial(queries, *fp16, scale)
        o, ml, _ = ops.mse_partials(run, queries, kc, vc, cache.rows, cache.encoded, scale, chunk=chunk)
        return ops.merge(run, o, ml, vc, queries.shape, queries.dtype, plain=plain, value_mean=value_mean)
    key_fields = {k: v[..., : cache.encoded, :] for k, v in cache.key_fields.items()}
    value_fields = {k: v[..., : cache.encoded, :] for k, v in cache.value_fields.items()}
    return merged(*portable.mse_partials(queries, kc, vc, key_fields, value_fields, cache.encoded, scale))
