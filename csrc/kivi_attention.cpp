// Decode attention on KIVI codes (veloxquant_mlx/methods/kivi.py) for MLX's CPU back end.
//
// One MLX primitive, `kivi_attention_partials`, with the contract of the mse kernel's
// partials (mse_attention.cpp), so the Python side merges splits, the fp16 sinks/window and
// the value mean as for every other path:
//
//   q            (N, R, D) float32: queries, already scaled (KIVI's domain is the identity)
//   key_codes    (N, C, Wk) uint32: per token, D codes of key_bits bits
//   key_scale, key_min (N, C / KG, D) float16: per channel, one row per group of KG tokens
//   value_codes  (N, C, Wv) uint32: per token, D codes of value_bits bits
//   value_scale, value_min (N, C, D / VG) float16: per token, one per group of VG channels
// -> o  (N, S, R, D) float32 and ml (N, S, R, 2) float32, as mse_attention_partials.
//
// Keys are k_tj = min_gj + scale_gj * code_tj within key group g (KIVI, arXiv 2402.02750,
// Sec. 3.2), so q . k_t = (q * scale_g) . code_t + q . min_g: the two per-group terms are
// formed once per group and each token costs one decode of its codes and one dot product.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <thread>
#include <vector>

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

struct KiviLayout {
  int R, D, C, key_words, value_words, key_bits, value_bits, key_group, value_group, value_groups, tokens, splits;
};

std::vector<float> identity_table(int bits) {
  std::vector<float> codes(1 << bits);
  for (size_t i = 0; i < codes.size(); ++i) codes[i] = float(i);
  return padded_table(codes.data(), bits);
}

struct Row {  // one kv head's buffers
  const uint32_t *key_codes, *value_codes;
  const mx::float16_t *key_scale, *key_min, *value_scale, *value_min;
  bool last;  // the last kv head of the buffers: its last token uses the scalar decoders
};

void attend_split(const KiviLayout& L, const float* q, const Row& in, const float* ktab, const float* vtab, int t0,
                  int t1, float* o, float* ml) {
  const int R = L.R, D = L.D;
  const Decoder key_fast = decoder_for(L.key_bits), value_fast = decoder_for(L.value_bits);
  const Decoder key_safe = scalar_decoder_for(L.key_bits), value_safe = scalar_decoder_for(L.value_bits);
  const int kb32 = L.key_bits, vb32 = L.value_bits;  // words per 32 codes
  std::vector<float> buf(D), qs(R * D), qm(R), scores(R * kBlock), acc(R * D, 0.0f), m(R, -INFINITY), l(R, 0.0f);
  int group = -1;
  for (int b0 = t0; b0 < t1; b0 += kBlock) {
    const int nb = std::min(kBlock, t1 - b0);
    for (int t = 0; t < nb; ++t) {
      const int token = b0 + t;
      if (token / L.key_group != group) {
        group = token / L.key_group;
        const mx::float16_t* scale = in.key_scale + size_t(group) * D;
        const mx::float16_t* low = in.key_min + size_t(group) * D;
        for (int r = 0; r < R; ++r) {
          float sum = 0.0f;
          for (int j = 0; j < D; ++j) {
            qs[r * D + j] = q[r * D + j] * static_cast<float>(scale[j]);
            sum += q[r * D + j] * static_cast<float>(low[j]);
          }
          qm[r] = sum;
        }
      }
      const Decoder decode = (in.last && token == L.C - 1) ? key_safe : key_fast;
      const uint32_t* words = in.key_codes + size_t(token) * L.key_words;
      for (int c = 0; c < D / 32; ++c) decode(words + c * kb32, ktab, buf.data() + c * 32);
      for (int r = 0; r < R; ++r) scores[r * kBlock + t] = qm[r] + dot(qs.data() + r * D, buf.data(), D);
    }
    softmax_block(scores.data(), kBlock, nb, R, D, m.data(), l.data(), acc.data());
    for (int t = 0; t < nb; ++t) {
      const int token = b0 + t;
      const Decoder decode = (in.last && token == L.C - 1) ? value_safe : value_fast;
      const uint32_t* words = in.value_codes + size_t(token) * L.value_words;
      for (int c = 0; c < D / 32; ++c) decode(words + c * vb32, vtab, buf.data() + c * 32);
      const mx::float16_t* scale = in.value_scale + size_t(token) * L.value_groups;
      const mx::float16_t* low = in.value_min + size_t(token) * L.value_groups;
      for (int g = 0; g < L.value_groups; ++g) {
        const float lo = static_cast<float>(low[g]), step = static_cast<float>(scale[g]);
        for (int j = g * L.value_group; j < (g + 1) * L.value_group; ++j) buf[j] = lo + step * buf[j];
      }
      accumulate(scores.data() + t, kBlock, R, D, buf.data(), acc.data());
    }
  }
  write_partial(acc, m, l, o, ml);
}

