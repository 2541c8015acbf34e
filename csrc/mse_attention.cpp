// Decode attention on turboquant_mse rows for MLX's CPU back end.
//
// One MLX primitive, `mse_attention_partials`: the same contract as the CUDA/Metal
// `mse_partial` kernel (veloxquant_mlx/kernels/templates.py) and the portable path
// (veloxquant_mlx/kernels/portable.py), so the Python side merges its splits, the
// fp16 sinks/window and the value un-rotation exactly as for the other back ends.
//
//   q     (N, R, D) float32: queries already scaled and rotated into the key domain
//   rows  (N, C, W) uint32:  one row per token (kernels/rows.py): key codes, value
//                            codes, then fp16 key norm | fp16 value norm in one word
//   kcent (2^kb) float32, vcent (2^vb) float32: the Lloyd-Max centroids
// -> o    (N, S, R, D) float32: sum_t p_t * vnorm_t * vcent[vcodes_t] per split
//    ml   (N, S, R, 2) float32: running max and sum of exp per split
//
// `mse_attention_partials_ragged` takes one more input, lengths (N,) int32: kv row n uses
// tokens [0, min(tokens, lengths[n])) only (a batch of sequences of different lengths in one
// buffer, veloxquant_mlx/batch_decode.py); a split past a row's length is empty (max -inf).
//
// Tokens [0, tokens) are cut into S splits; (n, split) items run on up to
// hardware_concurrency threads. Per block of 32 tokens: decode each key (codes
// straddle words; 32 codes fill exactly `bits` words, so one block of words is
// decoded with constant shifts), score it against the R queries of its kv head
// (GQA without repeating K/V), update the online softmax (Milakov & Gimelshein,
// arXiv 1805.02867), then decode each value and accumulate it weighted by p.
// Nothing is expanded beyond one token's D floats.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <sstream>
#include <thread>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <nanobind/nanobind.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

#include "decode.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace mx = mlx::core;

namespace {

using namespace vq_native;

constexpr int kBlock = 32;  // tokens per online-softmax block

struct Layout {
  int R, D, C, W, key_offset, value_offset, norm_word, key_bits, value_bits, tokens, splits;
};

// One (n, split) item: tokens [t0, t1) of kv head n; kcent / vcent padded (padded_table).
void attend_split(const Layout& L, const float* q, const uint32_t* rows, const float* kcent,
                  const float* vcent, Decoder decode_key, Decoder decode_value, int t0, int t1,
                  float* o, float* ml) {
  const int R = L.R, D = L.D;
  std::vector<float> buf(D), scores(R * kBlock), acc(R * D, 0.0f), m(R, -INFINITY), l(R, 0.0f);
  float vnorm[kBlock];
  const int kb32 = L.key_bits, vb32 = L.value_bits;  // words per 32 codes
  for (int b0 = t0; b0 < t1; b0 += kBlock) {
    const int nb = std::min(kBlock, t1 - b0);
    for (int t = 0; t < nb; ++t) {
      const uint32_t* row = rows + size_t(b0 + t) * L.W;
      const uint32_t norms = row[L.norm_word];
      const float knorm = half_to_float(norms & 0xffffu);
      vnorm[t] = half_to_float(norms >> 16);
      for (int c = 0; c < D / 32; ++c) decode_key(row + L.key_offset + c * kb32, kcent, buf.data() + c * 32);
      for (int r = 0; r < R; ++r) scores[r * kBlock + t] = knorm * dot(q + r * D, buf.data(), D);
    }
    softmax_block(scores.data(), kBlock, nb, R, D, m.data(), l.data(), acc.data());
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < nb; ++t) scores[r * kBlock + t] *= vnorm[t];  // p times the value norm: the value codes decode a unit vector
    for (int t = 0; t < nb; ++t) {
      const uint32_t* row = rows + size_t(b0 + t) * L.W + L.value_offset;
      for (int c = 0; c < D / 32; ++c) decode_value(row + c * vb32, vcent, buf.data() + c * 32);
      accumulate(scores.data() + t, kBlock, R, D, buf.data(), acc.data());
    }
  }
  write_partial(acc, m, l, o, ml);
}

