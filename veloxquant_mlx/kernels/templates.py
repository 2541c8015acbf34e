"""Kernel sources: one body per kernel, rendered for CUDA, Metal and a C++ emulator.

Each kernel body below is written once, in the common subset of CUDA C++, the
Metal Shading Language and C++20, against a few macros (`VQ_SHARED`,
`VQ_SYNC()`, `VQ_GLOBAL`, `VQ_F`, `vq_warp_max`, ...). A dialect supplies

* a *header*: the macro definitions and helpers (`mx.fast.cuda_kernel` and
  `mx.fast.metal_kernel` take it as `header=`), and
* a *prologue*: the first lines of the body, which name the thread and block
  indices (`threadIdx` in CUDA, `thread_position_in_threadgroup` in Metal;
  MLX's Metal front end finds those attribute names by scanning the body, so
  they must appear there, not in the header).

The C++ dialect runs every thread of a block as a `std::thread` with a
`std::barrier`, so the exact kernel text can be tested on a CPU without a GPU
(`veloxquant_mlx.kernels.emulator`).

Kernels (all float32 arithmetic):

``mse_encode``   one vector per block, D threads: ||x||, seeded-sign Hadamard
                 rotation (in-register FWHT, optional), Lloyd-Max boundary
                 count, dense little-endian bit packing (code i at bits
                 [i*b, (i+1)*b)), fp16 norm.
``mse_partial``  flash-decoding split: block (s, bh) reads the packed key and
                 value codes of tokens [s*CH, min((s+1)*CH, T)) of kv head bh,
                 scores the REP query heads of that kv head (GQA, no repeat)
                 with on-the-fly dequantisation against the rotated query, and
                 keeps an online softmax; writes (o, m, l) per split.
``merge``        combines the splits (and an optional plain fp16 partial),
                 un-rotates the value sum once (FWHT), adds REP-free value mean.
"""

from __future__ import annotations

from typing import Dict, Iterable, Tuple, Union

DIALECTS = ("cuda", "metal", "cpp")

# ----------------------------------------------------------------------------
# Dialect headers
# ----------------------------------------------------------------------------

_CUDA_HEADER = r"""
#ifndef VQ_DIALECT_CUDA
#define VQ_DIALECT_CUDA 1
#define VQ_GLOBAL
#define VQ_SHARED __shared__
#define VQ_SYNC() __syncthreads()
#define VQ_INLINE __device__ __forceinline__
#define VQ_NEG_INF (-__int_as_float(0x7f800000))
#define VQ_F(x) static_cast<float>(x)
#define VQ_CAST(T, x) static_cast<T>(x)
#define VQ_EXP(x) expf(x)
#define VQ_SQRT(x) sqrtf(x)
#define VQ_MAXF(a, b) fmaxf((a), (b))
#define VQ_MINI(a, b) min((a), (b))
#define VQ_UNROLL _Pragma("unroll")
typedef float4 vq_f4;
#define VQ_FPTR(arr) reinterpret_cast<float*>(arr)
typedef __half vq_half;
#define VQ_HALF_PTR(p) reinterpret_cast<vq_half*>(p)
#define VQ_HALF_CPTR(p) reinterpret_cast<const vq_half*>(p)
#define VQ_SHALF_PTR(p) reinterpret_cast<vq_half*>(p)
#define VQ_SHALF_CPTR(p) reinterpret_cast<const vq_half*>(p)
typedef unsigned long long vq_u64;
VQ_INLINE float vq_warp_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
VQ_INLINE float vq_warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
VQ_INLINE float vq_half_bits(uint32_t u) { return __half2float(__ushort_as_half((unsigned short)(u & 0xffffu))); }
// A code (< 2^23) as a float by its bits, 2^23 + c minus 2^23: two full-rate ops where int-to-float
// conversion runs at a quarter of the rate; the same float as (float)c.
VQ_INLINE float vq_code_float(uint32_t c) { return __uint_as_float(0x4b000000u | c) - 8388608.0f; }
VQ_INLINE uint32_t vq_half_word(float x) { return (uint32_t)__half_as_ushort(__float2half_rn(x)); }
#define VQ_ISFINITE(x) isfinite(x)
#define VQ_ATAN2(y, x) atan2f((y), (x))
#define VQ_ROUND(x) rintf(x)
#define VQ_FLOOR(x) floorf(x)
#define VQ_MINF(a, b) fminf((a), (b))
#define VQ_ABSF(x) fabsf(x)
VQ_INLINE uint32_t vq_pack_half2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
VQ_INLINE float vq_shfl_xor(float x, int m) { return __shfl_xor_sync(0xffffffffu, x, m); }
#define VQ_WSYNC() __syncwarp()
#define VQ_HAS_MMA 1
// c (16x8 f32) += a (16x16 f16, row-major) * b (16x8 f16, column-major), one warp: the
// fragments of PTX ISA 9.7.14.5.8 ("mma.m16n8k16", floating point), lane = 4 * group + t:
// a[0] (row group, cols 2t, 2t+1), a[1] (row group+8, same cols), a[2] / a[3] the same
// rows at cols 2t+8, 2t+9; b[0] (rows 2t, 2t+1, col group), b[1] (rows 2t+8, 2t+9);
// c[0], c[1] (row group, cols 2t, 2t+1), c[2], c[3] (row group+8). Lower half first.
VQ_INLINE void vq_mma16816(float* c, const uint32_t* a, const uint32_t* b) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
               "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#define VQ_UNROLL8 _Pragma("unroll 8")
#define VQ_UNROLL4 _Pragma("unroll 4")
// A word from global to shared memory without passing through registers (sm_80+), zero
// when !ok; visible to other lanes after vq_cp_wait() and a warp sync.
VQ_INLINE void vq_cp_async4(uint32_t* dst, const uint32_t* src, bool ok) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n"
               :: "r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src), "r"(ok ? 4 : 0));
}
VQ_INLINE void vq_cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
VQ_INLINE void vq_cp_wait() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
// Four consecutive words of global memory (16-byte aligned) in one load.
#define VQ_LOAD_U4(dst, src) { const uint4 v_ = *reinterpret_cast<const uint4*>(src); \
  (dst)[0] = v_.x; (dst)[1] = v_.y; (dst)[2] = v_.z; (dst)[3] = v_.w; }
#endif
"""

_METAL_HEADER = r"""
#ifndef VQ_DIALECT_METAL
#define VQ_DIALECT_METAL 1
#define VQ_GLOBAL device
#define VQ_SHARED threadgroup
#define VQ_SYNC() threadgroup_barrier(mem_flags::mem_threadgroup)
#define VQ_INLINE inline
#define VQ_NEG_INF (-INFINITY)
#define VQ_F(x) static_cast<float>(x)
#define VQ_CAST(T, x) static_cast<T>(x)
#define VQ_EXP(x) metal::precise::exp(x)
#define VQ_SQRT(x) metal::precise::sqrt(x)
#define VQ_MAXF(a, b) metal::max((a), (b))
#define VQ_MINI(a, b) metal::min((a), (b))
#define VQ_UNROLL _Pragma("unroll")
typedef float4 vq_f4;
#define VQ_FPTR(arr) ((threadgroup float*)(arr))
typedef half vq_half;
#define VQ_HALF_PTR(p) ((device vq_half*)(p))
#define VQ_HALF_CPTR(p) ((const device vq_half*)(p))
#define VQ_SHALF_PTR(p) ((threadgroup vq_half*)(p))
#define VQ_SHALF_CPTR(p) ((const threadgroup vq_half*)(p))
typedef ulong vq_u64;
VQ_INLINE float vq_warp_max(float x) { return simd_max(x); }
VQ_INLINE float vq_warp_sum(float x) { return simd_sum(x); }
VQ_INLINE float vq_half_bits(uint32_t u) { return float(as_type<half>((ushort)(u & 0xffffu))); }
VQ_INLINE float vq_code_float(uint32_t c) { return as_type<float>(0x4b000000u | c) - 8388608.0f; }
VQ_INLINE uint32_t vq_half_word(float x) { return (uint32_t)as_type<ushort>(half(x)); }
#define VQ_ISFINITE(x) metal::isfinite(x)
#define VQ_ATAN2(y, x) metal::precise::atan2((y), (x))
#define VQ_ROUND(x) metal::rint(x)
#define VQ_FLOOR(x) metal::floor(x)
#define VQ_MINF(a, b) metal::fmin((a), (b))
#define VQ_ABSF(x) metal::fabs(x)
#define VQ_LOAD_U4(dst, src) { const uint4 v_ = *((const device uint4*)(src)); \
  (dst)[0] = v_.x; (dst)[1] = v_.y; (dst)[2] = v_.z; (dst)[3] = v_.w; }
#define VQ_UNROLL8 _Pragma("unroll 8")
#define VQ_UNROLL4 _Pragma("unroll 4")
#endif
"""

