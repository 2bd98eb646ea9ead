// The pairs path's kernel passes (the slot-row path; its rules in ../pairs.h): pack's index and
// payload passes, unpack's index pass, the expert side of the return path. dedup.cpp has the
// same passes for token rows; the op files (pack.cpp, unpack.cpp, combine.cpp) call them.
#include "paths.h"

#include <atomic>
#include <vector>

namespace epkit {

namespace {

// The serial index pass (integers only): each kept slot's index in its chunk (send_map, to be
// turned into its row by the payload pass) and the slot of each send row (slot_of).
std::vector<int64_t> index_pass(const PackLayout& l, const int64_t* ip, int64_t* mp,
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

// The chunks hold exactly the kept slots, so no row is left unwritten.
void check_chunks_hold_the_kept(const PackLayout& l) {
  for (int64_t d = 0; d < l.R; ++d) {
    int64_t n = 0;
    for (int64_t j = 0; j < l.L; ++j) n += l.own_kept[d * l.L + j];
    TORCH_CHECK(n == l.counts[d], "epkit.pack: the plan keeps ", n, " slots for rank ", d,
                " but sends ", l.counts[d], " rows");
  }
}

// The payload pass: over the send rows in order (the buffer is written front to back, one
// stream; x is read by token, a small array).
void payload_pass(const PackLayout& l, const std::vector<int64_t>& slot_of, const uint8_t* xb,
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

}  // namespace

void pack_rows(Pairs, const PackLayout& l, const int64_t* ip, const float* wp, const uint8_t* xb,
               int64_t* mp, uint8_t* sb, std::vector<int64_t>& cursor) {
  const std::vector<int64_t> slot_of = index_pass(l, ip, mp, cursor);
  check_slots_are_the_plans(l, cursor);
  check_chunks_hold_the_kept(l);
  payload_pass(l, slot_of, xb, ip, wp, mp, sb);
}

// The chunk of s holds blocks (s, j) for j ascending; expert j takes blocks s = 0, 1, ...
// Fills recv_map (mp [N, 1]) and each expert-major row's source.
void index_rows(Pairs, const int64_t* plan, const PlanOffsets& o, const std::vector<RecvRow>& rows,
                int64_t /*P*/, int64_t /*K*/, int64_t* mp, std::vector<Source>& from) {
  const int64_t R = plan[kRanks], L = plan[kLocalExperts];
  const int64_t* recv_kept = plan + o.recv_kept;
  const int64_t* offsets = plan + o.offsets;
  const int64_t Nd = static_cast<int64_t>(rows.size());
  std::vector<int64_t> base(offsets, offsets + L);
  int64_t n = 0;
  for (int64_t s = 0; s < R; ++s)
    for (int64_t j = 0; j < L; ++j) {
      const int64_t c = recv_kept[s * L + j];
      TORCH_CHECK(c >= 0 && c <= Nd - n && c <= offsets[j + 1] - base[j], "epkit.unpack: plan: ",
                  c, " rows of local expert ", j, " from rank ", s, " overrun the rows received "
                  "or the expert's segment");
      for (int64_t i = 0; i < c; ++i, ++n) {
        mp[rows[n].row] = base[j] + i;
        from[base[j] + i] = Source{rows[n].bytes, nullptr, rows[n].src};
      }
      base[j] += c;
    }
  TORCH_CHECK(n == Nd, "epkit.unpack: received ", Nd, " rows, the plan says ", n);
}

void check_gather(Pairs, const char* op, const Tensor&, const Tensor& recv_map, const Tensor&,
                  bool) {
  check_size(op, "recv_map", recv_map, 1, 1, "pairs: one slot per row");
}

void check_units(Pairs, const char* op, const Tensor& out, const Tensor& recv_map,
                 const std::optional<Tensor>& first, c10::Device) {
  TORCH_CHECK(!first.has_value(), op, ": pairs' rows are placed one per row (no first)");
  check_size(op, "out", out, 0, recv_map.size(0), "pairs: rows of recv_map");
}

// Each received slot's row of expert_y, copied as is (the source multiplies); header and gap
// rows of the static exchange (recv_map -1) are zeros.
void gather_into(Pairs, const char* op_name, const Tensor& y, const Tensor& recv_map,
                 const Tensor& /*row_weight*/, bool /*weighted*/, const int64_t* /*fp*/,
                 int64_t /*U*/, uint8_t* ob) {
  const int64_t N = recv_map.size(0), M = y.size(0);
  const int64_t* mp = recv_map.data_ptr<int64_t>();
  const int64_t nbytes = y.size(1) * y.element_size();
  const uint8_t* yp = static_cast<const uint8_t*>(y.data_ptr());
  std::atomic<bool> bad{false};  // a map entry outside [-1, M): raised after the loop
  at::parallel_for(0, N, kRowGrain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const int64_t m = mp[n];
      if (n + 1 < n1 && mp[n + 1] >= 0 && mp[n + 1] < M)
        prefetch_row(yp + mp[n + 1] * nbytes, nbytes);
      if (m >= 0 && m < M) stream_row(ob + n * nbytes, yp + m * nbytes, nbytes);
      else std::memset(ob + n * nbytes, 0, nbytes);
      if (m < -1 || m >= M) bad.store(true, std::memory_order_relaxed);
    }
    stream_fence();
  });
  if (bad.load()) report_map_range(op_name, "recv_map", mp, N, M, "rows of expert_y");
}

}  // namespace epkit
