// fp8_block128: E4M3 elements, one float32 scale per 128 along H (DeepSeek-V3's activation
// format, DeepEP's). reference/fp8_block128.py is the specification; docs/semantics.md states it.
//
// Per block of 128: amax = max |v| (float32); scale = max(amax, 1e-4f) / 448, one correctly
// rounded float32 division; q = e4m3_rne(clamp(v / scale, -448, 448)), v / scale one float32
// division, E4M3 by c10's bit-level conversion (the Triton kernel writes the same rule on the bits).
// Non-finite x (refused by dispatch's checks; the raw op takes it): amax skips NaN
// (std::max(amax, NaN) keeps amax), and an element whose quotient is NaN (a NaN, or an infinity
// over an infinite scale) is the E4M3 NaN with v's sign, decided here rather than left to the
// platform's default NaN, so that the GPU kernel (epkit/triton/fp8_block128.py) can match it.
#include "../checks.h"

#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cmath>

namespace epkit {

namespace {

constexpr float kE4m3Max = 448.0f;
constexpr float kAmaxMin = 1e-4f;  // DeepEP's clamp of the block maximum (bits 0x38D1B717)
constexpr uint8_t kE4m3Nan = 0x7F;  // | 0x80 for the sign
constexpr uint8_t kSignBit = 0x80;

}  // namespace

std::tuple<Tensor, Tensor> quantize_fp8_block128_cpu(const Tensor& x_in) {
  check_quantize_fp8_block128_args(x_in);
  const Tensor x = x_in.contiguous();
  constexpr int64_t B = kFp8Block128Block;
  const int64_t T = x.size(0), H = x.size(1), NB = H / B;
  Tensor q = at::empty({T, H}, at::TensorOptions().dtype(at::kFloat8_e4m3fn));
  Tensor scale = at::empty({T, NB}, at::kFloat);
  uint8_t* qp = reinterpret_cast<uint8_t*>(q.data_ptr());
  float* sp = scale.data_ptr<float>();
  dispatch_float_types(x.scalar_type(), "epkit.quantize_fp8_block128", [&](auto tag) {
    using X = decltype(tag);
    const X* xp = x.data_ptr<X>();
    at::parallel_for(0, T * NB, kRowGrain, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const X* v = xp + b * B;  // blocks are contiguous: row t, block j is b = t * NB + j
        uint8_t* out = qp + b * B;
        float amax = 0.0f;
        for (int64_t i = 0; i < B; ++i) amax = std::max(amax, std::fabs(widen(v[i])));
        const float s = std::max(amax, kAmaxMin) / kE4m3Max;
        sp[b] = s;
        for (int64_t i = 0; i < B; ++i) {
          const float vi = widen(v[i]);
          const float u = vi / s;
          out[i] = std::isnan(u) ? static_cast<uint8_t>(kE4m3Nan | (std::signbit(vi) ? kSignBit : 0))
                                 : c10::detail::fp8e4m3fn_from_fp32_value(
                                       std::clamp(u, -kE4m3Max, kE4m3Max));
        }
      }
    });
  });
  return {q, scale};
}

}  // namespace epkit
