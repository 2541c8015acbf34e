"""A layer's input rotation in one launch on CUDA and Metal: y = T(x * w), or T(rms_norm(x) * w).

T is `mx.hadamard_transform` (n = m * 2^k, m in 1, 12, 20, 28, scale 1/sqrt(n)) and w the
first stage's signs times the column scale (`StructuredRotation._signs`), so for a rotation
of one randomised Hadamard transform (`StructuredRotation._one_transform`: every input
dimension `mx.hadamard_transform` supports, such as Llama-3.1-8B's 4096 and 14336 = 28 * 512)
the kernel computes `rotation.apply(x, scale)`, which the MLX ops run as two launches (the
multiply, then the transform). With the norm (`NORM`), w is a `RotatingRMSNorm`'s folded
weight and the kernel computes `rotation.apply_signed(mx.fast.rms_norm(x, w, eps))`, also two
launches as ops. One body in the common dialect of `kernels/templates.py`, registered there
as ``rotate_input`` when this module is imported, run by `kernels/launch.py` like the LUT
matmul (`kernel.py`) and by the C++ emulator in the tests.

The transform as row vectors is T(x) = x (B kron H) / sqrt(2^k), with B = T applied to the
m x m identity (the m-point base matrix with its 1/sqrt(m); identity for m = 1) and H the
unnormalised 2^k-point Walsh-Hadamard matrix; with x as an (m, P = 2^k) matrix X that is
Y = B^T X H / sqrt(P). One block per batch row, NT = min(P, 1024) threads (P itself, at most 512,
when m > 1): thread t holds the CPT = P / NT columns t, t + NT, ... of X (at most 4; 1 when
m > 1), every row of them, in registers. The butterflies of
H that pair columns of one thread run in registers; the others run in shared memory, G rows of
X at a time (G * P <= 4096 floats, so the buffer fits Metal's 32 KB and CUDA's 48 KB of static
shared memory whatever the dimension); B^T then mixes each column inside its thread (an m x m
product from shared memory). With the norm, a block reduction gives sum(x^2) first.

For one batch row and a power-of-two dimension up to 4096, `rotating_matmul.py` folds the
rotation into the LUT matmul's own launch instead (every block rotates the row in shared
memory); that is the default route there. This kernel remains for the other dimensions
(14336 floats, 56 KB, exceed a block's static shared memory) and batches, opt-in.
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Callable, Optional

import mlx.core as mx

from ..kernels import launch, templates
from . import first_use
from ..rotations import hadamard_base

KERNEL_NAME = "rotate_input"
MAX_THREADS = 1024
# With m > 1 a thread holds its column's m values and mixes them (about 70 registers at m = 28):
# at most 512 threads then (a block has 64K registers) and one column per thread.
MAX_MIXED_THREADS = 512
BUFFER_FLOATS = 4096  # shared-memory rows of X per pass: G * P <= this (16 KB)

# Opt-in (VELOXQUANT_WEIGHT_FUSED_ROTATION=1): route decode-sized calls of the GPU back ends through the
# kernel instead of the MLX ops (a multiply and mx.hadamard_transform). Off by default because on the H200
# it was not faster than the ops (docs/methods.md). Read when a layer makes its route for an input shape.
FUSED_ROTATION = os.environ.get("VELOXQUANT_WEIGHT_FUSED_ROTATION", "0") == "1"

# Template constants: D (= MB * P), MB (Hadamard base m), P (2^k), NT (threads, min(P, 1024); P when MB > 1),
# CPT (= P / NT columns per thread), G (rows of X per shared-memory pass, a divisor of MB),
# NORM (rms-normalise first), TO (output dtype; products are rounded to it as MLX's ops round them).
# Inputs: x (rows, D), w (D), base (MB * MB) f32 row-major B, params f32 [eps]. Output: out (rows, D) TO.
# Grid: (NT, rows) threads in blocks of NT.
ROTATE_INPUT = r"""
  VQ_SHARED float vq_base[MB * MB];
  VQ_SHARED float vq_buf[G * P];
  VQ_SHARED float vq_red[NT];
  const int t = vq_tid;
  const size_t row = (size_t)vq_by * D;
  for (int i = t; i < MB * MB; i += NT) vq_base[i] = base[i];
  float v[MB][CPT];
  float ss = 0.0f;
  VQ_UNROLL
  for (int a = 0; a < MB; ++a) {
    VQ_UNROLL
    for (int j = 0; j < CPT; ++j) {
      v[a][j] = VQ_F(x[row + a * P + j * NT + t]);
      ss += v[a][j] * v[a][j];
    }
  }
  float inv = 1.0f;
  if (NORM) {
    vq_red[t] = ss;
    VQ_SYNC();
    for (int s = NT / 2; s > 0; s >>= 1) {
      if (t < s) vq_red[t] += vq_red[t + s];
      VQ_SYNC();
    }
    inv = 1.0f / VQ_SQRT(vq_red[0] / (float)D + params[0]);
  }
  VQ_UNROLL
  for (int a = 0; a < MB; ++a) {
    VQ_UNROLL
    for (int j = 0; j < CPT; ++j) {
      const float u = NORM ? VQ_F(VQ_CAST(TO, v[a][j] * inv)) : v[a][j];
      v[a][j] = VQ_F(VQ_CAST(TO, u * VQ_F(w[a * P + j * NT + t])));
    }
  }
  // butterflies of H between columns of one thread (distance >= NT)
  VQ_UNROLL
  for (int k = 1; k < CPT; k <<= 1) {
    VQ_UNROLL
    for (int a = 0; a < MB; ++a) {
      VQ_UNROLL
      for (int j = 0; j < CPT; ++j) {
        if ((j & k) == 0) {
          const float p = v[a][j];
          const float r = v[a][j + k];
          v[a][j] = p + r;
          v[a][j + k] = p - r;
        }
      }
    }
  }
  // the others (distance < NT) in shared memory, G rows at a time
  for (int a0 = 0; a0 < MB; a0 += G) {
    VQ_UNROLL
    for (int a = 0; a < MB; ++a) {
      if (a >= a0 && a < a0 + G) {
        VQ_UNROLL
        for (int j = 0; j < CPT; ++j) vq_buf[(a - a0) * P + j * NT + t] = v[a][j];
      }
    }
    VQ_SYNC();
    for (int h = 1; h < NT; h <<= 1) {
      for (int q = t; q < G * P / 2; q += NT) {
        const int i = ((q & ~(h - 1)) << 1) | (q & (h - 1));
        const float p = vq_buf[i];
        const float r = vq_buf[i + h];
        vq_buf[i] = p + r;
        vq_buf[i + h] = p - r;
      }
      VQ_SYNC();
    }
    VQ_UNROLL
    for (int a = 0; a < MB; ++a) {
      if (a >= a0 && a < a0 + G) {
        VQ_UNROLL
        for (int j = 0; j < CPT; ++j) v[a][j] = vq_buf[(a - a0) * P + j * NT + t];
      }
    }
    VQ_SYNC();
  }
  // B^T across the rows of each column
  if (MB > 1) {
    VQ_UNROLL
    for (int j = 0; j < CPT; ++j) {
      float col[MB];
      VQ_UNROLL
      for (int a = 0; a < MB; ++a) col[a] = v[a][j];
      VQ_UNROLL
      for (int b = 0; b < MB; ++b) {
        float s = 0.0f;
        VQ_UNROLL
        for (int a = 0; a < MB; ++a) s += vq_base[a * MB + b] * col[a];
        v[b][j] = s;
      }
    }
  }
  const float scale = 1.0f / VQ_SQRT((float)P);
  VQ_UNROLL
  for (int a = 0; a < MB; ++a) {
    VQ_UNROLL
    for (int j = 0; j < CPT; ++j) out[row + a * P + j * NT + t] = VQ_CAST(TO, v[a][j] * scale);
  }
