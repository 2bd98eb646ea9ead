// Backward kernels. Gradients travel the reverse way of their forward and reuse its maps.
#include "../checks.h"
#include "../lanes.h"

#include <vector>

namespace epkit {

// One slot row of the combine backward: gy = cast_y(w * g) and (returned) <g, y> in 16 float32
// lanes, lane i summing h = i (mod 16) in ascending h, the tail h >= 16 * (H / 16) in lane 0,
// then the lanes added 0..15. Both in the single pass that reads y; the 16 lanes are one vector
// (each step one element-wise multiply and add, in that order), so no float32 operation is
// reordered whatever the vector width.
template <typename Y, typename G>
EPKIT_ROW_CLONES float weighted_row(const G* __restrict g, const Y* __restrict y,
                                    Y* __restrict gy, float w, int64_t H) {
  V16f lane = {};
  // w in every lane. Not V16f{} + w: +0 + -0 is +0, so a weight of -0 would lose its sign
  // (the spec's product w * g keeps it: -0 * g is -0 for g > 0).
  V16f wv;
  for (int i = 0; i < 16; ++i) wv[i] = w;
  int64_t h = 0;
  for (; h + 16 <= H; h += 16) {
    V16f gh, yh;
    load16(g + h, gh);
    load16(y + h, yh);
    store16(gy + h, wv * gh);
    lane = lane + gh * yh;
  }
  float tail[16];
  std::memcpy(tail, &lane, sizeof(tail));
  for (; h < H; ++h) {
    const float gh = widen(g[h]);
    gy[h] = narrow<Y>(w * gh);
    tail[0] = tail[0] + gh * widen(y[h]);
  }
  float dot = 0.0f;
  for (int i = 0; i < 16; ++i) dot = dot + tail[i];
  return dot;
}

// Unweighted (c = 1): gy = cast_y(g), no multiply, as the spec's reference does.
template <typename Y, typename G>
EPKIT_ROW_CLONES void plain_row(const G* __restrict g, Y* __restrict gy, int64_t H) {
  for (int64_t h = 0; h < H; ++h) gy[h] = narrow<Y>(widen(g[h]));
}

// Combine backward, expert side. recv [N, H]: grad_out rows as sent by the sources (per slot
// for pairs, per token and rank for dedup). For each slot row m:
//   grad_y[m]          = cast_y(c_m * g)             (c_m = row_weight[m] if weighted, else 1)
//   grad_row_weight[m] = sum_h g_h * y[m, h]          (weighted_row's 16 lanes; 0 unweighted)
// Padding rows get zeros. The rows are walked in expert-major order m (parallel over m), each
// taking its received row from source_rows (checks.h): y and grad_y stream front to back, padding rows
// are zeroed in the same pass, and grad_y is never zero-filled first.
std::tuple<Tensor, Tensor> combine_backward_dest_cpu(const Tensor& recv_in,
                                                     const Tensor& recv_map_in,
                                                     const Tensor& row_weight_in,
                                                     const Tensor& y_in, bool weighted) {
  check_combine_backward_dest_args(recv_in, recv_map_in, row_weight_in, y_in, weighted);
  const Tensor recv = recv_in.contiguous(), y = y_in.contiguous();
  const Tensor recv_map = recv_map_in.contiguous();
  const Tensor row_weight = weighted ? row_weight_in.contiguous() : row_weight_in;
  const int64_t H = y.size(1), M = y.size(0), C = recv_map.size(1);
  const std::vector<int64_t> src = source_rows(recv_map, M, "epkit.combine_backward_dest",
                                               "rows of expert_y");
  Tensor grad_y = empty_large({M, H}, y.scalar_type());
  Tensor grad_w = at::empty({M}, at::kFloat);
  const float* wp = weighted ? row_weight.data_ptr<float>() : nullptr;
  float* gwp = grad_w.data_ptr<float>();
  dispatch_float_types(y.scalar_type(), "epkit.combine_backward", [&](auto ytag) {
    using Y = decltype(ytag);
    const Y* yp = y.data_ptr<Y>();
    Y* gyp = grad_y.data_ptr<Y>();
    dispatch_float_types(recv.scalar_type(), "epkit.combine_backward", [&](auto gtag) {
      using G = decltype(gtag);
      const G* rp = recv.data_ptr<G>();
      at::parallel_for(0, M, kRowGrain, [&](int64_t m0, int64_t m1) {
        for (int64_t m = m0; m < m1; ++m) {
          const int64_t n = src[m] < 0 ? -1 : src[m] / C;  // the received row
          if (m + 1 < m1 && src[m + 1] >= 0)
            prefetch_row(rp + src[m + 1] / C * H, H * sizeof(G));
          if (n < 0) {  // padding
            std::memset(gyp + m * H, 0, H * sizeof(Y));
            gwp[m] = 0.0f;
          } else if (weighted) {
            gwp[m] = weighted_row(rp + n * H, yp + m * H, gyp + m * H, wp[m], H);
          } else {
            plain_row(rp + n * H, gyp + m * H, H);
            gwp[m] = 0.0f;
          }
        }
      });
    });
  });
  return {grad_y, grad_w};
}

// The weight gradients' return path, expert side: values [M] float32 (one per expert-major row)
// -> out [out_rows], one float32 per kept slot in the dispatch's slot-row order. Received row
// n's entries that name a row (recv_map[n, c] >= 0, c ascending: k ascending for dedup, one
// for pairs) go to first[n], first[n] + 1, ... (epkit.ops.move_slot_values places the rows:
// compact chunks, or fixed ones); every other entry is 0 (a fixed chunk's padding, a static
// chunk's front row).
Tensor gather_slot_values_cpu(const Tensor& values, const Tensor& recv_map_in,
                              const Tensor& first_in, c10::SymInt out_rows) {
  const int64_t B = out_rows.expect_int();
  check_gather_slot_values_args(values, recv_map_in, first_in, B);
  constexpr const char* name = "epkit.gather_slot_values";
  const Tensor v = values.contiguous(), recv_map = recv_map_in.contiguous();
  const Tensor first = first_in.contiguous();
  Tensor out = at::zeros({B}, at::kFloat);
  const int64_t N = recv_map.size(0), C = recv_map.size(1), M = v.numel();
  const int64_t* mp = recv_map.data_ptr<int64_t>();
  const int64_t* fp = first.data_ptr<int64_t>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n) {
    int64_t at = fp[n];
    for (int64_t c = 0; c < C; ++c) {
      const int64_t m = mp[n * C + c];
      if (m == -1) continue;
      if (m < 0 || m >= M)
        report_map_range(name, "recv_map", mp, N * C, M, "entries of values");
      TORCH_CHECK(at >= 0 && at < B, name, ": first[", n, "] = ", fp[n], " places entry ", c,
                  " of row ", n, " at ", at, ", outside [0, ", B, ") (out_rows)");
      op[at++] = vp[m];
    }
  }
  return out;
}

