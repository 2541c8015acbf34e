"""The LUT matmul kernel: y = x W^T straight from packed codes, for CUDA and Metal.

One body in the common dialect of `veloxquant_mlx.kernels.templates` (registered
there as ``lut_matmul`` when this module is imported), so that
`mx.fast.cuda_kernel`, `mx.fast.metal_kernel` and the C++ emulator all run the
same text with the same constants (`launch.run_mlx` / `launch.run_emulator`).

Work split (a GEMV for decode-sized batches): a block of NT threads has NT / 32
warps, RPW output rows each. A row's codes are cut into chunks of CW words (`plan`'s
layout: by default the fewest whole words, 8 codes in one word at 4 bits, 32 in three at
3 bits; or four words in one 16-byte load). Lane l of a warp takes chunks l, l + 32, ... of its
RPW rows: it loads them (RPW loads in flight) and decodes the codes with shifts the
compiler knows (the loop is unrolled), looks each code up in the 2^BITS-entry table in
shared memory, times its group scale when groups are on, and multiplies it by the rotated
input of up to MT batch rows, read once for the RPW rows. A warp sum gives y[m, n] (times
the row scale when there are no groups).
Decoding a word at a time, rather than one code per lane from a word it shares with
other lanes, cuts the instructions per weight: the kernel is instruction-bound.
"""

from __future__ import annotations

import math
import os
from functools import lru_cache
from typing import Callable, Optional, Tuple

import mlx.core as mx

from ..kernels import launch, native, templates
from . import first_use

KERNEL_NAME = "lut_matmul"
MAX_ROWS = 8  # batch rows the kernel takes; larger ones: tiled matmul
THREADS = 128
# Output rows per warp of the layers' launches (None: `plan`'s choice, one row with one-word
# chunks). A benchmark setting, read when a layer plans a new input shape.
ROWS_PER_WARP: Optional[int] = None

# Chunk q (CW words) of each of a warp's RPW rows n0.. into words[rr] (rows past N read row N - 1;
# words past a row's end read 0). Shared with `rotating_matmul.py`.
LOAD_ROW_CHUNKS = r"""    uint32_t words[RPW][CW];
    VQ_UNROLL
    for (int rr = 0; rr < RPW; ++rr) {
      const VQ_GLOBAL uint32_t* src = codes + (size_t)VQ_MINI(n0 + rr, N - 1) * W + q * CW;
      if (VEC) {
        VQ_LOAD_U4(words[rr], src);
      } else {
        VQ_UNROLL
        for (int k = 0; k < CW; ++k) words[rr][k] = (q * CW + k < W) ? src[k] : 0u;
      }
    }
"""

LUT_MATMUL = r"""
  constexpr uint32_t MASK = (1u << BITS) - 1u;
  constexpr int NWARP = NT / 32;
  VQ_SHARED float lut_s[1 << BITS];
  if (vq_tid < (1 << BITS)) lut_s[vq_tid] = lut[vq_tid];
  VQ_SYNC();
  const int warp = vq_tid / 32;
  const int lane = vq_tid % 32;
  // A warp's RPW output rows together: each lane loads its chunk of every row (RPW loads in
  // flight) and reads each input element once for all of them. Rows past N load row N - 1
  // and are not stored.
  const int n0 = (vq_bx * NWARP + warp) * RPW;
  const int m0 = vq_by * MT;
  float acc[MT * RPW];
  for (int i = 0; i < MT * RPW; ++i) acc[i] = 0.0f;
  for (int q = lane; q < NCHUNK; q += 32) {
""" + LOAD_ROW_CHUNKS + r"""    const int e0 = q * C;
    VQ_UNROLL
    for (int j = 0; j < C; ++j) {
      const int bit = j * BITS;
      if (e0 + j < D) {
        float wv[RPW];
        VQ_UNROLL
        for (int rr = 0; rr < RPW; ++rr) {
          uint32_t c = words[rr][bit >> 5] >> (bit & 31);
          if ((bit & 31) + BITS > 32) c |= words[rr][(bit >> 5) + 1] << (32 - (bit & 31));
          wv[rr] = lut_s[c & MASK];
          if (NG > 1) wv[rr] *= VQ_F(scales[(size_t)VQ_MINI(n0 + rr, N - 1) * NG + (e0 + j) / GS]);
        }
        for (int m = 0; m < MT; ++m) {
          if (m0 + m < M) {
            const float xv = VQ_F(x[(size_t)(m0 + m) * D + e0 + j]);
            VQ_UNROLL
            for (int rr = 0; rr < RPW; ++rr) acc[m * RPW + rr] += xv * wv[rr];
          }
        }
      }
    }
  }
  for (int m = 0; m < MT; ++m) {
    VQ_UNROLL
    for (int rr = 0; rr < RPW; ++rr) {
      const float s = vq_warp_sum(acc[m * RPW + rr]);
      const int n = n0 + rr;
      if (lane == 0 && n < N && m0 + m < M) {
        const float rs = (NG > 1) ? 1.0f : VQ_F(scales[n]);
        out[(size_t)(m0 + m) * N + n] = VQ_CAST(TO, s * rs);
      }
    }
  }
"""