"""

templates.KERNELS.setdefault(KERNEL_NAME, {
    "body": ROTATE_INPUT,
    "inputs": ("x", "w", "base", "params"),
    "outputs": ("out",),
})


def supports(dim: int, threads: int = MAX_THREADS, buffer: int = BUFFER_FLOATS) -> bool:
    """Whether the kernel takes this dimension: a Hadamard size m * 2^k whose 2^k fits the
    shared buffer, with at most 4 columns per thread for m = 1 (up to 4096) and one for m > 1
    (2^k up to 512: 14336 = 28 * 512, 6144, 10240). Others keep the MLX ops."""
    m = hadamard_base(dim)
    if m is None:
        return False
    p = dim // m
    return p <= buffer and (p <= 4 * threads if m == 1 else p <= min(threads, MAX_MIXED_THREADS))


@lru_cache(maxsize=256)
def plan(rows: int, dim: int, out_dtype: str, norm: bool, threads: int = MAX_THREADS,
         buffer: int = BUFFER_FLOATS) -> launch.Plan:
    """Constants and grid of one launch over `rows` rows of `dim` (smaller `threads` and
    `buffer` exercise the multi-column and multi-pass paths at small sizes in the tests)."""
    if not supports(dim, threads, buffer):
        raise ValueError(f"{KERNEL_NAME} does not take dim {dim} with {threads} threads and a {buffer}-float "
                         "buffer (`supports`)")
    m = hadamard_base(dim)
    p = dim // m
    nt = min(p, threads)
    g = max(d for d in range(1, m + 1) if m % d == 0 and d * p <= buffer)
    template = [("D", dim), ("MB", m), ("P", p), ("NT", nt), ("CPT", p // nt), ("G", g), ("NORM", bool(norm)),
                ("TO", out_dtype)]
    return launch.Plan(KERNEL_NAME, template, (nt, rows, 1), (nt, 1, 1), [(rows, dim)], [out_dtype])


@lru_cache(maxsize=None)
def base_matrix(dim: int) -> mx.array:
    """B of `dim` (module doc): `mx.hadamard_transform` of the m x m identity, float32."""
    m = hadamard_base(dim)
    # On the CPU stream: MLX's CUDA hadamard_transform fails to compile for m alone (N = 1, run38).
    return mx.ones((1, 1)) if m == 1 else mx.hadamard_transform(mx.eye(m), stream=mx.cpu).astype(mx.float32)


@lru_cache(maxsize=None)
def _params(eps: float) -> mx.array:
    return mx.array([eps], dtype=mx.float32)


def output_dtype(x_dtype, weight: mx.array, norm: bool):
    """The dtype the MLX ops give: x * w (w in x's dtype), or mx.fast.rms_norm's promotion."""
    probe = mx.zeros((1, weight.shape[0]), dtype=x_dtype)
    return (mx.fast.rms_norm(probe, weight, 1e-5) if norm else probe * weight).dtype


def rotate(x: mx.array, weight: mx.array, dialect: str, eps: Optional[float] = None,
           threads: int = MAX_THREADS, buffer: int = BUFFER_FLOATS) -> mx.array:
    """T(x * weight), or T(rms_norm(x, weight, eps)) when `eps` is given, through the kernel;
    dialect "cuda", "metal" or "emulator" (tests, selftest)."""
    dim = x.shape[-1]
    norm = eps is not None
    out_dtype = output_dtype(x.dtype, weight, norm)
    p = plan(x.size // dim, dim, launch.dtype_name(out_dtype), norm, threads, buffer)
    inputs = [x.reshape(-1, dim), weight, base_matrix(dim), _params(0.0 if eps is None else float(eps))]
    if dialect == "emulator":
        (out,) = launch.run_emulator(p, inputs)
        out = mx.array(out)
    else:
        (out,) = launch.run_mlx(dialect, p, inputs)
    return out.reshape(x.shape)


def route(x: mx.array, rotation, weight: mx.array, eps: Optional[float] = None
          ) -> Optional[Callable[[mx.array, mx.array], mx.array]]:
    """(x, weight) -> T(x * weight) (or with the norm) for inputs of x's shape and dtype, as
    one kernel call with its launch arguments resolved here; None where the MLX ops stay the
    path: no GPU back end or a prefill-sized batch (`kernel.dialect_for`), FUSED_ROTATION off,
    a rotation that is not one Hadamard transform or a dimension the kernel does not take,
    or a kernel that failed its first-use check (which warned)."""
    from . import kernel

    dialect = kernel.dialect_for(x)
    dim = x.shape[-1]
    if dialect is None or not FUSED_ROTATION or not rotation._one_transform or not supports(dim):
        return None
    norm = eps is not None
    out_dtype = output_dtype(x.dtype, weight, norm)
    if not usable(dialect, dim, norm, launch.dtype_name(out_dtype)):
        return None
    p = plan(x.size // dim, dim, launch.dtype_name(out_dtype), norm)
    run = launch._mlx_kernel(dialect, KERNEL_NAME)
    template = launch.mlx_template(p)
    base, params = base_matrix(dim), _params(0.0 if eps is None else float(eps))
    grid, threads, shapes, dtypes = p.grid, p.threadgroup, [tuple(x.shape)], [out_dtype]

    def rotated(x: mx.array, weight: mx.array) -> mx.array:
        return run(inputs=[x, weight, base, params], template=template, grid=grid, threadgroup=threads,
                   output_shapes=shapes, output_dtypes=dtypes)[0]
    return kernel.compiled(rotated)


# ---- checks -------------------------------------------------------------------

# (dim, rows, norm, dtype, threads, buffer): small shapes reaching every path of the kernel:
# several columns per thread (64 with 16 threads, as 4096 with 1024), several shared-memory
# passes with the base mix (28 * 16 with a 64-float buffer, as 14336 = 28 * 512), m = 12 and 20.
CHECK_CASES = (
    (64, 2, False, "float32", 16, 64),
    (28 * 16, 3, True, "float32", 16, 64),
    (12 * 8, 1, False, "float16", MAX_THREADS, BUFFER_FLOATS),
    (20 * 4, 2, True, "float16", MAX_THREADS, BUFFER_FLOATS),
)
TOLERANCES = {"float32": 1e-5, "float16": 4e-3, "bfloat16": 2e-2}


def reference(x: mx.array, weight: mx.array, eps: Optional[float] = None) -> mx.array:
    """The MLX ops the kernel replaces (`StructuredRotation.apply` / `RotatingRMSNorm`)."""
    return mx.hadamard_transform(mx.fast.rms_norm(x, weight, eps) if eps is not None else x * weight)


def check_case(dialect: str, dim: int, rows: int, norm: bool, dtype: str, threads: int = MAX_THREADS,
               buffer: int = BUFFER_FLOATS, seed: int = 0) -> dict:
    """The kernel against the MLX ops on seeded data: max |out - ref| / max |ref|."""
    import numpy as np

    rng = np.random.default_rng([seed, dim, rows])
    x = mx.array(rng.standard_normal((rows, dim)).astype(np.float32)).astype(getattr(mx, dtype))
    signs = rng.choice([-1.0, 1.0], dim) * (rng.uniform(0.5, 2.0, dim) if norm else np.ones(dim))
    weight = mx.array(signs.astype(np.float32)).astype(getattr(mx, dtype))
    eps = 1e-5 if norm else None
    got = rotate(x, weight, dialect, eps, threads, buffer).astype(mx.float32)
    ref = reference(x, weight, eps).astype(mx.float32)
    error = float(mx.max(mx.abs(got - ref)) / mx.max(mx.abs(ref)))
    tolerance = TOLERANCES[dtype]
    return {"kernel": KERNEL_NAME, "dim": dim, "rows": rows, "norm": norm, "dtype": dtype, "threads": threads,
            "buffer": buffer, "vs_ops": error, "tolerance": tolerance, "ok": error <= tolerance}


_VERDICTS = {}  # (dialect,) for CHECK_CASES, (dialect, dim, norm, dtype) for a route's own plan -> passed


def usable(dialect: str, dim: Optional[int] = None, norm: bool = False, out_dtype: str = "float32") -> bool:
    """First-use check of the kernel on `dialect`, once per process: CHECK_CASES against the
    MLX ops, then (with `dim`) the very template a route is about to keep (its dimension, norm
    and output dtype; two rows). A failure warns (the kernel, the case, the error) and the
    layers keep the ops."""
    keys = [(dialect,)] + ([(dialect, dim, bool(norm), out_dtype)] if dim is not None else [])
    for key in keys:
        if key not in _VERDICTS:
            cases = CHECK_CASES if len(key) == 1 else [(dim, 2, bool(norm), out_dtype)]
            _VERDICTS[key] = _check(dialect, cases)
        if not _VERDICTS[key]:
            return False
    return True


def checked(dialect: str) -> Optional[bool]:
    """Whether every first-use check run on `dialect` passed (None: none ran)."""
    return first_use.checked(_VERDICTS, dialect)


def _check(dialect: str, cases) -> bool:
    return first_use.run(dialect, cases, check_case, lambda c: f"dim {c[0]}, norm {c[2]}, {c[3]}", KERNEL_NAME,
                         "weights/rotation_kernel.py", "weight layers rotate their inputs with MLX ops instead "
                         "(a multiply or mx.fast.rms_norm, then mx.hadamard_transform).")


def reset() -> None:
    """Forget the verdicts (tests)."""
    _VERDICTS.clear()
