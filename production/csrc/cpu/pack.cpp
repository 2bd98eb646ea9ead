// Send-side packing: one pass over the payload, rows written straight into the send buffer.
//
// pairs: one row per kept slot, ordered by destination rank, local expert, token
//        (= global expert, token); send_map [T, K] = send row of slot (t, k) or -1.
// dedup: one token row per (token, destination rank with a *kept* slot), ordered by rank,
//        token, followed in the chunk by its n >= 1 slot rows (k << 24 | j, w); send_map
//        [T, R] = send row of (t, d) or -1 (no kept slot of t on d: t does not travel there).
#include "../checks.h"

#include <cstdlib>
#include <vector>

namespace epkit {

namespace {

// Where pack writes: chunk d of the send buffer is [token (pairs: slot) section | dedup slot
// section], each a run of fixed-size rows; under the static exchange each section opens with a
// header row carrying its count in-band (written here).
struct PackLayout {
  int64_t R = 0, E = 0, L = 0, K = 0, T = 0, P = 0, B = 0, cap = -1, hdr = 0;
  bool pairs = true;
  const int64_t* plan = nullptr;
  const int64_t* own_kept = nullptr;  // [E] kept slots of this rank per expert
  const int64_t* counts = nullptr;    // [R] data rows each chunk holds
  int64_t send_slots = 0;            // plan offset of the [R] slot rows each chunk holds
  std::vector<int64_t> chunk, slot_sec, row_start, rank_of, local_of;

