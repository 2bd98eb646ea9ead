// Receive-side unpacking into the canonical expert-major layout, on the device
// (cpu/unpack.cpp is the specification).
//
// Received rows are addressed in the row space combine and the backward passes exchange:
// compact (ragged, padded, equal) or static chunks of 1 + cap rows. pairs: the expert-major row
// of a received row is closed-form (chunk s holds blocks (s, j), j ascending, whose sizes the
// plan gives). dedup: a slot's row is its expert's offset plus its rank among all received
// slots to that expert in received order, the same chunked counting sort as pack's (a token
// row's slots name distinct experts; __match_any_sync ranks any that do not). Payload: one
// block per received row reads the row once and stores it to each of its expert-major rows;
// padding rows are written by their own pass, so every byte of expert_x is written once.
//
// The CPU kernel's consistency checks (in-band counts against the plan) would need a host read
// here; they are a deferred error instead (issue 12): every check the CPU kernel makes (plus the
// plan's shape, which the CPU takes from its host words) sets a bit of this call's status word;
// any bit stops the passes after it, and the last pass (settle_kernel) then writes every output
// in its "nothing received" form (expert_x zeros, row_src -1, row_weight 0, recv_map -1), so a
// mismatch never leaves an uninitialised row, and ORs the bits into the device's sticky word
// (unpack_status_word: epkit.device.check_static / unpack_status read and clear it). A status
// of 0 implies every output element was written by the passes: each data row of each expert by
// exactly one slot (the per-expert totals are checked against tokens_per_expert), the padding
// rows by padding_kernel. Under EPKIT_CUDA_CHECKS=1 the call also reads its status (a host wait)
// and raises at once.
#include "common.cuh"

#include <cstdlib>

