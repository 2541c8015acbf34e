"""The LUT matmul with the layer's input rotation in its prologue: y = T(x * w) (W R^T)^T in one launch.

A decode step through `QuantizedLinear` otherwise runs two launches per layer: the input
rotation (a multiply and `mx.hadamard_transform`, or `rotation_kernel`'s one launch) and the
LUT matmul (`kernel.py`). The rotation of one 4096-wide row is latency-bound: one small block
waits out a dozen barriers while the GPU idles, and a Llama block pays it for six of its seven
layers. Here every block of the matmul rotates the row itself in shared memory and then
multiplies its output rows against the codes, so the layer is one launch. The transform is
repeated per block, so a block takes several output rows per warp (`RPW`,
`kernel.rows_per_warp`) to keep the repeats few.

Scope: one batch row (decode at batch 1), a rotation of one randomised Hadamard transform of a
power-of-two dimension D from 64 to 4096 (`StructuredRotation._one_transform`; Llama-3.1-8B's
4096-wide inputs q/k/v, o, gate/up; down_proj's 14336 = 28 * 512 keeps the two launches).

The transform (T(v) = v H / sqrt(D), H the Sylvester Walsh-Hadamard matrix, what
`mx.hadamard_transform` computes for a power of two): each of NT threads holds E = D / NT
elements in registers. The butterflies pair indices that differ in one bit of the K = log2(D)
index bits; a pass gives a thread the E elements whose indices differ only in LB = log2(E)
consecutive bits (`BASE` upwards) and runs those butterflies in registers, then the elements
move through shared memory to the next pass's layout, so the K stages take ceil(K / LB)
passes and one barrier pair between passes, instead of K barriers. Shared memory is padded by
one float per 32 (index i at i + i / 32), which keeps the passes' accesses and the matmul's
strided reads of the rotated row off a single bank. Products are rounded where the MLX ops
round them: x * w in x's dtype, the transform in float32, its output in x's dtype.
"""

from __future__ import annotations

import math
import os
from functools import lru_cache
from typing import Callable, List, Optional, Tuple

import mlx.core as mx

from ..kernels import launch, templates
from . import first_use
from . import kernel
from .kernel import LOAD_ROW_CHUNKS

KERNEL_NAME = "lut_matmul_rotating"
THREADS = 256
MIN_DIM, MAX_DIM = 64, 4096  # E >= 2 with 32 threads; D + D / 32 floats within Metal's 32 KB

# Opt-out (VELOXQUANT_WEIGHT_ROTATING_MATMUL=0): decode calls at batch 1 take the two launches
# (rotation, then `kernel.py`'s LUT matmul) instead. Read when a layer makes its route.
ROTATING_MATMUL = os.environ.get("VELOXQUANT_WEIGHT_ROTATING_MATMUL", "1") == "1"
# Opt-out (VELOXQUANT_WEIGHT_SIBLING_LAUNCH=0): linked sibling layers (`siblings.py`) launch one
# kernel each instead of one for the group. Read when a group makes its launch.
SIBLING_LAUNCH = os.environ.get("VELOXQUANT_WEIGHT_SIBLING_LAUNCH", "1") == "1"