# The emulator's header: threads of one block are std::threads sharing the
# function-static `VQ_SHARED` arrays; blocks run one after another.
_CPP_HEADER = r"""
#ifndef VQ_DIALECT_CPP
#define VQ_DIALECT_CPP 1
#include <algorithm>
#include <barrier>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#define VQ_GLOBAL
#define VQ_SHARED static
#define VQ_SYNC() vq_emu::sync()
#define VQ_INLINE inline
#define VQ_NEG_INF (-std::numeric_limits<float>::infinity())
#define VQ_F(x) static_cast<float>(x)
#define VQ_CAST(T, x) static_cast<T>(x)
#define VQ_EXP(x) std::exp(x)
#define VQ_SQRT(x) std::sqrt(x)
#define VQ_MAXF(a, b) std::max<float>((a), (b))
#define VQ_MINI(a, b) std::min<int>((a), (b))
#define VQ_UNROLL
struct vq_f4 { float x, y, z, w; };
#define VQ_FPTR(arr) reinterpret_cast<float*>(arr)
#define VQ_HALF_PTR(p) reinterpret_cast<vq_half*>(p)
#define VQ_HALF_CPTR(p) reinterpret_cast<const vq_half*>(p)
#define VQ_SHALF_PTR(p) reinterpret_cast<vq_half*>(p)
#define VQ_SHALF_CPTR(p) reinterpret_cast<const vq_half*>(p)
typedef _Float16 vq_half;
typedef uint64_t vq_u64;
namespace vq_emu {
struct Ctx { std::barrier<>* bar; float* scratch; int tid, bx, by; };
inline thread_local Ctx ctx;
inline void sync() { ctx.bar->arrive_and_wait(); }
inline float warp_reduce(float x, bool is_max) {
  ctx.scratch[ctx.tid] = x;
  sync();
  const int base = ctx.tid & ~31;
  float r = is_max ? -std::numeric_limits<float>::infinity() : 0.0f;
  for (int i = 0; i < 32; ++i) r = is_max ? std::max(r, ctx.scratch[base + i]) : r + ctx.scratch[base + i];
  sync();
  return r;
}
}  // namespace vq_emu
inline float vq_warp_max(float x) { return vq_emu::warp_reduce(x, true); }
inline float vq_warp_sum(float x) { return vq_emu::warp_reduce(x, false); }
inline float vq_half_bits(uint32_t u) { return static_cast<float>(std::bit_cast<_Float16>(static_cast<uint16_t>(u & 0xffffu))); }
inline float vq_code_float(uint32_t c) { return std::bit_cast<float>(0x4b000000u | c) - 8388608.0f; }
inline uint32_t vq_half_word(float x) { return std::bit_cast<uint16_t>(static_cast<_Float16>(x)); }
#define VQ_ISFINITE(x) std::isfinite(x)
#define VQ_ATAN2(y, x) std::atan2((y), (x))
#define VQ_ROUND(x) std::nearbyint(x)
#define VQ_FLOOR(x) std::floor(x)
#define VQ_MINF(a, b) std::fmin((a), (b))
#define VQ_ABSF(x) std::fabs(x)
inline uint32_t vq_pack_half2(float lo, float hi) {
  return static_cast<uint32_t>(std::bit_cast<uint16_t>(static_cast<_Float16>(lo))) |
         (static_cast<uint32_t>(std::bit_cast<uint16_t>(static_cast<_Float16>(hi))) << 16);
}
namespace vq_emu {
// A warp's lanes exchange through the block's scratch (8 words per thread) between barriers,
// so callers must reach these with the same trip counts in every thread of the block.
inline float half_at(uint32_t word, int k) { return static_cast<float>(std::bit_cast<_Float16>(static_cast<uint16_t>(word >> (16 * (k & 1))))); }
inline float shfl_xor(float x, int m) {
  ctx.scratch[ctx.tid] = x;
  sync();
  const float r = ctx.scratch[(ctx.tid & ~31) | ((ctx.tid & 31) ^ m)];
  sync();
  return r;
}
inline void mma16816(float* c, const uint32_t* a, const uint32_t* b) {
  uint32_t* s = reinterpret_cast<uint32_t*>(ctx.scratch);
  for (int i = 0; i < 4; ++i) s[ctx.tid * 8 + i] = a[i];
  s[ctx.tid * 8 + 4] = b[0];
  s[ctx.tid * 8 + 5] = b[1];
  sync();
  const int base = ctx.tid & ~31, group = (ctx.tid & 31) >> 2, t = ctx.tid & 3;
  for (int i = 0; i < 4; ++i) {
    const int row = group + 8 * (i >> 1), col = 2 * t + (i & 1);
    float acc = c[i];
    for (int k = 0; k < 16; ++k) {
      const uint32_t aw = s[(base + (row & 7) * 4 + ((k & 7) >> 1)) * 8 + (row >> 3) + 2 * (k >> 3)];
      const uint32_t bw = s[(base + col * 4 + ((k & 7) >> 1)) * 8 + 4 + (k >> 3)];
      acc += half_at(aw, k) * half_at(bw, k);
    }
    c[i] = acc;
  }
  sync();
}
}  // namespace vq_emu
inline float vq_shfl_xor(float x, int m) { return vq_emu::shfl_xor(x, m); }
inline void vq_mma16816(float* c, const uint32_t* a, const uint32_t* b) { vq_emu::mma16816(c, a, b); }
#define VQ_WSYNC() vq_emu::sync()
#define VQ_HAS_MMA 1
#define VQ_UNROLL8
#define VQ_UNROLL4
inline void vq_cp_async4(uint32_t* dst, const uint32_t* src, bool ok) { *dst = ok ? *src : 0u; }
#define VQ_LOAD_U4(dst, src) { for (int k_ = 0; k_ < 4; ++k_) (dst)[k_] = (src)[k_]; }
inline void vq_cp_commit() {}
inline void vq_cp_wait() {}
#endif
"""

HEADERS = {"cuda": _CUDA_HEADER, "metal": _METAL_HEADER, "cpp": _CPP_HEADER}

# Thread / block indices: (x thread in block, x block, y block).
_PROLOGUES = {
    "cuda": "  const int vq_tid = (int)threadIdx.x;\n"
            "  const int vq_bx = (int)blockIdx.x;\n"
            "  const int vq_by = (int)blockIdx.y;\n"
            "  (void)vq_tid; (void)vq_bx; (void)vq_by;\n",
    "metal": "  const int vq_tid = (int)thread_position_in_threadgroup.x;\n"
             "  const int vq_bx = (int)threadgroup_position_in_grid.x;\n"
             "  const int vq_by = (int)threadgroup_position_in_grid.y;\n"
             "  (void)vq_tid; (void)vq_bx; (void)vq_by;\n",
    "cpp": "  const int vq_tid = vq_emu::ctx.tid;\n"
           "  const int vq_bx = vq_emu::ctx.bx;\n"
           "  const int vq_by = vq_emu::ctx.by;\n"
           "  (void)vq_tid; (void)vq_bx; (void)vq_by;\n",
}

# ----------------------------------------------------------------------------
# Kernel bodies
# ----------------------------------------------------------------------------

def pack_codes(bits, count, words, first_code, store: str) -> str:
    """C statements packing `count` codes of `bits` bits, `vq_codes[first_code + i]`, into `words`
    uint32 words, LSB first (the layout of `packing.py`): thread t makes words t, t + NTH, ...,
    and `store` writes word `word_` at index `w_`. The mse encoder and every format's encode
    kernel (`encode.Emit.pack`) share it."""
    return (f"    for (int w_ = t; w_ < {words}; w_ += NTH) {{\n"
            f"      uint32_t word_ = 0u;\n"
            f"      const int first_ = (32 * w_) / {bits};\n"
            f"      const int last_ = VQ_MINI({count} - 1, (32 * w_ + 31) / {bits});\n"
            f"      for (int i_ = first_; i_ <= last_; ++i_) {{\n"
            f"        const int sh_ = i_ * {bits} - 32 * w_;\n"
            f"        const uint32_t c_ = vq_codes[{first_code} + i_];\n"
            f"        word_ |= (sh_ >= 0) ? (c_ << sh_) : (c_ >> (-sh_));\n"
            f"      }}\n"
            f"      {store}\n"
            f"    }}")


# One role (keys or values) of `mse_encode_kv`; `@` names are substituted with
# the role's constants / arrays by `_encode_role`. E_D (dim), E_BITS, E_W (=
# ceil(E_D*E_BITS/32)), E_NB (= 2^E_BITS - 1 boundaries), E_P2 (next power of two >= E_D),
# E_ROTATE (apply the seeded-sign Hadamard rotation here; E_D a power of two),
# E_SCALE (the stored scale, `turboquant_mse.SCALES`: 0 ||x||, 1 ||x|| / ||c[codes]||,
# 2 ||x|| / <u, c[codes]>). Threads t >= E_D idle but keep the barriers. The E_ names
# and `auto` pointers are for Metal, where a kernel's template constants are template
# parameters, which no inner name may shadow, and an input of fewer than
# METAL_CONSTANT_ELEMENTS elements (a 1-3 bit codebook) lives in the constant address space.
_ENCODE_ROLE = r"""
  if (@GUARD) {
    constexpr int E_D = @D;
    constexpr int E_BITS = @BITS;
    constexpr int E_W = @W;
    constexpr int E_NB = @NB;
    constexpr int E_P2 = @P2;
    constexpr bool E_ROTATE = @ROTATE;
    constexpr int E_SCALE = @SCALE;
    const auto x = @x;
    const auto signs = @signs;
    const auto bnd = @bnd;
    const auto cent = @cent;
    const bool act = t < E_D;
    const float v = act ? (@VALUE) : 0.0f;
    if (t < E_P2) vq_red[t] = v * v;
    for (int i = t + NTH; i < E_P2; i += NTH) vq_red[i] = 0.0f;
    if (E_ROTATE && act) vq_buf[t] = v * signs[t];
    VQ_SYNC();
    for (int s = E_P2 / 2; s > 0; s >>= 1) {
      if (t < s) vq_red[t] += vq_red[t + s];
      VQ_SYNC();
    }
    const float nrm = VQ_SQRT(vq_red[0]);
    float y = v;
    if (E_ROTATE) {
      for (int h = 1; h < E_D; h <<= 1) {
        if (act && (t & h) == 0) {
          const float a = vq_buf[t];
          const float b = vq_buf[t + h];
          vq_buf[t] = a + b;
          vq_buf[t + h] = a - b;
        }
        VQ_SYNC();
      }
      y = act ? vq_buf[t] * (1.0f / VQ_SQRT((float)E_D)) : 0.0f;
    }
    y = y / VQ_MAXF(nrm, 1e-30f);
    uint32_t code = 0u;
    for (int k = 0; k < E_NB; ++k) code += (y > bnd[k]) ? 1u : 0u;
    if (act) vq_codes[t] = code;
    float out_norm = nrm;
    VQ_SYNC();
    if (E_SCALE != 0) {
      const float c = act ? cent[code] : 0.0f;
      if (t < E_P2) vq_red[t] = E_SCALE == 2 ? y * c : c * c;
      for (int i = t + NTH; i < E_P2; i += NTH) vq_red[i] = 0.0f;
      VQ_SYNC();
      for (int s = E_P2 / 2; s > 0; s >>= 1) {
        if (t < s) vq_red[t] += vq_red[t + s];
        VQ_SYNC();
      }
      out_norm = nrm / VQ_MAXF(E_SCALE == 2 ? vq_red[0] : VQ_SQRT(vq_red[0]), 1e-30f);
    }
@PACK
    if (t == 0 && (@STORE)) VQ_HALF_PTR(@OUT)[((size_t)@ROW * RW + KW + VW) * 2 + @ROLE] = VQ_CAST(vq_half, out_norm);
    @RESULT
  }
"""


def _encode_role(role: int, prefix: str, arrays: str, *, guard: str = "", value: str = "VQ_F(x[(size_t)n * E_D + t])",
                 row: str = "n", out: str = "rows", store: str = "true", result: str = "") -> str:
    """One role of an encoder: `guard` selects the threads' block, `value` is thread t's
    coordinate, the packed row goes to `out[row]` when `store`, `result` may keep the
    thread's code and the fp16-rounded norm (`code`, `out_norm`)."""
    store_word = "if (@STORE) @OUT[(size_t)@ROW * RW + @OFF + w_] = word_;"
    text = _ENCODE_ROLE.replace("@PACK", pack_codes("@BITS", "@D", "@W", 0, store_word))
    text = text.replace("@GUARD", guard or f"vq_by == {role}").replace("@VALUE", value)
    text = text.replace("@ROW", row).replace("@OUT", out).replace("@STORE", store).replace("@RESULT", result)
    text = text.replace("@ROLE", str(role)).replace("@OFF", "0" if role == 0 else "KW")
    for name in ("D", "BITS", "W", "NB", "P2", "ROTATE", "SCALE"):
        text = text.replace(f"@{name}", f"{prefix}{name}")
    for name in ("x", "signs", "bnd", "cent"):
        text = text.replace(f"@{name}", f"{arrays}{name}")
    return text


# Keys (block row 0) and values (block row 1) of N vectors in one launch.
# Template constants: K*/V* as in `_ENCODE_ROLE`, NTH (= max(KD, VD) threads),
# P2M (= max(KP2, VP2)), TX (input dtype, keys and values alike), RW (= KW + VW
# + 1 words per row). Inputs: kx (N, KD), vx (N, VD) TX; ksigns, vsigns (D) f32;
# kbnd, vbnd f32; kcent, vcent f32.  Output: rows (N, RW) uint32 in the layout
# of `rows.py`: key codes, value codes, then both fp16 norms in one word.
# Grid: (N * NTH, 2) threads in blocks of NTH.
MSE_ENCODE = r"""
  const int n = vq_bx;
  const int t = vq_tid;
  VQ_SHARED float vq_buf[NTH];
  VQ_SHARED float vq_red[P2M];
  VQ_SHARED uint32_t vq_codes[NTH];
""" + _encode_role(0, "K", "k") + _encode_role(1, "V", "v")