class MSEAttentionPartials : public mx::Primitive {
 public:
  MSEAttentionPartials(mx::Stream stream, int tokens, int key_bits, int value_bits, int splits, int key_offset,
                       int value_offset, int norm_word, bool ragged = false)
      : mx::Primitive(stream), tokens_(tokens), key_bits_(key_bits), value_bits_(value_bits),
        splits_(splits), key_offset_(key_offset), value_offset_(value_offset), norm_word_(norm_word),
        ragged_(ragged) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& q = inputs[0];
    const auto& rows = inputs[1];
    const auto& kcent = inputs[2];
    const auto& vcent = inputs[3];
    for (const auto* x : {&q, &rows, &kcent, &vcent})
      if (!x->flags().row_contiguous)
        throw std::invalid_argument("mse_attention_partials: inputs must be row contiguous");
    const int32_t* lengths = nullptr;
    if (ragged_) {
      if (!inputs[4].flags().row_contiguous)
        throw std::invalid_argument("mse_attention_partials: inputs must be row contiguous");
      lengths = inputs[4].data<int32_t>();
    }
    auto& o = outputs[0];
    auto& ml = outputs[1];
    o.set_data(mx::allocator::malloc(o.nbytes()));
    ml.set_data(mx::allocator::malloc(ml.nbytes()));

    Layout L;
    L.R = q.shape(1);
    L.D = q.shape(2);
    L.C = rows.shape(1);
    L.W = rows.shape(2);
    L.key_bits = key_bits_;
    L.value_bits = value_bits_;
    L.key_offset = key_offset_;
    L.value_offset = value_offset_;
    L.norm_word = norm_word_;
    L.tokens = tokens_;
    L.splits = splits_;
    const int N = q.shape(0);

    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(q);
    encoder.set_input_array(rows);
    encoder.set_input_array(kcent);
    encoder.set_input_array(vcent);
    if (ragged_) encoder.set_input_array(inputs[4]);
    encoder.set_output_array(o);
    encoder.set_output_array(ml);
    encoder.dispatch([L, N, lengths, q = q.data<float>(), rows = rows.data<uint32_t>(), kcent = kcent.data<float>(),
                      vcent = vcent.data<float>(), o = o.data<float>(), ml = ml.data<float>()]() {
      const Decoder decode_key = decoder_for(L.key_bits), decode_value = decoder_for(L.value_bits);
      const std::vector<float> ktable = padded_table(kcent, L.key_bits);
      const std::vector<float> vtable = padded_table(vcent, L.value_bits);
      for_each_split(N, L.splits, L.tokens, [&](int item, int n, int t0, int t1) {
        if (lengths != nullptr) {
          t1 = std::max(0, std::min(t1, int(lengths[n])));
          t0 = std::min(t0, t1);
        }
        attend_split(L, q + size_t(n) * L.R * L.D, rows + size_t(n) * L.C * L.W, ktable.data(), vtable.data(),
                     decode_key, decode_value, t0, t1, o + size_t(item) * L.R * L.D, ml + size_t(item) * L.R * 2);
      });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mse_attention_partials runs on the CPU only");
  }

  const char* name() const override { return "MSEAttentionPartials"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& p = static_cast<const MSEAttentionPartials&>(other);
    return tokens_ == p.tokens_ && key_bits_ == p.key_bits_ && value_bits_ == p.value_bits_ &&
           splits_ == p.splits_ && key_offset_ == p.key_offset_ && value_offset_ == p.value_offset_ &&
           norm_word_ == p.norm_word_ && ragged_ == p.ragged_;
  }

 private:
  int tokens_, key_bits_, value_bits_, splits_, key_offset_, value_offset_, norm_word_;
  bool ragged_;
};

std::vector<mx::array> make_partials(const mx::array& q, const mx::array& rows, const mx::array& key_centroids,
                                     const mx::array& value_centroids, const mx::array* lengths, int tokens,
                                     int key_bits, int value_bits, int splits, int key_offset, int value_offset,
                                     int norm_word, mx::StreamOrDevice s) {
  auto fail = [](const std::string& what) { throw std::invalid_argument("mse_attention_partials: " + what); };
  if (q.ndim() != 3 || rows.ndim() != 3 || q.shape(0) != rows.shape(0)) fail("q (N, R, D) and rows (N, C, W)");
  const int D = q.shape(2);
  if (D % 32 != 0) fail("head dim must be a multiple of 32");
  if (key_bits < 1 || key_bits > 8 || value_bits < 1 || value_bits > 8) fail("bits must be in 1..8");
  // Word offsets come from the row layout (formats.RowLayout): key codes, value codes, and
  // the word holding the fp16 key norm (low half) and value norm (high half).
  const int W = rows.shape(2);
  if (key_offset < 0 || value_offset < 0 || norm_word < 0 || key_offset + D * key_bits / 32 > W ||
      value_offset + D * value_bits / 32 > W || norm_word >= W)
    fail("word offsets outside the row");
  if (tokens < 1 || tokens > rows.shape(1)) fail("tokens must be in 1..rows.shape[1]");
  if (splits < 1) fail("splits must be >= 1");
  if (key_centroids.size() != (size_t(1) << key_bits) || value_centroids.size() != (size_t(1) << value_bits))
    fail("centroid tables must hold 2^bits entries");
  if (q.dtype() != mx::float32 || rows.dtype() != mx::uint32 || key_centroids.dtype() != mx::float32 ||
      value_centroids.dtype() != mx::float32)
    fail("q and centroids must be float32, rows uint32");
  auto stream = mx::to_stream(s, mx::Device::cpu);
  if (stream.device != mx::Device::cpu) fail("runs on the CPU only");
  const int N = q.shape(0), R = q.shape(1);
  std::vector<mx::array> inputs = {mx::contiguous(q, false, stream), mx::contiguous(rows, false, stream),
                                   mx::contiguous(key_centroids, false, stream),
                                   mx::contiguous(value_centroids, false, stream)};
  if (lengths != nullptr) {
    if (lengths->ndim() != 1 || lengths->shape(0) != N || lengths->dtype() != mx::int32)
      fail("lengths must be (N,) int32");
    inputs.push_back(mx::contiguous(*lengths, false, stream));
  }
  return mx::array::make_arrays(
      {{N, splits, R, D}, {N, splits, R, 2}}, {mx::float32, mx::float32},
      std::make_shared<MSEAttentionPartials>(stream, tokens, key_bits, value_bits, splits, key_offset, value_offset,
                                             norm_word, lengths != nullptr),
      inputs);
}

std::vector<mx::array> mse_attention_partials(const mx::array& q, const mx::array& rows,
                                              const mx::array& key_centroids,
                                              const mx::array& value_centroids, int tokens, int key_bits,
                                              int value_bits, int splits, int key_offset, int value_offset,
                                              int norm_word, mx::StreamOrDevice s) {
  return make_partials(q, rows, key_centroids, value_centroids, nullptr, tokens, key_bits, value_bits, splits,
                       key_offset, value_offset, norm_word, s);
}

std::vector<mx::array> mse_attention_partials_ragged(const mx::array& q, const mx::array& rows,
                                                     const mx::array& key_centroids,
                                                     const mx::array& value_centroids, const mx::array& lengths,
                                                     int tokens, int key_bits, int value_bits, int splits,
                                                     int key_offset, int value_offset, int norm_word,
                                                     mx::StreamOrDevice s) {
  return make_partials(q, rows, key_centroids, value_centroids, &lengths, tokens, key_bits, value_bits, splits,
                       key_offset, value_offset, norm_word, s);
}

}  // namespace

