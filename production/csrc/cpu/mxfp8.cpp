// MXFP8 (OCP Microscaling v1.0): E4M3 elements, one E8M0 scale per 32 along H.
//
// Per block: amax = max |v| (float32). amax == 0: code 0, elements +0. Otherwise
// e = floor(log2(amax)) - 8 clamped to [-127, 127] (via frexp: amax = m * 2^ex, m in [0.5, 1),
// so floor(log2(amax)) = ex - 1), code = e + 127, q = e4m3_rne(clamp(v / 2^e, -448, 448)).
// v / 2^e is one correctly rounded float32 operation, as in the reference.
#include "../checks.h"

#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cmath>

namespace epkit {

std::tuple<Tensor, Tensor> quantize_mxfp8_cpu(const Tensor& x_in) {
  check_quantize_mxfp8_args(x_in);
  const Tensor x = x_in.contiguous();
  const int64_t T = x.size(0), H = x.size(1), NB = H / kMxfp8Block;
  Tensor q = at::empty({T, H}, at::TensorOptions().dtype(at::kFloat8_e4m3fn));
  Tensor codes = at::empty({T, NB}, at::kByte);
  auto* qp = q.data_ptr<c10::Float8_e4m3fn>();
  uint8_t* cp = codes.data_ptr<uint8_t>();
  dispatch_float_types(x.scalar_type(), "epkit.quantize_mxfp8", [&](auto tag) {
    using X = decltype(tag);
    const X* xp = x.data_ptr<X>();
    at::parallel_for(0, T * NB, kRowGrain, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const X* v = xp + b * 32;  // blocks are contiguous: row t, block j is b = t * NB + j
        c10::Float8_e4m3fn* out = qp + b * 32;
        float amax = 0.0f;
        for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(widen(v[i])));
        if (amax == 0.0f) {
          cp[b] = 0;
          for (int i = 0; i < 32; ++i) out[i] = c10::Float8_e4m3fn(0.0f);
          continue;
        }
        int ex = 0;
        std::frexp(amax, &ex);
        const int e = std::clamp(ex - 1 - 8, -127, 127);
        cp[b] = static_cast<uint8_t>(e + 127);
        const float scale = std::ldexp(1.0f, e);  // exact: 2^-127 is a float32 subnormal
        for (int i = 0; i < 32; ++i) {
          const float u = std::clamp(widen(v[i]) / scale, -448.0f, 448.0f);
          out[i] = c10::Float8_e4m3fn(u);
        }
      }
    });
  });
  return {q, codes};
}

}  // namespace epkit