# Template constants: D (dim, a multiple of 32), KB / VB (key / value bits),
# KW / VW (words per key / value row = D*KB/32, D*VB/32), REP (query heads per
# kv head), NT (threads = tokens per tile, a multiple of 32), G (value dims per
# thread), NDG (= D / G), TL (= NT / NDG token lanes in the value phase), ROTQ
# (rotate the query here with the key codec's seeded-sign FWHT; else q is
# already in the key domain), TQ (q dtype). Each tile's rows are first copied
# to shared memory by all threads (coalesced: one memory latency per tile);
# the key and value phases then read only shared memory (RW is odd for any D
# that is a multiple of 32, so a thread-per-row read has no bank conflicts).
# RW (= KW + VW + 1 words per row). Inputs: q (BH*REP, D) TQ, rows (BH, CAP, RW)
#   u32 (the layout of `rows.py`), kcent (2^KB) f32, vcent (2^VB) f32, ksigns (D)
#   f32, meta int32 [T, CH, CAP, S], qscale f32 [scale], kscale (KH, D) f32: with KSC, smoothed
#   keys' scales s (`methods/smoothing.py`: the codes are of k / s, so queries enter as q * s).
# Outputs: o (BH, S, REP, D) f32, ml (BH, S, REP, 2) f32 (max, sum).
# Grid: (S * NT, BH) threads in blocks of NT.
# A tile's step of a flash-decoding partial kernel: the block's max of the valid threads' scores
# sc[REP] (through the warps' maxima in vq_wred), the running max m_run, the rescale alpha of
# what was summed so far, the running sum l_part, and @STORE of each weight p. @TID: the thread.
ONLINE_SOFTMAX = r"""    VQ_UNROLL
    for (int r = 0; r < REP; ++r) {
      const float wm = vq_warp_max(valid ? sc[r] : VQ_NEG_INF);
      if ((@TID & 31) == 0) vq_wred[r * NW + (@TID >> 5)] = wm;
    }
    VQ_SYNC();
    VQ_UNROLL
    for (int r = 0; r < REP; ++r) {
      float mm = VQ_NEG_INF;
      for (int w = 0; w < NW; ++w) mm = VQ_MAXF(mm, vq_wred[r * NW + w]);
      const float m_new = VQ_MAXF(m_run[r], mm);
      alpha[r] = (m_run[r] == VQ_NEG_INF) ? 0.0f : VQ_EXP(m_run[r] - m_new);
      const float p = valid ? VQ_EXP(sc[r] - m_new) : 0.0f;
      l_part[r] = l_part[r] * alpha[r] + p;
      @STORE
      m_run[r] = m_new;
    }
"""

# The end of a flash-decoding partial kernel (`mse_partial`, `kernels/partial.py`): the token
# lanes' value sums in vq_red (TL lanes x REP x @DV) and the warps' softmax sums in vq_wred, summed
# into this split's o (BH, S, REP, @DV) and ml (BH, S, REP, 2) = (max, sum). @TID: the thread index.
PARTIAL_RESULT = r"""
  const size_t obase = ((size_t)bh * S + s) * REP;
  for (int i = @TID; i < REP * @DV; i += NT) {
    const int r = i / @DV;
    const int d = i % @DV;
    float sum = 0.0f;
    for (int u = 0; u < TL; ++u) sum += vq_red[(u * REP + r) * @DV + d];
    o[obase * @DV + i] = sum;
  }
  VQ_UNROLL
  for (int r = 0; r < REP; ++r) {
    if (@TID == r) {
      float lt = 0.0f;
      for (int w = 0; w < NW; ++w) lt += vq_wred[r * NW + w];
      ml[(obase + r) * 2] = m_run[r];
      ml[(obase + r) * 2 + 1] = lt;
    }
  }
"""

# Both partial kernels: block (s, bh) takes tokens [start, end) of kv row bh; meta = [tokens,
# tokens per split, rows' capacity, splits]. RAG > 0: a batch of sequences of different lengths
# (`batch_decode.py`) of RAG kv rows each, sequence b's tokens at meta[4 + b] (meta[0] unused).
_SPLIT_RANGE = r"""  const int s = vq_bx;
  const int bh = vq_by;
  const int T = RAG ? meta[4 + bh / (RAG ? RAG : 1)] : meta[0];
  const int CH = meta[1];
  const int CAP = meta[2];
  const int S = meta[3];
  const int start = s * CH;
  const int end = VQ_MINI(start + CH, T);
"""

# Both partial kernels' prologue: the REP query rows of kv row bh, scaled (and, with KSC,
# times the kv head's smoothing scales s; with ROTQ, sign-flipped and FWHT-rotated into the key
# codec's domain, not yet normalised) into vq_qt, and the centroid tables into shared memory.
_ROTATED_QUERY = r"""  const float scale = qscale[0];
  for (int i = t; i < REP * D; i += NT) {
    float v = VQ_F(q[(size_t)bh * REP * D + i]) * scale;
    if (KSC) v *= kscale[(size_t)(bh % KH) * D + i % D];
    if (ROTQ) v *= ksigns[i % D];
    vq_qt[i] = v;
  }
  for (int i = t; i < (1 << KB); i += NT) vq_kc[i] = kcent[i];
  for (int i = t; i < (1 << VB); i += NT) vq_vc[i] = vcent[i];
  VQ_SYNC();
  if (ROTQ) {
    for (int h = 1; h < D; h <<= 1) {
      for (int p = t; p < REP * (D / 2); p += NT) {
        const int r = p / (D / 2);
        const int j = p % (D / 2);
        const int i = (j / h) * (2 * h) + (j % h) + r * D;
        const float a = vq_qt[i];
        const float b = vq_qt[i + h];
        vq_qt[i] = a + b;
        vq_qt[i + h] = a - b;
      }
      VQ_SYNC();
    }
  }
"""

MSE_PARTIAL = r"""
  constexpr int NW = NT / 32;
  constexpr uint32_t KMASK = (1u << KB) - 1u;
  constexpr uint32_t VMASK = (1u << VB) - 1u;
  const int t = vq_tid;
""" + _SPLIT_RANGE + r"""
  // One shared buffer serves three phases in turn (48 KB of static shared memory
  // must hold head_dim 256 with 8 query heads per kv head): the query while it is
  // rotated, each tile's rows, and the value sums of the token lanes at the end.
  constexpr int BIG0 = (REP * D > NT * RW) ? REP * D : NT * RW;
  constexpr int BIG = (BIG0 > TL * REP * D) ? BIG0 : TL * REP * D;
  VQ_SHARED uint32_t vq_tile[BIG];
  auto vq_qt = VQ_FPTR(vq_tile);
  auto vq_red = VQ_FPTR(vq_tile);
  // Query (per dim) and weights (per token) of the REP heads, padded to float4s.
  constexpr int R4 = (REP + 3) / 4;
  VQ_SHARED vq_f4 vq_q4[D * R4];
  VQ_SHARED float vq_kc[1 << KB];
  VQ_SHARED float vq_vc[1 << VB];
  VQ_SHARED vq_f4 vq_w4[NT * R4];
  VQ_SHARED float vq_wred[REP * NW];

""" + _ROTATED_QUERY + r"""  const float qnorm = ROTQ ? (1.0f / VQ_SQRT((float)D)) : 1.0f;
  for (int i = t; i < R4 * 4 * D; i += NT) {
    const int r = i / D;
    VQ_FPTR(vq_q4)[(i % D) * (R4 * 4) + r] = (r < REP) ? vq_qt[i] * qnorm : 0.0f;
  }
  VQ_SYNC();

  float m_run[REP];
  float l_part[REP];
  float alpha[REP];
  float acc[G * REP];
  VQ_UNROLL
  for (int r = 0; r < REP; ++r) {
    m_run[r] = VQ_NEG_INF;
    l_part[r] = 0.0f;
  }
  VQ_UNROLL
  for (int i = 0; i < G * REP; ++i) acc[i] = 0.0f;
  const int g = t % NDG;
  const int tl = t / NDG;
  const size_t base = (size_t)bh * CAP;
  const int vbit0 = g * G * VB;
  const int vwi = vbit0 >> 5;
  const int vsh = vbit0 & 31;

  for (int tile = start; tile < end; tile += NT) {
    const int ntok = VQ_MINI(NT, end - tile);
    {
      const VQ_GLOBAL uint32_t* src = rows + (base + (size_t)tile) * RW;
      for (int i = t; i < ntok * RW; i += NT) vq_tile[i] = src[i];
    }
    VQ_SYNC();
    // ---- scores: thread t scores token tile + t for the REP query heads
    const bool valid = t < ntok;
    float sc[R4 * 4];
    VQ_UNROLL
    for (int r = 0; r < R4 * 4; ++r) sc[r] = 0.0f;
    float vn = 0.0f;
    if (valid) {
      uint32_t kw[KW];
      VQ_UNROLL
      for (int i = 0; i < KW; ++i) kw[i] = vq_tile[t * RW + i];
      VQ_UNROLL
      for (int d = 0; d < D; ++d) {
        const int bit = d * KB;
        const int wi = bit >> 5;
        const int sh = bit & 31;
        uint32_t c = kw[wi] >> sh;
        if (sh + KB > 32) c |= kw[wi + 1] << (32 - sh);
        const float cv = vq_kc[c & KMASK];
        VQ_UNROLL
        for (int r4 = 0; r4 < R4; ++r4) {
          const vq_f4 qv = vq_q4[d * R4 + r4];
          sc[4 * r4] += qv.x * cv;
          if (4 * r4 + 1 < REP) sc[4 * r4 + 1] += qv.y * cv;
          if (4 * r4 + 2 < REP) sc[4 * r4 + 2] += qv.z * cv;
          if (4 * r4 + 3 < REP) sc[4 * r4 + 3] += qv.w * cv;
        }
      }
      const uint32_t norms = vq_tile[t * RW + KW + VW];  // fp16 key norm (low half), value norm
      const float kn = vq_half_bits(norms);
      VQ_UNROLL
      for (int r = 0; r < REP; ++r) sc[r] *= kn;
      vn = vq_half_bits(norms >> 16);
    }
    // ---- online softmax: the tile's max per head, then weights p * ||v||
""" + ONLINE_SOFTMAX.replace("@TID", "t").replace("@STORE", "VQ_FPTR(vq_w4)[t * (R4 * 4) + r] = p * vn;") + r"""    VQ_SYNC();
    // ---- values: thread (tl, g) adds dims [g*G, g*G+G) of tokens tl, tl+TL, ...
    VQ_UNROLL
    for (int k = 0; k < G; ++k) {
      VQ_UNROLL
      for (int r = 0; r < REP; ++r) acc[k * REP + r] *= alpha[r];
    }
    for (int jj = tl; jj < ntok; jj += TL) {
      const int vrow = jj * RW + KW;
      vq_u64 bits = (vq_u64)vq_tile[vrow + vwi];
      if (vwi + 1 < VW) bits |= ((vq_u64)vq_tile[vrow + vwi + 1]) << 32;
      bits >>= vsh;
      float wv[R4 * 4];
      VQ_UNROLL
      for (int r4 = 0; r4 < R4; ++r4) {
        const vq_f4 u = vq_w4[jj * R4 + r4];
        wv[4 * r4] = u.x; wv[4 * r4 + 1] = u.y; wv[4 * r4 + 2] = u.z; wv[4 * r4 + 3] = u.w;
      }
      VQ_UNROLL
      for (int k = 0; k < G; ++k) {
        const float cv = vq_vc[(uint32_t)(bits >> (k * VB)) & VMASK];
        VQ_UNROLL
        for (int r = 0; r < REP; ++r) acc[k * REP + r] += wv[r] * cv;
      }
    }
    VQ_SYNC();
  }

  // ---- this split's (o, m, l)
  VQ_UNROLL
  for (int r = 0; r < REP; ++r) {
    const float ls = vq_warp_sum(l_part[r]);
    if ((t & 31) == 0) vq_wred[r * NW + (t >> 5)] = ls;
  }
  VQ_UNROLL
  for (int k = 0; k < G; ++k) {
    VQ_UNROLL
    for (int r = 0; r < REP; ++r) vq_red[(tl * REP + r) * D + g * G + k] = acc[k * REP + r];
  }
""" + "  VQ_SYNC();\n" + PARTIAL_RESULT.replace("@TID", "t").replace("@DV", "D")