# Template constants: D, K = log2 D, NT threads, E = D / NT, LB = log2 E, PASSES = ceil(K / LB),
# N (output rows), BITS, W (words per row), C / CW (codes / words of a lane's chunk), VEC (CW = 4
# words read as one 16-byte load), NCHUNK,
# NG / GS (scale groups / their size), RPW (output rows per warp), TX (x and w), TO (output).
# Inputs: x (1, D) TX, w (D) TX (the first stage's signs times the column scale), codes (N, W) u32,
# scales (N, NG), lut (2^BITS) f32. Output: out (1, N) TO. Grid: ceil(N / (NT / 32 * RPW)) blocks of NT.
# The transform of x * w into xs (shared memory, padded), in every block.
_ROTATE_INPUT = r"""
  constexpr uint32_t MASK = (1u << BITS) - 1u;
  constexpr int NWARP = NT / 32;
  VQ_SHARED float lut_s[1 << BITS];
  VQ_SHARED float xs[D + D / 32];
  const int t = vq_tid;
  if (t < (1 << BITS)) lut_s[t] = lut[t];
  float v[E];
  // pass 0's layout (BASE 0): thread t holds the elements t * E + r
  VQ_UNROLL
  for (int r = 0; r < E; ++r) v[r] = VQ_F(VQ_CAST(TX, VQ_F(x[t * E + r]) * VQ_F(w[t * E + r])));
  VQ_UNROLL
  for (int p = 0; p < PASSES; ++p) {
    // the last pass may overlap the one before it; it then skips the bits already done
    const int base = (p + 1) * LB <= K ? p * LB : K - LB;
    const int done = p * LB - base;
    const int low = t & ((1 << base) - 1);
    const int high = (t >> base) << (base + LB);
    if (p > 0) {
      VQ_UNROLL
      for (int r = 0; r < E; ++r) {
        const int i = low | (r << base) | high;
        v[r] = xs[i + (i >> 5)];
      }
    }
    VQ_UNROLL
    for (int h = 1 << done; h < E; h <<= 1) {
      VQ_UNROLL
      for (int r = 0; r < E; ++r) {
        if ((r & h) == 0) {
          const float a = v[r];
          const float b = v[r + h];
          v[r] = a + b;
          v[r + h] = a - b;
        }
      }
    }
    const bool last = p + 1 == PASSES;
    const float scale = last ? 1.0f / VQ_SQRT((float)D) : 1.0f;
    VQ_SYNC();
    VQ_UNROLL
    for (int r = 0; r < E; ++r) {
      const int i = low | (r << base) | high;
      xs[i + (i >> 5)] = last ? VQ_F(VQ_CAST(TX, v[r] * scale)) : v[r];
    }
    VQ_SYNC();
  }
"""

# The RPW output rows of each warp against the rotated row; block bx of the layer (codes,
# scales, out, N).
_MULTIPLY = r"""  // The RPW rows of a warp together: each lane loads its chunk of every row (RPW loads in
  // flight), then reads each rotated input element once for all of them. Rows past N load row
  // N - 1 (the same trips and warp sums in every warp) and are not stored.
  const int warp = t / 32;
  const int lane = t % 32;
  const int n0 = (bx * NWARP + warp) * RPW;
  float acc[RPW];
  VQ_UNROLL
  for (int rr = 0; rr < RPW; ++rr) acc[rr] = 0.0f;
  for (int q = lane; q < NCHUNK; q += 32) {
""" + LOAD_ROW_CHUNKS + r"""    VQ_UNROLL
    for (int j = 0; j < C; ++j) {
      const int e = q * C + j;
      const float xv = xs[e + (e >> 5)];
      const int bit = j * BITS;
      VQ_UNROLL
      for (int rr = 0; rr < RPW; ++rr) {
        uint32_t c = words[rr][bit >> 5] >> (bit & 31);
        if ((bit & 31) + BITS > 32) c |= words[rr][(bit >> 5) + 1] << (32 - (bit & 31));
        float wv = lut_s[c & MASK];
        if (NG > 1) wv *= VQ_F(scales[(size_t)VQ_MINI(n0 + rr, N - 1) * NG + e / GS]);
        acc[rr] += xv * wv;
      }
    }
  }
  VQ_UNROLL
  for (int rr = 0; rr < RPW; ++rr) {
    const float s = vq_warp_sum(acc[rr]);
    const int n = n0 + rr;
    if (lane == 0 && n < N) {
      const float rs = (NG > 1) ? 1.0f : VQ_F(scales[n]);
      out[n] = VQ_CAST(TO, s * rs);
    }
  }
"""

LUT_MATMUL_ROTATING = "  const int bx = vq_bx;\n" + _ROTATE_INPUT + _MULTIPLY

templates.KERNELS.setdefault(KERNEL_NAME, {
    "body": LUT_MATMUL_ROTATING,
    "inputs": ("x", "w", "codes", "scales", "lut"),
    "outputs": ("out",),
})


# ---- sibling layers in one launch ------------------------------------------------
# Layers that read one input (a Llama block's q/k/v, or gate/up) each rotate it with their own
# signs. One launch serves L of them: its blocks are the layers' blocks one after the other
# (layer l's start at block Bl, B0 = 0), and each block rotates the input with its layer's w
# and multiplies its layer's rows, so no block straddles two layers. Template constants as
# above, with Nl (rows of layer l) and Bl instead of N; inputs x, w0.., codes0.., scales0.., lut
# (one codebook: the layers share bits); outputs out0... A decode step then makes 2 weight
# launches for a block's five input-sharing layers instead of 5.
GROUP_SIZES = (2, 3)


