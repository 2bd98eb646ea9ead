// epkit C++ kernels: shared declarations, wire format and plan layout.
//
// The kernels are local (one rank); the collectives live in Python over torch.distributed.
// Arithmetic follows docs/semantics.md exactly: float32 multiplies and adds, each rounded, sums
// from +0.0 in a fixed order; the build uses -ffp-contract=off so no FMA sneaks in.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#include "abi.h"
#include <tuple>
#include <vector>

// Device-agnostic helpers (the plan layout) are also compiled by nvcc for the CUDA kernels.
#if defined(__CUDACC__)
#define EPKIT_HD __host__ __device__
#else
#define EPKIT_HD
#endif

namespace epkit {

using at::Tensor;

// ---- the ABI: codes, the count-word and plan layouts, the wire format -------------------
// abi.h is generated from reference/abi.py (the one definition Python imports too): kPairs,
// kDedup, enum Requested / Variant / WordField / PlanHeader, reason::k*, dtype_code::k*, the
// row layouts (kPairsMeta*, kDedupMeta*, kSlotRowBytes, ...) and the limits.

// The slot word's fields. k occupies the top 8 bits, so for k >= 128 the int32 is negative:
// decode through uint32 (an arithmetic shift would give k - 256 and index out of bounds).
EPKIT_HD inline int64_t slot_word_k(int32_t packed) {
  return static_cast<int64_t>(static_cast<uint32_t>(packed) >> kSlotKShift);
}
EPKIT_HD inline int64_t slot_word_j(int32_t packed) {
  return packed & ((int32_t(1) << kSlotKShift) - 1);
}
struct PlanOffsets {
  int64_t send_counts, recv_counts, tokens_per_expert, dropped, offsets, recv_kept, own_kept,
      send_bytes, recv_bytes, send_slots, recv_slots, size;
  EPKIT_HD PlanOffsets(int64_t R, int64_t E) {
    const int64_t L = E / R;
    send_counts = kPlanHeader;
    recv_counts = send_counts + R;
    tokens_per_expert = recv_counts + R;
    dropped = tokens_per_expert + L;
    offsets = dropped + L;
    recv_kept = offsets + L + 1;
    own_kept = recv_kept + R * L;
    send_bytes = own_kept + E;
    recv_bytes = send_bytes + R;
    send_slots = recv_bytes + R;
    recv_slots = send_slots + R;
    size = recv_slots + R;
  }
};

// Step 4 of the plan for one local expert j of `rank`, shared by the CPU and CUDA plan kernels:
// kept rows per source (recv_kept), kept and dropped totals. Returns the padded segment size.
// `words` is the gathered [R, W] count words, `kept` the [R, E] kept counts.
EPKIT_HD inline int64_t plan_expert(int64_t* p, const PlanOffsets& o, const int64_t* words,
                                    int64_t W, const int64_t* kept, int64_t R, int64_t E,
                                    int64_t L, int64_t rank, int64_t j, int64_t align) {
  const int64_t e = rank * L + j;
  int64_t k = 0, used = 0;
  for (int64_t s = 0; s < R; ++s) {
    k += kept[s * E + e];
    used += words[s * W + kWordHeader + e];
    p[o.recv_kept + s * L + j] = kept[s * E + e];
  }
  p[o.tokens_per_expert + j] = k;
  p[o.dropped + j] = used - k;
  return (k + align - 1) / align * align;
}

// Step 5 of the plan, shared by the CPU kernel and the CUDA kernel (one thread): the exchange
// that runs and the dispatch chunks in bytes (docs/design.md, wire format). `p` has steps 1-4.
EPKIT_HD inline void plan_exchange(int64_t* p, const PlanOffsets& o, int64_t R, int64_t L,
                                   const int64_t* words0, int64_t transport, int64_t exchange,
                                   int64_t max_tokens, int64_t align, int64_t uniform,
                                   int64_t maxrows, int64_t maxslots) {
  const int64_t H = words0[kWordHidden], K = p[kTopK], per = K < L ? K : L;
  const int64_t itemsize = words0[kWordXDtype] == dtype_code::kBfloat16 ? 2 : 4;
  const int64_t P = words0[kWordPayload] == kPayloadMxfp8 ? H + H / kMxfp8Block  // E4M3 + codes
                                                          : H * itemsize;
  const int64_t B = P + (transport == kPairs ? kPairsMetaBytes : kDedupTokMeta);
  p[kPayloadBytes] = P;
  int64_t variant = kRagged;
  if (max_tokens >= 0 || exchange == kReqStatic) variant = kStatic;
  else if (exchange == kReqPadded) variant = kPadded;
  else if (exchange == kReqEqual || ((exchange == kReqAuto || exchange == kReqLazy) && uniform))
    variant = kEqual;
  p[kVariant] = variant;
  int64_t tokcap = -1, slotcap = -1;
  if (variant == kStatic) {
    // Sizes that depend only on (R, K, L, align, max_tokens), never on routing. A dedup token
    // row needs a kept slot: at most min(max_tokens, max_tokens * per) (0 when K = 0).
    const int64_t slots_cap = max_tokens * per;
    const int64_t cap = transport == kPairs || slots_cap < max_tokens ? slots_cap : max_tokens;
    p[kStaticCap] = cap;
    p[kSendRows] = p[kRecvRows] = R * (1 + cap);
    p[kMaxChunk] = 1 + cap;
    p[kExpertRows] = R * max_tokens * per + L * (align - 1);
    tokcap = 1 + cap;
    slotcap = 1 + max_tokens * per;
  } else if (variant != kRagged) {
    tokcap = maxrows;
    slotcap = maxslots;
  }
  p[kTokCap] = tokcap;
  p[kSlotCap] = transport == kDedup ? slotcap : -1;
  int64_t SB = 0, RB = 0;
  for (int64_t d = 0; d < R; ++d) {
    for (int dir = 0; dir < 2; ++dir) {
      int64_t nrows = p[(dir ? o.recv_counts : o.send_counts) + d];
      int64_t nslots = p[(dir ? o.recv_slots : o.send_slots) + d];
      if (tokcap >= 0) { nrows = tokcap; nslots = slotcap; }
      const int64_t bytes = nrows * B + (transport == kDedup ? nslots * kSlotRowBytes : 0);
      p[(dir ? o.recv_bytes : o.send_bytes) + d] = bytes;
      (dir ? RB : SB) += bytes;
    }
  }
  p[kSendBytes] = SB;
  p[kRecvBytes] = RB;
}

// ---- ops (CPU) ---------------------------------------------------------------------------
std::tuple<Tensor, Tensor, Tensor, Tensor> layout_cpu(const Tensor& topk_idx, int64_t num_experts,
                                                     int64_t num_ranks);
Tensor prepare_cpu(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_weights,
                   int64_t num_experts, int64_t num_ranks, at::IntArrayRef pre_error,
                   int64_t payload);
Tensor plan_cpu(const Tensor& words, int64_t rank, int64_t num_experts, int64_t align,
                int64_t capacity, int64_t transport, int64_t exchange,
                int64_t max_tokens_per_rank);
std::tuple<Tensor, Tensor> pack_cpu(const Tensor& x, const Tensor& topk_idx,
                                    const Tensor& topk_weights, const Tensor& plan, int64_t transport,
                                    int64_t num_ranks, c10::SymInt send_rows);
std::tuple<Tensor, Tensor, Tensor, Tensor> unpack_cpu(const Tensor& recv, const Tensor& plan,
                                                      int64_t transport, int64_t hidden,
                                                      at::ScalarType dtype, int64_t topk,
                                                      c10::SymInt recv_rows,
                                                      c10::SymInt expert_rows);
Tensor gather_rows_cpu(const Tensor& expert_y, const Tensor& recv_map, const Tensor& row_weight,
                       int64_t transport, bool weighted);
Tensor reduce_tokens_cpu(const Tensor& back, const Tensor& send_map, const Tensor& topk_idx,
                         const Tensor& topk_weights, int64_t num_experts, int64_t num_ranks,
                         int64_t transport, bool weighted, at::ScalarType out_dtype,
                         int64_t ranks_per_node);
Tensor scatter_rows_cpu(const Tensor& src, const Tensor& send_map, c10::SymInt send_rows);
std::tuple<Tensor, Tensor> combine_backward_dest_cpu(const Tensor& recv, const Tensor& recv_map,
                                                     const Tensor& row_weight,
                                                     const Tensor& expert_y, bool weighted);
std::tuple<Tensor, Tensor> quantize_mxfp8_cpu(const Tensor& x);
Tensor gather_slot_values_cpu(const Tensor& values, const Tensor& recv_map);
Tensor scatter_slot_values_cpu(const Tensor& back, const Tensor& send_map, const Tensor& topk_idx,
                               int64_t num_experts, int64_t num_ranks, int64_t transport);

// ---- helpers -----------------------------------------------------------------------------
// Rows are moved as bytes: a copy is bit for bit whatever the dtype.
inline void copy_row(uint8_t* dst, const uint8_t* src, int64_t nbytes) {
  std::memcpy(dst, src, static_cast<size_t>(nbytes));
}
template <typename T>
inline void put(uint8_t* p, T v) { std::memcpy(p, &v, sizeof(T)); }
template <typename T>
inline T get(const uint8_t* p) { T v; std::memcpy(&v, p, sizeof(T)); return v; }

// The static exchange: chunk d of a buffer starts at d * (1 + cap); its first row carries the
// chunk's row count in-band (int64 at byte 0), its data rows follow.
inline int64_t static_cap(const int64_t* plan) { return plan[kStaticCap]; }

// Zero the rows of `rows [M, ...]` that no entry of `recv_map` names (the padding rows of an
// expert-major buffer allocated with at::empty: cheaper than zeroing all of it first).
inline void zero_unmapped_rows(Tensor& rows, const Tensor& recv_map) {
  const int64_t M = rows.size(0);
  std::vector<uint8_t> hit(M, 0);
  const int64_t* mp = recv_map.data_ptr<int64_t>();
  for (int64_t i = 0, n = recv_map.numel(); i < n; ++i)
    if (mp[i] >= 0) hit[mp[i]] = 1;
  uint8_t* z = static_cast<uint8_t*>(rows.data_ptr());
  const int64_t rb = M ? rows.numel() / M * rows.element_size() : 0;
  for (int64_t m = 0; m < M; ++m)
    if (!hit[m]) std::memset(z + m * rb, 0, rb);
}

// Grain sizes for at::parallel_for: rows are wide (hidden >= 64 typically).
constexpr int64_t kRowGrain = 16;

}  // namespace epkit

namespace epkit {
// Calls f(T{}) with T = float or at::BFloat16: the two payload dtypes of the arithmetic kernels.
template <typename F>
inline void dispatch_float_types(at::ScalarType dt, const char* name, F&& f) {
  if (dt == at::kFloat) f(float{});
  else if (dt == at::kBFloat16) f(at::BFloat16{});
  else TORCH_CHECK(false, name, ": dtype must be float32 or bfloat16, got ", dt);
}
// Exact widening to float32 and round-to-nearest-even narrowing.
inline float widen(float v) { return v; }
inline float widen(at::BFloat16 v) { return static_cast<float>(v); }
template <typename T> inline T narrow(float v) { return static_cast<T>(v); }
}  // namespace epkit