# `mse_partial` on tensor cores (CUDA `mma.sync`, and the emulator's warp-level model of it):
# the same inputs, outputs, grid and split contract. Each warp walks its own 16-token tiles
# (the block's tiles in turn, one trip count for the whole block): scores are one m16n8k16
# mma per 16 key dims (A = 16 tokens' keys decoded two codes at a time through a pair table,
# B = the rotated queries of up to 8 heads, kept in registers), values one mma per 16 value
# dims (A = the values of 16 tokens, B = the weights p * ||v|| through shared memory). fp16
# operands, fp32 accumulation. The warps' (o, m, l) are merged in shared memory at the end.
MSE_PARTIAL_MMA = r"""
  constexpr int NW = NT / 32;
  constexpr int KS = D / 16;
  constexpr uint32_t KMASK = (1u << KB) - 1u;
  constexpr uint32_t VMASK = (1u << VB) - 1u;
  constexpr bool KPAIR = KB <= 3;  // pair tables up to 64 entries; wider codes: two lookups
  constexpr bool VPAIR = VB <= 3;
  constexpr int KP = KPAIR ? (1 << (2 * KB)) : 1;
  constexpr int VP = VPAIR ? (1 << (2 * VB)) : 1;
  // Thread (grp, tg) scores key dims [tg D/4, (tg + 1) D/4) and sums value dims
  // [grp D/8, (grp + 1) D/8): the mma's k (scores) and m (values) indices are permuted so
  // that each thread's codes are one contiguous bit range of a row, read as whole words.
  constexpr int KBITS = KB * (D / 4);
  constexpr int VBITS = VB * (D / 8);
  constexpr int KN = (KBITS + 31) / 32 + 1;
  constexpr int VN = (VBITS + 31) / 32 + 1;
  constexpr int TW = 16 * RW;
  constexpr int PRE = (TW + 31) / 32;
  constexpr int BIG = (2 * NW * TW > NW * REP * D) ? 2 * NW * TW : NW * REP * D;
  const int t = vq_tid;
""" + _SPLIT_RANGE + r"""  const int lane = t & 31;
  const int warp = t >> 5;
  const int grp = lane >> 2;
  const int tg = lane & 3;

  // One buffer serves the rotated query, then the warps' tiles (two each), then their value sums.
  VQ_SHARED uint32_t vq_tile[BIG];
  auto vq_qt = VQ_FPTR(vq_tile);
  // Two key codes -> their centroids as half2 (first code low), one copy per lane: entry e of
  // lane l's copy sits in bank l, so the warp's lookups never conflict.
  VQ_SHARED uint32_t vq_kpair[KP * 32];
  VQ_SHARED uint32_t vq_vpair[VP];
  VQ_SHARED float vq_kc[1 << KB];
  VQ_SHARED float vq_vc[1 << VB];
  VQ_SHARED uint32_t vq_p[NW * 64];  // each warp's weights as halves, [head][token]
  VQ_SHARED float vq_wm[NW * 8];
  VQ_SHARED float vq_wl[NW * 8];

""" + _ROTATED_QUERY + r"""  if (KPAIR) {
    for (int i = t; i < KP * 32; i += NT) vq_kpair[i] = vq_pack_half2(vq_kc[(i >> 5) & KMASK], vq_kc[(i >> (5 + KB)) & KMASK]);
  }
  if (VPAIR) for (int i = t; i < VP; i += NT) vq_vpair[i] = vq_pack_half2(vq_vc[i & VMASK], vq_vc[(i >> VB) & VMASK]);
  const float qnorm = ROTQ ? (1.0f / VQ_SQRT((float)D)) : 1.0f;
  // The score mma's B operand (k = key dims, n = query heads; heads >= REP are zero).
  uint32_t qb[2 * KS];
  {
    const bool head = grp < REP;
    const int qrow = (head ? grp : 0) * D;
    VQ_UNROLL
    for (int ks = 0; ks < KS; ++ks) {
      const int d = qrow + tg * (D / 4) + 4 * ks;
      qb[2 * ks] = head ? vq_pack_half2(vq_qt[d] * qnorm, vq_qt[d + 1] * qnorm) : 0u;
      qb[2 * ks + 1] = head ? vq_pack_half2(vq_qt[d + 2] * qnorm, vq_qt[d + 3] * qnorm) : 0u;
    }
  }
  VQ_SYNC();

  // The thread's n-word bit range of a row, shifted so that it starts at bit 0 of w[0] (n is
  // KN or VN: a constant once the lambda is inlined, so the loops unroll to n).
  constexpr int NMAX = KN > VN ? KN : VN;
  auto load_bits = [&](uint32_t* w, const uint32_t* row, int bit0, int n) {
    const int wi = bit0 >> 5;
    const int sh = bit0 & 31;
    VQ_UNROLL
    for (int i = 0; i < NMAX; ++i) if (i < n) w[i] = row[wi + i];
    if (sh) {
      VQ_UNROLL
      for (int i = 0; i + 1 < NMAX; ++i) if (i + 1 < n) w[i] = (w[i] >> sh) | (w[i + 1] << (32 - sh));
    }
  };
  // `width` bits at bit `bit` of an aligned range (bit a compile-time constant once unrolled).
  auto bits_at = [&](const uint32_t* w, int bit, int width) -> uint32_t {
    uint32_t c = w[bit >> 5] >> (bit & 31);
    if ((bit & 31) + width > 32) c |= w[(bit >> 5) + 1] << (32 - (bit & 31));
    return c & ((1u << width) - 1u);
  };
  auto key_pair = [&](const uint32_t* w, int j) -> uint32_t {  // relative key dims j, j + 1
    const uint32_t c = bits_at(w, j * KB, 2 * KB);
    return KPAIR ? vq_kpair[c * 32 + lane] : vq_pack_half2(vq_kc[c & KMASK], vq_kc[c >> KB]);
  };
  auto value_pair = [&](const uint32_t* wa, const uint32_t* wb, int j) -> uint32_t {  // relative dim j, two tokens
    const uint32_t ca = bits_at(wa, j * VB, VB);
    const uint32_t cb = bits_at(wb, j * VB, VB);
    return VPAIR ? vq_vpair[ca | (cb << VB)] : vq_pack_half2(vq_vc[ca], vq_vc[cb]);
  };

  float m_run[2] = {VQ_NEG_INF, VQ_NEG_INF};  // heads 2 tg and 2 tg + 1
  float l_run[2] = {0.0f, 0.0f};
  float acc[4 * KS];  // value sums (C of the value mma): dims grp D/8 + mt (+ D/16), heads 2 tg (+ 1)
  VQ_UNROLL
  for (int i = 0; i < 4 * KS; ++i) acc[i] = 0.0f;
  const size_t base = (size_t)bh * CAP;
  // The warp's next tile is copied into its second buffer while the current one is computed,
  // straight from global memory (no registers held for it: they cap the occupancy).
  auto fetch = [&](uint32_t* dst, int tok) {
    const int n = VQ_MINI(16, end - tok) * RW;
    VQ_UNROLL
    for (int u = 0; u < PRE; ++u) {
      const int i = lane + 32 * u;
      if (i < TW) vq_cp_async4(dst + i, rows + (base + (size_t)tok) * RW + (i < n ? i : 0), i < n);
    }
    vq_cp_commit();
  };
  fetch(vq_tile + warp * 2 * TW, start + warp * 16);
  int buffer = 0;
  for (int tile0 = start; tile0 < end; tile0 += NW * 16) {
    const int tok0 = tile0 + warp * 16;
    const int ntok = VQ_MINI(16, end - tok0);
    uint32_t* tile = vq_tile + (warp * 2 + buffer) * TW;
    vq_cp_wait();
    VQ_WSYNC();
    buffer ^= 1;
    fetch(vq_tile + (warp * 2 + buffer) * TW, tok0 + NW * 16);
    // ---- scores of tokens grp and grp + 8 for heads 2 tg, 2 tg + 1
    const uint32_t* r0 = tile + grp * RW;
    const uint32_t* r1 = r0 + 8 * RW;
    float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    {
      uint32_t k0[KN];
      uint32_t k1[KN];
      load_bits(k0, r0, tg * KBITS, KN);
      load_bits(k1, r1, tg * KBITS, KN);
      VQ_UNROLL
      for (int ks = 0; ks < KS; ++ks) {
        uint32_t a[4];
        a[0] = key_pair(k0, 4 * ks);
        a[1] = key_pair(k1, 4 * ks);
        a[2] = key_pair(k0, 4 * ks + 2);
        a[3] = key_pair(k1, 4 * ks + 2);
        vq_mma16816(sc, a, qb + 2 * ks);
      }
    }
    const uint32_t n0 = r0[KW + VW];  // fp16 key norm (low half), value norm
    const uint32_t n1 = r1[KW + VW];
    const bool ok0 = grp < ntok;
    const bool ok1 = grp + 8 < ntok;
    const float kn0 = vq_half_bits(n0);
    const float kn1 = vq_half_bits(n1);
    const float s00 = ok0 ? sc[0] * kn0 : VQ_NEG_INF;
    const float s01 = ok0 ? sc[1] * kn0 : VQ_NEG_INF;
    const float s10 = ok1 ? sc[2] * kn1 : VQ_NEG_INF;
    const float s11 = ok1 ? sc[3] * kn1 : VQ_NEG_INF;
    // ---- online softmax over the warp's tokens (lanes of one tg hold one pair of heads)
    float mx0 = VQ_MAXF(s00, s10);
    float mx1 = VQ_MAXF(s01, s11);
    VQ_UNROLL
    for (int o = 4; o < 32; o <<= 1) {
      mx0 = VQ_MAXF(mx0, vq_shfl_xor(mx0, o));
      mx1 = VQ_MAXF(mx1, vq_shfl_xor(mx1, o));
    }
    const float mn0 = VQ_MAXF(m_run[0], mx0);
    const float mn1 = VQ_MAXF(m_run[1], mx1);
    const float al0 = (m_run[0] == VQ_NEG_INF) ? 0.0f : VQ_EXP(m_run[0] - mn0);
    const float al1 = (m_run[1] == VQ_NEG_INF) ? 0.0f : VQ_EXP(m_run[1] - mn1);
    const float p00 = ok0 ? VQ_EXP(s00 - mn0) : 0.0f;
    const float p01 = ok0 ? VQ_EXP(s01 - mn1) : 0.0f;
    const float p10 = ok1 ? VQ_EXP(s10 - mn0) : 0.0f;
    const float p11 = ok1 ? VQ_EXP(s11 - mn1) : 0.0f;
    l_run[0] = l_run[0] * al0 + p00 + p10;
    l_run[1] = l_run[1] * al1 + p01 + p11;
    m_run[0] = mn0;
    m_run[1] = mn1;
    // ---- the weights p * ||v|| into the value mma's B layout (tokens x heads)
    {
      const float vn0 = vq_half_bits(n0 >> 16);
      const float vn1 = vq_half_bits(n1 >> 16);
      const uint32_t w0 = vq_pack_half2(p00 * vn0, p01 * vn0);  // token grp, heads 2 tg, 2 tg + 1
      const uint32_t w1 = vq_pack_half2(p10 * vn1, p11 * vn1);  // token grp + 8
      unsigned short* pw = reinterpret_cast<unsigned short*>(vq_p + warp * 64);
      pw[(2 * tg) * 16 + grp] = (unsigned short)(w0 & 0xffffu);
      pw[(2 * tg + 1) * 16 + grp] = (unsigned short)(w0 >> 16);
      pw[(2 * tg) * 16 + grp + 8] = (unsigned short)(w1 & 0xffffu);
      pw[(2 * tg + 1) * 16 + grp + 8] = (unsigned short)(w1 >> 16);
    }
    VQ_WSYNC();
    uint32_t pb[2];
    pb[0] = vq_p[warp * 64 + grp * 8 + tg];
    pb[1] = vq_p[warp * 64 + grp * 8 + tg + 4];
    // ---- values: m-tile mt's rows grp, grp + 8 are value dims grp D/8 + mt (+ D/16) of
    // tokens 2 tg, 2 tg + 1 (+ 8)
    {
      uint32_t wa[VN];
      uint32_t wb[VN];
      uint32_t wc[VN];
      uint32_t wd[VN];
      const uint32_t* va = tile + (2 * tg) * RW + KW;
      load_bits(wa, va, grp * VBITS, VN);
      load_bits(wb, va + RW, grp * VBITS, VN);
      load_bits(wc, va + 8 * RW, grp * VBITS, VN);
      load_bits(wd, va + 9 * RW, grp * VBITS, VN);
      VQ_UNROLL
      for (int mt = 0; mt < KS; ++mt) {
        acc[4 * mt] *= al0;
        acc[4 * mt + 1] *= al1;
        acc[4 * mt + 2] *= al0;
        acc[4 * mt + 3] *= al1;
        uint32_t a[4];
        a[0] = value_pair(wa, wb, mt);
        a[1] = value_pair(wa, wb, mt + KS);
        a[2] = value_pair(wc, wd, mt);
        a[3] = value_pair(wc, wd, mt + KS);
        vq_mma16816(acc + 4 * mt, a, pb);
      }
    }
    VQ_WSYNC();
  }

  // ---- the warps' (o, m, l) merged into this split's
  VQ_UNROLL
  for (int o = 4; o < 32; o <<= 1) {
    l_run[0] += vq_shfl_xor(l_run[0], o);
    l_run[1] += vq_shfl_xor(l_run[1], o);
  }
  if (grp == 0) {
    vq_wm[warp * 8 + 2 * tg] = m_run[0];
    vq_wm[warp * 8 + 2 * tg + 1] = m_run[1];
    vq_wl[warp * 8 + 2 * tg] = l_run[0];
    vq_wl[warp * 8 + 2 * tg + 1] = l_run[1];
  }
  VQ_SYNC();
  float f[2];
  VQ_UNROLL
  for (int j = 0; j < 2; ++j) {
    float mb = VQ_NEG_INF;
    for (int w = 0; w < NW; ++w) mb = VQ_MAXF(mb, vq_wm[w * 8 + 2 * tg + j]);
    f[j] = (m_run[j] == VQ_NEG_INF) ? 0.0f : VQ_EXP(m_run[j] - mb);
  }
  auto red = VQ_FPTR(vq_tile);
  VQ_UNROLL
  for (int mt = 0; mt < KS; ++mt) {
    VQ_UNROLL
    for (int i = 0; i < 4; ++i) {
      const int h = 2 * tg + (i & 1);
      if (h < REP) red[(warp * REP + h) * D + grp * (D / 8) + mt + KS * (i >> 1)] = acc[4 * mt + i] * f[i & 1];
    }
  }
  VQ_SYNC();
  const size_t obase = ((size_t)bh * S + s) * REP;
  for (int i = t; i < REP * D; i += NT) {
    const int h = i / D;
    const int d = i % D;
    float sum = 0.0f;
    for (int w = 0; w < NW; ++w) sum += red[(w * REP + h) * D + d];
    o[obase * D + i] = sum;
  }
  if (t < REP) {
    float mb = VQ_NEG_INF;
    for (int w = 0; w < NW; ++w) mb = VQ_MAXF(mb, vq_wm[w * 8 + t]);
    float lt = 0.0f;
    for (int w = 0; w < NW; ++w) {
      if (vq_wm[w * 8 + t] != VQ_NEG_INF) lt += vq_wl[w * 8 + t] * VQ_EXP(vq_wm[w * 8 + t] - mb);
    }
    ml[(obase + t) * 2] = mb;
    ml[(obase + t) * 2 + 1] = lt;
  }
"""

