// The dedup path's kernel passes (the token-row path; its rules in ../dedup.h): pack's index and
// payload passes (token rows, then their slot rows), unpack's index pass, the expert side of
// the return path (a token row's rows of y or its float32 partial). pairs.cpp has the same
// passes for slot rows; the op files (pack.cpp, unpack.cpp, combine.cpp) call them.
#include "paths.h"
#include "../lanes.h"

#include <algorithm>
#include <atomic>
#include <vector>

namespace epkit {

namespace {

// The serial index pass: the kept mask, the token row of each (t, d) with a kept slot
// (send_map, its index in the chunk) and the index of its first slot row (slot_at [T, R]).
void index_pass(const PackLayout& l, const int64_t* ip, int64_t* mp, std::vector<int64_t>& cursor,
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

// The payload pass: each token writes its own rows (its K slots share one row per rank), no two
// tokens share one; its kept slots on d follow as slot rows, k ascending.
void payload_pass(const PackLayout& l, const std::vector<uint8_t>& kept,
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
          const int64_t word = (k << kSlotKShift) | l.local_of[e];  // the slot word
          put<int32_t>(slot + n * kSlotRowBytes, static_cast<int32_t>(word));
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

void pack_rows(Dedup, const PackLayout& l, const int64_t* ip, const float* wp, const uint8_t* xb,
               int64_t* mp, uint8_t* sb, std::vector<int64_t>& cursor) {
  if (l.cap >= 0)  // the static exchange: each slot section opens with its count in-band
    for (int64_t d = 0; d < l.R; ++d)
      put<int64_t>(sb + l.slot_sec[d] - kSlotRowBytes, l.plan[l.send_slots + d]);
  std::vector<uint8_t> kept(l.T * l.K, 0);
  std::vector<int64_t> slot_at;
  index_pass(l, ip, mp, cursor, kept, slot_at);
  check_slots_are_the_plans(l, cursor);
  payload_pass(l, kept, slot_at, xb, ip, wp, mp, sb);
}

// Each token row's slot rows, in order, take the next row of their expert's segment. Fills
// recv_map (mp [N, K]) and each expert-major row's source.
void index_rows(Dedup, const int64_t* plan, const PlanOffsets& o, const std::vector<RecvRow>& rows,
                int64_t P, int64_t K, int64_t* mp, std::vector<Source>& from) {
  const int64_t L = plan[kLocalExperts];
  const int64_t* offsets = plan + o.offsets;
  std::vector<int64_t> cursor(offsets, offsets + L);
  for (const RecvRow& r : rows) {
    const int64_t n = Dedup::slots_in_row(r.bytes, P);
    for (int64_t i = 0; i < n; ++i) {
      const int32_t packed = get<int32_t>(r.slots + i * kSlotRowBytes);
      const int64_t k = slot_word_k(packed), j = slot_word_j(packed);
      TORCH_CHECK(j < L && k < K, "epkit.unpack: corrupt slot row (k ", k, ", j ", j, ")");
      TORCH_CHECK(cursor[j] < offsets[j + 1] && mp[r.row * K + k] < 0, "epkit.unpack: slot (k ",
                  k, ", local expert ", j, ") overruns its segment or repeats k");
      from[cursor[j]] = Source{r.bytes, r.slots + i * kSlotRowBytes, r.src};
      mp[r.row * K + k] = cursor[j]++;
    }
  }
  for (int64_t j = 0; j < L; ++j)
    TORCH_CHECK(cursor[j] - offsets[j] == plan[o.tokens_per_expert + j],
                "epkit.unpack: expert ", j, " received a count that disagrees with the plan");
}

void check_gather(Dedup, const char* op, const Tensor& expert_y, const Tensor&,
                  const Tensor& row_weight, bool weighted) {
  check_float_dtype(op, "expert_y", expert_y.scalar_type());
  if (weighted) {
    check_dim(op, "row_weight", row_weight, 1);
    check_dtype(op, "row_weight", row_weight, at::kFloat);
    check_device(op, "row_weight", row_weight, expert_y.device());
    check_size(op, "row_weight", row_weight, 0, expert_y.size(0), "rows of expert_y");
  }
}

void check_units(Dedup, const char* op, const Tensor&, const Tensor& recv_map,
                 const std::optional<Tensor>& first, c10::Device dev) {
  TORCH_CHECK(first.has_value(), op, ": dedup places its units by first");
  check_first(op, first, Dedup::kCode, recv_map.size(0), "rows of recv_map", dev);
}

// Per received token row with n kept slots, its u = min(n, per) units: the n rows of expert_y
// (k ascending, unweighted: the source multiplies) when n <= per, else the float32 partial
// P_d(t) (its K slots summed, weighted by row_weight when weighted).
void gather_into(Dedup, const char* op_name, const Tensor& y, const Tensor& recv_map,
                 const Tensor& row_weight, bool weighted, const int64_t* fp, int64_t U,
                 uint8_t* ob) {
  const int64_t N = recv_map.size(0), C = recv_map.size(1), H = y.size(1), M = y.size(0);
  const int64_t* mp = recv_map.data_ptr<int64_t>();
  std::atomic<bool> bad{false};  // a map entry outside [-1, M): raised after the loop
  const int64_t per = Dedup::per(y.element_size()), rb = H * y.element_size();
  const bool compact = fp != nullptr;
  if (compact) {  // the units must lie inside the buffer; gaps (fixed chunks' padding) are zero
    int64_t used = 0;
    for (int64_t n = 0; n < N; ++n) {
      int64_t kept = 0;
      for (int64_t c = 0; c < C; ++c) kept += mp[n * C + c] >= 0 && mp[n * C + c] < M;
      const int64_t u = std::min(kept, per);
      TORCH_CHECK(u == 0 || (fp[n] >= 0 && fp[n] + u <= U), op_name, ": first[", n, "] = ",
                  fp[n], " puts its ", u, " unit(s) outside the ", U, " units");
      used += u;
    }
    if (used != U) std::memset(ob, 0, static_cast<size_t>(U * rb));
  }
  const float* wp = weighted ? row_weight.data_ptr<float>() : nullptr;
  dispatch_float_types(y.scalar_type(), op_name, [&](auto tag) {
    using T = decltype(tag);
    const T* yp = y.data_ptr<T>();
    at::parallel_for(0, N, kRowGrain, [&](int64_t n0, int64_t n1) {
      std::vector<const T*> rows(C);
      std::vector<float> w(C);
      for (int64_t n = n0; n < n1; ++n) {
        if (n + 1 < n1)  // the next token row's sources, scattered over expert_y
          for (int64_t c = 0; c < C; ++c)
            if (mp[(n + 1) * C + c] >= 0 && mp[(n + 1) * C + c] < M)
              prefetch_row(yp + mp[(n + 1) * C + c] * H, rb);
        int64_t cnt = 0;  // the kept slots' rows, c order, and their weights
        for (int64_t c = 0; c < C; ++c) {
          const int64_t m = mp[n * C + c];
          if (m < 0 || m >= M) {
            if (m != -1) bad.store(true, std::memory_order_relaxed);
            continue;
          }
          rows[cnt] = yp + m * H;
          w[cnt++] = weighted ? wp[m] : 1.0f;
        }
        if (compact && cnt == 0) continue;  // no units
        uint8_t* raw = ob + (compact ? fp[n] : n * per) * rb;
        if (cnt <= per) {  // the rows themselves (the source multiplies)
          // the exchange's send buffer, written once front to back and read next by the
          // collective, not by this core: non-temporal stores (no read for ownership)
          for (int64_t i = 0; i < cnt; ++i)
            stream_row(raw + i * rb, reinterpret_cast<const uint8_t*>(rows[i]), rb);
          if (!compact) std::memset(raw + cnt * rb, 0, (per - cnt) * rb);  // unused bytes zero
          continue;
        }
        // the float32 partial P_d(t) = +0.0 + c * y + ... over the kept slots, c order; it may
        // start unaligned (compact units of an odd H), which sum_groups' stores allow
        const RowGroup all{cnt, nullptr, 0};
        sum_groups(reinterpret_cast<float*>(raw), H, &all, 1, rows.data(), w.data(), weighted,
                   false);
      }
      stream_fence();  // the streamed rows are visible before the exchange reads them
    });
  });
  if (bad.load()) report_map_range(op_name, "recv_map", mp, N * C, M, "rows of expert_y");
}

}  // namespace epkit
