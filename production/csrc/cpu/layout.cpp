// Layout, local validation and the count-exchange words (the "prepare" half of dispatch).
#include "../checks.h"

#include <cmath>

namespace epkit {

namespace {

// Error codes: reference/errors.py (Reason). Only the value checks live here; dtype, shape and
// option checks happen in Python before this kernel is called (their result is `pre_error`).
using reason::kDuplicateExpert, reason::kHiddenNotMult32, reason::kIndexOutOfRange,
    reason::kNonfinitePayload, reason::kNonfiniteWeight, reason::kStaticOverflow;

struct Err { int64_t code = 0, a = 0, b = 0; };

Err check_values(const Tensor& x, const Tensor& idx, const Tensor& w, int64_t E, int64_t payload) {
  const int64_t T = idx.size(0), K = idx.size(1);
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < T * K; ++i)
    if (ip[i] < -1 || ip[i] >= E) return {kIndexOutOfRange, ip[i], E};
  // The first row naming an expert twice; reported with the smallest such expert.
  for (int64_t t = 0; t < T; ++t) {
    int64_t dup = -1;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = ip[t * K + k];
      if (e < 0) continue;
      for (int64_t k2 = 0; k2 < k; ++k2)
        if (ip[t * K + k2] == e && (dup < 0 || e < dup)) dup = e;
    }
    if (dup >= 0) return {kDuplicateExpert, t, dup};
  }
  const float* wp = w.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k)
      if (!std::isfinite(wp[t * K + k])) return {kNonfiniteWeight, t, 0};
  const int64_t block = payload_block(payload);
  if (block) {  // a quantized payload: H % block, then finite x (b: the payload's code)
    if (x.size(1) % block) return {kHiddenNotMult32, x.size(1), payload};
    const Tensor xf = x.to(at::kFloat);
    const float* xp = xf.data_ptr<float>();
    const int64_t H = x.size(1);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h)
        if (!std::isfinite(xp[t * H + h])) return {kNonfinitePayload, t, payload};
  }
  return {};
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor, Tensor> layout_cpu(const Tensor& topk_idx, int64_t E,
                                                     int64_t R) {
  check_layout_args(topk_idx, E, R);
  const Tensor idx = topk_idx.to(at::kLong).contiguous();
  const int64_t T = idx.size(0), K = idx.size(1), L = E / R;
  Tensor tpe = at::zeros({E}, at::kLong), tpr = at::zeros({R}, at::kLong),
         spr = at::zeros({R}, at::kLong), in_rank = at::zeros({T, R}, at::kBool);
  const int64_t* ip = idx.data_ptr<int64_t>();
  int64_t *pe = tpe.data_ptr<int64_t>(), *pr = tpr.data_ptr<int64_t>(),
          *ps = spr.data_ptr<int64_t>();
  bool* pin = in_rank.data_ptr<bool>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = ip[t * K + k];
      if (e < 0) {
        TORCH_CHECK(e == -1, "epkit.layout: topk_idx[", t, ", ", k, "] = ", e, " outside [-1, ", E,
                    ")");
        continue;
      }
      TORCH_CHECK(e < E, "epkit.layout: topk_idx[", t, ", ", k, "] = ", e, " outside [-1, ", E, ")");
      const int64_t d = e / L;
      ++pe[e];
      ++ps[d];
      if (!pin[t * R + d]) { pin[t * R + d] = true; ++pr[d]; }
    }
  return {tpe, tpr, spr, in_rank};
}

// The word vector this rank contributes to the count exchange (see epkit.h).
Tensor prepare_cpu(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_weights, int64_t E,
                   int64_t R, at::IntArrayRef pre_error, int64_t payload) {
  check_prepare_args(x, topk_idx, topk_weights, E, R, pre_error, payload);
  Tensor words = at::zeros({kWordHeader + E + R}, at::kLong);
  int64_t* w = words.data_ptr<int64_t>();
  Err err{pre_error[kPreErrorCode], pre_error[kPreErrorA], pre_error[kPreErrorB]};
  if (err.code == 0) {
    const Tensor idx = topk_idx.to(at::kLong).contiguous();
    err = check_values(x, idx, topk_weights.contiguous(), E, payload);
    // max_tokens_per_rank of the static exchange (-1: not static).
    const int64_t max_tokens =
        int64_t(pre_error.size()) > kPreErrorMaxTokens ? pre_error[kPreErrorMaxTokens] : -1;
    if (err.code == 0 && max_tokens >= 0 && x.size(0) > max_tokens)
      err = {kStaticOverflow, x.size(0), max_tokens};
    if (err.code == 0) {
      auto [tpe, tpr, spr, in_rank] = layout_cpu(idx, E, R);
      std::memcpy(w + kWordHeader, tpe.data_ptr<int64_t>(), E * sizeof(int64_t));
      std::memcpy(w + kWordHeader + E, tpr.data_ptr<int64_t>(), R * sizeof(int64_t));
    }
    w[kWordTokens] = x.size(0);
    w[kWordHidden] = x.size(1);
    w[kWordTopK] = topk_idx.size(1);
  }
  w[kWordErrorCode] = err.code;
  w[kWordErrorA] = err.a;
  w[kWordErrorB] = err.b;
  w[kWordXDtype] = int64_t(pre_error.size()) > kPreErrorXDtype ? pre_error[kPreErrorXDtype] : 0;
  w[kWordPayload] = payload;
  return words;
}

}  // namespace epkit