# Shared by `merge` and `merge_encode` (block (bh, r), thread d): the block's query row,
# the softmax merge of the S splits of that row, in the value domain, and an in-place
# FWHT of vq_buf[D].
_MERGE_ROW = r"""
  const int row = vq_by;
  const int bh = row / REP;
  const int r = row % REP;
  const int S = meta[0];
  VQ_SHARED float vq_buf[D];
"""
# The splits of row (bh, r): every thread reads the statistics at once (the max in
# one strided pass, then the weights exp(m_s - M) through shared memory, D splits
# at a time), so the loads of o are independent of one another and can overlap.
_MERGE_SPLITS = r"""
  VQ_SHARED float vq_e[D];
  VQ_SHARED float vq_wm[D / 32];
  const size_t mlrow = (size_t)bh * S;
  float M = VQ_NEG_INF;
  for (int s = d; s < S; s += D) M = VQ_MAXF(M, ml[((mlrow + s) * REP + r) * 2]);
  M = vq_warp_max(M);
  if ((d & 31) == 0) vq_wm[d >> 5] = M;
  VQ_SYNC();
  for (int w = 0; w < D / 32; ++w) M = VQ_MAXF(M, vq_wm[w]);
  float L = 0.0f;
  float acc = 0.0f;
  for (int c0 = 0; c0 < S; c0 += D) {
    float e = 0.0f;
    if (c0 + d < S && M != VQ_NEG_INF) {
      const size_t idx = (mlrow + c0 + d) * REP + r;
      const float m = ml[idx * 2];
      if (m != VQ_NEG_INF) {
        e = VQ_EXP(m - M);
        L += e * ml[idx * 2 + 1];
      }
    }
    vq_e[d] = e;
    VQ_SYNC();
    const int n = VQ_MINI(D, S - c0);
    VQ_UNROLL8
    for (int k = 0; k < n; ++k) acc += vq_e[k] * o[((mlrow + c0 + k) * REP + r) * D + d];
    VQ_SYNC();
  }
  L = vq_warp_sum(L);
  if ((d & 31) == 0) vq_wm[d >> 5] = L;
  VQ_SYNC();
  L = 0.0f;
  for (int w = 0; w < D / 32; ++w) L += vq_wm[w];
"""
_FWHT_BUF = r"""
    for (int h = 1; h < D; h <<= 1) {
      if ((d & h) == 0) {
        const float a = vq_buf[d];
        const float b = vq_buf[d + h];
        vq_buf[d] = a + b;
        vq_buf[d + h] = a - b;
      }
      VQ_SYNC();
    }
"""

# A partial over fp16 tokens (po, pml of output row `row`, already in the output
# domain) merged into the running (acc, M, L) of value coordinate d.
_MERGE_PLAIN = r"""  if (HAS_PLAIN) {
    const float mp = pml[(size_t)row * 2];
    const float lp = pml[(size_t)row * 2 + 1];
    const float Mp = VQ_MAXF(M, mp);
    const float ec = (M == VQ_NEG_INF) ? 0.0f : VQ_EXP(M - Mp);
    const float ep = (mp == VQ_NEG_INF) ? 0.0f : VQ_EXP(mp - Mp);
    acc = acc * ec + po[(size_t)row * D + d] * ep;
    L = L * ec + lp * ep;
  }
"""

# `merge_encode`'s fp16 tokens (the sinks and the window, as held: arrays pa_* of meta[1]
# tokens and pb_* of meta[2], (BH, n, D) TX, keys centred here with kmean): their scores
# for query row `row` (one warp per token), softmax weights and value sum (thread d: value
# coordinate d), merged into the running (acc, M, L) as `_MERGE_PLAIN` merges a partial. In
# the kernel, not as a separate partial: that partial was a handful of tiny launches per
# layer and step. vq_ps (PMAX floats) is declared by the kernel.
_MERGE_TOKENS = r"""  if (@GATE) {
    const int NA = meta[1];
    const int NB = meta[2];
    const int NBS = @NBS;  // pb's tokens per head as held: NB, or a fixed-capacity tail's capacity
    VQ_SYNC();
    vq_buf[d] = VQ_F(q[(size_t)row * D + d]) * qscale[0];
    VQ_SYNC();
    // Unrolled so that each warp has several tokens' loads in flight: with one block per
    // query row the GPU is far from full, and a token at a time waits out every load.
    VQ_UNROLL4
    for (int p0 = 0; p0 < NA + NB; p0 += D / 32) {  // every warp the same trips: the reduction is collective
      const int p = p0 + (d >> 5);
      float part = 0.0f;
      if (p < NA + NB) {
        const VQ_GLOBAL TX* kp = (p < NA) ? pa_k + ((size_t)bh * NA + p) * D : pb_k + ((size_t)bh * NBS + (p - NA)) * D;
        VQ_UNROLL
        for (int i = d & 31; i < D; i += 32) {
          part += vq_buf[i] * (VQ_F(kp[i]) - (@CENTER ? VQ_F(kmean[(size_t)bh * D + i]) : 0.0f));
        }
      }
      part = vq_warp_sum(part);
      if ((d & 31) == 0 && p < NA + NB) vq_ps[p] = part;
    }
    VQ_SYNC();
    float mp = VQ_NEG_INF;
    for (int p = 0; p < NA + NB; ++p) mp = VQ_MAXF(mp, vq_ps[p]);
    float lp = 0.0f;
    float po = 0.0f;
    VQ_UNROLL8
    for (int p = 0; p < NA; ++p) {
      const float e = VQ_EXP(vq_ps[p] - mp);
      lp += e;
      po += e * VQ_F(pa_v[((size_t)bh * NA + p) * D + d]);
    }
    VQ_UNROLL8
    for (int p = 0; p < NB; ++p) {
      const float e = VQ_EXP(vq_ps[NA + p] - mp);
      lp += e;
      po += e * VQ_F(pb_v[((size_t)bh * NBS + p) * D + d]);
    }
    const float Mp = VQ_MAXF(M, mp);
    const float ec = (M == VQ_NEG_INF) ? 0.0f : VQ_EXP(M - Mp);
    const float ep = (mp == VQ_NEG_INF) ? 0.0f : VQ_EXP(mp - Mp);
    acc = acc * ec + po * ep;
    L = L * ec + lp * ep;
  }
"""


_WINDOW_KEY = "pb_k + ((size_t)bh * NBS + (p - NA)) * D"
_WINDOW_VALUE = "pb_v[((size_t)bh * NBS + p) * D + d]"