templates.KERNELS.setdefault(KERNEL_NAME, {
    "body": LUT_MATMUL,
    "inputs": ("x", "codes", "scales", "lut"),
    "outputs": ("out",),
})


TARGET_BLOCKS = 264  # two per SM of an H200: more rows per warp only while a launch keeps this many


def rows_per_warp(out_features: int, warps: int, batch_rows: int = 1) -> int:
    """Output rows per warp: a power of two up to 4 (one at more than 2 batch rows, whose sums
    already fill the registers) that keeps TARGET_BLOCKS blocks."""
    rpw = 1
    while rpw < (4 if batch_rows <= 2 else 1) and out_features // (warps * rpw * 2) >= TARGET_BLOCKS:
        rpw *= 2
    return rpw


def chunk_layout(in_features: int, bits: int, layout: str):
    """(codes, words, VEC) of a lane's chunk: "word", the fewest whole words (one at 4 bits); "vec",
    four words in one 16-byte load where they hold whole codes and rows start 16-byte aligned, else
    the 32 codes of `bits` words."""
    if layout == "word":
        chunk = 32 // math.gcd(32, bits)
        return chunk, chunk * bits // 32, False
    if layout == "vec":
        words = 4 if 128 % bits == 0 else bits
        return 32 * words // bits, words, words == 4 and -(-in_features * bits // 32) % 4 == 0
    raise ValueError(f"layout must be 'word' or 'vec', got {layout!r}")


