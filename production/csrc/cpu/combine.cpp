// Combine: the expert side reduces or forwards rows, the source side adds them up.
//
// The order is fixed by docs/semantics.md: out[t] = sum over nodes n ascending of N_n(t),
// N_n(t) = sum over the node's ranks d ascending of P_d(t) (G = ranks_per_node ranks a node;
// with G = 1 the plain sum over d ascending, bit for bit), P_d(t) = sum over k ascending of
// c_k * y(t, k) for the kept slots living on d; every product and every sum is a single
// float32 operation, every sum starts from +0.0.
//
// dedup's return path (docs/design.md): a token row with n kept slots returns its n rows of y
// themselves when n * itemsize(y) <= 4 (n <= per = 4 / itemsize), else its float32 partial
// P_d(t): u = min(n, per) units of H elements of y's dtype (a float32 partial is per units).
// With `first` (the return path as it travels): token row n's units start at unit first[n] of a
// [units, H] buffer in y's dtype, so gather_rows writes the exchange's send buffer itself and
// reduce_tokens reads the received buffer in place (no repacking pass on either side). Without
// it, a token row holds 4H bytes (one float32 row, the unused bytes zero): gather_rows' output
// [N, H] float32, reduce_tokens' input [S, per * H] (the form hier forwards and re-reduces).
#include "paths.h"
#include "../lanes.h"

#include <algorithm>
#include <atomic>
#include <vector>

