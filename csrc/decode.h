// Shared by the CPU kernels (mse_attention.cpp, kivi_attention.cpp): decoding 32 packed
// codes at a time through a table, fp16 scalars, a dot product in 8 lanes, the online-softmax
// step of a block of tokens, and the (kv row, split) work items on a thread pool.
#pragma once

#include <algorithm>
#include <cmath>
#include <thread>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "mlx/mlx.h"

namespace vq_native {

namespace mx = mlx::core;

// 32 codes of BITS bits (= BITS words, little-endian bit stream as packing.py).
template <int BITS>
inline void decode32(const uint32_t* words, const float* centroids, float* out) {
  constexpr uint32_t mask = (1u << BITS) - 1u;
#pragma GCC unroll 32
  for (int i = 0; i < 32; ++i) {
    const int bit = i * BITS;
    const int w = bit >> 5, s = bit & 31;
    uint32_t code = words[w] >> s;
    if (s + BITS > 32) code |= words[w + 1] << (32 - s);
    out[i] = centroids[code & mask];
  }
}

#if defined(__AVX2__)
// The same for BITS <= 4 with AVX2: 8 codes span BITS bytes and start on a byte, so one
// 32-bit window, shifted per lane, gives their indices, and the centroid table (padded to
// 16 entries) fits one register (two for 4 bits). The window of the last 8 codes reaches
// up to 3 bytes past the block: still inside the row (value codes or the norm word follow).
template <int BITS>
inline void decode32_avx2(const uint32_t* words, const float* centroids, float* out) {
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(words);
  const __m256i shifts = _mm256_setr_epi32(0, BITS, 2 * BITS, 3 * BITS, 4 * BITS, 5 * BITS, 6 * BITS, 7 * BITS);
  const __m256i mask = _mm256_set1_epi32((1 << BITS) - 1);
  const __m256 low = _mm256_loadu_ps(centroids);
  const __m256 high = _mm256_loadu_ps(centroids + 8);
  for (int k = 0; k < 4; ++k) {
    uint32_t window;
    std::memcpy(&window, bytes + k * BITS, sizeof(window));
    const __m256i idx = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(int(window)), shifts), mask);
    __m256 v = _mm256_permutevar8x32_ps(low, idx);
    if (BITS == 4)  // bit 3 picks the upper half of the table
      v = _mm256_blendv_ps(v, _mm256_permutevar8x32_ps(high, idx), _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
    _mm256_storeu_ps(out + 8 * k, v);
  }
}
#endif

using Decoder = void (*)(const uint32_t*, const float*, float*);


inline float half_to_float(uint16_t h) {
  mx::float16_t v;
  std::memcpy(&v, &h, sizeof(h));
  return static_cast<float>(v);
}

inline float dot(const float* a, const float* b, int n) {
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int j = 0; j < n; j += 8)
    for (int k = 0; k < 8; ++k) lanes[k] += a[j + k] * b[j + k];
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}


// Centroids padded with zeros to at least 16 entries (the AVX2 decoders read 16).
inline std::vector<float> padded_table(const float* centroids, int bits) {
  std::vector<float> table(std::max(16, 1 << bits), 0.0f);
  std::copy(centroids, centroids + (1 << bits), table.begin());
  return table;
}

// The scalar decoder, which reads no word past the 32 codes (the last token of a buffer).
inline Decoder scalar_decoder_for(int bits) {
  switch (bits) {
    case 1: return decode32<1>;
    case 2: return decode32<2>;
    case 3: return decode32<3>;
    case 4: return decode32<4>;
    case 5: return decode32<5>;
    case 6: return decode32<6>;
    case 7: return decode32<7>;
    case 8: return decode32<8>;
  }
  throw std::invalid_argument("bits must be in 1..8");
}

inline Decoder decoder_for(int bits) {
#if defined(__AVX2__)
  switch (bits) {
    case 1: return decode32_avx2<1>;
    case 2: return decode32_avx2<2>;
    case 3: return decode32_avx2<3>;
    case 4: return decode32_avx2<4>;
  }
#endif
  return scalar_decoder_for(bits);
}

// One block of nb scores s per query head of an online softmax (Milakov & Gimelshein,
// arXiv 1805.02867): the running max m and sum l updated, s replaced by exp(s - m), and the
// R x D accumulator rescaled to the new max.
inline void softmax_block(float* scores, int stride, int nb, int R, int D, float* m, float* l, float* acc) {
  for (int r = 0; r < R; ++r) {
    float* s = scores + r * stride;
    float top = m[r];
    for (int t = 0; t < nb; ++t) top = std::max(top, s[t]);
    const float alpha = m[r] == -INFINITY ? 0.0f : std::exp(m[r] - top);
    m[r] = top;
    float sum = 0.0f;
    for (int t = 0; t < nb; ++t) {
      s[t] = std::exp(s[t] - top);
      sum += s[t];
    }
    l[r] = l[r] * alpha + sum;
    if (alpha != 1.0f)
      for (int j = 0; j < D; ++j) acc[r * D + j] *= alpha;
  }
}

// acc[r] += p[r] * value for the R query heads; p[r] = scores[r * stride].
inline void accumulate(const float* scores, int stride, int R, int D, const float* value, float* acc) {
  for (int r = 0; r < R; ++r) {
    const float w = scores[r * stride];
    float* a = acc + r * D;
    for (int j = 0; j < D; ++j) a[j] += w * value[j];
  }
}

// A split's partial result: o (R, D) and ml (R, 2) = (max, sum).
inline void write_partial(const std::vector<float>& acc, const std::vector<float>& m, const std::vector<float>& l,
                          float* o, float* ml) {
  std::copy(acc.begin(), acc.end(), o);
  for (size_t r = 0; r < m.size(); ++r) {
    ml[2 * r] = m[r];
    ml[2 * r + 1] = l[r];
  }
}

// work(item, n, t0, t1) for each (kv row n, split) item of `rows` x `splits`, tokens [t0, t1)
// of [0, tokens) cut into equal splits, on up to hardware_concurrency threads.
template <class Work>
void for_each_split(int rows, int splits, int tokens, Work work) {
  const int items = rows * splits;
  const int per_split = (tokens + splits - 1) / splits;
  auto run = [&](int first, int stride) {
    for (int item = first; item < items; item += stride) {
      const int n = item / splits, split = item % splits;
      const int t0 = std::min(tokens, split * per_split), t1 = std::min(tokens, t0 + per_split);
      work(item, n, t0, t1);
    }
  };
  const int threads = std::max(1, std::min<int>(items, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (int i = 1; i < threads; ++i) pool.emplace_back(run, i, threads);
  run(0, threads);
  for (auto& t : pool) t.join();
}

}  // namespace vq_native
