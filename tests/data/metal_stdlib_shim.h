// The part of the Metal Shading Language (MSL) that the kernels use, declared for clang's C++
// front end, so that the Metal sources MLX would build can be type-checked without a Mac
// (tests/test_metal_sources.py). What it models of MSL (Apple, Metal Shading Language
// Specification, section 4 "Address Spaces"):
//   * device, constant and threadgroup are distinct address spaces (clang's address_space
//     attribute), and a pointer never converts from one to another: initializing a `device`
//     pointer from a `constant` one is an error, as it is for Apple's compiler;
//   * thread-local data (the default address space) converts to none of them either;
//   * MSL's scalar, vector and bit-cast types, and declarations of the builtins the kernels call.
// It is not Apple's compiler: what MSL forbids beyond these (double, recursion, ...) passes here.
#pragma once
// No system header: MSL's fixed-width integer types from the compiler's own macros.
typedef __SIZE_TYPE__ size_t;
typedef __INT8_TYPE__ int8_t;
typedef __INT16_TYPE__ int16_t;
typedef __INT32_TYPE__ int32_t;
typedef __INT64_TYPE__ int64_t;
typedef __UINT8_TYPE__ uint8_t;
typedef __UINT16_TYPE__ uint16_t;
typedef __UINT32_TYPE__ uint32_t;
typedef __UINT64_TYPE__ uint64_t;

#define device __attribute__((address_space(1)))
#define constant __attribute__((address_space(2)))
#define threadgroup __attribute__((address_space(3)))
#define thread

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned long ulong;
typedef unsigned char uchar;
typedef _Float16 half;

// MLX's bfloat16_t is MSL's builtin bfloat where the compiler has it (__HAVE_BFLOAT__, Metal 3.1:
// macOS 14 and later; MLX's bf16.h); clang's __bf16 models it.
typedef __bf16 bfloat16_t;

#define VQ_SHIM_VECTORS(T)                                    \
  typedef T T##2 __attribute__((ext_vector_type(2)));         \
  typedef T T##3 __attribute__((ext_vector_type(3)));         \
  typedef T T##4 __attribute__((ext_vector_type(4)));
VQ_SHIM_VECTORS(float)
VQ_SHIM_VECTORS(half)
VQ_SHIM_VECTORS(int)
VQ_SHIM_VECTORS(uint)
VQ_SHIM_VECTORS(short)
VQ_SHIM_VECTORS(ushort)
VQ_SHIM_VECTORS(uchar)

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
void threadgroup_barrier(mem_flags flags);
void simdgroup_barrier(mem_flags flags);

// as_type<T>(x): a bit cast between types of one size (MSL 2.4).
template <typename T, typename U>
T as_type(U x) {
  static_assert(sizeof(T) == sizeof(U), "as_type between types of different sizes");
  return __builtin_bit_cast(T, x);
}

// SIMD-group functions (MSL 6.9.2).
template <typename T> T simd_sum(T x);
template <typename T> T simd_max(T x);
template <typename T> T simd_min(T x);
template <typename T> T simd_prefix_exclusive_sum(T x);
template <typename T> T simd_prefix_inclusive_sum(T x);
template <typename T> T simd_broadcast(T x, ushort lane);
template <typename T> T simd_shuffle(T x, ushort lane);
template <typename T> T simd_shuffle_xor(T x, ushort mask);
template <typename T> T simd_shuffle_down(T x, ushort delta);
template <typename T> T simd_shuffle_up(T x, ushort delta);
bool simd_all(bool x);
bool simd_any(bool x);

#define INFINITY __builtin_inff()
#define NAN __builtin_nanf("")

namespace metal {
// Math functions (MSL 6.5); metal::precise:: and metal::fast:: hold the same names.
#define VQ_SHIM_UNARY(name) template <typename T> T name(T x);
#define VQ_SHIM_BINARY(name) template <typename T> T name(T x, T y);
#define VQ_SHIM_MATH                                                                                   \
  VQ_SHIM_UNARY(exp) VQ_SHIM_UNARY(exp2) VQ_SHIM_UNARY(log) VQ_SHIM_UNARY(log2) VQ_SHIM_UNARY(sqrt)   \
  VQ_SHIM_UNARY(rsqrt) VQ_SHIM_UNARY(sin) VQ_SHIM_UNARY(cos) VQ_SHIM_UNARY(tanh) VQ_SHIM_UNARY(fabs)  \
  VQ_SHIM_UNARY(abs) VQ_SHIM_UNARY(floor) VQ_SHIM_UNARY(ceil) VQ_SHIM_UNARY(rint) VQ_SHIM_UNARY(round) \
  VQ_SHIM_UNARY(trunc) VQ_SHIM_BINARY(atan2) VQ_SHIM_BINARY(pow) VQ_SHIM_BINARY(fmin)                 \
  VQ_SHIM_BINARY(fmax) VQ_SHIM_BINARY(fmod)
VQ_SHIM_MATH
namespace precise { VQ_SHIM_MATH }
namespace fast { VQ_SHIM_MATH }
template <typename T> T max(T x, T y);
template <typename T> T min(T x, T y);
template <typename T> T clamp(T x, T lo, T hi);
template <typename T> bool isfinite(T x);
template <typename T> bool isnan(T x);
template <typename T> bool isinf(T x);
template <typename T> T select(T a, T b, bool c);
}  // namespace metal

using namespace metal;
