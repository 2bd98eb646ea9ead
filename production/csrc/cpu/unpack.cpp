// Receive-side unpacking into the canonical expert-major layout.
//
// Rows of local expert j come from source ranks in ascending order, and from each source in
// token order; each expert's segment is zero-padded to a multiple of `align`. recv_map [N, K']
// records, for every received row (and, for dedup, each of its K slots), the expert-major row
// it landed in (-1: none); combine and the backward passes reuse it and never search again.
#include "../checks.h"

#include <vector>

namespace epkit {

namespace {

// Where an expert-major row comes from: a received row's bytes, (dedup) its slot row, its
// source rank. bytes == nullptr: a padding row.
struct Source { const uint8_t* bytes; const uint8_t* slot; int64_t src; };

// A received data row: its bytes, its row in the row space (compact, or static chunks of
// 1 + cap rows), its source rank, and (dedup) where its slot rows start.
struct Row { const uint8_t* bytes; int64_t row, src; const uint8_t* slots; };

// Every received data row, in order, checked against the plan. Under the static exchange each
// section's count travels in-band in its header row (checked too).
std::vector<Row> received_rows(const int64_t* plan, const PlanOffsets& o, const uint8_t* rb,
                               bool pairs, int64_t P, int64_t N) {
  const int64_t R = plan[kRanks], cap = static_cap(plan), tokcap = plan[kTokCap];
  const int64_t B = P + (pairs ? kPairsMetaBytes : kDedupTokMeta);
  std::vector<Row> rows;
  for (int64_t s = 0, chunk = 0, compact = 0; s < R; ++s) {
    const int64_t count = plan[o.recv_counts + s], nslots = plan[o.recv_slots + s];
    const int64_t hdr = cap >= 0 ? 1 : 0;
    const int64_t tok_rows = tokcap >= 0 ? tokcap : count;
    const uint8_t* slot_sec = rb + chunk + tok_rows * B;
    if (cap >= 0) {
      const int64_t inband = get<int64_t>(rb + chunk);
      TORCH_CHECK(inband == count, "epkit.unpack: chunk from rank ", s, " carries count ", inband,
                  ", the plan says ", count);
      if (!pairs)
        TORCH_CHECK(get<int64_t>(slot_sec) == nslots, "epkit.unpack: slot section from rank ", s,
                    " carries count ", get<int64_t>(slot_sec), ", the plan says ", nslots);
      slot_sec += kSlotRowBytes;
    }
    int64_t slot = 0;
    for (int64_t i = 0; i < count; ++i) {
      const uint8_t* bytes = rb + chunk + (hdr + i) * B;
      const int64_t row = cap >= 0 ? s * (1 + cap) + 1 + i : compact + i;
      TORCH_CHECK(row < N, "epkit.unpack: row ", i, " from rank ", s, " lands on row ", row,
                  ", past recv_rows ", N);
      rows.push_back({bytes, row, s, slot_sec + slot * kSlotRowBytes});
      if (!pairs) {
        const int32_t n = get<int32_t>(bytes + P + kDedupMetaN);
        TORCH_CHECK(n >= 0 && n <= nslots - slot, "epkit.unpack: row ", i, " from rank ", s,
                    " carries ", n, " slots, past the plan's ", nslots);
        slot += n;
      }
    }
    TORCH_CHECK(pairs || slot == nslots, "epkit.unpack: rank ", s, " sent ", slot,
                " slots, the plan says ", nslots);
    compact += count;
    chunk += plan[o.recv_bytes + s];
  }
  return rows;
}

// pairs' index pass: chunk of s holds blocks (s, j) for j ascending; expert j takes blocks
// s = 0, 1, ... Fills recv_map (mp [N]) and each expert-major row's source.
void pairs_index(const int64_t* plan, const PlanOffsets& o, const std::vector<Row>& rows,
                 int64_t* mp, std::vector<Source>& from) {
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

// dedup's index pass: each token row's slot rows, in order, take the next row of their
// expert's segment. Fills recv_map (mp [N, K]) and each expert-major row's source.
void dedup_index(const int64_t* plan, const PlanOffsets& o, const std::vector<Row>& rows,
                 int64_t P, int64_t K, int64_t* mp, std::vector<Source>& from) {
  const int64_t L = plan[kLocalExperts];
  const int64_t* offsets = plan + o.offsets;
  std::vector<int64_t> cursor(offsets, offsets + L);
  for (const Row& r : rows) {
    const int32_t n = get<int32_t>(r.bytes + P + kDedupMetaN);
    for (int32_t i = 0; i < n; ++i) {
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

// The payload pass over the expert-major rows, front to back (expert_x is the large output;
// its rows are then one stream): each row copied from its received row, the next one's bytes
// prefetched; padding rows get zeros, row_src -1 and weight 0.
void payload_pass(const std::vector<Source>& from, bool pairs, int64_t P, uint8_t* xb,
                  int64_t* sp, float* wp) {
  const int64_t M = static_cast<int64_t>(from.size());
  at::parallel_for(0, M, kRowGrain, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const Source& f = from[m];
      if (m + 1 < m1 && from[m + 1].bytes) prefetch_row(from[m + 1].bytes, P);
      if (!f.bytes) {
        std::memset(xb + m * P, 0, P);
        sp[m * 3 + 0] = sp[m * 3 + 1] = sp[m * 3 + 2] = -1;
        wp[m] = 0.0f;
        continue;
      }
      const uint8_t* meta = f.bytes + P;
      stream_row(xb + m * P, f.bytes, P);
      sp[m * 3 + 0] = f.src;
      sp[m * 3 + 1] = get<int32_t>(meta);
      if (pairs) {
        sp[m * 3 + 2] = get<int32_t>(meta + kPairsMetaK);
        wp[m] = get<float>(meta + kPairsMetaW);
      } else {  // the slot row: int32 code, float32 w
        sp[m * 3 + 2] = slot_word_k(get<int32_t>(f.slot));
        wp[m] = get<float>(f.slot + sizeof(int32_t));
      }
    }
    stream_fence();
  });
}

}  // namespace

// The op: checks, the received rows, the serial index pass (the expert-major row of every
// received slot, and its inverse: each expert-major row's source), the parallel payload pass.
std::tuple<Tensor, Tensor, Tensor, Tensor> unpack_cpu(const Tensor& recv_in, const Tensor& plan_t,
                                                      int64_t transport, int64_t H,
                                                      at::ScalarType dtype, int64_t K,
                                                      c10::SymInt recv_rows,
                                                      c10::SymInt expert_rows) {
  const int64_t M = expert_rows.expect_int(), N = recv_rows.expect_int();
  check_unpack_args(recv_in, plan_t, transport, H, dtype, K, N, M);
  const Tensor recv = recv_in.contiguous();
  const int64_t* plan = plan_t.data_ptr<int64_t>();
  const int64_t P = H * static_cast<int64_t>(c10::elementSize(dtype));
  // Every chunk of the plan fits the received buffer, its offsets fit the M expert rows.
  const PlanOffsets o = check_unpack_plan(plan, plan_t.numel(), transport, P, N, M, recv.numel());
  const bool pairs = transport == kPairs;

  // Every output row is written once by the payload pass (padding rows too): no fill.
  Tensor expert_x = empty_large({M, H}, dtype);
  Tensor row_src = at::empty({M, 3}, at::kLong);
  Tensor row_weight = at::empty({M}, at::kFloat);
  Tensor recv_map = at::full({N, pairs ? 1 : K}, -1, at::kLong);
  int64_t* mp = recv_map.data_ptr<int64_t>();

  const std::vector<Row> rows = received_rows(plan, o, recv.data_ptr<uint8_t>(), pairs, P, N);
  std::vector<Source> from(M, Source{nullptr, nullptr, -1});
  if (pairs) pairs_index(plan, o, rows, mp, from);
  else dedup_index(plan, o, rows, P, K, mp, from);
  payload_pass(from, pairs, P, static_cast<uint8_t*>(expert_x.data_ptr()),
               row_src.data_ptr<int64_t>(), row_weight.data_ptr<float>());
  return {expert_x, row_src, row_weight, recv_map};
}

}  // namespace epkit
