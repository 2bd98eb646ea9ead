// Send-side packing: one pass over the payload, rows written straight into the send buffer.
//
// pairs: one row per kept slot, ordered by destination rank, local expert, token
//        (= global expert, token); send_map [T, K] = send row of slot (t, k) or -1.
// dedup: one token row per (token, destination rank with a *kept* slot), ordered by rank,
//        token, followed in the chunk by its n >= 1 slot rows (k << 24 | j, w); send_map
//        [T, R] = send row of (t, d) or -1 (no kept slot of t on d: t does not travel there).
#include "../checks.h"

#include <vector>

namespace epkit {

std::tuple<Tensor, Tensor> pack_cpu(const Tensor& x_in, const Tensor& topk_idx,
                                    const Tensor& topk_weights, const Tensor& plan_t,
                                    int64_t transport, int64_t num_ranks, c10::SymInt send_bytes) {
  const int64_t SB = send_bytes.expect_int();
  check_pack_args(x_in, topk_idx, topk_weights, plan_t, transport, SB);
  const Tensor x = x_in.contiguous();
  const Tensor idx = topk_idx.to(at::kLong).contiguous();
  const Tensor wt = topk_weights.contiguous();
  const int64_t* plan = plan_t.data_ptr<int64_t>();
  const int64_t T = idx.size(0), K = idx.size(1);
  const int64_t P = x.size(1) * x.element_size();
  // Every chunk of the plan fits the SB-byte buffer; each write below stays in its chunk.
  const PlanOffsets o = check_pack_plan(plan, plan_t.numel(), transport, num_ranks, P, SB);
  const int64_t R = plan[kRanks], E = plan[kExperts], L = plan[kLocalExperts];
  const bool pairs = transport == kPairs;
  const int64_t B = P + (pairs ? kPairsMetaBytes : kDedupTokMeta);
  const int64_t cap = static_cap(plan), tokcap = plan[kTokCap], slotcap = plan[kSlotCap];
  const int64_t* own_kept = plan + o.own_kept;
  std::vector<int64_t> rank_of(E), local_of(E);
  for (int64_t e = 0; e < E; ++e) { rank_of[e] = e / L; local_of[e] = e % L; }

  // Chunk d: [token (pairs: slot) section | dedup slot section], each a run of fixed-size rows;
  // under the static exchange each section opens with a header row carrying its count in-band.
  Tensor send = tokcap >= 0 ? at::zeros({SB}, at::kByte) : at::empty({SB}, at::kByte);
  uint8_t* sb = send.data_ptr<uint8_t>();
  std::vector<int64_t> chunk(R + 1, 0), slot_sec(R), row_start(R, 0);
  for (int64_t d = 0; d < R; ++d) {
    chunk[d + 1] = chunk[d] + plan[o.send_bytes + d];
    const int64_t tok_rows = tokcap >= 0 ? tokcap : plan[o.send_counts + d];
    slot_sec[d] = chunk[d] + tok_rows * B + (cap >= 0 ? kSlotRowBytes : 0);
    if (d > 0) row_start[d] = row_start[d - 1] + plan[o.send_counts + d - 1];
    if (cap >= 0) {
      put<int64_t>(sb + chunk[d], plan[o.send_counts + d]);
      if (!pairs) put<int64_t>(sb + slot_sec[d] - kSlotRowBytes, plan[o.send_slots + d]);
    }
  }
  const int64_t hdr = cap >= 0 ? 1 : 0;
  // Byte offset of data row i of chunk d; and its row in the row space that combine and the
  // backward passes exchange (compact, or static chunks of 1 + cap rows).
  auto byte_of = [&](int64_t d, int64_t i) { return chunk[d] + (hdr + i) * B; };
  auto row_of = [&](int64_t d, int64_t i) {
    return cap >= 0 ? d * (1 + cap) + 1 + i : row_start[d] + i;
  };

  const int64_t* ip = idx.data_ptr<int64_t>();
  const float* wp = wt.data_ptr<float>();
  // Serial index pass (integers only): kept slots, and the row of each slot (pairs) or of each
  // (token, rank) with the start of its slot rows (dedup).
  std::vector<int64_t> cursor(E, 0);
  std::vector<uint8_t> kept(T * K, 0);
  std::vector<int64_t> slot_at;  // dedup: [T, R] index of the first slot row of (t, d)
  std::vector<int64_t> local(R, 0);  // rows of chunk d so far
  const int64_t* counts = plan + o.send_counts;  // data rows each chunk holds
  auto expert = [&](int64_t t, int64_t k) {
    const int64_t e = ip[t * K + k];
    TORCH_CHECK(e >= -1 && e < E, "epkit.pack: topk_idx[", t, ", ", k, "] = ", e,
                " outside [-1, ", E, ")");
    return e;
  };
  auto overrun = [&](int64_t d, int64_t i) {
    TORCH_CHECK(false, "epkit.pack: row ", i, " of chunk ", d, " is past the plan's ", counts[d],
                " rows (a plan from another call?)");
  };
  Tensor send_map;
  std::vector<int64_t> slot_of;  // pairs: the slot t * K + k of each send row, in send order
  if (pairs) {
    send_map = at::full({T, K}, -1, at::kLong);
    int64_t* mp = send_map.data_ptr<int64_t>();
    slot_of.assign(R ? row_start[R - 1] + counts[R - 1] : 0, -1);
    std::vector<int64_t> start(E + 1, 0);
    for (int64_t e = 0; e < E; ++e) start[e + 1] = start[e] + own_kept[e];
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k) {
        const int64_t e = expert(t, k);
        if (e < 0) continue;
        const int64_t r = cursor[e]++;
        if (r < own_kept[e]) {
          const int64_t d = rank_of[e], i = start[e] + r - start[d * L];  // index in chunk
          if (i < 0 || i >= counts[d]) overrun(d, i);
          mp[t * K + k] = i;
          slot_of[row_start[d] + i] = t * K + k;
        }
      }
  } else {
    send_map = at::full({T, R}, -1, at::kLong);
    int64_t* mp = send_map.data_ptr<int64_t>();
    slot_at.assign(T * R, 0);
    std::vector<int64_t> nslot(R, 0);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k) {
        const int64_t e = expert(t, k);
        if (e < 0) continue;
        const int64_t d = rank_of[e];
        const bool keep = cursor[e]++ < own_kept[e];
        kept[t * K + k] = keep;
        if (keep && mp[t * R + d] < 0) {  // the first kept slot of t on d opens its token row
          if (local[d] >= counts[d]) overrun(d, local[d]);
          mp[t * R + d] = local[d]++;
          slot_at[t * R + d] = nslot[d];
        }
        nslot[d] += keep;
      }
    for (int64_t d = 0; d < R; ++d)
      TORCH_CHECK(local[d] == counts[d] && nslot[d] == plan[o.send_slots + d], "epkit.pack: ",
                  local[d], " rows and ", nslot[d], " slot rows for chunk ", d,
                  ", the plan says ", counts[d], " and ", plan[o.send_slots + d],
                  " (a plan from another call?)");
  }

  // This call's slots are the plan's: all of them kept without capacity (else at least the kept
  // ones), and (pairs) the chunks hold exactly the kept slots, so no row is left unwritten.
  for (int64_t e = 0; e < E; ++e)
    TORCH_CHECK(plan[kCapacity] < 0 ? cursor[e] == own_kept[e] : cursor[e] >= own_kept[e],
                "epkit.pack: ", cursor[e], " slots name expert ", e, ", the plan keeps ",
                own_kept[e], " (a plan from another call?)");
  if (pairs)
    for (int64_t d = 0; d < R; ++d) {
      int64_t n = 0;
      for (int64_t j = 0; j < L; ++j) n += own_kept[d * L + j];
      TORCH_CHECK(n == counts[d], "epkit.pack: the plan keeps ", n, " slots for rank ", d,
                  " but sends ", counts[d], " rows");
    }

  // Parallel payload pass. pairs: over the send rows in order (the buffer is written front to
  // back, one stream; x is read by token, a small array). dedup: each token writes its own
  // rows (its K slots share one row per rank), no two tokens share one.
  const uint8_t* xb = static_cast<const uint8_t*>(x.data_ptr());
  int64_t* mp = send_map.data_ptr<int64_t>();
  if (pairs) {
    const int64_t rows_sent = static_cast<int64_t>(slot_of.size());
    at::parallel_for(0, rows_sent, kRowGrain, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t slot = slot_of[g], t = slot / K, e = ip[slot], d = rank_of[e];
        const int64_t i = g - row_start[d];
        uint8_t* row = sb + byte_of(d, i);
        copy_row(row, xb + t * P, P);
        put<int32_t>(row + P, static_cast<int32_t>(t));
        put<int32_t>(row + P + kPairsMetaK, static_cast<int32_t>(slot % K));
        put<int32_t>(row + P + kPairsMetaJ, static_cast<int32_t>(local_of[e]));
        put<float>(row + P + kPairsMetaW, wp[slot]);
        mp[slot] = row_of(d, i);
      }
    });
    return {send, send_map};
  }
  at::parallel_for(0, T, kRowGrain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* src = xb + t * P;
      for (int64_t d = 0; d < R; ++d) {
        int64_t& i = mp[t * R + d];
        if (i < 0) continue;
        uint8_t* row = sb + byte_of(d, i);
        copy_row(row, src, P);
        int32_t n = 0;
        uint8_t* slot = sb + slot_sec[d] + slot_at[t * R + d] * kSlotRowBytes;
        for (int64_t k = 0; k < K; ++k) {
          const int64_t e = ip[t * K + k];
          if (e < 0 || rank_of[e] != d || !kept[t * K + k]) continue;
          put<int32_t>(slot + n * kSlotRowBytes, static_cast<int32_t>((k << 24) | (local_of[e])));
          put<float>(slot + n * kSlotRowBytes + 4, wp[t * K + k]);
          ++n;
        }
        put<int32_t>(row + P, static_cast<int32_t>(t));
        put<int32_t>(row + P + kDedupMetaN, n);
        i = row_of(d, i);
      }
    }
  });
  return {send, send_map};
}

