// Combine: the expert side reduces or forwards rows, the source side adds them up.
//
// The order is fixed by docs/semantics.md: out[t] = sum over d ascending of P_d(t),
// P_d(t) = sum over k ascending of c_k * y(t, k) for the kept slots living on d; every
// product and every sum is a single float32 operation, both sums start from +0.0.
#include "../checks.h"

#include <algorithm>
#include <atomic>
#include <vector>

namespace epkit {

// Expert side. dedup: one float32 partial P_d(t) per received row (its K slots summed);
// pairs: each received slot's row of expert_y, copied as is (the source multiplies).
Tensor gather_rows_cpu(const Tensor& y_in, const Tensor& recv_map_in, const Tensor& row_weight,
                       int64_t transport, bool weighted) {
  check_gather_rows_args(y_in, recv_map_in, row_weight, transport, weighted);
  const Tensor y = y_in.contiguous(), recv_map = recv_map_in.contiguous();
  const int64_t N = recv_map.size(0), C = recv_map.size(1), H = y.size(1), M = y.size(0);
  const int64_t* mp = recv_map.data_ptr<int64_t>();
  std::atomic<bool> bad{false};  // a map entry outside [-1, M): raised after the loop
  auto report = [&] {
    report_map_range("epkit.gather_rows", "recv_map", mp, N * C, M, "rows of expert_y");
  };
  if (transport == kPairs) {
    Tensor out = at::empty({N, H}, y.options());
    const int64_t nbytes = H * y.element_size();
    const uint8_t* yp = static_cast<const uint8_t*>(y.data_ptr());
    uint8_t* op = static_cast<uint8_t*>(out.data_ptr());
    at::parallel_for(0, N, kRowGrain, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) {
        const int64_t m = mp[n];
        if (m >= 0 && m < M) copy_row(op + n * nbytes, yp + m * nbytes, nbytes);
        else std::memset(op + n * nbytes, 0, nbytes);  // static-exchange header and gap rows
        if (m < -1 || m >= M) bad.store(true, std::memory_order_relaxed);
      }
    });
    if (bad.load()) report();
    return out;
  }
  Tensor out = at::empty({N, H}, at::kFloat);
  float* op = out.data_ptr<float>();
  const float* wp = weighted ? row_weight.data_ptr<float>() : nullptr;
  dispatch_float_types(y.scalar_type(), "epkit.gather_rows", [&](auto tag) {
    using T = decltype(tag);
    const T* yp = y.data_ptr<T>();
    at::parallel_for(0, N, kRowGrain, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) {
        float* acc = op + n * H;
        std::fill(acc, acc + H, 0.0f);
        for (int64_t c = 0; c < C; ++c) {
          const int64_t m = mp[n * C + c];
          if (m < 0 || m >= M) {
            if (m != -1) bad.store(true, std::memory_order_relaxed);
            continue;
          }
          const T* yr = yp + m * H;
          if (weighted) {
            const float w = wp[m];
            for (int64_t h = 0; h < H; ++h) acc[h] = acc[h] + w * widen(yr[h]);
          } else {
            for (int64_t h = 0; h < H; ++h) acc[h] = acc[h] + widen(yr[h]);
          }
        }
      }
    });
  });
  if (bad.load()) report();
  return out;
}