// The source side: back [B] float32 as it came back (gather_slot_values' layout) -> per-slot
// values [T, K], 0 for unused and dropped slots. topk_idx is the kept routing (dedup: dropped
// slots -1, epkit.ops.kept_routing); first [S]: where send row r's first value lies in back.
// Slot (t, k) to rank d = e / L reads back[first[r] + place], r its send_map entry and place
// its path's (pairs.h: 0, its row's only value; dedup.h: its place among t's kept slots on d).
Tensor scatter_slot_values_cpu(const Tensor& back_in, const Tensor& send_map_in,
                               const Tensor& topk_idx, const Tensor& first_in, int64_t E,
                               int64_t R, int64_t transport) {
  check_scatter_slot_values_args(back_in, send_map_in, topk_idx, first_in, E, R, transport);
  constexpr const char* name = "epkit.scatter_slot_values";
  const Tensor back = back_in.contiguous(), send_map = send_map_in.contiguous();
  const Tensor idx = topk_idx.to(at::kLong).contiguous(), first = first_in.contiguous();
  const int64_t T = idx.size(0), K = idx.size(1), L = E / R, C = send_map.size(1);
  const int64_t S = first.size(0), B = back.size(0);
  Tensor out = at::zeros({T, K}, at::kFloat);
  const int64_t* mp = send_map.data_ptr<int64_t>();
  const int64_t* ip = idx.data_ptr<int64_t>();
  const int64_t* fp = first.data_ptr<int64_t>();
  const float* bp = back.data_ptr<float>();
  float* op = out.data_ptr<float>();
  with_transport(name, transport, [&](auto path) {
    using Path = decltype(path);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k) {
        const int64_t e = ip[t * K + k];
        if (e < 0 || e >= E) {
          if (e != -1) check_expert_range(name, ip, T * K, E);
          continue;
        }
        const int64_t i = t * C + Path::send_map_col(k, e / L), r = mp[i];
        if (r < 0 || r >= S) {
          TORCH_CHECK(r == -1, name, ": send_map entry ", i, " is ", r, ", outside [-1, ", S,
                      ") (rows of first)");
          continue;
        }
        const int64_t at = fp[r] + Path::slot_place(ip + t * K, k, e / L, E, L);
        TORCH_CHECK(fp[r] >= 0 && at < B, name, ": first[", r, "] = ", fp[r], " places slot (",
                    t, ", ", k, ") at ", at, ", outside [0, ", B, ") (rows of back)");
        op[t * K + k] = bp[at];
      }
  });
  return out;
}

}  // namespace epkit
