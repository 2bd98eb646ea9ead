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
// here; they are recorded in a device word instead and read only under EPKIT_CUDA_CHECKS=1.
#include "common.cuh"

#include <cstdlib>

namespace epkit {
namespace cuda {

namespace {

constexpr int kChunk = 64;
constexpr int kThreads = 128;

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
  int64_t Lb;               // host bound on L: the row stride of jbase
  const int64_t* rchunk;    // [R + 1] byte offset of chunk s
  const int64_t* rrow;      // [R + 1] compact row of chunk s's first row
  const int64_t* exp_base;  // pairs [R, L]: offsets[j] + rows of j from sources before s
  const int64_t* blk;       // pairs [R, L + 1]: start of block (s, j) among chunk s's rows
  const int64_t* G;         // dedup [N]: slot rows received before row r
  const int32_t* lrank;     // dedup [N * K] by slot number: rank among the chunk's slots to j
  const int32_t* jbase;     // dedup [chunks, Lb]
};

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
  const int64_t n = dget<int32_t>(row + a.P + 4);
  return n < 0 ? 0 : n > a.K ? a.K : n;
}

__global__ void setup_kernel(Unpack a_in, int64_t* rchunk, int64_t* rrow, int64_t* exp_base,
                             int64_t* blk, bool pairs) {
  const Unpack a = ready(a_in);
  const int64_t* p = a.plan;
  const int64_t R = a.R, L = a.L;
  const PlanOffsets o(R, a.E);
  block_exclusive_scan(p + o.recv_bytes, rchunk, R);
  block_exclusive_scan(p + o.recv_counts, rrow, R);
  const int64_t cap = p[kStaticCap];
  for (int64_t s = threadIdx.x; s < R; s += blockDim.x) {
    if (p[kErrCode] == 0 && cap >= 0) {  // in-band counts against the plan
      const uint8_t* c0 = a.rb + rchunk[s];
      if (dget<int64_t>(c0) != p[o.recv_counts + s]) atomicOr(a.status, 1);
      if (!pairs) {
        const int64_t tokcap = p[kTokCap];
        if (dget<int64_t>(c0 + tokcap * a.B) != p[o.recv_slots + s]) atomicOr(a.status, 2);
      }
    }
    if (pairs) {
      int64_t at = 0;
      for (int64_t j = 0; j < L; ++j) {
        blk[s * (L + 1) + j] = at;
        at += p[o.recv_kept + s * L + j];
      }
      blk[s * (L + 1) + L] = at;
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
  if (a.plan[kErrCode] != 0 || !row_info(a, r, s, i)) return;
  const int64_t* blk = a.blk + s * (L + 1);
  if (i >= blk[L]) {  // more rows than the plan's kept count
    if (threadIdx.x == 0) atomicOr(a.status, 4);
    return;
  }
  const int64_t j = upper_bound(blk, L + 1, i) - 1;
  const int64_t m = a.exp_base[s * L + j] + i - blk[j];
  const uint8_t* row = row_bytes(a, s, i);
  if (threadIdx.x == 0) {
    a.recv_map[r] = m;
    a.row_src[m * 3 + 0] = s;
    a.row_src[m * 3 + 1] = dget<int32_t>(row + P);
    a.row_src[m * 3 + 2] = dget<int32_t>(row + P + 4);
    a.row_weight[m] = dget<float>(row + P + 12);
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
  nrow[r] = a.plan[kErrCode] == 0 && row_info(a, r, s, i) ? row_slots(a, row_bytes(a, s, i)) : 0;
}

// dedup, one warp per chunk of rows: lrank of every received slot, the chunk's count per j.
__global__ void rank_kernel(Unpack a_in, int32_t* lrank, int32_t* jcount) {
  const Unpack a = ready(a_in);
  extern __shared__ int32_t cnt[];  // [L]
  const int lane = threadIdx.x;
  const int64_t c = blockIdx.x, L = a.L;
  for (int64_t j = lane; j < L; j += kWarp) cnt[j] = 0;
  __syncwarp();
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
        if (j >= L || slot_word_k(packed) >= a.K) { atomicOr(a.status, 8); j = -1; }
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
  for (int64_t j = lane; j < L; j += kWarp) jcount[c * a.Lb + j] = cnt[j];
}

// dedup: one block per received row: its slots' rows, then the payload to each of them.
__global__ void dedup_kernel(Unpack a_in) {
  const Unpack a = ready(a_in);
  extern __shared__ uint8_t* dst[];  // [K]
  __shared__ int nd;
  __shared__ unsigned long long bits;
  const int64_t r = blockIdx.x, K = a.K, L = a.L, P = a.P;
  int64_t s, i;
  if (a.plan[kErrCode] != 0 || !row_info(a, r, s, i)) return;
  const int64_t* offsets = a.plan + PlanOffsets(a.R, a.E).offsets;
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
    if (j >= L || k < 0 || k >= K) continue;
    const int64_t m = offsets[j] + a.jbase[c * a.Lb + j] + a.lrank[a.G[r] + q];
    if (m < 0 || m >= a.M) { atomicOr(a.status, 16); continue; }
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
  if (m >= a.M) return;
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

void set_smem(const void* kernel, size_t bytes) {
  if (bytes > 48 * 1024)
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(bytes)));
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor, Tensor> unpack_cuda(const Tensor& recv_in, const Tensor& plan_in,
                                                       int64_t transport, int64_t H,
                                                       at::ScalarType dtype, int64_t K,
                                                       c10::SymInt recv_rows,
                                                       c10::SymInt expert_rows) {
  const c10::cuda::CUDAGuard guard(recv_in.device());
  const at::Device dev = recv_in.device();
  const Tensor recv = recv_in.contiguous();
  const int64_t M = expert_rows.expect_int(), N = recv_rows.expect_int();
  const bool pairs = transport == kPairs;
  const int64_t P = H * c10::elementSize(dtype);
  const int64_t B = P + (pairs ? kPairsMetaBytes : kDedupTokMeta);
  TORCH_CHECK(recv.dim() == 1, "epkit.unpack: recv must be a byte vector");
  if (!plan_in.is_cuda()) {  // a host plan: the CPU kernel's checks cost nothing
    const int64_t* hp = plan_in.data_ptr<int64_t>();
    TORCH_CHECK(M == hp[kExpertRows], "epkit.unpack: expert_rows disagrees with the plan");
    TORCH_CHECK(N == hp[kRecvRows], "epkit.unpack: recv_rows disagrees with the plan");
    TORCH_CHECK(recv.numel() == hp[kRecvBytes], "epkit.unpack: received ", recv.numel(),
                " bytes, the plan says ", hp[kRecvBytes]);
  }
  // R, E and L are read from the plan on the device; the host sizes scratch by bounds from the
  // plan's length n = 25 + 6R + 2E + 3L (epkit.h): R, L <= E <= (n - 25) / 2.
  const int64_t n = plan_in.numel();
  TORCH_CHECK(n >= kPlanHeader, "epkit.unpack: a plan of ", n, " words");
  const int64_t Eb = std::max<int64_t>((n - 25) / 2, 1);
  const Tensor plan = plan_on(plan_in, dev);
  const auto i64 = recv.options().dtype(at::kLong), i32 = recv.options().dtype(at::kInt);

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
  a.K = K; a.P = P; a.B = B; a.N = N; a.M = M; a.Lb = Eb;
  a.rchunk = op;
  a.rrow = op + Eb + 1;
  a.exp_base = pairs ? op + 2 * (Eb + 1) : nullptr;
  a.blk = pairs ? op + 2 * (Eb + 1) + Eb : nullptr;
  setup_kernel<<<1, 512, 0, stream()>>>(a, op, op + Eb + 1, const_cast<int64_t*>(a.exp_base),
                                        const_cast<int64_t*>(a.blk), pairs);
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  Tensor G, lrank, jbase;
  if (N > 0) {
    if (pairs) {
      pairs_kernel<<<N, kThreads, 0, stream()>>>(a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    } else if (K > 0) {
      Tensor nrow = at::empty({N}, i64);
      nrow_kernel<<<ceil_div(N, 256), 256, 0, stream()>>>(a, nrow.data_ptr<int64_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      G = nrow.cumsum(0).sub_(nrow);  // exclusive prefix: integers, exact and deterministic
      a.G = G.data_ptr<int64_t>();
      const int64_t chunks = ceil_div(N, kChunk);
      lrank = at::empty({N * K}, i32);
      jbase = at::empty({chunks * Eb}, i32);
      a.lrank = lrank.data_ptr<int32_t>();
      a.jbase = jbase.data_ptr<int32_t>();
      const size_t smem = Eb * sizeof(int32_t);  // cnt [L], L <= Eb
      set_smem(reinterpret_cast<const void*>(&rank_kernel), smem);
      rank_kernel<<<chunks, kWarp, smem, stream()>>>(a, lrank.data_ptr<int32_t>(),
                                                      jbase.data_ptr<int32_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      scan_columns(jbase.data_ptr<int32_t>(), chunks, Eb);  // columns >= L: unused
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
  if (std::getenv("EPKIT_CUDA_CHECKS") != nullptr) {  // debugging: a host read, by request
    const int32_t st = status.item<int32_t>();
    TORCH_CHECK(st == 0, "epkit.unpack: the received chunks disagree with the plan (status ", st,
                ": 1 in-band count, 2 in-band slot count, 4 rows, 8 slot row, 16 expert row)");
  }
  return {expert_x, row_src, row_weight, recv_map};
}

}  // namespace cuda
}  // namespace epkit
