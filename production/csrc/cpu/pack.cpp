// Send-side packing: one pass over the payload, rows written straight into the send buffer.
//
// pairs: one row per kept slot, ordered by destination rank, local expert, token
//        (= global expert, token); send_map [T, K] = send row of slot (t, k) or -1.
// dedup: one row per (token, destination rank with a used slot), ordered by rank, token;
//        send_map [T, R] = send row of (t, d) or -1. Its meta carries the K local ids
//        (-1 where the slot is unused, dropped, or on another rank) and weights.
#include "../epkit.h"

#include <vector>

namespace epkit {

std::tuple<Tensor, Tensor> pack_cpu(const Tensor& x_in, const Tensor& topk_idx,
                                    const Tensor& topk_weights, const Tensor& plan_t,
                                    int64_t transport, int64_t num_ranks, c10::SymInt send_rows) {
  const Tensor x = x_in.contiguous();
  const Tensor idx = topk_idx.to(at::kLong).contiguous();
  const Tensor wt = topk_weights.contiguous();
  const int64_t* plan = plan_t.data_ptr<int64_t>();
  const int64_t R = plan[kRanks], E = plan[kExperts], L = plan[kLocalExperts];
  TORCH_CHECK(num_ranks == R, "epkit.pack: num_ranks disagrees with the plan");
  const PlanOffsets o(R, E);
  const int64_t T = idx.size(0), K = idx.size(1);
  const int64_t payload = x.size(1) * x.element_size();
  const int64_t B = payload + meta_bytes(transport, K);
  const int64_t S = send_rows.expect_int();
  TORCH_CHECK(S == plan[kSendRows], "epkit.pack: send_rows disagrees with the plan");

  const int64_t cap = static_cap(plan);
  // Static: gaps stay zero, and every chunk's first row carries its count in-band.
  Tensor send = cap >= 0 ? at::zeros({S, B}, at::kByte) : at::empty({S, B}, at::kByte);
  std::vector<int64_t> chunk_start(R, 0);  // compact start of chunk d
  for (int64_t d = 1; d < R; ++d) chunk_start[d] = chunk_start[d - 1] + plan[o.send_counts + d - 1];
  // Row of the i-th row of chunk d in the send buffer.
  auto place = [&](int64_t d, int64_t i) {
    return cap >= 0 ? d * (1 + cap) + 1 + i : chunk_start[d] + i;
  };
  if (cap >= 0)
    for (int64_t d = 0; d < R; ++d)
      put<int64_t>(send.data_ptr<uint8_t>() + d * (1 + cap) * B, plan[o.send_counts + d]);
  const int64_t* ip = idx.data_ptr<int64_t>();
  const float* wp = wt.data_ptr<float>();
  const int64_t* own_kept = plan + o.own_kept;

  // Serial index pass (integers only): which slots are kept, and where each row goes.
  std::vector<int64_t> cursor(E, 0);
  std::vector<uint8_t> kept(T * K, 0);
  Tensor send_map;
  if (transport == kPairs) {
    send_map = at::full({T, K}, -1, at::kLong);
    int64_t* mp = send_map.data_ptr<int64_t>();
    std::vector<int64_t> start(E + 1, 0);
    for (int64_t e = 0; e < E; ++e) start[e + 1] = start[e] + own_kept[e];
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k) {
        const int64_t e = ip[t * K + k];
        if (e < 0) continue;
        const int64_t r = cursor[e]++;
        if (r < own_kept[e]) mp[t * K + k] = place(e / L, start[e] + r - chunk_start[e / L]);
      }
  } else {
    send_map = at::full({T, R}, -1, at::kLong);
    int64_t* mp = send_map.data_ptr<int64_t>();
    std::vector<int64_t> next(R, 0);  // rows of chunk d so far
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k) {
        const int64_t e = ip[t * K + k];
        if (e < 0) continue;
        kept[t * K + k] = cursor[e]++ < own_kept[e];
        int64_t& slot = mp[t * R + e / L];
        if (slot < 0) slot = place(e / L, next[e / L]++);  // rows of rank d in token order
      }
  }

  // Parallel payload pass: each token writes its own rows, no two tokens share one.
  const uint8_t* xb = static_cast<const uint8_t*>(x.data_ptr());
  uint8_t* sb = send.data_ptr<uint8_t>();
  const int64_t* mp = send_map.data_ptr<int64_t>();
  at::parallel_for(0, T, kRowGrain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* src = xb + t * payload;
      if (transport == kPairs) {
        for (int64_t k = 0; k < K; ++k) {
          const int64_t r = mp[t * K + k];
          if (r < 0) continue;
          uint8_t* row = sb + r * B;
          copy_row(row, src, payload);
          const int64_t e = ip[t * K + k];
          put<int32_t>(row + payload, static_cast<int32_t>(t));
          put<int32_t>(row + payload + 4, static_cast<int32_t>(k));
          put<int32_t>(row + payload + 8, static_cast<int32_t>(e % L));
          put<float>(row + payload + 12, wp[t * K + k]);
        }
      } else {
        for (int64_t d = 0; d < R; ++d) {
          const int64_t r = mp[t * R + d];
          if (r < 0) continue;
          uint8_t* row = sb + r * B;
          copy_row(row, src, payload);
          uint8_t* meta = row + payload;
          std::memset(meta, 0, B - payload);
          put<int32_t>(meta, static_cast<int32_t>(t));
          for (int64_t k = 0; k < K; ++k) {
            const int64_t e = ip[t * K + k];
            const bool here = e >= 0 && e / L == d && kept[t * K + k];
            put<int32_t>(meta + 4 + 4 * k, here ? static_cast<int32_t>(e % L) : -1);
            put<float>(meta + 4 + 4 * K + 4 * k, here ? wp[t * K + k] : 0.0f);
          }
        }
      }
    }
  });
  return {send, send_map};
}

// Rows of src [T, H] copied to the send rows named by send_map [T, C] (pairs: per slot;
// dedup: per destination rank); used for gradients travelling the dispatch direction.
Tensor scatter_rows_cpu(const Tensor& src_in, const Tensor& send_map, c10::SymInt send_rows) {
  const Tensor src = src_in.contiguous();
  const int64_t T = src.size(0), C = send_map.size(1), S = send_rows.expect_int();
  const int64_t nbytes = src.size(1) * src.element_size();
  Tensor out = at::zeros({S, src.size(1)}, src.options());  // rows no slot names stay zero
  const uint8_t* sp = static_cast<const uint8_t*>(src.data_ptr());
  uint8_t* op = static_cast<uint8_t*>(out.data_ptr());
  const int64_t* mp = send_map.data_ptr<int64_t>();
  at::parallel_for(0, T, kRowGrain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t c = 0; c < C; ++c) {
        const int64_t r = mp[t * C + c];
        if (r >= 0) copy_row(op + r * nbytes, sp + t * nbytes, nbytes);
      }
  });
  return out;
}

}  // namespace epkit
