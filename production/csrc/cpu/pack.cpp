// Send-side packing: one pass over the payload, rows written straight into the send buffer.
//
// pairs: one row per kept slot, ordered by destination rank, local expert, token
//        (= global expert, token); send_map [T, K] = send row of slot (t, k) or -1.
// dedup: one token row per (token, destination rank with a *kept* slot), ordered by rank,
//        token, followed in the chunk by its n >= 1 slot rows (k << 24 | j, w); send_map
//        [T, R] = send row of (t, d) or -1 (no kept slot of t on d: t does not travel there).
#include "paths.h"

#include <vector>

namespace epkit {

namespace {

// Where each chunk's sections start; under the static exchange the token section's header row
// is written here (a slot section's, by the path that has one: cpu/dedup.cpp).
PackLayout layout_of(const int64_t* plan, const PlanOffsets& o, int64_t meta_bytes, int64_t T,
                     int64_t K, int64_t P, uint8_t* sb) {
  PackLayout l;
  l.plan = plan;
  l.send_slots = o.send_slots;
  l.R = plan[kRanks], l.E = plan[kExperts], l.L = plan[kLocalExperts], l.K = K, l.T = T, l.P = P;
  l.B = P + meta_bytes;
  l.cap = static_cap(plan);
  l.hdr = l.cap >= 0 ? 1 : 0;
  l.own_kept = plan + o.own_kept;
  l.counts = plan + o.send_counts;
  const int64_t tokcap = plan[kTokCap];
  l.rank_of.resize(l.E), l.local_of.resize(l.E);
  for (int64_t e = 0; e < l.E; ++e) { l.rank_of[e] = e / l.L; l.local_of[e] = e % l.L; }
  l.chunk.assign(l.R + 1, 0), l.slot_sec.assign(l.R, 0), l.row_start.assign(l.R, 0);
  for (int64_t d = 0; d < l.R; ++d) {
    l.chunk[d + 1] = l.chunk[d] + plan[o.send_bytes + d];
    const int64_t tok_rows = tokcap >= 0 ? tokcap : l.counts[d];
    l.slot_sec[d] = l.chunk[d] + tok_rows * l.B + (l.cap >= 0 ? kSlotRowBytes : 0);
    if (d > 0) l.row_start[d] = l.row_start[d - 1] + l.counts[d - 1];
    if (l.cap >= 0) put<int64_t>(sb + l.chunk[d], l.counts[d]);  // the token section's count
  }
  return l;
}

}  // namespace

void check_slots_are_the_plans(const PackLayout& l, const std::vector<int64_t>& cursor) {
  for (int64_t e = 0; e < l.E; ++e)
    TORCH_CHECK(l.plan[kCapacity] < 0 ? cursor[e] == l.own_kept[e] : cursor[e] >= l.own_kept[e],
                "epkit.pack: ", cursor[e], " slots name expert ", e, ", the plan keeps ",
                l.own_kept[e], " (a plan from another call?)");
}

namespace {

// The plan's offsets, checked against the other arguments: every chunk of the plan fits an
// SB-byte send buffer, so each write of pack_into_send stays in its chunk. (Before a buffer of
// SB bytes is allocated: an absurd SB is an error, not an allocation.)
PlanOffsets plan_offsets(const Tensor& x, const Tensor& plan_t, int64_t transport,
                         int64_t num_ranks, int64_t SB) {
  return check_pack_plan(plan_t.data_ptr<int64_t>(), plan_t.numel(), transport, num_ranks,
                         x.size(1) * x.element_size(), SB);
}

// The op into `send` (the SB bytes `o` was checked against): the layout, then the path's passes
// (pairs.cpp, dedup.cpp: the serial index pass, the plan's consistency, the payload pass).
// Returns send_map.
Tensor pack_into_send(const Tensor& x_in, const Tensor& topk_idx, const Tensor& topk_weights,
                      const Tensor& plan_t, int64_t transport, const PlanOffsets& o,
                      const Tensor& send) {
  const Tensor x = x_in.contiguous();
  const Tensor idx = topk_idx.to(at::kLong).contiguous();
  const Tensor wt = topk_weights.contiguous();
  const int64_t* plan = plan_t.data_ptr<int64_t>();
  const int64_t T = idx.size(0), K = idx.size(1);
  const int64_t P = x.size(1) * x.element_size();
  // Static chunks have gaps (cap rows, not all used) that must be zero; else every byte is
  // written by the passes below.
  if (plan[kTokCap] >= 0) send.zero_();  // static: the chunks' unused rows travel as zeros
  uint8_t* sb = send.data_ptr<uint8_t>();
  const int64_t* ip = idx.data_ptr<int64_t>();
  const float* wp = wt.data_ptr<float>();
  const uint8_t* xb = static_cast<const uint8_t*>(x.data_ptr());
  return with_transport("epkit.pack", transport, [&](auto path) {
    using Path = decltype(path);
    const PackLayout l = layout_of(plan, o, Path::kMetaBytes, T, K, P, sb);
    std::vector<int64_t> cursor(l.E, 0);
    Tensor send_map = at::full({T, Path::send_map_cols(K, l.R)}, -1, at::kLong);
    pack_rows(path, l, ip, wp, xb, send_map.data_ptr<int64_t>(), sb, cursor);
    return send_map;
  });
}

}  // namespace

std::tuple<Tensor, Tensor> pack_cpu(const Tensor& x_in, const Tensor& topk_idx,
                                    const Tensor& topk_weights, const Tensor& plan_t,
                                    int64_t transport, int64_t num_ranks, c10::SymInt send_bytes,
                                    const std::optional<Tensor>& plan_host) {
  const int64_t SB = send_bytes.expect_int();
  // plan_host is checked, not read: the CPU kernel reads the plan, host memory itself
  check_pack_args(x_in, topk_idx, topk_weights, plan_t, transport, SB, plan_host);
  const PlanOffsets o = plan_offsets(x_in, plan_t, transport, num_ranks, SB);
  Tensor send = empty_large({SB}, at::kByte);
  Tensor send_map = pack_into_send(x_in, topk_idx, topk_weights, plan_t, transport, o, send);
  return {send, send_map};
}

Tensor pack_into_cpu(const Tensor& x_in, const Tensor& topk_idx, const Tensor& topk_weights,
                     const Tensor& plan_t, int64_t transport, int64_t num_ranks,
                     const Tensor& send,
                     const std::optional<Tensor>& plan_host) {
  constexpr const char* op = "epkit.pack_into";
  check_send_buffer(op, send, x_in.device());
  check_pack_args(x_in, topk_idx, topk_weights, plan_t, transport, send.numel(), plan_host, op);
  const PlanOffsets o = plan_offsets(x_in, plan_t, transport, num_ranks, send.numel());
  return pack_into_send(x_in, topk_idx, topk_weights, plan_t, transport, o, send);
}

// Rows of src [T, H] copied to the send rows named by send_map [T, C] (pairs: per slot;
// dedup: per destination rank); used for gradients travelling the dispatch direction. The
// send rows are written front to back (from[r]: the source token of send row r, found in the
// serial range-check pass), so the large output is one stream; rows no entry names get zeros.
namespace {

void scatter_rows_into_out(const char* op_name, const Tensor& src_in, const Tensor& send_map_in,
                           const Tensor& out) {
  const int64_t S = out.size(0);
  const Tensor src = src_in.contiguous(), send_map = send_map_in.contiguous();
  const int64_t C = send_map.size(1);
  const int64_t nbytes = src.size(1) * src.element_size();
  const int64_t* mp = send_map.data_ptr<int64_t>();
  std::vector<int64_t> from(S, -1);
  for (int64_t i = 0, n = send_map.numel(); i < n; ++i) {
    TORCH_CHECK(mp[i] >= -1 && mp[i] < S, op_name, ": send_map entry ", i, " is ", mp[i],
                ", outside [-1, ", S, ") (send_rows)");
    if (mp[i] < 0) continue;
    TORCH_CHECK(from[mp[i]] < 0, op_name, ": send_map entry ", i, " names send row ",
                mp[i], ", named already by token ", from[mp[i]]);
    from[mp[i]] = i / C;
  }
  const uint8_t* sp = static_cast<const uint8_t*>(src.data_ptr());
  uint8_t* op = static_cast<uint8_t*>(out.data_ptr());
  at::parallel_for(0, S, kRowGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if (from[r] < 0) std::memset(op + r * nbytes, 0, nbytes);
      else stream_row(op + r * nbytes, sp + from[r] * nbytes, nbytes);
    }
    stream_fence();
  });
}

}  // namespace

Tensor scatter_rows_cpu(const Tensor& src, const Tensor& send_map, c10::SymInt send_rows) {
  const int64_t S = send_rows.expect_int();
  check_scatter_rows_args(src, send_map, S);
  Tensor out = empty_large({S, src.size(1)}, src.scalar_type());
  scatter_rows_into_out("epkit.scatter_rows", src, send_map, out);
  return out;
}

void scatter_rows_into_cpu(const Tensor& src, const Tensor& send_map, const Tensor& out) {
  check_scatter_rows_into_args(src, send_map, out);
  scatter_rows_into_out("epkit.scatter_rows_into", src, send_map, out);
}

}  // namespace epkit