  // Byte offset of data row i of chunk d; and its row in the row space that combine and the
  // backward passes exchange (compact, or static chunks of 1 + cap rows).
  int64_t byte_of(int64_t d, int64_t i) const { return chunk[d] + (hdr + i) * B; }
  int64_t row_of(int64_t d, int64_t i) const {
    return cap >= 0 ? d * (1 + cap) + 1 + i : row_start[d] + i;
  }
  int64_t rows_sent() const { return R ? row_start[R - 1] + counts[R - 1] : 0; }
};

PackLayout layout_of(const int64_t* plan, const PlanOffsets& o, int64_t transport, int64_t T,
                     int64_t K, int64_t P, uint8_t* sb) {
  PackLayout l;
  l.plan = plan;
  l.send_slots = o.send_slots;
  l.R = plan[kRanks], l.E = plan[kExperts], l.L = plan[kLocalExperts], l.K = K, l.T = T, l.P = P;
  l.pairs = transport == kPairs;
  l.B = P + (l.pairs ? kPairsMetaBytes : kDedupTokMeta);
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
    if (l.cap >= 0) {
      put<int64_t>(sb + l.chunk[d], l.counts[d]);
      if (!l.pairs) put<int64_t>(sb + l.slot_sec[d] - kSlotRowBytes, plan[o.send_slots + d]);
    }
  }
  return l;
}

int64_t expert_at(const int64_t* ip, int64_t t, int64_t k, int64_t K, int64_t E) {
  const int64_t e = ip[t * K + k];
  TORCH_CHECK(e >= -1 && e < E, "epkit.pack: topk_idx[", t, ", ", k, "] = ", e,
              " outside [-1, ", E, ")");
  return e;
}

[[noreturn]] void overrun(const PackLayout& l, int64_t d, int64_t i) {
  TORCH_CHECK(false, "epkit.pack: row ", i, " of chunk ", d, " is past the plan's ", l.counts[d],
              " rows (a plan from another call?)");
  std::abort();  // not reached: TORCH_CHECK(false) throws
}

// pairs' serial index pass (integers only): each kept slot's index in its chunk (send_map, to
// be turned into its row by the payload pass) and the slot of each send row (slot_of).
std::vector<int64_t> pairs_index(const PackLayout& l, const int64_t* ip, int64_t* mp,
                                 std::vector<int64_t>& cursor) {
  std::vector<int64_t> slot_of(l.rows_sent(), -1);
  std::vector<int64_t> start(l.E + 1, 0);
  for (int64_t e = 0; e < l.E; ++e) start[e + 1] = start[e] + l.own_kept[e];
  for (int64_t t = 0; t < l.T; ++t)
    for (int64_t k = 0; k < l.K; ++k) {
      const int64_t e = expert_at(ip, t, k, l.K, l.E);
      if (e < 0) continue;
      const int64_t r = cursor[e]++;
      if (r < l.own_kept[e]) {
        const int64_t d = l.rank_of[e], i = start[e] + r - start[d * l.L];  // index in chunk
        if (i < 0 || i >= l.counts[d]) overrun(l, d, i);
        mp[t * l.K + k] = i;
        slot_of[l.row_start[d] + i] = t * l.K + k;
      }
    }
  return slot_of;
}

// dedup's serial index pass: the kept mask, the token row of each (t, d) with a kept slot
// (send_map, its index in the chunk) and the index of its first slot row (slot_at [T, R]).
void dedup_index(const PackLayout& l, const int64_t* ip, int64_t* mp, std::vector<int64_t>& cursor,
                 std::vector<uint8_t>& kept, std::vector<int64_t>& slot_at) {
  const int64_t R = l.R;
  slot_at.assign(l.T * R, 0);
  std::vector<int64_t> local(R, 0), nslot(R, 0);
  for (int64_t t = 0; t < l.T; ++t)
    for (int64_t k = 0; k < l.K; ++k) {
      const int64_t e = expert_at(ip, t, k, l.K, l.E);
      if (e < 0) continue;
      const int64_t d = l.rank_of[e];
      const bool keep = cursor[e]++ < l.own_kept[e];
      kept[t * l.K + k] = keep;
      if (keep && mp[t * R + d] < 0) {  // the first kept slot of t on d opens its token row
        if (local[d] >= l.counts[d]) overrun(l, d, local[d]);
        mp[t * R + d] = local[d]++;
        slot_at[t * R + d] = nslot[d];
      }
      nslot[d] += keep;
    }
  for (int64_t d = 0; d < R; ++d)
    TORCH_CHECK(local[d] == l.counts[d] && nslot[d] == l.plan[l.send_slots + d], "epkit.pack: ",
                local[d], " rows and ", nslot[d], " slot rows for chunk ", d,
                ", the plan says ", l.counts[d], " and ", l.plan[l.send_slots + d],
                " (a plan from another call?)");
}

// This call's slots are the plan's: all of them kept without capacity (else at least the kept
// ones), and (pairs) the chunks hold exactly the kept slots, so no row is left unwritten.
void check_slots_are_the_plans(const PackLayout& l, const std::vector<int64_t>& cursor) {
  for (int64_t e = 0; e < l.E; ++e)
    TORCH_CHECK(l.plan[kCapacity] < 0 ? cursor[e] == l.own_kept[e] : cursor[e] >= l.own_kept[e],
                "epkit.pack: ", cursor[e], " slots name expert ", e, ", the plan keeps ",
                l.own_kept[e], " (a plan from another call?)");
  if (!l.pairs) return;
  for (int64_t d = 0; d < l.R; ++d) {
    int64_t n = 0;
    for (int64_t j = 0; j < l.L; ++j) n += l.own_kept[d * l.L + j];
    TORCH_CHECK(n == l.counts[d], "epkit.pack: the plan keeps ", n, " slots for rank ", d,
                " but sends ", l.counts[d], " rows");
  }
}

// pairs' payload pass: over the send rows in order (the buffer is written front to back, one
// stream; x is read by token, a small array).
void pairs_payload(const PackLayout& l, const std::vector<int64_t>& slot_of, const uint8_t* xb,
                   const int64_t* ip, const float* wp, int64_t* mp, uint8_t* sb) {
  const int64_t P = l.P, K = l.K;
  at::parallel_for(0, static_cast<int64_t>(slot_of.size()), kRowGrain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t slot = slot_of[g], t = slot / K, e = ip[slot], d = l.rank_of[e];
      const int64_t i = g - l.row_start[d];
      uint8_t* row = sb + l.byte_of(d, i);
      copy_row(row, xb + t * P, P);
      put<int32_t>(row + P, static_cast<int32_t>(t));
      put<int32_t>(row + P + kPairsMetaK, static_cast<int32_t>(slot % K));
      put<int32_t>(row + P + kPairsMetaJ, static_cast<int32_t>(l.local_of[e]));
      put<float>(row + P + kPairsMetaW, wp[slot]);
      mp[slot] = l.row_of(d, i);
    }
  });
}

