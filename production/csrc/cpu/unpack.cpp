// Receive-side unpacking into the canonical expert-major layout.
//
// Rows of local expert j come from source ranks in ascending order, and from each source in
// token order; each expert's segment is zero-padded to a multiple of `align`. recv_map [N, K']
// records, for every received row (and, for dedup, each of its K slots), the expert-major row
// it landed in (-1: none); combine and the backward passes reuse it and never search again.
#include "../epkit.h"

#include <vector>

namespace epkit {

std::tuple<Tensor, Tensor, Tensor, Tensor> unpack_cpu(const Tensor& recv_in, const Tensor& plan_t,
                                                      int64_t transport, int64_t H,
                                                      at::ScalarType dtype, int64_t K,
                                                      c10::SymInt expert_rows) {
  const Tensor recv = recv_in.contiguous();
  const int64_t* plan = plan_t.data_ptr<int64_t>();
  const int64_t R = plan[kRanks], E = plan[kExperts], L = plan[kLocalExperts];
  const PlanOffsets o(R, E);
  const int64_t M = expert_rows.expect_int(), N = recv.size(0);
  TORCH_CHECK(M == plan[kExpertRows], "epkit.unpack: expert_rows disagrees with the plan");
  const int64_t payload = H * c10::elementSize(dtype);
  const int64_t B = payload + meta_bytes(transport, K);
  TORCH_CHECK(recv.size(1) == B, "epkit.unpack: received rows have ", recv.size(1),
              " bytes, expected ", B);
  const int64_t* recv_kept = plan + o.recv_kept;
  const int64_t* offsets = plan + o.offsets;

  Tensor expert_x = at::zeros({M, H}, at::TensorOptions().dtype(dtype));
  Tensor row_src = at::full({M, 3}, -1, at::kLong);
  Tensor row_weight = at::zeros({M}, at::kFloat);
  const int64_t C = transport == kPairs ? 1 : K;
  Tensor recv_map = at::full({N, C}, -1, at::kLong);
  int64_t* mp = recv_map.data_ptr<int64_t>();
  const uint8_t* rb = recv.data_ptr<uint8_t>();

  // The received rows that carry data, in order (`rows[n]`: buffer row of the n-th), and the
  // source rank of each. Chunks arrive in rank order; under the static exchange chunk s sits at
  // s * (1 + cap), its count in-band in its first row.
  const int64_t cap = static_cap(plan);
  std::vector<int64_t> rows, src_rank;
  for (int64_t s = 0, at = 0; s < R; ++s) {
    int64_t count = plan[o.recv_counts + s];
    if (cap >= 0) {
      at = s * (1 + cap);
      const int64_t inband = get<int64_t>(rb + at * B);
      TORCH_CHECK(inband == count, "epkit.unpack: chunk from rank ", s, " carries count ", inband,
                  ", the plan says ", count);
      ++at;
    }
    for (int64_t i = 0; i < count; ++i) { rows.push_back(at++); src_rank.push_back(s); }
  }
  const int64_t Nd = static_cast<int64_t>(rows.size());

  // Serial index pass: the expert-major row of every received slot.
  if (transport == kPairs) {
    // Chunk of s holds blocks (s, j) for j ascending; expert j takes blocks s = 0, 1, ...
    std::vector<int64_t> base(L);
    for (int64_t j = 0; j < L; ++j) base[j] = offsets[j];
    int64_t n = 0;
    for (int64_t s = 0; s < R; ++s)
      for (int64_t j = 0; j < L; ++j) {
        const int64_t c = recv_kept[s * L + j];
        for (int64_t i = 0; i < c; ++i, ++n) mp[rows[n]] = base[j] + i;
        base[j] += c;
      }
    TORCH_CHECK(n == Nd, "epkit.unpack: received ", Nd, " rows, the plan says ", n);
  } else {
    std::vector<int64_t> cursor(offsets, offsets + L);
    for (int64_t n = 0; n < Nd; ++n) {
      const uint8_t* meta = rb + rows[n] * B + payload;
      for (int64_t k = 0; k < K; ++k) {
        const int32_t j = get<int32_t>(meta + 4 + 4 * k);
        if (j < 0) continue;
        TORCH_CHECK(j < L, "epkit.unpack: corrupt local expert id ", j);
        mp[rows[n] * K + k] = cursor[j]++;
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
      const uint8_t* row = rb + rows[n] * B;
      const uint8_t* meta = row + payload;
      const int64_t t = get<int32_t>(meta);
      for (int64_t c = 0; c < C; ++c) {
        const int64_t m = mp[rows[n] * C + c];
        if (m < 0) continue;
        copy_row(xb + m * payload, row, payload);
        sp[m * 3 + 0] = src_rank[n];
        sp[m * 3 + 1] = t;
        if (transport == kPairs) {
          sp[m * 3 + 2] = get<int32_t>(meta + 4);
          wp[m] = get<float>(meta + 12);
        } else {
          sp[m * 3 + 2] = c;
          wp[m] = get<float>(meta + 4 + 4 * K + 4 * c);
        }
      }
    }
  });
  return {expert_x, row_src, row_weight, recv_map};
}

}  // namespace epkit