def _merge_tokens(gate: str, center: str, slide: bool = False, held: str = "NB") -> str:
    """`_MERGE_TOKENS` under the kernel's own flags: `gate` (fp16 tokens present), `center` (keys
    centred), `held`: pb's tokens per head as held (its row stride). `slide`: the window (pb) is
    read as it is after the step's slide, the new token kx / vx in place of the one at slot
    meta[3] (`MERGE_ENCODE_SLIDE`)."""
    text = _MERGE_TOKENS.replace("@GATE", gate).replace("@CENTER", center).replace("@NBS", held)
    if slide:
        assert _WINDOW_KEY in text and _WINDOW_VALUE in text
        text = text.replace(_WINDOW_KEY, f"(p - NA == meta[3] ? kx + (size_t)bh * D : {_WINDOW_KEY})")
        text = text.replace(_WINDOW_VALUE, f"(p == meta[3] ? vx[(size_t)bh * D + d] : {_WINDOW_VALUE})")
    return text


# Template constants: D (dim, = threads per block), REP, UNROT (un-rotate the
# value sum with the value codec's seeded-sign FWHT; needs D a power of two), UNMAP
# (0, or the heads of vmap: leave a dense per-head value domain through vmap (UNMAP, D, D) f32),
# HAS_PLAIN (merge a partial over fp16 tokens, already in the output domain),
# HAS_TOKENS (attend to fp16 sinks / window tokens as held, `_MERGE_TOKENS`; keys
# centred with kmean when HAS_VMEAN), PMAX (>= their count), TX (their dtype),
# HAS_VMEAN (centered values: add l * mean_v), TO (output dtype).
# Inputs: o (BH, S, REP, D) f32, ml (BH, S, REP, 2) f32, vsigns (D) f32,
#   meta int32 [S, NA, NB, NBS], po (BH*REP, D) f32, pml (BH*REP, 2) f32, vmean (BH, D) f32,
#   q (BH*REP, D), qscale f32 [scale], kmean (BH, D) f32, pa_k, pa_v (BH, NA, D) TX, pb_k, pb_v (BH, NBS, D) TX
#   (the first NB of pb's NBS tokens per head: a fixed-capacity tail holds more than it fills).
# Output: out (BH*REP, D) TO.  Grid: (D, BH*REP) threads in blocks of D.
MERGE = r"""
  const int d = vq_tid;
""" + _MERGE_ROW + r"""  VQ_SHARED float vq_ps[PMAX];
""" + _MERGE_SPLITS + r"""  if (UNROT) {
    vq_buf[d] = acc;
    VQ_SYNC();
""" + _FWHT_BUF + r"""    acc = vq_buf[d] * (1.0f / VQ_SQRT((float)D)) * vsigns[d];
  }
  if (UNMAP) {  // a dense per-head domain: out_d = sum_i y_i vmap[head][i][d], head = bh % UNMAP
    vq_buf[d] = acc;
    VQ_SYNC();
    const VQ_GLOBAL float* m = vmap + (size_t)(bh % UNMAP) * D * D;
    float mapped = 0.0f;
    for (int i = 0; i < D; ++i) mapped += vq_buf[i] * m[(size_t)i * D + d];
    acc = mapped;
  }
  if (HAS_VMEAN) acc += L * vmean[(size_t)bh * D + d];
""" + _MERGE_PLAIN + _merge_tokens("HAS_TOKENS", "HAS_VMEAN", held="meta[3]") + r"""  out[(size_t)row * D + d] = VQ_CAST(TO, acc / VQ_MAXF(L, 1e-30f));
"""

# One decode step's last kernel when the new token is stored by the step itself:
# `merge` plus the new token. Block (bh, r) encodes kv head bh's new key and value
# (as `mse_encode`; every block of bh computes them, block r = 0 stores the row),
# scores the new key for query row r from its codes (as `mse_partial`), merges it
# with the splits and un-rotates. Template constants: D (a power of two; both
# roles rotate in-kernel), REP, K*/V* as in `_ENCODE_ROLE` (KD = VD = KP2 = VP2 =
# D), NTH (= D), RW, HAS_CENTER (subtract kmean / vmean before encoding, add
# L * vmean to the output), HAS_PLAIN (attend to fp16 sinks / window tokens too,
# `_MERGE_TOKENS`), PMAX (>= their count), TX (new key / value and fp16 token dtype), TO
# (output dtype).
# Inputs: o (BH, S, REP, D) f32, ml (BH, S, REP, 2) f32, q (BH*REP, D), kx, vx
# (BH, D) TX, ksigns, vsigns (D) f32, kbnd, vbnd, kcent, vcent f32, meta int32
# [S, NA, NB], qscale f32 [scale], kmean, vmean (BH, D), pa_k, pa_v (BH, NA, D) TX, pb_k,
# pb_v (BH, NB, D) TX, kscale (KH, D) f32 (with KSC: the new key is encoded as (k - kmean) / s and
# scored with q * s, smoothed keys; the fp16 tokens meet q as held). Outputs: out (BH*REP, D) TO,
# rec (BH, RW) u32. Grid: (D, BH*REP) threads in blocks of D.
_KEY_RESULT = "kcode_out = code; knorm_out = VQ_F(VQ_CAST(vq_half, out_norm));"
_VALUE_RESULT = "vcode_out = code; vnorm_out = VQ_F(VQ_CAST(vq_half, out_norm));"
_CENTERED = "VQ_F({x}) - (HAS_CENTER ? VQ_F({mean}[(size_t)bh * D + t]) : 0.0f)"
_KEY_SCALE = "(KSC ? kscale[(size_t)(bh % KH) * D + {i}] : 1.0f)"
_NEW_TOKEN = "x[(size_t)bh * D + t]"
_LEAVING_TOKEN = "{window}[((size_t)bh * meta[2] + meta[3]) * D + t]"  # the window's slot meta[3]
# `MERGE_ENCODE_SLIDE`'s last lines: the REP blocks of kv head bh write the window after the
# slide, kx / vx at slot meta[3] and the held tokens elsewhere (outputs wk, wv (BH, NB, D) TX),
# block r taking tokens r, r + REP, ...; each thread loads 8 tokens' coordinates before storing
# any, so their loads are in flight together (a store to wk may alias pb_k for all the compiler
# knows, so a plain loop would wait out one load per token).
_WRITE_WINDOW = r"""  {
    const int nwin = meta[2];
    const int slot = meta[3];
    for (int p0 = r; p0 < nwin; p0 += 8 * REP) {
      TX held_k[8];
      TX held_v[8];
      VQ_UNROLL
      for (int u = 0; u < 8; ++u) {
        const int p = p0 + u * REP;
        if (p < nwin) {
          const size_t i = ((size_t)bh * nwin + p) * D + t;
          held_k[u] = (p == slot) ? kx[(size_t)bh * D + t] : pb_k[i];
          held_v[u] = (p == slot) ? vx[(size_t)bh * D + t] : pb_v[i];
        }
      }
      VQ_UNROLL
      for (int u = 0; u < 8; ++u) {
        const int p = p0 + u * REP;
        if (p < nwin) {
          const size_t i = ((size_t)bh * nwin + p) * D + t;
          wk[i] = held_k[u];
          wv[i] = held_v[u];
        }
      }
    }
  }
"""


def _merge_encode(slide: bool) -> str:
    """`MERGE_ENCODE`'s body; with `slide`, `MERGE_ENCODE_SLIDE`'s."""
    key = _LEAVING_TOKEN.format(window="pb_k") if slide else _NEW_TOKEN
    value = _LEAVING_TOKEN.format(window="pb_v") if slide else _NEW_TOKEN
    return r"""
  const int t = vq_tid;
  const int d = t;
""" + _MERGE_ROW + r"""  VQ_SHARED float vq_red[D];
  VQ_SHARED float vq_ps[PMAX];
  VQ_SHARED uint32_t vq_codes[D];
  uint32_t kcode_out = 0u;
  uint32_t vcode_out = 0u;
  float knorm_out = 0.0f;
  float vnorm_out = 0.0f;
""" + _encode_role(0, "K", "k", guard="true", value="(" + _CENTERED.format(x=key, mean="kmean") + ") / "
                   + _KEY_SCALE.format(i="t"), row="bh", out="rec",
                   store="r == 0", result=_KEY_RESULT) + "  VQ_SYNC();\n" + _encode_role(
    1, "V", "v", guard="true", value=_CENTERED.format(x=value, mean="vmean"), row="bh", out="rec", store="r == 0",
    result=_VALUE_RESULT) + r"""
  // The new key's score for query row r, as mse_partial computes it.
  VQ_SYNC();
  vq_buf[d] = VQ_F(q[(size_t)row * D + d]) * qscale[0] * """ + _KEY_SCALE.format(i="d") + r""" * ksigns[d];
  VQ_SYNC();
""" + _FWHT_BUF + r"""  vq_red[t] = vq_buf[t] * (1.0f / VQ_SQRT((float)D)) * kcent[kcode_out];
  VQ_SYNC();
  for (int s = D / 2; s > 0; s >>= 1) {
    if (t < s) vq_red[t] += vq_red[t + s];
    VQ_SYNC();
  }
  const float s_new = """ + ("meta[4] ? VQ_NEG_INF : " if slide else "") + r"""vq_red[0] * knorm_out;
  // The splits, then the new token (thread t holds value coordinate t).
""" + _MERGE_SPLITS + r"""  const float M2 = VQ_MAXF(M, s_new);
  const float ec = (M == VQ_NEG_INF) ? 0.0f : VQ_EXP(M - M2);
  const float en = (s_new == VQ_NEG_INF) ? 0.0f : VQ_EXP(s_new - M2);
  acc = acc * ec + en * vnorm_out * vcent[vcode_out];
  L = L * ec + en;
  VQ_SYNC();
  vq_buf[d] = acc;
  VQ_SYNC();
""" + _FWHT_BUF + r"""  acc = vq_buf[d] * (1.0f / VQ_SQRT((float)D)) * vsigns[d];
  if (HAS_CENTER) acc += L * VQ_F(vmean[(size_t)bh * D + t]);
  M = M2;
""" + _merge_tokens("HAS_PLAIN", "HAS_CENTER", slide) + r"""  out[(size_t)row * D + t] = VQ_CAST(TO, acc / VQ_MAXF(L, 1e-30f));
""" + (_WRITE_WINDOW if slide else "")


MERGE_ENCODE = _merge_encode(slide=False)
# A decode step that also slides the fp16 window (`kernels/step.py`): the token encoded is the
# window's oldest, at slot meta[3] of pb (the window is a ring: decode attention does not depend
# on the order of the tokens it reads), and kx / vx, the new token, take its slot. The window
# after the slide is an output, so a decode step of a windowed cache launches what a plain one does.
# meta[4] != 0: the encoded token is not attended to from its codes (it was kept in fp16 as it
# left the window, `kept.py`, and a split of the step's holds it). Meta: int32 [S, NA, NB, slot, kept].
MERGE_ENCODE_SLIDE = _merge_encode(slide=True)