// dedup's payload pass: each token writes its own rows (its K slots share one row per rank),
// no two tokens share one; its kept slots on d follow as slot rows, k ascending.
void dedup_payload(const PackLayout& l, const std::vector<uint8_t>& kept,
                   const std::vector<int64_t>& slot_at, const uint8_t* xb, const int64_t* ip,
                   const float* wp, int64_t* mp, uint8_t* sb) {
  const int64_t P = l.P, K = l.K, R = l.R;
  at::parallel_for(0, l.T, kRowGrain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* src = xb + t * P;
      for (int64_t d = 0; d < R; ++d) {
        int64_t& i = mp[t * R + d];
        if (i < 0) continue;
        uint8_t* row = sb + l.byte_of(d, i);
        copy_row(row, src, P);
        int32_t n = 0;
        uint8_t* slot = sb + l.slot_sec[d] + slot_at[t * R + d] * kSlotRowBytes;
        for (int64_t k = 0; k < K; ++k) {
          const int64_t e = ip[t * K + k];
          if (e < 0 || l.rank_of[e] != d || !kept[t * K + k]) continue;
          put<int32_t>(slot + n * kSlotRowBytes, static_cast<int32_t>((k << 24) | l.local_of[e]));
          put<float>(slot + n * kSlotRowBytes + 4, wp[t * K + k]);
          ++n;
        }
        put<int32_t>(row + P, static_cast<int32_t>(t));
        put<int32_t>(row + P + kDedupMetaN, n);
        i = l.row_of(d, i);
      }
    }
  });
}

}  // namespace

namespace {

// The plan's offsets, checked against the other arguments: every chunk of the plan fits an
// SB-byte send buffer, so each write of pack_into_send stays in its chunk. (Before a buffer of
// SB bytes is allocated: an absurd SB is an error, not an allocation.)
PlanOffsets plan_offsets(const Tensor& x, const Tensor& plan_t, int64_t transport,
                         int64_t num_ranks, int64_t SB) {
  return check_pack_plan(plan_t.data_ptr<int64_t>(), plan_t.numel(), transport, num_ranks,
                         x.size(1) * x.element_size(), SB);
}

// The op into `send` (the SB bytes `o` was checked against): the layout, the serial index pass,
// the plan's consistency, the parallel payload pass (one per transport). Returns send_map.
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
  const PackLayout l = layout_of(plan, o, transport, T, K, P, sb);

  const int64_t* ip = idx.data_ptr<int64_t>();
  const float* wp = wt.data_ptr<float>();
  const uint8_t* xb = static_cast<const uint8_t*>(x.data_ptr());
  std::vector<int64_t> cursor(l.E, 0);
  Tensor send_map = at::full({T, l.pairs ? K : l.R}, -1, at::kLong);
  int64_t* mp = send_map.data_ptr<int64_t>();
  if (l.pairs) {
    const std::vector<int64_t> slot_of = pairs_index(l, ip, mp, cursor);
    check_slots_are_the_plans(l, cursor);
    pairs_payload(l, slot_of, xb, ip, wp, mp, sb);
  } else {
    std::vector<uint8_t> kept(T * K, 0);
    std::vector<int64_t> slot_at;
    dedup_index(l, ip, mp, cursor, kept, slot_at);
    check_slots_are_the_plans(l, cursor);
    dedup_payload(l, kept, slot_at, xb, ip, wp, mp, sb);
  }
  return send_map;
}

}  // namespace

std::tuple<Tensor, Tensor> pack_cpu(const Tensor& x_in, const Tensor& topk_idx,
                                    const Tensor& topk_weights, const Tensor& plan_t,
                                    int64_t transport, int64_t num_ranks, c10::SymInt send_bytes) {
  const int64_t SB = send_bytes.expect_int();
  check_pack_args(x_in, topk_idx, topk_weights, plan_t, transport, SB);
  const PlanOffsets o = plan_offsets(x_in, plan_t, transport, num_ranks, SB);
  Tensor send = empty_large({SB}, at::kByte);
  Tensor send_map = pack_into_send(x_in, topk_idx, topk_weights, plan_t, transport, o, send);
  return {send, send_map};
}

Tensor pack_into_cpu(const Tensor& x_in, const Tensor& topk_idx, const Tensor& topk_weights,
                     const Tensor& plan_t, int64_t transport, int64_t num_ranks,
                     const Tensor& send) {
  constexpr const char* op = "epkit.pack_into";
  check_send_buffer(op, send, x_in.device());
  check_pack_args(x_in, topk_idx, topk_weights, plan_t, transport, send.numel(), op);
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