@lru_cache(maxsize=1024)
def plan(rows: int, in_features: int, out_features: int, bits: int, groups: int, x_dtype: str,
         out_dtype: str, threads: int = THREADS, layout: str = "word", rpw: Optional[int] = None) -> launch.Plan:
    """Constants and grid of one launch: `rows` batch rows of a (out, in) layer. `layout`: a
    lane's chunk is the fewest whole words ("word": one word at 4 bits; the lanes of a warp then
    read neighbouring input elements, which this kernel reads from global memory) or four words
    ("vec": one 16-byte load where rows start 16-byte aligned, else the 32 codes of `bits` words).
    `rpw`: output rows per warp (None: 1 for "word", `rows_per_warp` for "vec"). Two rows per warp
    on down_proj alone measured faster (39.2 against 58.0 us, weights-lut-variants) but the
    whole-model decode with it 0.59x affine against 0.69x with one row (docs/methods.md), so "word"
    keeps one row until that is repeated."""
    group_size = in_features // groups
    mt = min(rows, MAX_ROWS)
    nwarp = threads // 32
    chunk, chunk_words, vec = chunk_layout(in_features, bits, layout)
    if rpw is None:
        rpw = 1 if layout == "word" else rows_per_warp(out_features, nwarp, mt)
    template = [("D", in_features), ("N", out_features), ("BITS", bits), ("W", -(-in_features * bits // 32)),
                ("C", chunk), ("CW", chunk_words), ("VEC", vec),
                ("NCHUNK", -(-in_features // chunk)), ("RPW", rpw),
                ("M", rows), ("MT", mt), ("NT", threads), ("NG", groups), ("GS", group_size),
                ("TX", x_dtype), ("TO", out_dtype)]
    grid = (-(-out_features // (nwarp * rpw)) * threads, -(-rows // mt), 1)
    return launch.Plan(KERNEL_NAME, template, grid, (threads, 1, 1), [(rows, out_features)], [out_dtype])


def _plan_for(rotated: mx.array, layer) -> launch.Plan:
    # Kept on the layer per (rows, dtype): a decode step launches every layer once, and
    # the plan's lookup would otherwise cost host time on each.
    plans = layer.__dict__.setdefault("_plans", {})
    rows = rotated.size // layer.in_features
    found = plans.get((rows, rotated.dtype))
    if found is None:
        name = launch.dtype_name(rotated.dtype)
        found = plan(rows, layer.in_features, layer.out_features, layer.bits, layer.scales.shape[1], name, name,
                     rpw=ROWS_PER_WARP)
        plans[(rows, rotated.dtype)] = found
    return found


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


# Wrap each kept decode route in mx.compile: a compiled call replays the traced graph instead of
# building it again, which on a GPU skips MLX's per-call writing of the kernel's source text and
# template arguments (host time limits decode there) and on the CPU fuses the rotation's ops;
# both measured faster (docs/methods.md). VELOXQUANT_WEIGHT_COMPILE=0 turns it off. Read when a
# layer makes its route for a new input shape.
COMPILE_ROUTES = os.environ.get("VELOXQUANT_WEIGHT_COMPILE", "1") == "1"


def compiled(function: Callable) -> Callable:
    """`function` under mx.compile when COMPILE_ROUTES is on (decided when a route is made).
    Only for routes kept per input shape: a compiled function traces again for every new one."""
    return mx.compile(function) if COMPILE_ROUTES else function


# The LUT matmul's first-use check: first_use.py's small cases (a ragged
# and an odd dimension, grouped scales) in the input's dtype, against the tiled matmul (MLX ops, on
# the CPU).
CHECK_CASES = ("3bit-odd-dim-m3", "2bit-groups-m8", "3bit-ragged-m5")
# Metal only, as the engine's per-format checks (`kernels/check.FORMAT_CHECKED_BACKENDS`): no Metal kernel
# has run on a Mac, and on CUDA the weights' self-test runs these cases on every device.
CHECKED_DIALECTS = ("metal",)
_VERDICTS = {}  # (dialect, dtype) -> passed


def usable(dialect: str, dtype: str) -> bool:
    """Whether the LUT matmul may run on `dialect` for inputs of `dtype`: checked once per process
    (the engine's kernels have their own check, `kernels/check.py`). A failure warns, naming the
    case and the error, and weight layers take the tiled matmul (MLX ops)."""
    if dialect not in CHECKED_DIALECTS:
        return True
    key = (dialect, dtype)
    if key not in _VERDICTS:
        from dataclasses import replace

        cases = [(replace(case, dtype=dtype),) for case in first_use.CASES if case.name in CHECK_CASES]
        _VERDICTS[key] = first_use.run(dialect, cases, _check_case, lambda case: case[0].name, KERNEL_NAME,
                                       "weights/kernel.py", "weight layers decode their codes in tiles and "
                                       "multiply with MLX ops instead.")
    return _VERDICTS[key]


def _check_case(dialect: str, case) -> dict:
    layer, _, x_rot = first_use.case_arrays(case)
    got = lut_matmul(x_rot, layer, dialect).astype(mx.float32)
    with mx.stream(mx.cpu):  # in full float32: MLX's GPU matmuls run at TF32 by default
        ref = layer.tiled_matmul(x_rot).astype(mx.float32)
        mx.eval(ref)
    error = float(mx.max(mx.abs(got - ref)) / mx.max(mx.abs(ref)))
    tolerance = first_use.TOLERANCES[case.dtype]
    return {"vs_ops": error, "tolerance": tolerance, "ok": error <= tolerance}


def reset() -> None:
    """Forget the verdicts (tests)."""
    _VERDICTS.clear()


def launch_function(layer, rotated: mx.array) -> Optional[Tuple[Callable, bool]]:
    """(f(x, codes, scales, codebook) -> the layer's matmul of x, whether it is a GPU launch) for
    inputs of this shape and dtype, with the launch arguments resolved here, once: the GPU
    kernel as one `mx.fast.*_kernel` call with no reshape (it reads x as rows of in_features and
    writes the output in its final shape), or the C++ CPU kernel. None where the matmul does not
    take the arrays this way (the emulator, the CPU without the kernel)."""
    dialect = dialect_for(rotated)
    if dialect in ("cuda", "metal") and usable(dialect, launch.dtype_name(rotated.dtype)):
        p = _plan_for(rotated, layer)
        run = launch._mlx_kernel(dialect, p.kernel)
        template = launch.mlx_template(p)
        out_shapes = [tuple(rotated.shape[:-1]) + (layer.out_features,)]
        out_dtypes = [launch._DTYPES[d] for d in p.output_dtypes]
        grid, threads = p.grid, p.threadgroup

        def matmul(x, codes, scales, codebook):
            return run(inputs=[x, codes, scales, codebook], template=template, grid=grid, threadgroup=threads,
                       output_shapes=out_shapes, output_dtypes=out_dtypes)[0]
        return matmul, True
    if dialect is None and native_cpu_for(rotated, layer) and layer.scales.dtype == mx.float16:
        lut = native.module().lut_matmul
        bits, rows_in = layer.bits, (-1, layer.in_features)
        out_shape = tuple(rotated.shape[:-1]) + (layer.out_features,)

        def matmul(x, codes, scales, codebook):
            y = lut(x.reshape(rows_in).astype(mx.float32), codes, scales, codebook, bits)
            return y.astype(x.dtype).reshape(out_shape)
        return matmul, False
    return None


def route(layer, rotated: mx.array) -> Callable[[mx.array], mx.array]:
    """The matmul `layer` runs for inputs of this shape and dtype (kept by the layer): the
    `launch_function` (compiled where `compiled` says so), the emulator's launch, the C++ CPU
    kernel on non-fp16 scales, or the tiled matmul."""
    found = launch_function(layer, rotated)
    if found is None:
        dialect = dialect_for(rotated)
        if dialect is not None and usable(dialect, launch.dtype_name(rotated.dtype)):
            return lambda x: lut_matmul(x, layer, dialect)
        if native_cpu_for(rotated, layer):
            return lambda x: native_lut_matmul(x, layer)
        return layer.tiled_matmul
    matmul = compiled(found[0])
    # the arrays are read from the layer at each call (they are its parameters; the item
    # lookup of the Module's dict is much cheaper than its attribute lookup)
    return lambda x: matmul(x, layer["codes"], layer["scales"], layer["codebook"])


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


def native_cpu_for(rotated: mx.array, layer) -> bool:
    """Whether the C++ CPU LUT matmul (csrc/lut_matmul.cpp) takes this call: the CPU, at most
    MAX_ROWS batch rows, grouped scales in whole 32-code steps, and the engine's CPU back end
    "native" (the extension built; VELOXQUANT_KERNELS=portable turns it off)."""
    if rotated.size // rotated.shape[-1] > MAX_ROWS or not _native_cpu():
        return False
    return layer.scales.shape[1] == 1 or layer.group_size % 32 == 0


@lru_cache(maxsize=1)
def _native_cpu() -> bool:
    """Resolved once per process, as the engine's settings are."""
    from ..settings import EngineSettings

    if mx.default_device() != mx.cpu or EngineSettings.resolve().backend != "native":
        return False
    if not hasattr(native.module(), "lut_matmul"):
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
    lead = rotated.shape[:-1]
    x = rotated.reshape(-1, layer.in_features).astype(mx.float32)
    y = native.module().lut_matmul(x, layer.codes, layer.scales.astype(mx.float16), layer.codebook, layer.bits)
    return y.astype(rotated.dtype).reshape(*lead, layer.out_features)
