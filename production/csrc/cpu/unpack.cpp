// Receive-side unpacking into the canonical expert-major layout.
//
// Rows of local expert j come from source ranks in ascending order, and from each source in
// token order; each expert's segment is zero-padded to a multiple of `align`. recv_map [N, K']
// records, for every received row (and, for dedup, each of its K slots), the expert-major row
// it landed in (-1: none); combine and the backward passes reuse it and never search again.
#include "../checks.h"

#include <vector>

namespace epkit {

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
  const int64_t R = plan[kRanks], L = plan[kLocalExperts];
  const bool pairs = transport == kPairs;
  const int64_t B = P + (pairs ? kPairsMetaBytes : kDedupTokMeta);
  const int64_t cap = static_cap(plan), tokcap = plan[kTokCap];
  const int64_t* recv_kept = plan + o.recv_kept;
  const int64_t* offsets = plan + o.offsets;
  const uint8_t* rb = recv.data_ptr<uint8_t>();

  Tensor expert_x = at::empty({M, H}, at::TensorOptions().dtype(dtype));
  Tensor row_src = at::full({M, 3}, -1, at::kLong);
  Tensor row_weight = at::zeros({M}, at::kFloat);
  const int64_t C = pairs ? 1 : K;
  Tensor recv_map = at::full({N, C}, -1, at::kLong);
  int64_t* mp = recv_map.data_ptr<int64_t>();

  // Every received data row, in order: its bytes, its row in the row space (compact, or static
  // chunks of 1 + cap rows), its source rank, and (dedup) where its slot rows start. Under the
  // static exchange each section's count travels in-band in its header row.
  struct Row { const uint8_t* bytes; int64_t row, src; const uint8_t* slots; };
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
  const int64_t Nd = static_cast<int64_t>(rows.size());

  // Serial index pass: the expert-major row of every received slot.
  if (pairs) {
    // Chunk of s holds blocks (s, j) for j ascending; expert j takes blocks s = 0, 1, ...
    std::vector<int64_t> base(offsets, offsets + L);
    int64_t n = 0;
    for (int64_t s = 0; s < R; ++s)
      for (int64_t j = 0; j < L; ++j) {
        const int64_t c = recv_kept[s * L + j];
        TORCH_CHECK(c >= 0 && c <= Nd - n && c <= offsets[j + 1] - base[j], "epkit.unpack: plan: ",
                    c, " rows of local expert ", j, " from rank ", s, " overrun the rows received "
                    "or the expert's segment");
        for (int64_t i = 0; i < c; ++i, ++n) mp[rows[n].row] = base[j] + i;
        base[j] += c;
      }
    TORCH_CHECK(n == Nd, "epkit.unpack: received ", Nd, " rows, the plan says ", n);
  } else {
    std::vector<int64_t> cursor(offsets, offsets + L);
    for (const Row& r : rows) {
      const int32_t n = get<int32_t>(r.bytes + P + kDedupMetaN);
      for (int32_t i = 0; i < n; ++i) {
        const int32_t packed = get<int32_t>(r.slots + i * kSlotRowBytes);
        const int64_t k = slot_word_k(packed), j = slot_word_j(packed);
        TORCH_CHECK(j < L && k < K, "epkit.unpack: corrupt slot row (k ", k, ", j ", j, ")");
        TORCH_CHECK(cursor[j] < offsets[j + 1] && mp[r.row * K + k] < 0, "epkit.unpack: slot (k ",
                    k, ", local expert ", j, ") overruns its segment or repeats k");
        mp[r.row * K + k] = cursor[j]++;
      }
    }
    for (int64_t j = 0; j < L; ++j)
      TORCH_CHECK(cursor[j] - offsets[j] == plan[o.tokens_per_expert + j],
                  "epkit.unpack: expert ", j, " received a count that disagrees with the plan");
  }

  // Parallel payload pass: every expert-major row is written by exactly one received row.
  uint8_t* xb = static_cast<uint8_t*>(expert_x.data_ptr());
  int64_t* sp = row_src.data_ptr<int64_t>();
  float* wp = row_weight.data_ptr<float>();
  at::parallel_for(0, Nd, kRowGrain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const Row& r = rows[n];
      const uint8_t* meta = r.bytes + P;
      const int64_t t = get<int32_t>(meta);
      if (pairs) {
        const int64_t m = mp[r.row];
        copy_row(xb + m * P, r.bytes, P);
        sp[m * 3 + 0] = r.src; sp[m * 3 + 1] = t; sp[m * 3 + 2] = get<int32_t>(meta + kPairsMetaK);
        wp[m] = get<float>(meta + kPairsMetaW);
        continue;
      }
      const int32_t cnt = get<int32_t>(meta + kDedupMetaN);
      for (int32_t i = 0; i < cnt; ++i) {
        const uint8_t* slot = r.slots + i * kSlotRowBytes;
        const int64_t k = slot_word_k(get<int32_t>(slot)), m = mp[r.row * K + k];
        copy_row(xb + m * P, r.bytes, P);
        sp[m * 3 + 0] = r.src; sp[m * 3 + 1] = t; sp[m * 3 + 2] = k;
        wp[m] = get<float>(slot + sizeof(int32_t));  // the slot row: int32 code, float32 w
      }
    }
  });
  zero_unmapped_rows(expert_x, recv_map);  // padding rows; every other row was written
  return {expert_x, row_src, row_weight, recv_map};
}

}  // namespace epkit