# Tokens kept in fp16 past the window (`kept.py`), for a decode step that scored every stored
# code: two splits per query row, in the value codec's domain, merged with the step's others.
# Split 0 holds minus the kept tokens' code terms (those whose row is stored, below meta[0]),
# split 1 the kept tokens in fp16 (keys centred with kmean, values centred with vmean and
# rotated into the value domain, H S x / sqrt(D)). Block (row = bh * REP + r), thread d.
# Template constants: D (a power of two, = threads), REP, KB, VB, KW, VW, RW (mse rows),
# HAS_CENTER, KSC, KH (smoothed keys' scales), SB (>= the slots: shared score arrays), TX (kept
# keys / values dtype). Inputs: q (BH*REP, D), rows (BH, CAP, RW) u32, kcent, vcent, ksigns,
# vsigns f32, kk, kv (BH, C1, D) TX, kpos (C1) int32 (1 << 30: empty), meta int32 [stored,
# first coded position, CAP, C1], qscale f32 [scale], kmean, vmean (BH, D) f32, kscale (KH, D)
# f32, slide int32 [5] (merge_encode_slide's meta). Outputs: o (BH, 2, REP, D) f32, ml (BH, 2,
# REP, 2) f32, slide_out int32 [5]: slide with two more splits and [4] = whether the kept tokens
# include the one at row meta[0] (the token a fused step encodes: not attended to from its codes).
# Grid: (D, BH*REP) threads in blocks of D.
KEPT_SPLITS = r"""
  const int d = vq_tid;
  const int row = vq_by;
  const int bh = row / REP;
  const int r = row % REP;
  constexpr int NW = D / 32;
  constexpr uint32_t KMASK = (1u << KB) - 1u;
  constexpr uint32_t VMASK = (1u << VB) - 1u;
  constexpr int EMPTY_POS = 1 << 30;
  const int stored = meta[0];
  const int first_code = meta[1];
  const int CAP = meta[2];
  const int C1 = meta[3];
  VQ_SHARED float vq_buf[D];
  VQ_SHARED float vq_qr[D];
  VQ_SHARED float vq_qp[D];
  VQ_SHARED float vq_sc[SB];
  VQ_SHARED float vq_sf[SB];
  VQ_SHARED float vq_vn[SB];
  VQ_SHARED int vq_at[SB];
  const float qv = VQ_F(q[(size_t)row * D + d]) * qscale[0];
  vq_qp[d] = qv;
  vq_buf[d] = qv * (KSC ? kscale[(size_t)(bh % KH) * D + d] : 1.0f) * ksigns[d];
  VQ_SYNC();
""" + _FWHT_BUF + r"""  vq_qr[d] = vq_buf[d] * (1.0f / VQ_SQRT((float)D));
  VQ_SYNC();
  // Scores: warp w takes slots w, w + NW, ... (every warp the same trips: the sums are collective).
  for (int s0 = 0; s0 < C1; s0 += NW) {
    const int s = s0 + (d >> 5);
    const int pos = s < C1 ? kpos[s] : EMPTY_POS;
    const bool held = pos < EMPTY_POS;
    const int crow = pos - first_code;
    const bool coded = held && crow >= 0 && crow < stored;
    float pf = 0.0f;
    float pc = 0.0f;
    if (held) {
      const VQ_GLOBAL TX* kp = kk + ((size_t)bh * C1 + s) * D;
      for (int i = d & 31; i < D; i += 32) {
        pf += vq_qp[i] * (VQ_F(kp[i]) - (HAS_CENTER ? kmean[(size_t)bh * D + i] : 0.0f));
      }
    }
    if (coded) {
      const VQ_GLOBAL uint32_t* w = rows + ((size_t)bh * CAP + crow) * RW;
      for (int i = d & 31; i < D; i += 32) {
        const int bit = i * KB;
        const int wi = bit >> 5;
        const int sh = bit & 31;
        uint32_t c = w[wi] >> sh;
        if (sh + KB > 32) c |= w[wi + 1] << (32 - sh);
        pc += vq_qr[i] * kcent[c & KMASK];
      }
    }
    pf = vq_warp_sum(pf);
    pc = vq_warp_sum(pc);
    if ((d & 31) == 0 && s < C1) {
      const uint32_t norms = coded ? rows[((size_t)bh * CAP + crow) * RW + KW + VW] : 0u;
      vq_sf[s] = held ? pf : VQ_NEG_INF;
      vq_sc[s] = coded ? pc * vq_half_bits(norms) : VQ_NEG_INF;
      vq_vn[s] = vq_half_bits(norms >> 16);
      vq_at[s] = coded ? crow : 0;
    }
  }
  VQ_SYNC();
  float mc = VQ_NEG_INF;
  float mf = VQ_NEG_INF;
  for (int s = 0; s < C1; ++s) {
    mc = VQ_MAXF(mc, vq_sc[s]);
    mf = VQ_MAXF(mf, vq_sf[s]);
  }
  float lc = 0.0f;
  float lf = 0.0f;
  float oc = 0.0f;
  float of = 0.0f;
  const float vm = HAS_CENTER ? vmean[(size_t)bh * D + d] : 0.0f;
  const int vbit = d * VB;
  const int vwi = KW + (vbit >> 5);
  const int vsh = vbit & 31;
  // Every slot's loads are independent of the others' (offsets and norms staged above): unrolled,
  // several are in flight at once.
  VQ_UNROLL4
  for (int s = 0; s < C1; ++s) {
    if (vq_sc[s] != VQ_NEG_INF) {
      const VQ_GLOBAL uint32_t* w = rows + ((size_t)bh * CAP + vq_at[s]) * RW + vwi;
      uint32_t c = w[0] >> vsh;
      if (vsh + VB > 32) c |= w[1] << (32 - vsh);
      const float e = VQ_EXP(vq_sc[s] - mc);
      lc += e;
      oc += e * vq_vn[s] * vcent[c & VMASK];
    }
    if (vq_sf[s] != VQ_NEG_INF) {
      const float e = VQ_EXP(vq_sf[s] - mf);
      lf += e;
      of += e * (VQ_F(kv[((size_t)bh * C1 + s) * D + d]) - vm);
    }
  }
  VQ_SYNC();
  vq_buf[d] = of * vsigns[d];
  VQ_SYNC();
""" + _FWHT_BUF + r"""  of = vq_buf[d] * (1.0f / VQ_SQRT((float)D));
  const size_t ob = (size_t)bh * 2 * REP;
  o[(ob + r) * D + d] = -oc;
  o[(ob + REP + r) * D + d] = of;
  if (d == 0) {
    ml[(ob + r) * 2] = mc;
    ml[(ob + r) * 2 + 1] = -lc;
    ml[(ob + REP + r) * 2] = mf;
    ml[(ob + REP + r) * 2 + 1] = lf;
  }
  if (row == 0 && d == 0) {
    int encoded = 0;
    for (int s = 0; s < C1; ++s) encoded |= (kpos[s] < EMPTY_POS && kpos[s] - first_code == stored) ? 1 : 0;
    slide_out[0] = slide[0] + 2;
    slide_out[1] = slide[1];
    slide_out[2] = slide[2];
    slide_out[3] = slide[3];
    slide_out[4] = encoded;
  }
"""

# A decode step's kept-token bookkeeping (`KeptTokens.decode_step_sliding`) before a fused step
# slides the window ring: the query's window shares (each query head's softmax over its fp16
# tokens, the sinks and its band, the band's part summed over the heads and divided by their
# number), added to the running shares of the window's tokens; the oldest token (at ring slot
# meta[0], position meta[1]) settled: kept in the next free slot if its share reaches par[1]
# and a slot is free. The band is the window after the slide: ring slots meta[0] + 1, ... and
# the entering token xk (the query's own). Block 0 computes the shares; the NB blocks copy the
# slots (each decides the fill from the inputs). Template constants: D, H (kv heads), REP,
# W (the window), TOKB (>= sinks + W), NT, NB, TX. Inputs: q (H*REP, D), ringk, ringv (H, W, D) TX,
# xk (H, D) TX, sk (H, NSK, D) TX, run (W) f32 (shares of positions meta[1], ...), meta int32
# [slot, first, query position, first fp16 position, slots' capacity, NSK, C1], par f32 [scale,
# threshold], count int32 [1], kk, kv (H, C1, D) TX, kpos (C1) int32. Outputs: run_out (W) f32
# (shares of positions meta[1] + 1, ...), kk_out, kv_out, kpos_out, count_out as the inputs.
KEPT_SETTLE = r"""
  const int t = vq_tid;
  const int blk = vq_bx;
  constexpr int HQ = H * REP;
  constexpr int NW = NT / 32;
  const int slot = meta[0];
  const int first = meta[1];
  const int qpos = meta[2];
  const int fp16_from = meta[3];
  const int cap = meta[4];
  const int NSK = meta[5];
  const int C1 = meta[6];
  const int NTOK = NSK + W;
  const float scale = par[0];
  VQ_SHARED float vq_s[HQ * TOKB];
  VQ_SHARED float vq_m[HQ];
  VQ_SHARED float vq_l[HQ];
  for (int p0 = 0; blk == 0 && p0 < HQ * NTOK; p0 += NW) {  // every warp the same trips: the sums are collective
    const int p = p0 + (t >> 5);
    float part = 0.0f;
    bool ok = false;
    if (p < HQ * NTOK) {
      const int hq = p / NTOK;
      const int j = p % NTOK;
      const int h = hq / REP;
      if (j < NSK) {  // (sk may be a dummy in another address space: read apart from the window's keys)
        ok = j <= qpos;
        if (ok) {
          for (int i = t & 31; i < D; i += 32) part += VQ_F(q[(size_t)hq * D + i]) * VQ_F(sk[((size_t)h * NSK + j) * D + i]);
        }
      } else {
        const int b = j - NSK;
        const int pos = qpos - W + 1 + b;
        ok = pos >= fp16_from && pos >= first;
        const VQ_GLOBAL TX* kp = (b == W - 1) ? xk + (size_t)h * D : ringk + ((size_t)h * W + (slot + 1 + b) % W) * D;
        if (ok) {
          for (int i = t & 31; i < D; i += 32) part += VQ_F(q[(size_t)hq * D + i]) * VQ_F(kp[i]);
        }
      }
    }
    part = vq_warp_sum(part);
    if ((t & 31) == 0 && p < HQ * NTOK) vq_s[p] = ok ? part * scale : VQ_NEG_INF;
  }
  VQ_SYNC();
  for (int hq = t; blk == 0 && hq < HQ; hq += NT) {
    float m = VQ_NEG_INF;
    for (int j = 0; j < NTOK; ++j) m = VQ_MAXF(m, vq_s[hq * NTOK + j]);
    float l = 0.0f;
    for (int j = 0; j < NTOK; ++j) l += (vq_s[hq * NTOK + j] == VQ_NEG_INF) ? 0.0f : VQ_EXP(vq_s[hq * NTOK + j] - m);
    vq_m[hq] = m;
    vq_l[hq] = l;
  }
  VQ_SYNC();
  for (int b = t; blk == 0 && b < W; b += NT) {
    float share = 0.0f;
    for (int hq = 0; hq < HQ; ++hq) {
      const float sc = vq_s[hq * NTOK + NSK + b];
      if (sc != VQ_NEG_INF) share += VQ_EXP(sc - vq_m[hq]) / vq_l[hq];
    }
    run_out[b] = (b + 1 < W ? run[b + 1] : 0.0f) + share / (float)HQ;
  }
  const int filled = count[0];
  const bool fits = run[0] >= par[1] && filled < cap;
  for (int i = blk * NT + t; i < H * C1 * D; i += NB * NT) {
    const int s = (i / D) % C1;
    if (fits && s == filled) {
      const size_t from = ((size_t)(i / (C1 * D)) * W + slot) * D + i % D;
      kk_out[i] = ringk[from];
      kv_out[i] = ringv[from];
    } else {
      kk_out[i] = kk[i];
      kv_out[i] = kv[i];
    }
  }
  for (int s = blk * NT + t; s < C1; s += NB * NT) kpos_out[s] = (fits && s == filled) ? first : kpos[s];
  if (blk == 0 && t == 0) count_out[0] = filled + (fits ? 1 : 0);
"""


