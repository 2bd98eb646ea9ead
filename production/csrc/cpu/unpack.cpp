// Receive-side unpacking into the canonical expert-major layout.
//
// Rows of local expert j come from source ranks in ascending order, and from each source in
// token order; each expert's segment is zero-padded to a multiple of `align`. recv_map [N, K']
// records, for every received row (and, for dedup, each of its K slots), the expert-major row
// it landed in (-1: none); combine and the backward passes reuse it and never search again.
#include "paths.h"

#include <vector>

namespace epkit {

namespace {

// Every received data row, in order, checked against the plan. Under the static exchange each
// section's count travels in-band in its header row (checked too).
// Path: the transport's (pairs.h, dedup.h): its row bytes, its slot section (pairs has none:
// each row is its one slot).
template <typename Path>
std::vector<RecvRow> received_rows(const int64_t* plan, const PlanOffsets& o, const uint8_t* rb,
                                   int64_t P, int64_t N) {
  const int64_t R = plan[kRanks], cap = static_cap(plan), tokcap = plan[kTokCap];
  const int64_t B = P + Path::kMetaBytes;
  std::vector<RecvRow> rows;
  for (int64_t s = 0, chunk = 0, compact = 0; s < R; ++s) {
    const int64_t count = plan[o.recv_counts + s], nslots = plan[o.recv_slots + s];
    const int64_t hdr = cap >= 0 ? 1 : 0;
    const int64_t tok_rows = tokcap >= 0 ? tokcap : count;
    const uint8_t* slot_sec = rb + chunk + tok_rows * B;
    if (cap >= 0) {
      const int64_t inband = get<int64_t>(rb + chunk);
      TORCH_CHECK(inband == count, "epkit.unpack: chunk from rank ", s, " carries count ", inband,
                  ", the plan says ", count);
      slot_sec = Path::open_slot_section(slot_sec, nslots, s);
    }
    int64_t slot = 0;
    for (int64_t i = 0; i < count; ++i) {
      const uint8_t* bytes = rb + chunk + (hdr + i) * B;
      const int64_t row = cap >= 0 ? s * (1 + cap) + 1 + i : compact + i;
      TORCH_CHECK(row < N, "epkit.unpack: row ", i, " from rank ", s, " lands on row ", row,
                  ", past recv_rows ", N);
      const uint8_t* slots = nullptr;  // where the row's slot rows start (a slot section's)
      if constexpr (Path::kSlotSection) {
        slots = slot_sec + slot * kSlotRowBytes;
        const int64_t n = Path::slots_in_row(bytes, P);
        TORCH_CHECK(n >= 0 && n <= nslots - slot, "epkit.unpack: row ", i, " from rank ", s,
                    " carries ", n, " slots, past the plan's ", nslots);
        slot += n;
      }
      rows.push_back({bytes, row, s, slots});
    }
    TORCH_CHECK(!Path::kSlotSection || slot == nslots, "epkit.unpack: rank ", s, " sent ", slot,
                " slots, the plan says ", nslots);
    compact += count;
    chunk += plan[o.recv_bytes + s];
  }
  return rows;
}

// The payload pass over the expert-major rows, front to back (expert_x is the large output;
// its rows are then one stream): each row copied from its received row, the next one's bytes
// prefetched; padding rows get zeros, row_src -1 and weight 0.
template <typename Path>
void payload_pass(const std::vector<Source>& from, int64_t P, uint8_t* xb, int64_t* sp,
                  float* wp) {
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
      Path::slot_meta(meta, f.slot, &sp[m * 3 + 2], &wp[m]);  // k and w: row or slot row
    }
    stream_fence();
  });
}

}  // namespace

// The op: checks, the received rows, the path's serial index pass (pairs.cpp, dedup.cpp: the
// expert-major row of every received slot, and its inverse: each expert-major row's source),
// the parallel payload pass.
std::tuple<Tensor, Tensor, Tensor, Tensor> unpack_cpu(const Tensor& recv_in, const Tensor& plan_t,
                                                      int64_t transport, int64_t H,
                                                      at::ScalarType dtype, int64_t K,
                                                      c10::SymInt recv_rows,
                                                      c10::SymInt expert_rows,
                                                      const std::optional<Tensor>& plan_host) {
  const int64_t M = expert_rows.expect_int(), N = recv_rows.expect_int();
  check_unpack_args(recv_in, plan_t, transport, H, dtype, K, N, M, plan_host);
  const Tensor recv = recv_in.contiguous();
  const int64_t* plan = plan_t.data_ptr<int64_t>();
  const int64_t P = H * static_cast<int64_t>(c10::elementSize(dtype));
  // Every chunk of the plan fits the received buffer, its offsets fit the M expert rows.
  const PlanOffsets o = check_unpack_plan(plan, plan_t.numel(), transport, P, N, M, recv.numel());
  // Every output row is written once by the payload pass (padding rows too): no fill.
  Tensor expert_x = empty_large({M, H}, dtype);
  Tensor row_src = at::empty({M, 3}, at::kLong);
  Tensor row_weight = at::empty({M}, at::kFloat);
  return with_transport("epkit.unpack", transport, [&](auto path) {
    using Path = decltype(path);
    Tensor recv_map = at::full({N, Path::recv_map_cols(K)}, -1, at::kLong);
    const std::vector<RecvRow> rows =
        received_rows<Path>(plan, o, recv.data_ptr<uint8_t>(), P, N);
    std::vector<Source> from(M, Source{nullptr, nullptr, -1});
    index_rows(path, plan, o, rows, P, K, recv_map.data_ptr<int64_t>(), from);
    payload_pass<Path>(from, P, static_cast<uint8_t*>(expert_x.data_ptr()),
                       row_src.data_ptr<int64_t>(), row_weight.data_ptr<float>());
    return std::make_tuple(expert_x, row_src, row_weight, recv_map);
  });
}

}  // namespace epkit