// Source side. dedup: back [S, H] float32 partials, added over d ascending.
// pairs: back [S, H] rows of expert_y per slot; slots visited in (rank, k) order, a partial
// per rank, as the dedup transport forms it on the expert side: the same bits.
Tensor reduce_tokens_cpu(const Tensor& back_in, const Tensor& send_map_in, const Tensor& topk_idx,
                         const Tensor& topk_weights, int64_t E, int64_t R, int64_t transport,
                         bool weighted, at::ScalarType out_dtype) {
  check_reduce_tokens_args(back_in, send_map_in, topk_idx, topk_weights, E, R, transport, weighted,
                           out_dtype);
  const Tensor back = back_in.contiguous(), send_map = send_map_in.contiguous();
  const Tensor idx = topk_idx.to(at::kLong).contiguous();
  const bool pairs_weighted = transport == kPairs && weighted;  // the only reader of the weights
  const Tensor wt = pairs_weighted ? topk_weights.contiguous() : topk_weights;
  const int64_t T = send_map.size(0), C = send_map.size(1), H = back.size(1), L = E / R;
  const int64_t K = idx.size(1), S = back.size(0);
  const int64_t* mp = send_map.data_ptr<int64_t>();
  const int64_t* ip = idx.data_ptr<int64_t>();
  const float* wp = pairs_weighted ? wt.data_ptr<float>() : nullptr;
  // A send_map entry outside [-1, S), or (pairs) a used slot whose expert is outside [0, E):
  // raised after the loop.
  std::atomic<bool> bad{false};
  Tensor out = at::empty({T, H}, at::TensorOptions().dtype(out_dtype));
  dispatch_float_types(out_dtype, "epkit.reduce_tokens", [&](auto otag) {
    using O = decltype(otag);
    O* op = out.data_ptr<O>();
    dispatch_float_types(back.scalar_type(), "epkit.reduce_tokens", [&](auto btag) {
      using Bt = decltype(btag);
      const Bt* bp = back.data_ptr<Bt>();
      at::parallel_for(0, T, kRowGrain, [&](int64_t t0, int64_t t1) {
        std::vector<float> total(H), part(H);
        std::vector<int64_t> order(K);
        for (int64_t t = t0; t < t1; ++t) {
          std::fill(total.begin(), total.end(), 0.0f);
          if (transport == kDedup) {
            for (int64_t d = 0; d < C; ++d) {
              const int64_t r = mp[t * C + d];
              if (r < 0 || r >= S) {
                if (r != -1) bad.store(true, std::memory_order_relaxed);
                continue;
              }
              const Bt* br = bp + r * H;
              for (int64_t h = 0; h < H; ++h) total[h] = total[h] + widen(br[h]);
            }
          } else {
            // Slots of t in (destination rank, k) order.
            int64_t n = 0;
            for (int64_t k = 0; k < K; ++k) {
              const int64_t r = mp[t * K + k], e = ip[t * K + k];
              if (r >= 0 && r < S && e >= 0 && e < E) order[n++] = k;
              else if (r != -1) bad.store(true, std::memory_order_relaxed);
            }
            std::stable_sort(order.begin(), order.begin() + n, [&](int64_t a, int64_t b) {
              return ip[t * K + a] / L < ip[t * K + b] / L;
            });
            int64_t cur = -1;
            for (int64_t i = 0; i < n; ++i) {
              const int64_t k = order[i], d = ip[t * K + k] / L;
              if (d != cur) {
                if (cur >= 0)
                  for (int64_t h = 0; h < H; ++h) total[h] = total[h] + part[h];
                std::fill(part.begin(), part.end(), 0.0f);
                cur = d;
              }
              const Bt* br = bp + mp[t * K + k] * H;
              if (weighted) {
                const float w = wp[t * K + k];
                for (int64_t h = 0; h < H; ++h) part[h] = part[h] + w * widen(br[h]);
              } else {
                for (int64_t h = 0; h < H; ++h) part[h] = part[h] + widen(br[h]);
              }
            }
            if (cur >= 0)
              for (int64_t h = 0; h < H; ++h) total[h] = total[h] + part[h];
          }
          O* orow = op + t * H;
          for (int64_t h = 0; h < H; ++h) orow[h] = narrow<O>(total[h]);
        }
      });
    });
  });
  if (bad.load()) {
    constexpr const char* op = "epkit.reduce_tokens";
    check_map_range(op, "send_map", mp, T * C, S, "rows of back");
    check_expert_range(op, ip, T * K, E);
    TORCH_CHECK(false, op, ": send_map sends a slot whose topk_idx is -1");
  }
  return out;
}

}  // namespace epkit