// Rows of src [T, H] copied to the send rows named by send_map [T, C] (pairs: per slot;
// dedup: per destination rank); used for gradients travelling the dispatch direction. The
// send rows are written front to back (from[r]: the source token of send row r, found in the
// serial range-check pass), so the large output is one stream; rows no entry names get zeros.
Tensor scatter_rows_cpu(const Tensor& src_in, const Tensor& send_map_in, c10::SymInt send_rows) {
  const int64_t S = send_rows.expect_int();
  check_scatter_rows_args(src_in, send_map_in, S);
  const Tensor src = src_in.contiguous(), send_map = send_map_in.contiguous();
  const int64_t C = send_map.size(1);
  const int64_t nbytes = src.size(1) * src.element_size();
  const int64_t* mp = send_map.data_ptr<int64_t>();
  std::vector<int64_t> from(S, -1);
  for (int64_t i = 0, n = send_map.numel(); i < n; ++i) {
    TORCH_CHECK(mp[i] >= -1 && mp[i] < S, "epkit.scatter_rows: send_map entry ", i, " is ", mp[i],
                ", outside [-1, ", S, ") (send_rows)");
    if (mp[i] < 0) continue;
    TORCH_CHECK(from[mp[i]] < 0, "epkit.scatter_rows: send_map entry ", i, " names send row ",
                mp[i], ", named already by token ", from[mp[i]]);
    from[mp[i]] = i / C;
  }
  Tensor out = at::empty({S, src.size(1)}, src.options());
  const uint8_t* sp = static_cast<const uint8_t*>(src.data_ptr());
  uint8_t* op = static_cast<uint8_t*>(out.data_ptr());
  at::parallel_for(0, S, kRowGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if (from[r] < 0) std::memset(op + r * nbytes, 0, nbytes);
      else stream_row(op + r * nbytes, sp + from[r] * nbytes, nbytes);
    }
    stream_fence();
  });
  return out;
}

}  // namespace epkit