namespace epkit {
namespace cuda {

// The device's sticky unpack status: the OR of every unpack's status bits since it was last
// cleared (one word per device: module globals are per device context).
__device__ int32_t g_unpack_status = 0;

namespace {

constexpr int kChunk = 64;
constexpr int kThreads = 128;

constexpr const char* kUnpackStatusBits =
    "1 in-band count, 2 in-band slot count, 4 rows, 8 slot row, 16 expert row, "
    "32 plan shape or sizes, 64 expert total";
// Status bits (this call's word; kUnpackStatusBits names them for the messages).
enum : int32_t {
  kStInBandCount = 1,   // a static chunk's in-band token count != the plan's
  kStSlotCount = 2,     // slots received from a rank (in-band) != the plan's recv_slots
  kStRows = 4,          // pairs: a rank's kept blocks do not cover its received rows
  kStSlotRow = 8,       // dedup: a slot word names k >= K or j >= L
  kStExpertRow = 16,    // an expert-major row outside its expert's segment / expert_rows
  kStShape = 32,        // the plan's words vs its length, recv bytes, recv_rows, expert_rows
  kStExpertTotal = 64,  // dedup: slots received for an expert != tokens_per_expert
};

struct Unpack {
  const int64_t* plan;
  const uint8_t* rb;
  uint8_t* xb;
  int64_t* row_src;
  float* row_weight;
  int64_t* recv_map;
  int32_t* status;
  int64_t R, E, L;  // read from the plan on the device (ready()): unpack has no num_ranks
  int64_t K, P, B, N, M;
  int64_t n;                // the plan's length (its words R, E must fit it)
  int64_t nbytes;           // recv.numel()
  int64_t Lb;               // host bound on L (scratch sizes; the stride of jbase is L itself)
  const int64_t* rchunk;    // [R + 1] byte offset of chunk s
  const int64_t* rrow;      // [R + 1] compact row of chunk s's first row
  const int64_t* exp_base;  // pairs [R, L]: offsets[j] + rows of j from sources before s
  const int64_t* blk;       // pairs [R, L + 1]: start of block (s, j) among chunk s's rows
  const int64_t* G;         // dedup [N]: slot rows received before row r
  const int64_t* Gi;        // dedup [N]: G[r] + slots of row r (inclusive prefix)
  const int32_t* lrank;     // dedup [N * K] by slot number: rank among the chunk's slots to j
  const int32_t* jbase;     // dedup [chunks + 1, L] (stride L; row `chunks`: per-j totals)
};

// An earlier pass found a mismatch: the passes after it do nothing (settle_kernel cleans up).
__device__ __forceinline__ bool failed(const Unpack& a) {
  return *reinterpret_cast<volatile const int32_t*>(a.status) != 0;
}

// The group's shape from the plan (every plan, an erroneous one too, carries it).
__device__ __forceinline__ Unpack ready(Unpack a) {
  a.R = a.plan[kRanks];
  a.E = a.plan[kExperts];
  a.L = a.plan[kLocalExperts];
  return a;
}

__device__ __forceinline__ int64_t upper_bound(const int64_t* a, int64_t n, int64_t v) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (a[mid] <= v) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// Row r of the row space: its source s and data row i; false for header and gap rows.
__device__ __forceinline__ bool row_info(const Unpack& a, int64_t r, int64_t& s, int64_t& i) {
  const int64_t cap = a.plan[kStaticCap];
  if (cap >= 0) {
    s = r / (1 + cap);
    i = r % (1 + cap) - 1;
    return s < a.R && i >= 0 && i < a.plan[PlanOffsets(a.R, a.E).recv_counts + s];
  }
  s = upper_bound(a.rrow, a.R + 1, r) - 1;
  i = r - (s >= 0 ? a.rrow[s] : 0);
  return s >= 0 && s < a.R;
}
__device__ __forceinline__ const uint8_t* row_bytes(const Unpack& a, int64_t s, int64_t i) {
  return a.rb + a.rchunk[s] + (i + (a.plan[kStaticCap] >= 0 ? 1 : 0)) * a.B;
}
// dedup: the first slot row of chunk s, and row r's first slot row.
__device__ __forceinline__ const uint8_t* slot_rows(const Unpack& a, int64_t s, int64_t r) {
  const int64_t* p = a.plan;
  const int64_t cap = p[kStaticCap], tokcap = p[kTokCap];
  const int64_t tok_rows = tokcap >= 0 ? tokcap : p[PlanOffsets(a.R, a.E).recv_counts + s];
  const int64_t first_row = cap >= 0 ? s * (1 + cap) : a.rrow[s];
  return a.rb + a.rchunk[s] + tok_rows * a.B + (cap >= 0 ? kSlotRowBytes : 0) +
         (a.G[r] - a.G[first_row]) * kSlotRowBytes;
}
__device__ __forceinline__ int64_t row_slots(const Unpack& a, const uint8_t* row) {
  const int64_t n = dget<int32_t>(row + a.P + kDedupMetaN);
  return n < 0 ? 0 : n > a.K ? a.K : n;
}

__global__ void setup_kernel(Unpack a_in, int64_t* rchunk, int64_t* rrow, int64_t* exp_base,
                             int64_t* blk, bool pairs) {
  const Unpack a = ready(a_in);
  const int64_t* p = a.plan;
  const int64_t R = a.R, L = a.L;
  // The plan's shape words against its length and the host's scratch bounds: every index
  // below depends on them (an inconsistent plan: nothing is read, the outputs are settled).
  const bool shape_ok = R >= 1 && L >= 1 && L <= a.Lb && a.E == R * L &&
                        PlanOffsets(R, a.E).size == a.n;
  if (!shape_ok) {
    if (threadIdx.x == 0) atomicOr(a.status, kStShape);
    return;
  }
  const PlanOffsets o(R, a.E);
  block_exclusive_scan(p + o.recv_bytes, rchunk, R);
  block_exclusive_scan(p + o.recv_counts, rrow, R);
  const int64_t cap = p[kStaticCap];
  // Sizes (the CPU kernel's first checks): only under a plan without an error, whose sizes
  // are the ones the host allocated by.
  const bool sizes_ok = p[kErrCode] != 0 ||
      (rchunk[R] == a.nbytes && p[kRecvBytes] == a.nbytes && p[kRecvRows] == a.N &&
       p[kExpertRows] == a.M && p[o.offsets + L] <= a.M);
  if (!sizes_ok) {
    if (threadIdx.x == 0) atomicOr(a.status, kStShape);
    return;
  }
  for (int64_t s = threadIdx.x; s < R; s += blockDim.x) {
    if (p[kErrCode] == 0 && cap >= 0) {  // in-band counts against the plan
      const uint8_t* c0 = a.rb + rchunk[s];
      if (dget<int64_t>(c0) != p[o.recv_counts + s]) atomicOr(a.status, kStInBandCount);
      if (!pairs) {
        const int64_t tokcap = p[kTokCap];
        if (dget<int64_t>(c0 + tokcap * a.B) != p[o.recv_slots + s])
          atomicOr(a.status, kStSlotCount);
      }
    }
    if (pairs) {
      int64_t at = 0;
      for (int64_t j = 0; j < L; ++j) {
        blk[s * (L + 1) + j] = at;
        at += p[o.recv_kept + s * L + j];
      }
      blk[s * (L + 1) + L] = at;
      // Every received row of s must fall in one of its blocks (else it would map nowhere and
      // an expert row would stay unwritten).
      if (p[kErrCode] == 0 && at != p[o.recv_counts + s]) atomicOr(a.status, kStRows);
    }
  }
  if (pairs)
    for (int64_t j = threadIdx.x; j < L; j += blockDim.x) {
      int64_t at = p[o.offsets + j];
      for (int64_t s = 0; s < R; ++s) {
        exp_base[s * L + j] = at;
        at += p[o.recv_kept + s * L + j];
      }
    }
}

// pairs: one block per received row.
__global__ void pairs_kernel(Unpack a_in) {
  const Unpack a = ready(a_in);
  __shared__ uint8_t* dst[1];
  const int64_t r = blockIdx.x, L = a.L, P = a.P;
  int64_t s, i;
  if (failed(a) || a.plan[kErrCode] != 0 || !row_info(a, r, s, i)) return;
  const int64_t* blk = a.blk + s * (L + 1);
  if (i >= blk[L]) {  // more rows than the plan's kept count
    if (threadIdx.x == 0) atomicOr(a.status, kStRows);
    return;
  }
  const int64_t j = upper_bound(blk, L + 1, i) - 1;
  const int64_t m = a.exp_base[s * L + j] + i - blk[j];
  if (m < 0 || m >= a.M) {
    if (threadIdx.x == 0) atomicOr(a.status, kStExpertRow);
    return;
  }
  const uint8_t* row = row_bytes(a, s, i);
  if (threadIdx.x == 0) {
    a.recv_map[r] = m;
    a.row_src[m * 3 + 0] = s;
    a.row_src[m * 3 + 1] = dget<int32_t>(row + P + kPairsMetaT);
    a.row_src[m * 3 + 2] = dget<int32_t>(row + P + kPairsMetaK);
    a.row_weight[m] = dget<float>(row + P + kPairsMetaW);
    dst[0] = a.xb + m * P;
  }
  __syncthreads();
  const uint64_t bits = reinterpret_cast<uint64_t>(row) | reinterpret_cast<uint64_t>(dst[0]) |
                        static_cast<uint64_t>(P);
  copy_to_all(dst, 1, row, P, vec_width(bits), threadIdx.x, blockDim.x);
}

// dedup: slots per received row (0 for header and gap rows).
__global__ void nrow_kernel(Unpack a_in, int64_t* nrow) {
  const Unpack a = ready(a_in);
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= a.N) return;
  int64_t s, i;
  nrow[r] = !failed(a) && a.plan[kErrCode] == 0 && row_info(a, r, s, i)
                ? row_slots(a, row_bytes(a, s, i)) : 0;
}

// dedup, one thread per source: the slots its rows announce (in-band) against the plan's
// recv_slots, as the CPU kernel checks; this also keeps every slot read inside its section.
__global__ void slot_count_kernel(Unpack a_in) {
  const Unpack a = ready(a_in);
  const int64_t s = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (failed(a) || a.plan[kErrCode] != 0 || s >= a.R) return;
  const PlanOffsets o(a.R, a.E);
  const int64_t cap = a.plan[kStaticCap], count = a.plan[o.recv_counts + s];
  const int64_t first = cap >= 0 ? s * (1 + cap) + 1 : a.rrow[s];
  if (count < 0 || first + count > a.N) { atomicOr(a.status, kStShape); return; }
  const int64_t sum = count > 0 ? a.Gi[first + count - 1] - a.G[first] : 0;
  if (sum != a.plan[o.recv_slots + s]) atomicOr(a.status, kStSlotCount);
}

// dedup, one warp per chunk of rows: lrank of every received slot, the chunk's count per j.
__global__ void rank_kernel(Unpack a_in, int32_t* lrank, int32_t* jcount) {
  const Unpack a = ready(a_in);
  extern __shared__ int32_t cnt[];  // [L]
  const int lane = threadIdx.x;
  const int64_t c = blockIdx.x, L = a.L;
  if (failed(a)) return;  // uniform: nothing after reads jbase then
  for (int64_t j = lane; j < L; j += kWarp) cnt[j] = 0;
  __syncwarp();
  // Block `chunks` walks no row: it writes the zero row whose scan gives the per-j totals.
  const int64_t r1 = min(a.N, (c + 1) * kChunk);
  for (int64_t r = c * kChunk; r < r1; ++r) {
    int64_t s, i;
    if (a.plan[kErrCode] != 0 || !row_info(a, r, s, i)) continue;  // uniform over the warp
    const uint8_t* row = row_bytes(a, s, i);
    const int64_t n = row_slots(a, row);
    const uint8_t* slots = slot_rows(a, s, r);
    for (int64_t ib = 0; ib < n; ib += kWarp) {
      const int64_t q = ib + lane;
      int64_t j = -1;
      if (q < n) {
        const int32_t packed = dget<int32_t>(slots + q * kSlotRowBytes);
        j = slot_word_j(packed);
        if (j >= L || slot_word_k(packed) >= a.K) { atomicOr(a.status, kStSlotRow); j = -1; }
      }
      const bool valid = j >= 0;
      const unsigned peers = __match_any_sync(kFull, valid ? j : -2 - lane);
      int32_t base = 0;
      if (valid) {
        base = cnt[j];
        lrank[a.G[r] + q] = base + __popc(peers & lanemask_lt());
      }
      __syncwarp();
      if (valid && lane == __ffs(peers) - 1) cnt[j] = base + __popc(peers);
      __syncwarp();
    }
  }
  for (int64_t j = lane; j < L; j += kWarp) jcount[c * L + j] = cnt[j];
}

// dedup, one thread per local expert: the slots received for j (row `chunks` of the scanned
// jbase) must be the plan's tokens_per_expert[j]; then the ranks 0 .. total - 1 of j's slots
// write each of its rows exactly once.
__global__ void expert_total_kernel(Unpack a_in, int64_t chunks) {
  const Unpack a = ready(a_in);
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (failed(a) || a.plan[kErrCode] != 0 || j >= a.L) return;
  const PlanOffsets o(a.R, a.E);
  if (a.jbase[chunks * a.L + j] != a.plan[o.tokens_per_expert + j])
    atomicOr(a.status, kStExpertTotal);
}

// dedup: one block per received row: its slots' rows, then the payload to each of them.
__global__ void dedup_kernel(Unpack a_in) {
  const Unpack a = ready(a_in);
  extern __shared__ uint8_t* dst[];  // [K]
  __shared__ int nd;
  __shared__ unsigned long long bits;
  const int64_t r = blockIdx.x, K = a.K, L = a.L, P = a.P;
  int64_t s, i;
  if (failed(a) || a.plan[kErrCode] != 0 || !row_info(a, r, s, i)) return;
  const PlanOffsets o(a.R, a.E);
  const int64_t* offsets = a.plan + o.offsets;
  const int64_t* tpe = a.plan + o.tokens_per_expert;
  const uint8_t* row = row_bytes(a, s, i);
  const int64_t n = row_slots(a, row), t = dget<int32_t>(row + P), c = r / kChunk;
  const uint8_t* slots = slot_rows(a, s, r);
  if (threadIdx.x == 0) {
    nd = 0;
    bits = reinterpret_cast<uint64_t>(row) | static_cast<uint64_t>(P);
  }
  __syncthreads();
  for (int64_t q = threadIdx.x; q < n; q += blockDim.x) {
    const uint8_t* slot = slots + q * kSlotRowBytes;
    const int32_t packed = dget<int32_t>(slot);
    const int64_t k = slot_word_k(packed), j = slot_word_j(packed);
    if (j >= L || k < 0 || k >= K) continue;  // rank_kernel skipped it too (no lrank)
    const int64_t rank = a.jbase[c * L + j] + a.lrank[a.G[r] + q];
    const int64_t m = offsets[j] + rank;
    if (rank < 0 || rank >= tpe[j] || m >= a.M) { atomicOr(a.status, kStExpertRow); continue; }
    a.recv_map[r * K + k] = m;
    a.row_src[m * 3 + 0] = s;
    a.row_src[m * 3 + 1] = t;
    a.row_src[m * 3 + 2] = k;
    a.row_weight[m] = dget<float>(slot + 4);
    uint8_t* d = a.xb + m * P;
    dst[atomicAdd(&nd, 1)] = d;
    atomicOr(&bits, reinterpret_cast<uint64_t>(d));
  }
  __syncthreads();
  copy_to_all(dst, nd, row, P, vec_width(bits), threadIdx.x, blockDim.x);
}

// Padding rows (each expert's tail up to align, and the static tail after offsets[L]): zero
// payload, row_src -1, row_weight 0. One warp per row.
__global__ void padding_kernel(Unpack a_in) {
  const Unpack a = ready(a_in);
  const int64_t m = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (m >= a.M || failed(a)) return;
  const PlanOffsets o(a.R, a.E);
  const int64_t* offsets = a.plan + o.offsets;
  const int64_t L = a.L;
  bool pad = m >= offsets[L];
  if (!pad) {
    const int64_t j = upper_bound(offsets, L + 1, m) - 1;
    pad = j < 0 || m - offsets[j] >= a.plan[o.tokens_per_expert + j];
  }
  if (!pad) return;
  zero_range(a.xb, m * a.P, (m + 1) * a.P, lane, kWarp);
  if (lane < 3) a.row_src[m * 3 + lane] = -1;
  if (lane == 3) a.row_weight[m] = 0.0f;
}

// Last pass: on any status bit, every output in its "nothing received" form (a defined result,
// as under an erroneous plan), and the bits into the device's sticky word.
__global__ void settle_kernel(Unpack a, int64_t C) {
  const int32_t st = *reinterpret_cast<volatile const int32_t*>(a.status);
  if (st == 0) return;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nt = static_cast<int64_t>(gridDim.x) * blockDim.x;
  if (tid == 0) atomicOr(&g_unpack_status, st);
  zero_range(a.xb, 0, a.M * a.P, tid, nt);
  for (int64_t i = tid; i < a.M * 3; i += nt) a.row_src[i] = -1;
  for (int64_t i = tid; i < a.M; i += nt) a.row_weight[i] = 0.0f;
  for (int64_t i = tid; i < a.N * C; i += nt) a.recv_map[i] = -1;
}

// The host's bound on L from the plan's length alone (a device plan is never read on the host):
// n = kPlanHeader + 1 + 6R + 2E + 3L with E = R L, i.e. n - (kPlanHeader - 8) = (2R + 3)(L + 3);
// the largest L of any R >= 1 comes with the smallest odd divisor d >= 5 of that (exact for
// R = 1, and whenever 2R + 3 is that divisor). tests/cuda/emulate.py local_experts_bound is this
// function.
int64_t local_experts_bound(int64_t n) {
  const int64_t m = n - (kPlanHeader - 8);
  for (int64_t d = 5; d * 4 <= m; d += 2)
    if (m % d == 0) return m / d - 3;
  return 1;
}

void set_smem(const void* kernel, size_t bytes) {
  if (bytes > 48 * 1024)
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(bytes)));
}

}  // namespace