def group_kernel_name(count: int) -> str:
    return f"{KERNEL_NAME}_{count}"


def _pick(name: str, count: int) -> str:
    """`layer == 0 ? name0 : (layer == 1 ? name1 : name2)` for `count` layers."""
    chain = f"{name}{count - 1}"
    for i in reversed(range(count - 1)):
        chain = f"(layer == {i} ? {name}{i} : {chain})"
    return chain


def _group_body(count: int) -> str:
    layer = " + ".join(f"(vq_bx >= B{i})" for i in range(1, count))
    prologue = f"  const int layer = {layer};\n  const int bx = vq_bx - {_pick('B', count)};\n"
    prologue += f"  const int N = {_pick('N', count)};\n"
    for name in ("w", "codes", "scales", "out"):
        prologue += f"  const auto {name} = {_pick(name, count)};\n"
    return prologue + _ROTATE_INPUT + _MULTIPLY


for _count in GROUP_SIZES:
    templates.KERNELS.setdefault(group_kernel_name(_count), {
        "body": _group_body(_count),
        "inputs": ("x",) + tuple(f"{name}{i}" for name in ("w", "codes", "scales") for i in range(_count)) + ("lut",),
        "outputs": tuple(f"out{i}" for i in range(_count)),
    })


def supports(dim: int, threads: int = THREADS) -> bool:
    """A power-of-two dimension in [MIN_DIM, MAX_DIM] (at least two elements per thread: NT <= D / 2)."""
    return MIN_DIM <= dim <= MAX_DIM and dim & (dim - 1) == 0 and threads >= 32 and threads & (threads - 1) == 0


