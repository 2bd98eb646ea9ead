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
#if defined(__SSE2__)
#include <emmintrin.h>
#define EPKIT_STREAM_STORES 1
#endif

#include "abi.h"
#include <tuple>
#include <vector>

namespace epkit {

using at::Tensor;

// ---- the ABI: codes, the count-word and plan layouts, the wire format -------------------
// abi.h is generated from reference/abi.py (the one definition Python imports too): kPairs,
// kDedup, enum Requested / Variant / WordField / PlanHeader, reason::k*, dtype_code::k*, the
// row layouts (kPairsMeta*, kDedupMeta*, kSlotRowBytes, ...) and the limits.

// The payload table by code (reference/payloads.py; numbers from abi.h): elements per scale
// along H (0: rows of x itself), bytes per scale, and P, the bytes of one token's payload on the
// wire: H * itemsize(x), or H E4M3 bytes then H / block scales (abi.payload_bytes).
inline bool payload_known(int64_t payload) {
  return payload >= kPayloadNone && payload < kPayloadCount;
}
inline int64_t payload_block(int64_t payload) {
  return payload_known(payload) ? kPayloadBlocks[payload] : 0;
}
inline int64_t payload_scale_bytes(int64_t payload) {
  return payload_known(payload) ? kPayloadScaleBytes[payload] : 0;
}
inline int64_t payload_row_bytes(int64_t payload, int64_t H, int64_t itemsize) {
  const int64_t block = payload_block(payload);
  return block ? H + payload_scale_bytes(payload) * (H / block) : H * itemsize;
}

// The slot word's fields. k occupies the top 8 bits, so for k >= 128 the int32 is negative:
// decode through uint32 (an arithmetic shift would give k - 256 and index out of bounds).
inline int64_t slot_word_k(int32_t packed) {
  return static_cast<int64_t>(static_cast<uint32_t>(packed) >> kSlotKShift);
}
inline int64_t slot_word_j(int32_t packed) {
  return packed & ((int32_t(1) << kSlotKShift) - 1);
}
struct PlanOffsets {
  int64_t send_counts, recv_counts, tokens_per_expert, dropped, offsets, recv_kept, own_kept,
      send_bytes, recv_bytes, send_slots, recv_slots, size;
  PlanOffsets(int64_t R, int64_t E) {
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

// Step 4 of the plan for one local expert j of `rank` (the Triton plan, production/triton/plan.py,
// follows the same steps):
// kept rows per source (recv_kept), kept and dropped totals. Returns the padded segment size.
// `words` is the gathered [R, W] count words, `kept` the [R, E] kept counts.
inline int64_t plan_expert(int64_t* p, const PlanOffsets& o, const int64_t* words,
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

// The weight gradients' return path (scatter_slot_values): the place of slot k
// among its token's kept slots on rank d, k ascending (the slots before it there), i.e. after
// its token row's first value. idx: the token's kept routing [K] (dropped, unused: -1).
inline int64_t slot_rank(const int64_t* idx, int64_t k, int64_t d, int64_t E,
                                  int64_t L) {
  int64_t r = 0;
  for (int64_t j = 0; j < k; ++j) r += idx[j] >= 0 && idx[j] < E && idx[j] / L == d;
  return r;
}

// Step 5 of the plan: the exchange
// that runs and the dispatch chunks in bytes (docs/design.md, wire format). `p` has steps 1-4;
// Path is the transport's (pairs.h, dedup.h): its row metadata, its slot section.
template <typename Path>
void plan_exchange(int64_t* p, const PlanOffsets& o, int64_t R, int64_t L,
                   const int64_t* words0, int64_t exchange, int64_t max_tokens, int64_t align,
                   int64_t uniform, int64_t maxrows, int64_t maxslots) {
  const int64_t H = words0[kWordHidden], K = p[kTopK], per = K < L ? K : L;
  const int64_t itemsize = words0[kWordXDtype] == dtype_code::kBfloat16 ? 2 : 4;
  const int64_t P = payload_row_bytes(words0[kWordPayload], H, itemsize);
  const int64_t B = P + Path::kMetaBytes;
  p[kPayloadBytes] = P;
  int64_t variant = kRagged;
  if (max_tokens >= 0 || exchange == kReqStatic) variant = kStatic;
  else if (exchange == kReqPadded) variant = kPadded;
  else if (exchange == kReqEqual || ((exchange == kReqAuto || exchange == kReqLazy) && uniform))
    variant = kEqual;
  p[kVariant] = variant;
  int64_t tokcap = -1, slotcap = -1;
  if (variant == kStatic) {
    // Sizes that depend only on (R, K, L, align, max_tokens), never on routing.
    const int64_t cap = Path::static_rows(max_tokens, max_tokens * per);
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
  p[kSlotCap] = Path::slot_cap(slotcap);
  int64_t SB = 0, RB = 0;
  for (int64_t d = 0; d < R; ++d) {
    for (int dir = 0; dir < 2; ++dir) {
      int64_t nrows = p[(dir ? o.recv_counts : o.send_counts) + d];
      int64_t nslots = p[(dir ? o.recv_slots : o.send_slots) + d];
      if (tokcap >= 0) { nrows = tokcap; nslots = slotcap; }
      const int64_t bytes = nrows * B + Path::slot_section_bytes(nslots);
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
                                    int64_t num_ranks, c10::SymInt send_rows,
                                    const std::optional<Tensor>& plan_host);
std::tuple<Tensor, Tensor, Tensor, Tensor> unpack_cpu(const Tensor& recv, const Tensor& plan,
                                                      int64_t transport, int64_t hidden,
                                                      at::ScalarType dtype, int64_t topk,
                                                      c10::SymInt recv_rows,
                                                      c10::SymInt expert_rows,
                                                      const std::optional<Tensor>& plan_host);
Tensor gather_rows_cpu(const Tensor& expert_y, const Tensor& recv_map, const Tensor& row_weight,
                       int64_t transport, bool weighted);
void gather_units_cpu(const Tensor& expert_y, const Tensor& recv_map, const Tensor& row_weight,
                      int64_t transport, bool weighted, const std::optional<Tensor>& first,
                      const Tensor& out);
Tensor reduce_tokens_cpu(const Tensor& back, const Tensor& send_map, const Tensor& topk_idx,
                         const Tensor& topk_weights, int64_t num_experts, int64_t num_ranks,
                         int64_t transport, bool weighted, at::ScalarType out_dtype,
                         int64_t ranks_per_node, const std::optional<Tensor>& first);
Tensor scatter_rows_cpu(const Tensor& src, const Tensor& send_map, c10::SymInt send_rows);
void scatter_rows_into_cpu(const Tensor& src, const Tensor& send_map, const Tensor& out);
Tensor pack_into_cpu(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_weights,
                     const Tensor& plan, int64_t transport, int64_t num_ranks, const Tensor& send,
                     const std::optional<Tensor>& plan_host);
std::tuple<Tensor, Tensor> combine_backward_dest_cpu(const Tensor& recv, const Tensor& recv_map,
                                                     const Tensor& row_weight,
                                                     const Tensor& expert_y, bool weighted);
std::tuple<Tensor, Tensor> quantize_mxfp8_cpu(const Tensor& x);
std::tuple<Tensor, Tensor> quantize_fp8_block128_cpu(const Tensor& x);
Tensor gather_slot_values_cpu(const Tensor& values, const Tensor& recv_map, const Tensor& first,
                              c10::SymInt out_rows);
Tensor scatter_slot_values_cpu(const Tensor& back, const Tensor& send_map, const Tensor& topk_idx,
                               const Tensor& first, int64_t num_experts, int64_t num_ranks,
                               int64_t transport);

// ---- helpers -----------------------------------------------------------------------------
// A CPU tensor for a large output or send buffer: 2 MiB-aligned on transparent huge pages when
// it is 2 MiB or more (cpu/alloc.cpp: a fresh large buffer then faults once per 2 MiB, not per
// 4 KiB page), else at::empty. Uninitialised, like at::empty.
Tensor empty_large(at::IntArrayRef sizes, at::ScalarType dtype);
Tensor empty_large_cpu(const Tensor& like, c10::SymIntArrayRef size, at::ScalarType dtype);
int64_t release_cache();
int64_t cached_bytes();
// Rows are moved as bytes: a copy is bit for bit whatever the dtype.
inline void copy_row(uint8_t* dst, const uint8_t* src, int64_t nbytes) {
  std::memcpy(dst, src, static_cast<size_t>(nbytes));
}
// The same for the rows of a large output written whole, row after row (expert_x, the
// gradient rows of scatter_rows): non-temporal stores where dst and nbytes are 16-byte
// aligned, so the row does not read its destination's cache lines first nor evict the
// sources (measured: unpack 1.75 -> 0.94 ms at the default bench workload). Not for buffers
// whose rows share cache lines with other stores (the pack's rows end in metadata). A loop
// that streams ends each parallel chunk with stream_fence(): every store is then visible.
inline void stream_row(uint8_t* dst, const uint8_t* src, int64_t nbytes) {
#if defined(EPKIT_STREAM_STORES)
  if ((reinterpret_cast<uintptr_t>(dst) | static_cast<uintptr_t>(nbytes)) % 16 == 0) {
    for (int64_t i = 0; i < nbytes; i += 16)
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i),
                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    return;
  }
#endif
  std::memcpy(dst, src, static_cast<size_t>(nbytes));
}
inline void stream_fence() {
#if defined(EPKIT_STREAM_STORES)
  _mm_sfence();
#endif
}
template <typename T>
inline void put(uint8_t* p, T v) { std::memcpy(p, &v, sizeof(T)); }
template <typename T>
inline T get(const uint8_t* p) { T v; std::memcpy(&v, p, sizeof(T)); return v; }

// The static exchange: chunk d of a buffer starts at d * (1 + cap); its first row carries the
// chunk's row count in-band (int64 at byte 0), its data rows follow.
inline int64_t static_cap(const int64_t* plan) { return plan[kStaticCap]; }

// Prefetch the nbytes at p (a source row read next): a kernel that walks its output front to
// back reads its source rows scattered, one short stream each, which the hardware prefetcher
// does not anticipate; asking for the next row while the current one is processed hides it.
inline void prefetch_row(const void* p, int64_t nbytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < nbytes; i += 64) __builtin_prefetch(c + i);
}

// Row loops with float arithmetic are built for AVX-512 (x86-64-v4), AVX2 and the baseline,
// the CPU choosing at load time: the baseline's 4-wide SSE2 makes the bfloat16 conversions
// compute-bound (combine_backward_dest at the default bench workload: 7.8 ms SSE2, 3.3 AVX2,
// 3.0 AVX-512). Only the width changes: every float32 multiply and add stays one IEEE
// operation (no FMA: -ffp-contract=off), so the bits are the same on all three.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#define EPKIT_ROW_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#elif defined(__x86_64__) && defined(__GNUC__)
#define EPKIT_ROW_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define EPKIT_ROW_CLONES
#endif

// Grain sizes for at::parallel_for: rows are wide (hidden >= 64 typically).
constexpr int64_t kRowGrain = 16;

}  // namespace epkit

namespace epkit {
// A dtype as Python spells it (torch.float32, not Float): the name the Triton kernels' checks
// (production/triton/rowchecks.py) print too, so both tiers give one message.
inline std::string dtype_name(at::ScalarType dt) {
  return "torch." + std::string(c10::getDtypeNames(dt).first);
}

// Calls f(T{}) with T = float or at::BFloat16: the two payload dtypes of the arithmetic kernels.
template <typename F>
inline void dispatch_float_types(at::ScalarType dt, const char* name, F&& f) {
  if (dt == at::kFloat) f(float{});
  else if (dt == at::kBFloat16) f(at::BFloat16{});
  else TORCH_CHECK(false, name, ": dtype must be float32 or bfloat16, got ", dtype_name(dt));
}
// Exact widening to float32 and round-to-nearest-even narrowing.
inline float widen(float v) { return v; }
inline float widen(at::BFloat16 v) { return static_cast<float>(v); }
template <typename T> inline T narrow(float v) { return static_cast<T>(v); }
// c10's rounding (NaN -> 0x7FC0, else RNE on the bits) written without a branch, so the row
// loops that call it vectorise; bit for bit the same as static_cast<at::BFloat16>.
template <> inline at::BFloat16 narrow<at::BFloat16>(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  const uint32_t rounded = (u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16;
  const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return at::BFloat16(nan ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded),
                      at::BFloat16::from_bits());
}
}  // namespace epkit