// The device's sticky status word (unpack_status_word op, registration.cu): an alias of
// g_unpack_status on `like`'s device, int32 [1].
Tensor unpack_status_word(const Tensor& like) {
  TORCH_CHECK(like.is_cuda(), "epkit.unpack_status_word: needs a CUDA tensor for its device");
  const c10::cuda::CUDAGuard guard(like.device());
  void* ptr = nullptr;
  C10_CUDA_CHECK(cudaGetSymbolAddress(&ptr, g_unpack_status));
  return at::from_blob(ptr, {1}, at::TensorOptions().dtype(at::kInt).device(like.device()));
}

std::tuple<Tensor, Tensor, Tensor, Tensor> unpack_cuda(const Tensor& recv_in, const Tensor& plan_in,
                                                       int64_t transport, int64_t H,
                                                       at::ScalarType dtype, int64_t K,
                                                       c10::SymInt recv_rows,
                                                       c10::SymInt expert_rows) {
  const c10::cuda::CUDAGuard guard(recv_in.device());
  const at::Device dev = recv_in.device();
  const int64_t M = expert_rows.expect_int(), N = recv_rows.expect_int();
  check_unpack_args(recv_in, plan_in, transport, H, dtype, K, N, M);  // the plan on dev
  const Tensor recv = recv_in.contiguous();
  const bool pairs = transport == kPairs;
  const int64_t P = H * c10::elementSize(dtype);
  const int64_t B = P + (pairs ? kPairsMetaBytes : kDedupTokMeta);
  // R, E and L are read from the plan on the device; the host sizes scratch by bounds from the
  // plan's length n = 25 + 6R + 2E + 3L (epkit.h): R, E + R <= Eb = (n - 25) / 2, and L <= Lb
  // (local_experts_bound). setup_kernel checks the plan's words against them, and the sizes
  // (expert_rows, recv_rows, recv bytes) the CPU kernel checks on the host.
  const int64_t n = plan_in.numel();
  TORCH_CHECK(n >= kPlanHeader + 7, "epkit.unpack: a plan of ", n, " words");
  const int64_t Eb = std::max<int64_t>((n - 25) / 2, 1);
  const int64_t Lb = std::max<int64_t>(local_experts_bound(n), 1);
  const Tensor plan = plan_on(plan_in, dev);
  const auto i64 = recv.options().dtype(at::kLong), i32 = recv.options().dtype(at::kInt);

  // Outputs are written once by the passes (status 0), or in full by settle_kernel.
  Tensor expert_x = at::empty({M, H}, recv.options().dtype(dtype));
  Tensor row_src = at::empty({M, 3}, i64);
  Tensor row_weight = at::empty({M}, recv.options().dtype(at::kFloat));
  const int64_t C = pairs ? 1 : K;
  Tensor recv_map = at::full({N, C}, -1, i64);
  Tensor status = at::zeros({1}, i32);
  // rchunk [R + 1] | rrow [R + 1] | pairs: exp_base [R * L] | blk [R * (L + 1)]
  Tensor offs = at::empty({2 * (Eb + 1) + (pairs ? 2 * Eb + Eb : 0)}, i64);
  int64_t* op = offs.data_ptr<int64_t>();

  Unpack a{};
  a.plan = plan.data_ptr<int64_t>();
  a.rb = recv.data_ptr<uint8_t>();
  a.xb = static_cast<uint8_t*>(expert_x.data_ptr());
  a.row_src = row_src.data_ptr<int64_t>();
  a.row_weight = row_weight.data_ptr<float>();
  a.recv_map = recv_map.data_ptr<int64_t>();
  a.status = status.data_ptr<int32_t>();
  a.K = K; a.P = P; a.B = B; a.N = N; a.M = M; a.n = n; a.nbytes = recv.numel(); a.Lb = Lb;
  a.rchunk = op;
  a.rrow = op + Eb + 1;
  a.exp_base = pairs ? op + 2 * (Eb + 1) : nullptr;
  a.blk = pairs ? op + 2 * (Eb + 1) + Eb : nullptr;
  setup_kernel<<<1, 512, 0, stream()>>>(a, op, op + Eb + 1, const_cast<int64_t*>(a.exp_base),
                                        const_cast<int64_t*>(a.blk), pairs);
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  Tensor G, Gi, lrank, jbase;
  if (N > 0) {
    if (pairs) {
      pairs_kernel<<<N, kThreads, 0, stream()>>>(a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    } else if (K > 0) {
      Tensor nrow = at::empty({N}, i64);
      nrow_kernel<<<ceil_div(N, 256), 256, 0, stream()>>>(a, nrow.data_ptr<int64_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      Gi = nrow.cumsum(0);  // inclusive prefix: integers, exact and deterministic
      G = Gi - nrow;        // exclusive
      a.G = G.data_ptr<int64_t>();
      a.Gi = Gi.data_ptr<int64_t>();
      slot_count_kernel<<<ceil_div(Eb, 256), 256, 0, stream()>>>(a);  // R <= Eb sources
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      const int64_t chunks = ceil_div(N, kChunk);
      lrank = at::empty({N * K}, i32);
      jbase = at::empty({(chunks + 1) * Lb}, i32);  // [chunks + 1, L], L <= Lb
      a.lrank = lrank.data_ptr<int32_t>();
      a.jbase = jbase.data_ptr<int32_t>();
      const size_t smem = Lb * sizeof(int32_t);  // cnt [L]
      set_smem(reinterpret_cast<const void*>(&rank_kernel), smem);
      rank_kernel<<<chunks + 1, kWarp, smem, stream()>>>(a, lrank.data_ptr<int32_t>(),
                                                          jbase.data_ptr<int32_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      // L columns of stride L (the device word; warps past it return)
      scan_columns(jbase.data_ptr<int32_t>(), chunks + 1, Lb, a.plan + kLocalExperts);
      expert_total_kernel<<<ceil_div(Lb, 256), 256, 0, stream()>>>(a, chunks);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      const size_t smem2 = K * sizeof(void*);
      set_smem(reinterpret_cast<const void*>(&dedup_kernel), smem2);
      dedup_kernel<<<N, kThreads, smem2, stream()>>>(a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }
  if (M > 0) {
    padding_kernel<<<ceil_div(M * kWarp, 256), 256, 0, stream()>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  settle_kernel<<<128, 256, 0, stream()>>>(a, C);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (std::getenv("EPKIT_CUDA_CHECKS") != nullptr) {  // debugging: a host read, by request
    const int32_t st = status.item<int32_t>();
    TORCH_CHECK(st == 0, "epkit.unpack: the received chunks disagree with the plan (status ", st,
                ": ", kUnpackStatusBits, "); the outputs were zero-filled");
  }
  return {expert_x, row_src, row_weight, recv_map};
}

}  // namespace cuda
}  // namespace epkit