class KiviAttentionPartials : public mx::Primitive {
 public:
  KiviAttentionPartials(mx::Stream stream, int tokens, int key_bits, int value_bits, int key_group, int splits)
      : mx::Primitive(stream), tokens_(tokens), key_bits_(key_bits), value_bits_(value_bits), key_group_(key_group),
        splits_(splits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    for (const auto& x : inputs)
      if (!x.flags().row_contiguous) throw std::invalid_argument("kivi_attention_partials: inputs must be row contiguous");
    const auto &q = inputs[0], &kc = inputs[1], &ks = inputs[2], &km = inputs[3], &vc = inputs[4],
               &vs = inputs[5], &vm = inputs[6];
    auto& o = outputs[0];
    auto& ml = outputs[1];
    o.set_data(mx::allocator::malloc(o.nbytes()));
    ml.set_data(mx::allocator::malloc(ml.nbytes()));
    KiviLayout L;
    L.R = q.shape(1);
    L.D = q.shape(2);
    L.C = kc.shape(1);
    L.key_words = kc.shape(2);
    L.value_words = vc.shape(2);
    L.key_bits = key_bits_;
    L.value_bits = value_bits_;
    L.key_group = key_group_;
    L.value_groups = vs.shape(2);
    L.value_group = L.D / L.value_groups;
    L.tokens = tokens_;
    L.splits = splits_;
    const int N = q.shape(0);
    const size_t key_rows = ks.shape(1), value_rows = vc.shape(1);
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& x : inputs) encoder.set_input_array(x);
    encoder.set_output_array(o);
    encoder.set_output_array(ml);
    encoder.dispatch([L, N, key_rows, value_rows, q = q.data<float>(), kc = kc.data<uint32_t>(),
                      ks = ks.data<mx::float16_t>(), km = km.data<mx::float16_t>(), vc = vc.data<uint32_t>(),
                      vs = vs.data<mx::float16_t>(), vm = vm.data<mx::float16_t>(), o = o.data<float>(),
                      ml = ml.data<float>()]() {
      const std::vector<float> ktab = identity_table(L.key_bits), vtab = identity_table(L.value_bits);
      for_each_split(N, L.splits, L.tokens, [&](int item, int n, int t0, int t1) {
        const Row in{kc + size_t(n) * L.C * L.key_words, vc + size_t(n) * value_rows * L.value_words,
                     ks + size_t(n) * key_rows * L.D, km + size_t(n) * key_rows * L.D,
                     vs + size_t(n) * value_rows * L.value_groups, vm + size_t(n) * value_rows * L.value_groups,
                     n == N - 1};
        attend_split(L, q + size_t(n) * L.R * L.D, in, ktab.data(), vtab.data(), t0, t1,
                     o + size_t(item) * L.R * L.D, ml + size_t(item) * L.R * 2);
      });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("kivi_attention_partials runs on the CPU only");
  }

  const char* name() const override { return "KiviAttentionPartials"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& p = static_cast<const KiviAttentionPartials&>(other);
    return tokens_ == p.tokens_ && key_bits_ == p.key_bits_ && value_bits_ == p.value_bits_ &&
           key_group_ == p.key_group_ && splits_ == p.splits_;
  }

 private:
  int tokens_, key_bits_, value_bits_, key_group_, splits_;
};

std::vector<mx::array> kivi_attention_partials(const mx::array& q, const mx::array& key_codes,
                                               const mx::array& key_scale, const mx::array& key_min,
                                               const mx::array& value_codes, const mx::array& value_scale,
                                               const mx::array& value_min, int tokens, int key_bits, int value_bits,
                                               int key_group, int splits, mx::StreamOrDevice s) {
  auto fail = [](const std::string& what) { throw std::invalid_argument("kivi_attention_partials: " + what); };
  if (q.ndim() != 3 || key_codes.ndim() != 3 || value_codes.ndim() != 3 || key_scale.ndim() != 3 ||
      key_min.shape() != key_scale.shape() || value_scale.ndim() != 3 || value_min.shape() != value_scale.shape())
    fail("q (N, R, D), codes (N, C, W), scales and mins (N, rows, width)");
  const int N = q.shape(0), R = q.shape(1), D = q.shape(2);
  if (D % 32 != 0) fail("head dim must be a multiple of 32");
  if (key_bits < 1 || key_bits > 8 || value_bits < 1 || value_bits > 8) fail("bits must be in 1..8");
  if (key_group < 1) fail("key_group must be >= 1");
  for (const auto* x : {&key_codes, &key_scale, &value_codes, &value_scale})
    if (x->shape(0) != N) fail("every input has N kv rows");
  const int C = key_codes.shape(1);
  if (key_codes.shape(2) < D * key_bits / 32 || value_codes.shape(2) < D * value_bits / 32)
    fail("code rows are narrower than D codes");
  if (value_codes.shape(1) < C || value_scale.shape(1) < C) fail("value buffers hold fewer tokens than the keys");
  if (key_scale.shape(2) != D || key_scale.shape(1) * key_group < C) fail("key scales: one row of D per group");
  if (D % value_scale.shape(2) != 0) fail("value groups must divide D");
  if (tokens < 1 || tokens > C) fail("tokens must be in 1..C");
  if (splits < 1) fail("splits must be >= 1");
  if (q.dtype() != mx::float32 || key_codes.dtype() != mx::uint32 || value_codes.dtype() != mx::uint32)
    fail("q must be float32, codes uint32");
  for (const auto* x : {&key_scale, &key_min, &value_scale, &value_min})
    if (x->dtype() != mx::float16) fail("scales and mins must be float16");
  auto stream = mx::to_stream(s, mx::Device::cpu);
  if (stream.device != mx::Device::cpu) fail("runs on the CPU only");
  std::vector<mx::array> inputs;
  for (const auto* x : {&q, &key_codes, &key_scale, &key_min, &value_codes, &value_scale, &value_min})
    inputs.push_back(mx::contiguous(*x, false, stream));
  return mx::array::make_arrays({{N, splits, R, D}, {N, splits, R, 2}}, {mx::float32, mx::float32},
                                std::make_shared<KiviAttentionPartials>(stream, tokens, key_bits, value_bits,
                                                                        key_group, splits),
                                inputs);
}

}  // namespace

namespace vq_native {

void register_kivi(nb::module_& m) {
  m.def("kivi_attention_partials", &kivi_attention_partials, "q"_a, "key_codes"_a, "key_scale"_a, "key_min"_a,
        "value_codes"_a, "value_scale"_a, "value_min"_a, "tokens"_a, "key_bits"_a, "value_bits"_a, "key_group"_a,
        "splits"_a, nb::kw_only(), "stream"_a = nb::none(),
        "Per-split (o, ml) of decode attention over KIVI codes; see csrc/kivi_attention.cpp.");
}

}  // namespace vq_native
