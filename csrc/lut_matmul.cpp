// y = x W^T straight from packed weight codes (veloxquant_mlx/weights/linear.py) on MLX's CPU
// back end, for decode-sized batches: no decoded weight exists beyond 32 floats of one row.
//
//   x        (M, D) float32: inputs, already rotated (and column-scaled) by the layer
//   codes    (N, W) uint32: row n holds D codes of `bits` bits (packing.py's bit stream)
//   scales   (N, G) float16: one scale per group of D / G codes
//   codebook (2^bits) float32
// -> y (M, N) float32, y[m, n] = sum_g scales[n, g] * sum_{i in g} codebook[code_ni] x[m, i].
//
// Output rows are split over threads when the layer is large enough to pay for them.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/variant.h>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

#include "decode.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace mx = mlx::core;

namespace {

using namespace vq_native;

constexpr int kMaxRows = 8;                    // batch rows per call (larger batches tile in Python)
constexpr size_t kWeightsPerThread = 1 << 20;  // below this a layer runs on one thread

struct LutLayout {
  int M, D, N, W, G, bits;
};

// 8-lane partial sums, reduced once per group (or row): no horizontal sum per 32 codes.
inline float reduce8(const float* lanes) {
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

// Rows [n0, n1) of y for all M batch rows.
void lut_rows(const LutLayout& L, const float* x, const uint32_t* codes, const mx::float16_t* scales,
              const float* table, int n0, int n1, float* y) {
  const Decoder fast = decoder_for(L.bits);
  const int blocks = (L.D + 31) / 32, group = L.D / L.G;
  alignas(32) float w[32];
  alignas(32) float lanes[kMaxRows][8];
  std::vector<uint32_t> tail(L.bits + 1);
  float acc[kMaxRows];
  for (int n = n0; n < n1; ++n) {
    const uint32_t* row = codes + size_t(n) * L.W;
    const mx::float16_t* s = scales + size_t(n) * L.G;
    for (int m = 0; m < L.M; ++m) {
      acc[m] = 0.0f;
      for (int l = 0; l < 8; ++l) lanes[m][l] = 0.0f;
    }
    for (int b = 0; b < blocks; ++b) {
      const int j0 = b * 32, count = std::min(32, L.D - j0);
      if (b + 1 < blocks) {
        fast(row + b * L.bits, table, w);
      } else {  // the last block: its words copied, so no decoder reads past the row
        std::fill(tail.begin(), tail.end(), 0u);
        std::memcpy(tail.data(), row + b * L.bits, sizeof(uint32_t) * (L.W - b * L.bits));
        scalar_decoder_for(L.bits)(tail.data(), table, w);
        for (int k = count; k < 32; ++k) w[k] = 0.0f;
      }
      for (int m = 0; m < L.M; ++m) {
        const float* xm = x + size_t(m) * L.D + j0;
        float* lane = lanes[m];
        if (count == 32) {
#pragma GCC unroll 4
          for (int k = 0; k < 32; k += 8)
            for (int l = 0; l < 8; ++l) lane[l] += w[k + l] * xm[k + l];
        } else {
          for (int k = 0; k < count; ++k) lane[k & 7] += w[k] * xm[k];
        }
      }
      // group boundaries fall on block boundaries (group % 32 == 0) or at the row's end
      if (L.G > 1 && ((j0 + count) % group == 0)) {
        const float scale = static_cast<float>(s[(j0 + count) / group - 1]);
        for (int m = 0; m < L.M; ++m) {
          acc[m] += scale * reduce8(lanes[m]);
          for (int l = 0; l < 8; ++l) lanes[m][l] = 0.0f;
        }
      }
    }
    const float row_scale = L.G > 1 ? 1.0f : static_cast<float>(s[0]);
    for (int m = 0; m < L.M; ++m) y[size_t(m) * L.N + n] = L.G > 1 ? acc[m] : row_scale * reduce8(lanes[m]);
  }
}

class LutMatmul : public mx::Primitive {
 public:
  LutMatmul(mx::Stream stream, int bits) : mx::Primitive(stream), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    for (const auto& a : inputs)
      if (!a.flags().row_contiguous) throw std::invalid_argument("lut_matmul: inputs must be row contiguous");
    const auto &x = inputs[0], &codes = inputs[1], &scales = inputs[2], &codebook = inputs[3];
    auto& y = outputs[0];
    y.set_data(mx::allocator::malloc(y.nbytes()));
    const LutLayout L{int(x.shape(0)), int(x.shape(1)), int(codes.shape(0)), int(codes.shape(1)),
                      int(scales.shape(1)), bits_};
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(y);
    encoder.dispatch([L, x = x.data<float>(), codes = codes.data<uint32_t>(), scales = scales.data<mx::float16_t>(),
                      codebook = codebook.data<float>(), y = y.data<float>()]() {
      const std::vector<float> table = padded_table(codebook, L.bits);
      const size_t weights = size_t(L.N) * L.D;
      const int threads = std::max<int>(
          1, std::min<size_t>(std::thread::hardware_concurrency(), weights / kWeightsPerThread));
      const int per = (L.N + threads - 1) / threads;
      std::vector<std::thread> pool;
      for (int t = 1; t < threads; ++t) {
        const int n0 = std::min(L.N, t * per), n1 = std::min(L.N, n0 + per);
        pool.emplace_back(lut_rows, std::cref(L), x, codes, scales, table.data(), n0, n1, y);
      }
      lut_rows(L, x, codes, scales, table.data(), 0, std::min(L.N, per), y);
      for (auto& t : pool) t.join();
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("lut_matmul runs on the CPU only");
  }

  const char* name() const override { return "LutMatmul"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return bits_ == static_cast<const LutMatmul&>(other).bits_;
  }

 private:
  int bits_;
};

mx::array lut_matmul(const mx::array& x, const mx::array& codes, const mx::array& scales, const mx::array& codebook,
                     int bits, mx::StreamOrDevice s) {
  auto fail = [](const std::string& what) { throw std::invalid_argument("lut_matmul: " + what); };
  if (x.ndim() != 2 || codes.ndim() != 2 || scales.ndim() != 2 || codebook.ndim() != 1)
    fail("x (M, D), codes (N, W), scales (N, G), codebook (2^bits)");
  if (bits < 1 || bits > 4) fail("bits must be in 1..4");
  const int M = x.shape(0), D = x.shape(1), N = codes.shape(0), W = codes.shape(1), G = scales.shape(1);
  if (M < 1 || M > kMaxRows) fail("1 to 8 batch rows");
  if (W != (D * bits + 31) / 32) fail("codes rows must hold D codes");
  if (scales.shape(0) != N || G < 1 || D % G != 0) fail("scales (N, G) with G dividing D");
  if (G > 1 && (D / G) % 32 != 0) fail("group size must be a multiple of 32");
  if (codebook.shape(0) != (1 << bits)) fail("codebook must have 2^bits entries");
  if (x.dtype() != mx::float32 || codes.dtype() != mx::uint32 || scales.dtype() != mx::float16 ||
      codebook.dtype() != mx::float32)
    fail("x float32, codes uint32, scales float16, codebook float32");
  auto stream = mx::to_stream(s, mx::Device::cpu);
  if (stream.device != mx::Device::cpu) fail("runs on the CPU only");
  std::vector<mx::array> inputs;
  for (const auto* a : {&x, &codes, &scales, &codebook}) inputs.push_back(mx::contiguous(*a, false, stream));
  return mx::array({M, N}, mx::float32, std::make_shared<LutMatmul>(stream, bits), inputs);
}

}  // namespace

namespace vq_native {

void register_lut(nb::module_& m) {
  m.def("lut_matmul", &lut_matmul, "x"_a, "codes"_a, "scales"_a, "codebook"_a, "bits"_a, nb::kw_only(),
        "stream"_a = nb::none(), "x W^T from packed weight codes (M <= 8); see csrc/lut_matmul.cpp.");
}

}  // namespace vq_native
