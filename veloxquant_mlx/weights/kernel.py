"""The LUT matmul kernel: y = x W^T straight from packed codes, for CUDA and Metal.

One body in the common dialect of `veloxquant_mlx.kernels.templates` (registered
there as ``lut_matmul`` when this module is imported), so that
`mx.fast.cuda_kernel`, `mx.fast.metal_kernel` and the C++ emulator all run the
same text with the same constants (`launch.run_mlx` / `launch.run_emulator`).

Work split (a GEMV for decode-sized batches): a block of NT threads has NT / 32
warps, one output row n each; lane l of a warp decodes codes l, l + 32, ... of row n
(code i sits at bits [i*BITS, (i+1)*BITS) of the row's words, so the 32 lanes of one
step read BITS consecutive words and 32 consecutive inputs: coalesced), looks each
code up in the 2^BITS-entry table in shared memory, times its group scale when groups
are on, multiplies it by the rotated input of up to MT batch rows, and a warp sum
gives y[m, n] (times the row scale when there are no groups).
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Optional

import mlx.core as mx

from ..kernels import launch, templates

KERNEL_NAME = "lut_matmul"
THREADS = 128
MAX_ROWS = 8  # batch rows the kernel takes; larger batches use the tiled matmul

LUT_MATMUL = r"""
  constexpr uint32_t MASK = (1u << BITS) - 1u;
  constexpr int NWARP = NT / 32;
  VQ_SHARED float lut_s[1 << BITS];
  if (vq_tid < (1 << BITS)) lut_s[vq_tid] = lut[vq_tid];
  VQ_SYNC();
  const int warp = vq_tid / 32;
  const int lane = vq_tid % 32;
  const int n = vq_bx * NWARP + warp;
  const int m0 = vq_by * MT;
  float acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = 0.0f;
  if (n < N) {
    const VQ_GLOBAL uint32_t* row = codes + (size_t)n * W;
    for (int i = lane; i < D; i += 32) {
      const int bit = i * BITS;
      const int wi = bit >> 5;
      const int sh = bit & 31;
      uint32_t c = row[wi] >> sh;
      if (sh + BITS > 32) c |= row[wi + 1] << (32 - sh);
      float wv = lut_s[c & MASK];
      if (NG > 1) wv *= VQ_F(scales[(size_t)n * NG + i / GS]);
      for (int m = 0; m < MT; ++m) {
        if (m0 + m < M) acc[m] += VQ_F(x[(size_t)(m0 + m) * D + i]) * wv;
      }
    }
  }
  for (int m = 0; m < MT; ++m) {
    const float s = vq_warp_sum(acc[m]);
    if (lane == 0 && n < N && m0 + m < M) {
      const float rs = (NG > 1) ? 1.0f : VQ_F(scales[n]);
      out[(size_t)(m0 + m) * N + n] = VQ_CAST(TO, s * rs);
    }
  }
"""

templates.KERNELS.setdefault(KERNEL_NAME, {
    "body": LUT_MATMUL,
    "inputs": ("x", "codes", "scales", "lut"),
    "outputs": ("out",),
})


@lru_cache(maxsize=1024)
def plan(rows: int, in_features: int, out_features: int, bits: int, groups: int, x_dtype: str,
         out_dtype: str, threads: int = THREADS) -> launch.Plan:
    """Constants and grid of one launch: `rows` batch rows of a (out, in) layer."""
    group_size = in_features // groups
    mt = min(rows, MAX_ROWS)
    nwarp = threads // 32
    template = [("D", in_features), ("N", out_features), ("BITS", bits), ("W", -(-in_features * bits // 32)),
                ("M", rows), ("MT", mt), ("NT", threads), ("NG", groups), ("GS", group_size),
                ("TX", x_dtype), ("TO", out_dtype)]
    grid = (-(-out_features // nwarp) * threads, -(-rows // mt), 1)
    return launch.Plan(KERNEL_NAME, template, grid, (threads, 1, 1), [(rows, out_features)], [out_dtype])


def _plan_for(rotated: mx.array, layer) -> launch.Plan:
    rows = rotated.size // layer.in_features
    name = launch.dtype_name(rotated.dtype)
    return plan(rows, layer.in_features, layer.out_features, layer.bits, layer.scales.shape[1], name, name)


def lut_matmul(rotated: mx.array, layer, dialect: str) -> mx.array:
    """(x R^T)(W R^T)^T through the kernel; dialect "cuda", "metal" or "emulator"."""
    lead = rotated.shape[:-1]
    x = rotated.reshape(-1, layer.in_features)
    p = _plan_for(rotated, layer)
    inputs = [x, layer.codes, layer.scales, layer.codebook]
    if dialect == "emulator":
        (out,) = launch.run_emulator(p, inputs)
        out = mx.array(out)
    else:
        (out,) = launch.run_mlx(dialect, p, inputs)
    return out.reshape(*lead, layer.out_features)


@lru_cache(maxsize=1)
def _gpu_dialect() -> Optional[str]:
    from ..settings import EngineSettings

    backend = EngineSettings.resolve().backend
    return backend if backend in ("cuda", "metal") else None


def dialect_for(rotated: mx.array) -> Optional[str]:
    """The kernel's dialect for this input, or None for the tiled matmul (CPU, big batches)."""
    dialect = _gpu_dialect()
    if dialect is None or rotated.size // rotated.shape[-1] > MAX_ROWS:
        return None
    if rotated.dtype not in (mx.float32, mx.float16, mx.bfloat16):
        return None
    return dialect


_PORTABLE = ("portable", "off", "generic", "0", "none", "emulator")


def native_cpu_for(rotated: mx.array, layer) -> bool:
    """Whether the C++ CPU LUT matmul (csrc/lut_matmul.cpp) takes this call: the CPU, at most
    MAX_ROWS batch rows, the module built, and VELOXQUANT_KERNELS not forcing the portable path."""
    if mx.default_device() != mx.cpu or rotated.size // rotated.shape[-1] > MAX_ROWS:
        return False
    if os.environ.get("VELOXQUANT_KERNELS", "").strip().lower() in _PORTABLE:
        return False
    if layer.scales.shape[1] > 1 and layer.group_size % 32:
        return False
    from ..kernels import native

    module = native.module()
    if module is None:
        return False
    if not hasattr(module, "lut_matmul"):
        _warn_stale_native()
        return False
    return True


@lru_cache(maxsize=1)
def _warn_stale_native() -> None:
    import warnings

    warnings.warn("veloxquant_mlx._native was built before csrc/lut_matmul.cpp existed: weight layers decode "
                  "their codes in tiles on the CPU (slow). Rebuild it with scripts/build_native.sh.",
                  RuntimeWarning, stacklevel=3)


def native_lut_matmul(rotated: mx.array, layer) -> mx.array:
    """x W^T from the packed codes on the CPU, no decoded weight matrix (up to MAX_ROWS rows)."""
    from ..kernels import native

    lead = rotated.shape[:-1]
    x = rotated.reshape(-1, layer.in_features).astype(mx.float32)
    y = native.module().lut_matmul(x, layer.codes, layer.scales.astype(mx.float16), layer.codebook, layer.bits)
    return y.astype(rotated.dtype).reshape(*lead, layer.out_features)