# Template constants: D, BITS, W (= ceil(D*BITS/32)), NT (threads per block),
# TO (output dtype), RW (words per row), OFF (the role's first code word), NORMH
# (the role's norm, in halves from the row start). Inputs: rows (BH, CAP, RW)
# u32 (the layout of `rows.py`), cent (2^BITS) f32, meta int32 [T, CAP]. Output: out (BH, T, D) TO, the
# decoded vectors in the codec's (rotated) domain, centroid * norm.
# Grid: (T * D, BH) threads in blocks of NT.
MSE_DEQUANT = r"""
  constexpr uint32_t MASK = (1u << BITS) - 1u;
  const int T = meta[0];
  const int CAP = meta[1];
  const int bh = vq_by;
  const int x = vq_bx * NT + vq_tid;
  const int j = x / D;
  const int d = x % D;
  if (j < T) {
    const VQ_GLOBAL uint32_t* row = rows + ((size_t)bh * CAP + j) * RW + OFF;
    const int bit = d * BITS;
    const int wi = bit >> 5;
    const int sh = bit & 31;
    uint32_t c = row[wi] >> sh;
    if (sh + BITS > 32) c |= row[wi + 1] << (32 - sh);
    const float v = cent[c & MASK] * VQ_F(VQ_HALF_CPTR(rows)[((size_t)bh * CAP + j) * RW * 2 + NORMH]);
    out[((size_t)bh * T + j) * D + d] = VQ_CAST(TO, v);
  }
"""

KERNELS: Dict[str, dict] = {
    "mse_dequant": {
        "body": MSE_DEQUANT,
        "inputs": ("rows", "cent", "meta"),
        "outputs": ("out",),
    },
    "mse_encode": {
        "body": MSE_ENCODE,
        "inputs": ("kx", "vx", "ksigns", "vsigns", "kbnd", "vbnd", "kcent", "vcent"),
        "outputs": ("rows",),
    },
    "mse_partial": {
        "body": MSE_PARTIAL,
        "inputs": ("q", "rows", "kcent", "vcent", "ksigns", "meta", "qscale", "kscale"),
        "outputs": ("o", "ml"),
    },
    "mse_partial_mma": {
        "body": MSE_PARTIAL_MMA,
        "inputs": ("q", "rows", "kcent", "vcent", "ksigns", "meta", "qscale", "kscale"),
        "outputs": ("o", "ml"),
        "dialects": ("cuda", "cpp"),  # Metal has 8x8 simdgroup matrices, not this mma
    },
    "merge_encode": {
        "body": MERGE_ENCODE,
        "inputs": ("o", "ml", "q", "kx", "vx", "ksigns", "vsigns", "kbnd", "vbnd", "kcent", "vcent", "meta",
                   "qscale", "kmean", "vmean", "pa_k", "pa_v", "pb_k", "pb_v", "kscale"),
        "outputs": ("out", "rec"),
    },
    "merge_encode_slide": {
        "body": MERGE_ENCODE_SLIDE,
        "inputs": ("o", "ml", "q", "kx", "vx", "ksigns", "vsigns", "kbnd", "vbnd", "kcent", "vcent", "meta",
                   "qscale", "kmean", "vmean", "pa_k", "pa_v", "pb_k", "pb_v", "kscale"),
        "outputs": ("out", "rec", "wk", "wv"),
    },
    "kept_splits": {
        "body": KEPT_SPLITS,
        "inputs": ("q", "rows", "kcent", "vcent", "ksigns", "vsigns", "kk", "kv", "kpos", "meta", "qscale", "kmean",
                   "vmean", "kscale", "slide"),
        "outputs": ("o", "ml", "slide_out"),
    },
    "kept_settle": {
        "body": KEPT_SETTLE,
        "inputs": ("q", "ringk", "ringv", "xk", "sk", "run", "meta", "par", "count", "kk", "kv", "kpos"),
        "outputs": ("run_out", "kk_out", "kv_out", "kpos_out", "count_out"),
    },
    "merge": {
        "body": MERGE,
        "inputs": ("o", "ml", "vsigns", "meta", "po", "pml", "vmean", "q", "qscale", "kmean", "pa_k", "pa_v",
                   "pb_k", "pb_v", "vmap"),
        "outputs": ("out",),
    },
}

TemplateValue = Union[int, bool, str]


def header(dialect: str) -> str:
    if dialect not in HEADERS:
        raise ValueError(f"unknown dialect {dialect!r}; known: {', '.join(DIALECTS)}")
    return HEADERS[dialect]


def source(kernel: str, dialect: str) -> str:
    """The kernel body for `dialect` (what `mx.fast.*_kernel(source=...)` takes)."""
    header(dialect)
    dialects = KERNELS[kernel].get("dialects", DIALECTS)
    if dialect not in dialects:
        raise ValueError(f"kernel {kernel} is written for {', '.join(dialects)}, not {dialect}")
    return _PROLOGUES[dialect] + KERNELS[kernel]["body"]


def _constant_lines(template: Iterable[Tuple[str, TemplateValue]], dialect: str) -> str:
    lines = []
    for name, value in template:
        if isinstance(value, bool):
            lines.append(f"  constexpr bool {name} = {'true' if value else 'false'};")
        elif isinstance(value, int):
            lines.append(f"  constexpr int {name} = {value};")
        else:  # a type name
            lines.append(f"  using {name} = {value};")
    return "\n".join(lines) + "\n"


# C type names of MLX dtypes, per dialect (what MLX writes in the signature).
C_TYPES = {
    "cuda": {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16",
             "uint32": "uint32_t", "int32": "int32_t"},
    "metal": {"float32": "float", "float16": "half", "bfloat16": "bfloat16_t",
              "uint32": "uint32_t", "int32": "int32_t"},
    "cpp": {"float32": "float", "float16": "_Float16", "uint32": "uint32_t", "int32": "int32_t"},
}


def render_cuda(kernel: str, template, input_dtypes: Dict[str, str], output_dtypes: Dict[str, str],
                name: str = "vq_kernel", mlx_header: bool = True) -> str:
    """The whole translation unit MLX's CUDA back end builds for this kernel
    (mirrors `build_kernel` in mlx/backend/cuda/custom_kernel.cpp), so that it
    can be compiled with nvcc ahead of a GPU run."""
    spec = KERNELS[kernel]
    ctype = C_TYPES["cuda"]
    text = ""
    if mlx_header:
        text += ('#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
                 "#define inf cuda::std::numeric_limits<float>::infinity()\n\n")
    else:
        text += "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include <cstdint>\n"
    text += header("cuda")
    text += "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n" if mlx_header else ""
    args = [f"    const {ctype[input_dtypes[n]]}* {n}" for n in spec["inputs"]]
    args += [f"    {ctype[output_dtypes[n]]}* {n}" for n in spec["outputs"]]
    text += f'extern "C" __global__ void {name}(\n' + ",\n".join(args) + ") {\n"
    text += _constant_lines(_typed(template, "cuda"), "cuda") + "\n"
    text += source(kernel, "cuda")
    text += "\n}\n"
    if mlx_header:
        text += "\n} // namespace mlx::core::cu\n"
    return text


# Inputs with fewer elements than this are passed in Metal's `constant` address space, larger ones in
# `device` (`max_constant_array_size` in mlx/backend/metal's custom kernel front end).
METAL_CONSTANT_ELEMENTS = 8


def render_metal(kernel: str, template, inputs, output_dtypes: Dict[str, str], name: str = "vq_kernel") -> str:
    """The kernel function MLX's Metal front end writes for this kernel and call (mirrors
    `write_signature` and `write_template` in mlx/backend/metal), after the header, so that it can be
    type-checked without a Mac. `inputs`: name -> (dtype name, elements, ndim) of each input array.
    An input of fewer than METAL_CONSTANT_ELEMENTS elements is a `constant` pointer there, and a
    0-d one a reference; the thread attributes are those the body names."""
    spec = KERNELS[kernel]
    ctype = C_TYPES["metal"]
    body = source(kernel, "metal")
    text = header("metal")
    if template:
        kinds = ["typename" if isinstance(v, str) else "bool" if isinstance(v, bool) else "int" for _, v in template]
        text += "template <" + ", ".join(f"{k} {n}" for k, (n, _) in zip(kinds, template)) + ">\n"
    args, index = [], 0
    for arg in spec["inputs"]:
        dtype, elements, ndim = inputs[arg]
        space = "constant" if elements < METAL_CONSTANT_ELEMENTS else "device"
        args.append(f"  const {space} {ctype[dtype]}{'&' if ndim == 0 else '*'} {arg} [[buffer({index})]]")
        index += 1
        for suffix, kind in (("_shape", "int*"), ("_strides", "int64_t*"), ("_ndim", "int&")):
            if ndim > 0 and arg + suffix in body:
                args.append(f"  const constant {kind} {arg}{suffix} [[buffer({index})]]")
                index += 1
    for arg in spec["outputs"]:
        args.append(f"  device {ctype[output_dtypes[arg]]}* {arg} [[buffer({index})]]")
        index += 1
    args += [f"  {kind} {attr} [[{attr}]]" for attr, kind in _METAL_ATTRIBUTES if attr in body]
    text += f"[[kernel]] void {name}(\n" + ",\n".join(args) + ") {\n" + body + "\n}\n"
    if template:
        values = ", ".join(ctype[v] if isinstance(v, str) else str(int(v)) for _, v in template)
        text += (f'\ntemplate [[host_name("{name}")]] [[kernel]] decltype({name}<{values}>) '
                 f"{name}<{values}>;\n")
    return text


# The thread attributes MLX's Metal front end adds to the signature when the body names them.
_METAL_ATTRIBUTES = (("dispatch_quadgroups_per_threadgroup", "uint"), ("dispatch_simdgroups_per_threadgroup", "uint"),
                     ("dispatch_threads_per_threadgroup", "uint3"), ("grid_origin", "uint3"), ("grid_size", "uint3"),
                     ("quadgroup_index_in_threadgroup", "uint"), ("quadgroups_per_threadgroup", "uint"),
                     ("simdgroup_index_in_threadgroup", "uint"), ("simdgroups_per_threadgroup", "uint"),
                     ("thread_execution_width", "uint"), ("thread_index_in_quadgroup", "uint"),
                     ("thread_index_in_simdgroup", "uint"), ("thread_index_in_threadgroup", "uint"),
                     ("thread_position_in_grid", "uint3"), ("thread_position_in_threadgroup", "uint3"),
                     ("threadgroup_position_in_grid", "uint3"), ("threadgroups_per_grid", "uint3"),
                     ("threads_per_grid", "uint3"), ("threads_per_simdgroup", "uint"), ("threads_per_threadgroup", "uint3"))


def _typed(template, dialect):
    """Template entries with dtype names ('float16') turned into C type names."""
    out = []
    for name, value in template:
        if isinstance(value, str):
            value = C_TYPES[dialect][value]
        out.append((name, value))
    return out


def render_cpp(kernel: str, template, input_dtypes: Dict[str, str], output_dtypes: Dict[str, str],
               name: str) -> str:
    """A C++ function `void name(ptrs...)` running one thread of the kernel (the
    emulator calls it from every thread of every block)."""
    spec = KERNELS[kernel]
    ctype = C_TYPES["cpp"]
    args = [f"const {ctype[input_dtypes[n]]}* {n}" for n in spec["inputs"]]
    args += [f"{ctype[output_dtypes[n]]}* {n}" for n in spec["outputs"]]
    text = f"static void {name}(" + ", ".join(args) + ") {\n"
    text += _constant_lines(_typed(template, "cpp"), "cpp") + "\n"
    text += source(kernel, "cpp")
    text += "\n}\n"
    return text