namespace epkit {

namespace {

// The expert side's arguments: what both paths check, then the path's own (pairs.cpp,
// dedup.cpp).
void check_gather_rows_args(const Tensor& expert_y, const Tensor& recv_map,
                            const Tensor& row_weight, int64_t transport, bool weighted,
                            const char* op = "epkit.gather_rows") {
  check_dim(op, "expert_y", expert_y, 2);
  check_map(op, "recv_map", recv_map);
  check_device(op, "recv_map", recv_map, expert_y.device());
  with_transport(op, transport, [&](auto path) {
    check_gather(path, op, expert_y, recv_map, row_weight, weighted);
  });
}

// gather_units: gather_rows' arguments, and the buffer it writes: out [units, H] (pairs: [N, H])
// in expert_y's dtype, contiguous, on its device; dedup places its units by first [N].
void check_gather_units_args(const Tensor& expert_y, const Tensor& recv_map,
                             const Tensor& row_weight, int64_t transport, bool weighted,
                             const std::optional<Tensor>& first, const Tensor& out) {
  constexpr const char* op = "epkit.gather_units";
  check_gather_rows_args(expert_y, recv_map, row_weight, transport, weighted, op);
  check_dim(op, "out", out, 2);
  check_dtype(op, "out", out, expert_y.scalar_type());
  check_device(op, "out", out, expert_y.device());
  TORCH_CHECK(out.is_contiguous(), op, ": out must be contiguous");
  check_size(op, "out", out, 1, expert_y.size(1), "hidden of expert_y");
  with_transport(op, transport, [&](auto path) {
    check_units(path, op, out, recv_map, first, expert_y.device());
  });
}

}  // namespace

Tensor gather_rows_cpu(const Tensor& y_in, const Tensor& recv_map_in, const Tensor& row_weight,
                       int64_t transport, bool weighted) {
  check_gather_rows_args(y_in, recv_map_in, row_weight, transport, weighted);
  const Tensor y = y_in.contiguous(), recv_map = recv_map_in.contiguous();
  const int64_t N = recv_map.size(0), H = y.size(1);
  return with_transport("epkit.gather_rows", transport, [&](auto path) {
    using Path = decltype(path);
    Tensor out = empty_large({N, H}, Path::gather_dtype(y.scalar_type()));
    gather_into(path, "epkit.gather_rows", y, recv_map, row_weight, weighted, nullptr,
                N * Path::per(y.element_size()), static_cast<uint8_t*>(out.data_ptr()));
    return out;
  });
}

void gather_units_cpu(const Tensor& y_in, const Tensor& recv_map_in, const Tensor& row_weight,
                      int64_t transport, bool weighted, const std::optional<Tensor>& first,
                      const Tensor& out) {
  check_gather_units_args(y_in, recv_map_in, row_weight, transport, weighted, first, out);
  const Tensor y = y_in.contiguous(), recv_map = recv_map_in.contiguous();
  const Tensor fp = first.has_value() ? first->contiguous() : Tensor();
  with_transport("epkit.gather_units", transport, [&](auto path) {
    gather_into(path, "epkit.gather_units", y, recv_map, row_weight, weighted,
                fp.defined() ? fp.data_ptr<int64_t>() : nullptr, out.size(0),
                static_cast<uint8_t*>(out.data_ptr()));
  });
}

namespace {

// Source side, a partial per destination rank, added into its node's partial over d ascending,
// the node partials added over nodes ascending (G = 1: the partials added over d). dedup: token
// row r = (t, d) of send_map has its units at first[r] of back [U, H] (else at r * per of back
// [S, per * H]), in y's dtype: its n rows of y when n <= per (the partial formed here with the
// weights, k ascending), else the float32 partial's bits; topk_idx is the *kept* routing
// (dropped slots -1), so n = t's slots on d.
// pairs: back [S, H] rows of expert_y per slot; slots visited in (rank, k) order, a partial
// per rank, as the expert side forms it for dedup: the same bits.
// One body (about 90 lines) on purpose, over the path's rules (pairs.h, dedup.h: where a slot's
// row is, whether a rank's slots share a token row or came back as its partial): the source's
// sum is the spec's order (docs/semantics.md, "Combine": slots k ascending per rank, then
// ranks, grouped by node) and reads here in one place, under one dtype dispatch.
template <typename Path>
Tensor reduce_tokens_path(const Tensor& back_in, const Tensor& send_map_in,
                          const Tensor& topk_idx, const Tensor& topk_weights, int64_t E,
                          int64_t R, bool weighted, at::ScalarType out_dtype, int64_t G,
                          const std::optional<Tensor>& first_in) {
  const Tensor back = back_in.contiguous(), send_map = send_map_in.contiguous();
  const Tensor idx = topk_idx.to(at::kLong).contiguous();
  const Tensor wt = weighted ? topk_weights.contiguous() : topk_weights;  // the source's weights
  const int64_t T = send_map.size(0), C = send_map.size(1), L = E / R;
  const int64_t per = Path::per(back.element_size());        // y rows in one float32 row
  const bool compact = first_in.has_value();                  // dedup's units at first[r]
  const Tensor first = compact ? first_in->contiguous() : Tensor();
  const int64_t* fp = compact ? first.data_ptr<int64_t>() : nullptr;
  const int64_t H = compact ? back.size(1) : back.size(1) / per;
  const int64_t K = idx.size(1), S = compact ? first.size(0) : back.size(0);  // rows sent
  const int64_t U = compact ? back.size(0) : S * per;         // units of H elements in back
  const int64_t* mp = send_map.data_ptr<int64_t>();
  const int64_t* ip = idx.data_ptr<int64_t>();
  const float* wp = weighted ? wt.data_ptr<float>() : nullptr;
  // A send_map entry outside [-1, S), a used slot whose expert is outside [0, E), (dedup) a
  // token row without a kept slot or whose units lie outside back: raised after the loop.
  std::atomic<bool> bad{false}, bad_first{false};
  Tensor out = empty_large({T, H}, out_dtype);
  dispatch_float_types(out_dtype, "epkit.reduce_tokens", [&](auto otag) {
    using O = decltype(otag);
    O* op = out.data_ptr<O>();
    dispatch_float_types(back.scalar_type(), "epkit.reduce_tokens", [&](auto btag) {
      using Bt = decltype(btag);
      const Bt* bp = back.data_ptr<Bt>();
      at::parallel_for(0, T, kRowGrain, [&](int64_t t0, int64_t t1) {
        std::vector<float> w(K);
        std::vector<int64_t> order(K);
        std::vector<const Bt*> rows(K);
        std::vector<RowGroup> groups(K);
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t* mrow = mp + t * C;  // t's send_map row
          if (t + 1 < t1)  // the next token's rows, in as many streams as it has ranks
            for (int64_t c = 0; c < C; ++c) {
              const int64_t r = mrow[C + c];
              if (r < 0 || r >= S) continue;
              const int64_t at = Path::unit_of_row(r, fp, per);
              if (at >= 0 && at + per <= U) prefetch_row(bp + at * H, per * H * sizeof(Bt));
            }
          // The used slots of t with a row (pairs: the slot's; dedup: its token row's), in
          // (destination rank, k) order.
          int64_t n = 0;
          for (int64_t k = 0; k < K; ++k) {
            const int64_t e = ip[t * K + k];
            if (e < 0) {  // an unused slot
              if (!Path::unused_slot_ok(mrow, k)) bad.store(true, std::memory_order_relaxed);
              continue;
            }
            const int64_t r = e < E ? mrow[Path::send_map_col(k, e / L)] : -2;
            if (r >= 0 && r < S) order[n++] = k;
            else if (r != -1 || Path::kKeptRouting) bad.store(true, std::memory_order_relaxed);
          }
          std::stable_sort(order.begin(), order.begin() + n, [&](int64_t a, int64_t b) {
            return ip[t * K + a] / L < ip[t * K + b] / L;
          });
          // One group per destination rank d: its rows (pairs: the slots' rows; dedup: the
          // token row's units) with the source's weights, or its float32 partial.
          int64_t ng = 0, nr = 0;
          for (int64_t i = 0; i < n;) {
            const int64_t d = ip[t * K + order[i]] / L;
            int64_t cnt = 0;
            while (i + cnt < n && ip[t * K + order[i + cnt]] / L == d) ++cnt;
            // dedup: the token row's first unit in back (its rows follow it, or its partial)
            const int64_t at0 = Path::group_unit(mrow, d, fp, per);
            if (!Path::group_fits(at0, cnt, per, U)) {
              bad_first.store(true, std::memory_order_relaxed);
              i += cnt;
              continue;
            }
            if (Path::partial(cnt, per)) {  // the float32 partial P_d(t), formed on the expert side
              groups[ng++] = {0, reinterpret_cast<const uint8_t*>(bp + at0 * H), d / G};
              i += cnt;
              continue;
            }
            for (int64_t q = 0; q < cnt; ++q, ++i, ++nr) {
              const int64_t k = order[i];
              rows[nr] = bp + Path::unit_of_slot(mrow, k, at0, q) * H;
              w[nr] = weighted ? wp[t * K + k] : 1.0f;
            }
            groups[ng++] = {cnt, nullptr, d / G};
          }
          sum_groups(op + t * H, H, groups.data(), ng, rows.data(), w.data(), weighted, G > 1);
        }
      });
    });
  });
  if (bad.load() || bad_first.load()) {
    constexpr const char* op = "epkit.reduce_tokens";
    check_map_range(op, "send_map", mp, T * C, S, "rows of back");
    check_expert_range(op, ip, T * K, E);
    TORCH_CHECK(!bad_first.load(), op, ": a token row whose units lie outside back's ", U,
                " units (first names a unit out of range)");
    TORCH_CHECK(false, op, Path::kMissingRow);
  }
  return out;
}

}  // namespace

Tensor reduce_tokens_cpu(const Tensor& back, const Tensor& send_map, const Tensor& topk_idx,
                         const Tensor& topk_weights, int64_t E, int64_t R, int64_t transport,
                         bool weighted, at::ScalarType out_dtype, int64_t G,
                         const std::optional<Tensor>& first) {
  check_reduce_tokens_args(back, send_map, topk_idx, topk_weights, E, R, transport, weighted,
                           out_dtype, G, first);
  return with_transport("epkit.reduce_tokens", transport, [&](auto path) {
    return reduce_tokens_path<decltype(path)>(back, send_map, topk_idx, topk_weights, E, R,
                                              weighted, out_dtype, G, first);
  });
}

}  // namespace epkit
