// Combine: the expert side reduces or forwards rows, the source side adds them up.
//
// The order is fixed by docs/semantics.md: out[t] = sum over nodes n ascending of N_n(t),
// N_n(t) = sum over the node's ranks d ascending of P_d(t) (G = ranks_per_node ranks a node;
// with G = 1 the plain sum over d ascending, bit for bit), P_d(t) = sum over k ascending of
// c_k * y(t, k) for the kept slots living on d; every product and every sum is a single
// float32 operation, every sum starts from +0.0.
//
// dedup's way back (docs/design.md): a token row with n kept slots returns its n rows of y
// themselves when n * itemsize(y) <= 4 (n <= per = 4 / itemsize), else its float32 partial
// P_d(t). Both kernels hold a token row in 4H bytes (one float32 row): gather_rows' output
// [N, H] float32, reduce_tokens' input [S, per * H] in y's dtype (the same bytes); the ops
// in Python move only the min(n, per) rows of y each token row uses.
#include "../checks.h"

#include <algorithm>
#include <atomic>
#include <vector>

namespace epkit {

// Expert side. dedup: per received row with n kept slots, its 4H bytes: the n rows of
// expert_y (k ascending, unweighted: the source multiplies) when n <= per, else the float32
// partial P_d(t) (its K slots summed); pairs: each received slot's row of expert_y, copied as
// is (the source multiplies).
// (About 70 lines: both transports' expert-side passes under one dtype dispatch.)
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
  const int64_t per = 4 / y.element_size(), rb = H * y.element_size();
  dispatch_float_types(y.scalar_type(), "epkit.gather_rows", [&](auto tag) {
    using T = decltype(tag);
    const T* yp = y.data_ptr<T>();
    at::parallel_for(0, N, kRowGrain, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) {
        float* acc = op + n * H;
        int64_t kept = 0;
        for (int64_t c = 0; c < C; ++c) kept += mp[n * C + c] >= 0 && mp[n * C + c] < M;
        if (kept <= per) {  // the rows themselves, k ascending; the unused bytes zero
          uint8_t* raw = reinterpret_cast<uint8_t*>(acc);
          int64_t i = 0;
          for (int64_t c = 0; c < C; ++c) {
            const int64_t m = mp[n * C + c];
            if (m < 0 || m >= M) {
              if (m != -1) bad.store(true, std::memory_order_relaxed);
              continue;
            }
            copy_row(raw + i++ * rb, reinterpret_cast<const uint8_t*>(yp + m * H), rb);
          }
          std::memset(raw + i * rb, 0, (per - i) * rb);
          continue;
        }
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

// Source side, a partial per destination rank, added into its node's partial over d ascending,
// the node partials added over nodes ascending (G = 1: the partials added over d). dedup: back
// [S, per * H] in y's dtype, row r = token row (t, d) of send_map: its n rows of y when
// n <= per (the partial formed here with the weights, k ascending), else the float32 partial's
// bits; topk_idx is the *kept* routing (dropped slots -1), so n = t's slots on d.
// pairs: back [S, H] rows of expert_y per slot; slots visited in (rank, k) order, a partial
// per rank, as the expert side forms it for dedup: the same bits.
namespace {

// part = +0.0 + c_0 * y_0 + c_1 * y_1 + ... over the rows `rows[i]` (k ascending), c the slot's
// weight when weighted (else the row itself: 1 * y is exact, the spec's sum either way).
template <typename Bt>
inline void partial_of(float* part, int64_t H, const Bt* const* rows, const float* w, int64_t n,
                       bool weighted) {
  std::fill(part, part + H, 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    const Bt* br = rows[i];
    if (weighted)
      for (int64_t h = 0; h < H; ++h) part[h] = part[h] + w[i] * widen(br[h]);
    else
      for (int64_t h = 0; h < H; ++h) part[h] = part[h] + widen(br[h]);
  }
}

}  // namespace

// One body (about 90 lines) on purpose: the source's sum is the spec's order (docs/semantics.md,
// "Combine": slots k ascending per rank, then ranks, grouped by node) and reads here in one
// place, under one dtype dispatch, for both transports.
Tensor reduce_tokens_cpu(const Tensor& back_in, const Tensor& send_map_in, const Tensor& topk_idx,
                         const Tensor& topk_weights, int64_t E, int64_t R, int64_t transport,
                         bool weighted, at::ScalarType out_dtype, int64_t G) {
  check_reduce_tokens_args(back_in, send_map_in, topk_idx, topk_weights, E, R, transport, weighted,
                           out_dtype, G);
  const Tensor back = back_in.contiguous(), send_map = send_map_in.contiguous();
  const Tensor idx = topk_idx.to(at::kLong).contiguous();
  const Tensor wt = weighted ? topk_weights.contiguous() : topk_weights;  // the source's weights
  const bool dedup = transport == kDedup;
  const int64_t T = send_map.size(0), C = send_map.size(1), L = E / R;
  const int64_t per = dedup ? 4 / back.element_size() : 1;   // y rows in one float32 row
  const int64_t H = back.size(1) / per, BW = back.size(1);   // BW: back's row width
  const int64_t K = idx.size(1), S = back.size(0);
  const int64_t* mp = send_map.data_ptr<int64_t>();
  const int64_t* ip = idx.data_ptr<int64_t>();
  const float* wp = weighted ? wt.data_ptr<float>() : nullptr;
  // A send_map entry outside [-1, S), a used slot whose expert is outside [0, E), or (dedup) a
  // token row without a kept slot: raised after the loop.
  std::atomic<bool> bad{false};
  Tensor out = at::empty({T, H}, at::TensorOptions().dtype(out_dtype));
  dispatch_float_types(out_dtype, "epkit.reduce_tokens", [&](auto otag) {
    using O = decltype(otag);
    O* op = out.data_ptr<O>();
    dispatch_float_types(back.scalar_type(), "epkit.reduce_tokens", [&](auto btag) {
      using Bt = decltype(btag);
      const Bt* bp = back.data_ptr<Bt>();
      at::parallel_for(0, T, kRowGrain, [&](int64_t t0, int64_t t1) {
        std::vector<float> total(H), part(H), node(G > 1 ? H : 0), w(K);
        std::vector<int64_t> order(K);
        std::vector<const Bt*> rows(K);
        for (int64_t t = t0; t < t1; ++t) {
          std::fill(total.begin(), total.end(), 0.0f);
          int64_t open_node = -1;  // G > 1: the node whose partial `node` holds
          // The used slots of t with a row (pairs: the slot's; dedup: its token row's), in
          // (destination rank, k) order.
          int64_t n = 0;
          for (int64_t k = 0; k < K; ++k) {
            const int64_t e = ip[t * K + k];
            if (e < 0) {  // pairs: an unused slot has no row
              if (!dedup && mp[t * C + k] != -1) bad.store(true, std::memory_order_relaxed);
              continue;
            }
            const int64_t r = e < E ? mp[t * C + (dedup ? e / L : k)] : -2;
            if (r >= 0 && r < S) order[n++] = k;
            else if (r != -1 || dedup) bad.store(true, std::memory_order_relaxed);
          }
          std::stable_sort(order.begin(), order.begin() + n, [&](int64_t a, int64_t b) {
            return ip[t * K + a] / L < ip[t * K + b] / L;
          });
          for (int64_t i = 0; i < n;) {  // one destination rank d at a time
            const int64_t d = ip[t * K + order[i]] / L;
            int64_t j = i, cnt = 0;
            for (; j < n && ip[t * K + order[j]] / L == d; ++j, ++cnt) {
              const int64_t k = order[j];
              const int64_t r = mp[t * C + (dedup ? d : k)];
              rows[cnt] = dedup ? bp + r * BW + cnt * H : bp + r * BW;
              w[cnt] = weighted ? wp[t * K + k] : 1.0f;
            }
            if (dedup && cnt > per)  // the float32 partial P_d(t), formed on the expert side
              std::memcpy(part.data(), bp + mp[t * C + d] * BW, H * sizeof(float));
            else
              partial_of(part.data(), H, rows.data(), w.data(), cnt, weighted);
            if (G == 1) {
              for (int64_t h = 0; h < H; ++h) total[h] = total[h] + part[h];
            } else {  // N_n = +0.0 + P_d + ..., added to the total when the next node opens
              if (d / G != open_node) {
                if (open_node >= 0)
                  for (int64_t h = 0; h < H; ++h) total[h] = total[h] + node[h];
                std::fill(node.begin(), node.end(), 0.0f);
                open_node = d / G;
              }
              for (int64_t h = 0; h < H; ++h) node[h] = node[h] + part[h];
            }
            i = j;
          }
          if (open_node >= 0)
            for (int64_t h = 0; h < H; ++h) total[h] = total[h] + node[h];
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
    TORCH_CHECK(false, op, dedup ? ": a kept slot whose token row send_map does not name"
                                 : ": send_map sends a slot whose topk_idx is -1");
  }
  return out;
}

}  // namespace epkit