namespace vq_native {
void register_kivi(nb::module_& m);  // kivi_attention.cpp
void register_lut(nb::module_& m);   // lut_matmul.cpp
}

NB_MODULE(_native, m) {
  m.doc() = "VeloxQuant-MLX CPU kernels (see csrc/mse_attention.cpp)";
  m.def("mse_attention_partials", &mse_attention_partials, "q"_a, "rows"_a, "key_centroids"_a,
        "value_centroids"_a, "tokens"_a, "key_bits"_a, "value_bits"_a, "splits"_a, "key_offset"_a,
        "value_offset"_a, "norm_word"_a, nb::kw_only(),
        "stream"_a = nb::none(),
        "Per-split (o, ml) of decode attention over turboquant_mse rows; see csrc/mse_attention.cpp.");
  m.def("mse_attention_partials_ragged", &mse_attention_partials_ragged, "q"_a, "rows"_a, "key_centroids"_a,
        "value_centroids"_a, "lengths"_a, "tokens"_a, "key_bits"_a, "value_bits"_a, "splits"_a, "key_offset"_a,
        "value_offset"_a, "norm_word"_a, nb::kw_only(), "stream"_a = nb::none(),
        "mse_attention_partials with kv row n's tokens cut at lengths[n]; see csrc/mse_attention.cpp.");
  vq_native::register_kivi(m);
  vq_native::register_lut(m);
}