@lru_cache(maxsize=1024)
def plan(in_features: int, out_features: int, bits: int, groups: int, x_dtype: str, out_dtype: str,
         threads: int = THREADS, rpw: Optional[int] = None) -> launch.Plan:
    """Constants and grid of one launch for one batch row of an (out, in) layer (smaller
    `threads` and `rpw` reach the multi-pass and multi-row paths at test sizes)."""
    if not supports(in_features, threads):
        raise ValueError(f"{KERNEL_NAME} takes power-of-two input dims {MIN_DIM}-{MAX_DIM}, got {in_features}")
    nt = min(threads, in_features // 2)
    e = in_features // nt
    k, lb = int(math.log2(in_features)), int(math.log2(e))
    # Four-word chunks; rows per warp as `kernel.rows_per_warp` picks them: more rows repeat the
    # transform in fewer blocks, while the launch keeps enough blocks to stream the codes.
    chunk, words, vec = kernel.chunk_layout(in_features, bits, "vec")
    rpw = kernel.rows_per_warp(out_features, nt // 32) if rpw is None else rpw
    template = [("D", in_features), ("K", k), ("NT", nt), ("E", e), ("LB", lb), ("PASSES", -(-k // lb)),
                ("N", out_features), ("BITS", bits), ("W", in_features * bits // 32), ("C", chunk),
                ("CW", words), ("VEC", vec), ("NCHUNK", in_features // chunk), ("NG", groups),
                ("GS", in_features // groups), ("RPW", rpw), ("TX", x_dtype), ("TO", out_dtype)]
    grid = (-(-out_features // (nt // 32 * rpw)) * nt, 1, 1)
    return launch.Plan(KERNEL_NAME, template, grid, (nt, 1, 1), [(1, out_features)], [out_dtype])


@lru_cache(maxsize=256)
def group_plan(in_features: int, out_features: Tuple[int, ...], bits: int, groups: int, x_dtype: str,
               out_dtype: str, threads: int = THREADS, rpw: Optional[int] = None) -> launch.Plan:
    """One launch for sibling layers of `out_features` rows each, reading one (1, in_features)
    row: `plan`'s constants, rows per warp picked for their rows together, each layer's blocks
    after the one before's."""
    if len(out_features) not in GROUP_SIZES:
        raise ValueError(f"a sibling launch takes {GROUP_SIZES} layers, got {len(out_features)}")
    total = sum(out_features)
    one = dict(plan(in_features, total, bits, groups, x_dtype, out_dtype, threads, rpw).template)
    nt, rpw = one["NT"], one["RPW"]
    per_block = nt // 32 * rpw
    starts, blocks = [], 0
    for n in out_features:
        starts.append(blocks)
        blocks += -(-n // per_block)
    template = [(k, v) for k, v in one.items() if k != "N"]
    template += [(f"N{i}", n) for i, n in enumerate(out_features)] + [(f"B{i}", b) for i, b in enumerate(starts)]
    return launch.Plan(group_kernel_name(len(out_features)), template, (blocks * nt, 1, 1), (nt, 1, 1),
                       [(1, n) for n in out_features], [out_dtype] * len(out_features))


def _group_inputs(layers, x: mx.array, signs) -> list:
    return ([x.reshape(1, layers[0].in_features)] + list(signs) + [layer.codes for layer in layers]
            + [layer.scales for layer in layers] + [layers[0].codebook])


def group_matmul(x: mx.array, layers, signs, dialect: str, threads: int = THREADS,
                 rpw: Optional[int] = None) -> List[mx.array]:
    """Each layer's T(x * signs_l) (W_l R_l^T)^T for one batch row, in one launch (dialect "cuda",
    "metal" or "emulator")."""
    name = launch.dtype_name(x.dtype)
    first = layers[0]
    p = group_plan(first.in_features, tuple(layer.out_features for layer in layers), first.bits,
                   first.scales.shape[1], name, name, threads, rpw)
    inputs = _group_inputs(layers, x, signs)
    if dialect == "emulator":
        outs = [mx.array(o) for o in launch.run_emulator(p, inputs)]
    else:
        outs = launch.run_mlx(dialect, p, inputs)
    return [o.reshape(*x.shape[:-1], layer.out_features) for o, layer in zip(outs, layers)]


def group_takes(layers, x: mx.array) -> bool:
    """Whether sibling layers' calls on x may take one launch: SIBLING_LAUNCH on, each would take the rotating
    matmul (`takes`), and they share the input width, bits, scale groups and codebook."""
    first = layers[0]
    return (SIBLING_LAUNCH and len(layers) in GROUP_SIZES and all(takes(layer, x) for layer in layers)
            and all((layer.in_features, layer.bits, layer.scales.shape[1]) ==
                    (first.in_features, first.bits, first.scales.shape[1]) for layer in layers))


def group_route(layers, x: mx.array, dialect: str) -> Optional[Callable[[mx.array], List[mx.array]]]:
    """x -> the layers' matmuls of x (without bias) as one launch with its arguments resolved
    here, or None where each layer keeps its own route (`group_takes` says no, or the kernel
    failed its first-use check on this back end, which warned)."""
    if not group_takes(layers, x) or not group_usable(dialect, launch.dtype_name(x.dtype)):
        return None
    name = launch.dtype_name(x.dtype)
    first = layers[0]
    p = group_plan(first.in_features, tuple(layer.out_features for layer in layers), first.bits,
                   first.scales.shape[1], name, name)
    run = launch._mlx_kernel(dialect, p.kernel)
    template = launch.mlx_template(p)
    grid, threads = p.grid, p.threadgroup
    lead = tuple(x.shape[:-1])
    shapes, dtypes = [lead + (layer.out_features,) for layer in layers], [x.dtype] * len(layers)
    signs = [layer.rotation._signs(0, x.dtype, layer.get("input_scales")) for layer in layers]

    def matmul(x, *arrays):
        return run(inputs=[x, *arrays], template=template, grid=grid, threadgroup=threads,
                   output_shapes=shapes, output_dtypes=dtypes)
    matmul = kernel.compiled(matmul)
    return lambda x: matmul(x, *signs, *[layer["codes"] for layer in layers],
                            *[layer["scales"] for layer in layers], first["codebook"])


def _plan_for(layer, x: mx.array, threads: int = THREADS, rpw: Optional[int] = None) -> launch.Plan:
    name = launch.dtype_name(x.dtype)
    return plan(layer.in_features, layer.out_features, layer.bits, layer.scales.shape[1], name, name, threads, rpw)


def _inputs(layer, x: mx.array, signs: mx.array) -> list:
    return [x.reshape(1, layer.in_features), signs, layer.codes, layer.scales, layer.codebook]


def rotating_matmul(x: mx.array, layer, signs: mx.array, dialect: str, threads: int = THREADS,
                    rpw: Optional[int] = None) -> mx.array:
    """One batch row's T(x * signs) (W R^T)^T through the kernel; dialect "cuda", "metal" or "emulator"."""
    p = _plan_for(layer, x, threads, rpw)
    if dialect == "emulator":
        (out,) = launch.run_emulator(p, _inputs(layer, x, signs))
        out = mx.array(out)
    else:
        (out,) = launch.run_mlx(dialect, p, _inputs(layer, x, signs))
    return out.reshape(*x.shape[:-1], layer.out_features)


def takes(layer, x: mx.array) -> bool:
    """Whether a layer's call on x may take the kernel: ROTATING_MATMUL on, one batch row, the
    layer rotates its own input with one Hadamard transform of a dimension the kernel takes."""
    return (ROTATING_MATMUL and x.size == x.shape[-1] and not layer.input_rotated
            and layer.rotation._one_transform and supports(layer.in_features))


def route(layer, x: mx.array, signs: mx.array, dialect: str) -> Optional[Callable[[mx.array], mx.array]]:
    """x -> the layer's matmul of x (without bias) as one kernel launch with its arguments resolved
    here, or None where the two launches stay: `takes` says no, or the kernel failed its first-use
    check on this back end (which warned)."""
    if not takes(layer, x) or not usable(dialect, launch.dtype_name(x.dtype)):
        return None
    p = _plan_for(layer, x)
    run = launch._mlx_kernel(dialect, KERNEL_NAME)
    template = launch.mlx_template(p)
    grid, threads = p.grid, p.threadgroup
    shapes, dtypes = [tuple(x.shape[:-1]) + (layer.out_features,)], [x.dtype]

    def matmul(x, signs, codes, scales, codebook):
        return run(inputs=[x, signs, codes, scales, codebook], template=template, grid=grid,
                   threadgroup=threads, output_shapes=shapes, output_dtypes=dtypes)[0]
    matmul = kernel.compiled(matmul)
    return lambda x: matmul(x, signs, layer["codes"], layer["scales"], layer["codebook"])


# ---- checks -------------------------------------------------------------------

# (in, out, bits, group size or None, dtype, threads, rows per warp): every path at small sizes:
# several passes, the last overlapping (128 = 2^7 with E = 4), several rows per warp with a
# ragged last block, groups, 2/3/4 bits, and the 8B shape's q_proj at the kept threads.
CHECK_CASES = (
    (64, 40, 4, None, "float32", 32, 2),
    (128, 72, 3, 32, "float32", 32, 4),
    (256, 33, 2, None, "float16", 64, 1),
)
GPU_CHECK_CASES = CHECK_CASES + ((4096, 1024, 4, None, "float16", THREADS, None),)
TOLERANCES = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 2e-2}


def check_case(dialect: str, dim: int, out_features: int, bits: int, group_size: Optional[int], dtype: str,
               threads: int = THREADS, rpw: Optional[int] = None, seed: int = 0) -> dict:
    """The kernel against the layer's two-step forward (MLX ops: multiply, hadamard_transform,
    the decoded rotated weight): max |out - ref| / max |ref|."""
    import numpy as np

    QuantizedLinear = first_use.layer_class()

    rng = np.random.default_rng([seed, dim, out_features, bits])
    weight = mx.array(rng.standard_normal((out_features, dim)).astype(np.float32))
    layer = QuantizedLinear.from_weight(weight, bits, seed=seed, group_size=group_size, column_alpha=0.5)
    x = mx.array(rng.standard_normal((1, dim)).astype(np.float32)).astype(getattr(mx, dtype))
    signs = layer.rotation._signs(0, x.dtype, layer.get("input_scales"))
    rotated = mx.hadamard_transform(x * signs)
    ref = (rotated.astype(mx.float32) @ layer.rotated_weight().T).astype(mx.float32)
    got = rotating_matmul(x, layer, signs, dialect, threads, rpw).astype(mx.float32)
    error = float(mx.max(mx.abs(got - ref)) / mx.max(mx.abs(ref)))
    tolerance = TOLERANCES[dtype]
    return {"kernel": KERNEL_NAME, "dim": dim, "out": out_features, "bits": bits, "group_size": group_size,
            "dtype": dtype, "threads": threads, "rpw": rpw, "vs_ops": error, "tolerance": tolerance,
            "ok": error <= tolerance}


# (in, (out of each layer), bits, group size or None, dtype, threads, rows per warp): two and
# three siblings, ragged last blocks, groups; on a GPU also the 8B shape's q/k/v.
GROUP_CHECK_CASES = (
    (64, (40, 24), 4, None, "float32", 32, 2),
    (128, (72, 16, 16), 3, 32, "float32", 32, 1),
)
GPU_GROUP_CHECK_CASES = GROUP_CHECK_CASES + ((4096, (4096, 1024, 1024), 4, None, "float16", THREADS, None),)


def check_group_case(dialect: str, dim: int, out_features: Tuple[int, ...], bits: int, group_size: Optional[int],
                     dtype: str, threads: int = THREADS, rpw: Optional[int] = None, seed: int = 0) -> dict:
    """The sibling launch against each layer's two-step forward: the largest max |out - ref| / max |ref|."""
    import numpy as np

    QuantizedLinear = first_use.layer_class()

    rng = np.random.default_rng([seed, dim, bits, *out_features])
    layers = [QuantizedLinear.from_weight(mx.array(rng.standard_normal((n, dim)).astype(np.float32)), bits,
                                          seed=seed + i, group_size=group_size, column_alpha=0.5)
              for i, n in enumerate(out_features)]
    x = mx.array(rng.standard_normal((1, dim)).astype(np.float32)).astype(getattr(mx, dtype))
    signs = [layer.rotation._signs(0, x.dtype, layer.get("input_scales")) for layer in layers]
    got = group_matmul(x, layers, signs, dialect, threads, rpw)
    error = 0.0
    for layer, s, out in zip(layers, signs, got):
        ref = (mx.hadamard_transform(x * s).astype(mx.float32) @ layer.rotated_weight().T).astype(mx.float32)
        error = max(error, float(mx.max(mx.abs(out.astype(mx.float32) - ref)) / mx.max(mx.abs(ref))))
    tolerance = TOLERANCES[dtype]
    return {"kernel": group_kernel_name(len(out_features)), "dim": dim, "out": list(out_features), "bits": bits,
            "group_size": group_size, "dtype": dtype, "threads": threads, "rpw": rpw, "vs_ops": error,
            "tolerance": tolerance, "ok": error <= tolerance}


_VERDICTS = {}  # (dialect, dtype) -> passed; (dialect, dtype, "group") for the sibling launch


def usable(dialect: str, dtype: str = "float32") -> bool:
    """First-use check, once per process and dtype: the check cases in `dtype` against the MLX
    ops. A failure warns (the kernel, the case, the error) and the layers keep two launches."""
    key = (dialect, dtype)
    if key not in _VERDICTS:
        cases = [(*c[:4], dtype, *c[5:]) for c in (GPU_CHECK_CASES if dialect != "emulator" else CHECK_CASES)]
        _VERDICTS[key] = _check(dialect, cases)
    return _VERDICTS[key]


def group_usable(dialect: str, dtype: str = "float32") -> bool:
    """First-use check of the sibling launch, as `usable`; a failure warns and the layers keep
    one launch each."""
    key = (dialect, dtype, "group")
    if key not in _VERDICTS:
        cases = [(*c[:4], dtype, *c[5:]) for c in (GPU_GROUP_CHECK_CASES if dialect != "emulator"
                                                   else GROUP_CHECK_CASES)]
        _VERDICTS[key] = first_use.run(dialect, cases, check_group_case, lambda c: str(c[:5]),
                                       " and ".join(map(group_kernel_name, GROUP_SIZES)), "weights/rotating_matmul.py",
                                       "sibling weight layers (q/k/v, gate/up) launch one kernel each instead.")
    return _VERDICTS[key]


def checked(dialect: str) -> Optional[bool]:
    """Whether every first-use check run on `dialect` passed (None: none ran)."""
    return first_use.checked(_VERDICTS, dialect)


def _check(dialect: str, cases) -> bool:
    return first_use.run(dialect, cases, check_case, lambda c: str(c[:5]), KERNEL_NAME, "weights/rotating_matmul.py",
                         "weight layers rotate their input and multiply in two launches instead.")


def reset() -> None:
    """Forget the verdicts (tests)."""
    _VERDICTS.clear()
