// Send-side packing on the device (cpu/pack.cpp is the specification, byte for byte).
//
// Index passes (integers): the rank of every slot among this rank's slots to its expert, in
// token order, is a chunked counting sort: one warp walks a chunk of kChunk tokens in order
// (lanes over k; lanes naming one expert are ranked by __match_any_sync, so even a row naming
// an expert twice ranks as the CPU's serial cursor does), then a column scan over chunks gives
// each chunk's base. Dedup adds the same two steps per (token, destination rank): the token row
// index and the start of its slot rows.
// Payload pass: one block per token reads each 16-byte vector of x[t] once and stores it to
// every row the token sends (vector width: the largest of 16/8/4/2/1 bytes that divides the
// addresses and the row length). Every byte of the send buffer is written exactly once: rows
// by the payload pass, in-band headers and chunk padding by the fill pass.
#include "common.cuh"

namespace epkit {
namespace cuda {

namespace {

constexpr int kChunk = 32;     // tokens per chunk of the index passes
constexpr int kStageK = 32;    // up to this K, a chunk's routing is staged in shared memory

// The chunk's routing rows [t0, t1) in shared memory (read once, coalesced) when K is small, so
// the warp's serial walk over tokens waits on no global load; else the global rows. Row t is
// then at (t - base) * K with base = the returned t0 (staged) or 0.
__device__ __forceinline__ const int64_t* stage_routing(const int64_t* ip, int64_t t0, int64_t t1,
                                                       int64_t K, int64_t* stage, int64_t& base) {
  base = 0;
  if (K > kStageK) return ip;
  for (int64_t i = threadIdx.x; i < (t1 - t0) * K; i += kWarp) stage[i] = ip[t0 * K + i];
  base = t0;
  return stage;
}
inline size_t stage_bytes(int64_t K) { return K > kStageK ? 0 : kChunk * K * sizeof(int64_t); }
constexpr int kThreads = 128;  // payload blocks

struct Pack {
  const int64_t* plan;
  const int64_t* ip;
  const float* wp;
  const uint8_t* xb;
  uint8_t* sb;
  int64_t* send_map;
  int64_t T, K, E, R, L, P, B;
  const int64_t* chunk;      // [R + 1] byte offset of chunk d
  const int64_t* row_start;  // [R + 1] compact row of chunk d's first row
  const int64_t* slot_sec;   // [R] byte offset of chunk d's first dedup slot row
  const int64_t* start;      // [E + 1] prefix of own_kept
  const int32_t* lrank;      // [T, K] rank among the chunk's slots to the same expert
  const int32_t* ebase;      // [chunks, E] slots to e in earlier chunks
  const int32_t* tok_local;  // [T, R] dedup: token row within the chunk's rows to d (-1: none)
  const int32_t* slot_local; // [T, R] dedup: its first slot row within the chunk's
  const int32_t* tok_base;   // [chunks, R]
  const int32_t* slot_base;  // [chunks, R]
};

__global__ void setup_kernel(const int64_t* p, int64_t R, int64_t E, int64_t B, bool pairs,
                             int64_t* chunk, int64_t* row_start, int64_t* slot_sec,
                             int64_t* start) {
  const PlanOffsets o(R, E);
  block_exclusive_scan(p + o.send_bytes, chunk, R);
  block_exclusive_scan(p + o.send_counts, row_start, R);
  block_exclusive_scan(p + o.own_kept, start, E);
  if (pairs) return;
  const int64_t tokcap = p[kTokCap], cap = p[kStaticCap];
  for (int64_t d = threadIdx.x; d < R; d += blockDim.x) {
    const int64_t tok_rows = tokcap >= 0 ? tokcap : p[o.send_counts + d];
    slot_sec[d] = chunk[d] + tok_rows * B + (cap >= 0 ? kSlotRowBytes : 0);
  }
}

// One warp per chunk of tokens: lrank[t, k] and the chunk's count per expert.
__global__ void rank_kernel(const int64_t* ip_global, int64_t T, int64_t K, int64_t E,
                            int32_t* lrank, int32_t* ccount) {
  extern __shared__ int64_t rank_smem[];  // staged routing [kChunk * K] | cnt [E]
  const int lane = threadIdx.x;
  const int64_t c = blockIdx.x;
  int32_t* cnt = reinterpret_cast<int32_t*>(rank_smem + (K > kStageK ? 0 : kChunk * K));
  for (int64_t e = lane; e < E; e += kWarp) cnt[e] = 0;
  const int64_t t1 = min(T, (c + 1) * kChunk);
  int64_t tb;
  const int64_t* ip = stage_routing(ip_global, c * kChunk, t1, K, rank_smem, tb);
  __syncwarp();
  for (int64_t t = c * kChunk; t < t1; ++t)
    for (int64_t kb = 0; kb < K; kb += kWarp) {
      const int64_t k = kb + lane;
      const int64_t e = k < K ? ip[(t - tb) * K + k] : -1;
      const bool valid = e >= 0 && e < E;
      const unsigned peers = __match_any_sync(kFull, valid ? e : -2 - lane);
      int32_t base = 0;
      if (valid) {
        base = cnt[e];
        lrank[t * K + k] = base + __popc(peers & lanemask_lt());
      }
      __syncwarp();
      if (valid && lane == __ffs(peers) - 1) cnt[e] = base + __popc(peers);
      __syncwarp();
    }
  for (int64_t e = lane; e < E; e += kWarp) ccount[c * E + e] = cnt[e];
}

__device__ __forceinline__ bool slot_kept(const Pack& a, const int64_t* own_kept, int64_t c,
                                          int64_t t, int64_t k, int64_t e) {
  return a.ebase[c * a.E + e] + a.lrank[t * a.K + k] < own_kept[e];
}

// Dedup, one warp per chunk: the token row and first slot row of every (t, d) with a kept slot
// within the chunk.
__global__ void dedup_index_kernel(Pack a, int32_t* tok_local, int32_t* slot_local,
                                   int32_t* ctok, int32_t* cslot) {
  extern __shared__ int64_t index_smem[];  // staged routing [kChunk * K] | tokc | slotc | stamp
  const int64_t R = a.R, K = a.K, E = a.E, L = a.L;
  int32_t* sh = reinterpret_cast<int32_t*>(index_smem + (K > kStageK ? 0 : kChunk * K));
  int32_t *tokc = sh, *slotc = sh + R, *stamp = sh + 2 * R;
  const int64_t* own_kept = a.plan + PlanOffsets(R, E).own_kept;
  const int lane = threadIdx.x;
  const int64_t c = blockIdx.x;
  for (int64_t d = lane; d < R; d += kWarp) { tokc[d] = 0; slotc[d] = 0; stamp[d] = -1; }
  const int64_t t1 = min(a.T, (c + 1) * kChunk);
  int64_t tb;
  const int64_t* ip = stage_routing(a.ip, c * kChunk, t1, K, index_smem, tb);
  __syncwarp();
  for (int64_t t = c * kChunk; t < t1; ++t)
    for (int64_t kb = 0; kb < K; kb += kWarp) {
      const int64_t k = kb + lane;
      const int64_t e = k < K ? ip[(t - tb) * K + k] : -1;
      const bool valid = e >= 0 && e < E;
      const int64_t d = valid ? e / L : -2 - lane;
      const bool kept = valid && slot_kept(a, own_kept, c, t, k, e);
      const unsigned peers = __match_any_sync(kFull, d);
      const int nk = __popc(__ballot_sync(kFull, kept) & peers);
      if (valid && lane == __ffs(peers) - 1) {
        // a token row opens at t's first kept slot on d (cpu/pack.cpp): n >= 1
        if (nk > 0 && stamp[d] != static_cast<int32_t>(t)) {
          tok_local[t * R + d] = tokc[d];
          slot_local[t * R + d] = slotc[d];
          ++tokc[d];
          stamp[d] = static_cast<int32_t>(t);
        }
        slotc[d] += nk;
      }
      __syncwarp();
    }
  for (int64_t d = lane; d < R; d += kWarp) {
    ctok[c * R + d] = tokc[d];
    cslot[c * R + d] = slotc[d];
  }
}

__device__ __forceinline__ int64_t row_of(const Pack& a, int64_t cap, int64_t d, int64_t i) {
  return cap >= 0 ? d * (1 + cap) + 1 + i : a.row_start[d] + i;
}

// pairs: one block per token; thread k places slot k (meta, send_map), then the block copies.
__global__ void pairs_kernel(Pack a) {
  extern __shared__ uint8_t* dst[];  // [K]
  __shared__ int nd;
  __shared__ unsigned long long bits;
  const int64_t t = blockIdx.x, K = a.K, E = a.E, L = a.L, P = a.P;
  if (a.plan[kErrCode] != 0) return;
  const int64_t* own_kept = a.plan + PlanOffsets(a.R, E).own_kept;
  const int64_t cap = a.plan[kStaticCap], hdr = cap >= 0 ? 1 : 0, c = t / kChunk;
  const uint8_t* src = a.xb + t * P;
  if (threadIdx.x == 0) {
    nd = 0;
    bits = reinterpret_cast<uint64_t>(src) | static_cast<uint64_t>(P);
  }
  __syncthreads();
  for (int64_t k = threadIdx.x; k < K; k += blockDim.x) {
    const int64_t e = a.ip[t * K + k];
    int64_t map = -1;
    if (e >= 0 && e < E && slot_kept(a, own_kept, c, t, k, e)) {
      const int64_t d = e / L;
      const int64_t i = a.start[e] - a.start[d * L] + a.ebase[c * E + e] + a.lrank[t * K + k];
      uint8_t* row = a.sb + a.chunk[d] + (hdr + i) * a.B;
      dput<int32_t>(row + P + kPairsMetaT, static_cast<int32_t>(t));
      dput<int32_t>(row + P + kPairsMetaK, static_cast<int32_t>(k));
      dput<int32_t>(row + P + kPairsMetaJ, static_cast<int32_t>(e % L));
      dput<float>(row + P + kPairsMetaW, a.wp[t * K + k]);
      map = row_of(a, cap, d, i);
      dst[atomicAdd(&nd, 1)] = row;
      atomicOr(&bits, reinterpret_cast<uint64_t>(row));
    }
    a.send_map[t * K + k] = map;
  }
  __syncthreads();
  copy_to_all(dst, nd, src, P, vec_width(bits), threadIdx.x, blockDim.x);
}

// dedup: one block per token; thread k places slot row k and, for the first k on its rank, the
// token row (meta, send_map); then the block copies the payload to every token row.
__global__ void dedup_kernel(Pack a) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int64_t t = blockIdx.x, K = a.K, E = a.E, L = a.L, R = a.R, P = a.P;
  uint8_t** dst = reinterpret_cast<uint8_t**>(smem);               // [K]
  int64_t* dk = reinterpret_cast<int64_t*>(smem + K * sizeof(void*));  // [K] rank or -1
  uint8_t* keptk = reinterpret_cast<uint8_t*>(dk + K);             // [K]
  __shared__ int nd;
  __shared__ unsigned long long bits;
  if (a.plan[kErrCode] != 0) return;
  const int64_t* own_kept = a.plan + PlanOffsets(R, E).own_kept;
  const int64_t cap = a.plan[kStaticCap], hdr = cap >= 0 ? 1 : 0, c = t / kChunk;
  const uint8_t* src = a.xb + t * P;
  if (threadIdx.x == 0) {
    nd = 0;
    bits = reinterpret_cast<uint64_t>(src) | static_cast<uint64_t>(P);
  }
  for (int64_t k = threadIdx.x; k < K; k += blockDim.x) {
    const int64_t e = a.ip[t * K + k];
    const bool valid = e >= 0 && e < E;
    dk[k] = valid ? e / L : -1;
    keptk[k] = valid && slot_kept(a, own_kept, c, t, k, e);
  }
  __syncthreads();
  for (int64_t k = threadIdx.x; k < K; k += blockDim.x) {
    const int64_t d = dk[k];
    if (d < 0) continue;
    bool first = keptk[k];  // t's first kept slot on d writes its token row (n >= 1)
    int32_t pos = 0, n = 0;
    for (int64_t k2 = 0; k2 < K; ++k2) {
      if (dk[k2] != d || !keptk[k2]) continue;
      n += 1;
      if (k2 < k) { pos += 1; first = false; }
    }
    if (keptk[k]) {
      const int64_t sa = a.slot_base[c * R + d] + a.slot_local[t * R + d] + pos;
      uint8_t* slot = a.sb + a.slot_sec[d] + sa * kSlotRowBytes;
      const int64_t e = a.ip[t * K + k];
      dput<int32_t>(slot, static_cast<int32_t>((k << 24) | (e % L)));
      dput<float>(slot + 4, a.wp[t * K + k]);
    }
    if (first) {
      const int64_t i = a.tok_base[c * R + d] + a.tok_local[t * R + d];
      uint8_t* row = a.sb + a.chunk[d] + (hdr + i) * a.B;
      dput<int32_t>(row + P + kDedupMetaT, static_cast<int32_t>(t));
      dput<int32_t>(row + P + kDedupMetaN, n);
      a.send_map[t * R + d] = row_of(a, cap, d, i);
      dst[atomicAdd(&nd, 1)] = row;
      atomicOr(&bits, reinterpret_cast<uint64_t>(row));
    }
  }
  __syncthreads();
  copy_to_all(dst, nd, src, P, vec_width(bits), threadIdx.x, blockDim.x);
}

// In-band counts of the static exchange and the zeros of every chunk's unused rows (padded,
// equal, static); the whole buffer is zeros under a plan that carries an error. grid (R, Y).
__global__ void fill_kernel(Pack a, int64_t SB, bool pairs) {
  const int64_t* p = a.plan;
  const PlanOffsets o(a.R, a.E);
  if (p[kErrCode] != 0) {
    const int64_t tid = (static_cast<int64_t>(blockIdx.x) * gridDim.y + blockIdx.y) * blockDim.x +
                        threadIdx.x;
    zero_range(a.sb, 0, SB, tid, static_cast<int64_t>(gridDim.x) * gridDim.y * blockDim.x);
    return;
  }
  const int64_t tokcap = p[kTokCap], cap = p[kStaticCap], hdr = cap >= 0 ? 1 : 0;
  if (tokcap < 0) return;  // ragged: chunks hold their rows and nothing else
  const int64_t d = blockIdx.x, B = a.B;
  const int64_t tid = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  const int64_t nt = static_cast<int64_t>(gridDim.y) * blockDim.x;
  const int64_t count = p[o.send_counts + d], c0 = a.chunk[d];
  if (hdr) {
    if (tid == 0) dput<int64_t>(a.sb + c0, count);
    zero_range(a.sb, c0 + 8, c0 + B, tid, nt);
  }
  zero_range(a.sb, c0 + (hdr + count) * B, c0 + tokcap * B, tid, nt);
  if (pairs) return;
  const int64_t nslots = p[o.send_slots + d];
  if (hdr && tid == 0) dput<int64_t>(a.sb + a.slot_sec[d] - kSlotRowBytes, nslots);
  zero_range(a.sb, a.slot_sec[d] + nslots * kSlotRowBytes, a.chunk[d + 1], tid, nt);
}

// scatter_rows: one block per token, its row read once and stored to every row it names.
__global__ void scatter_rows_kernel(const uint8_t* sp, const int64_t* mp, uint8_t* op, int64_t C,
                                    int64_t nbytes, int64_t S) {
  extern __shared__ uint8_t* sdst[];  // [C]
  __shared__ int nd;
  __shared__ unsigned long long bits;
  const int64_t t = blockIdx.x;
  const uint8_t* src = sp + t * nbytes;
  if (threadIdx.x == 0) {
    nd = 0;
    bits = reinterpret_cast<uint64_t>(src) | static_cast<uint64_t>(nbytes);
    for (int64_t c = 0; c < C; ++c) {
      const int64_t r = mp[t * C + c];
      if (r < 0 || r >= S) continue;
      sdst[nd++] = op + r * nbytes;
      bits |= reinterpret_cast<uint64_t>(op + r * nbytes);
    }
  }
  __syncthreads();
  copy_to_all(sdst, nd, src, nbytes, vec_width(bits), threadIdx.x, blockDim.x);
}

void set_smem(const void* kernel, size_t bytes) {
  if (bytes > 48 * 1024)
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(bytes)));
}

}  // namespace

namespace {

// The op into `send` (its SB bytes); returns send_map.
Tensor pack_into_send(const Tensor& x_in, const Tensor& topk_idx, const Tensor& topk_weights,
                      const Tensor& plan_in, int64_t transport, int64_t num_ranks,
                      const Tensor& send) {
  const at::Device dev = x_in.device();
  const int64_t SB = send.numel();
  const Tensor x = x_in.contiguous();
  const Tensor idx = topk_idx.to(at::kLong).contiguous();
  const Tensor wt = topk_weights.contiguous();
  const int64_t R = num_ranks;
  const int64_t E = experts_from_plan(plan_in.numel(), R), L = E / R;
  const int64_t T = idx.size(0), K = idx.size(1);
  const int64_t P = x.size(1) * x.element_size();
  const bool pairs = transport == kPairs;
  const int64_t B = P + (pairs ? kPairsMetaBytes : kDedupTokMeta);
  const Tensor plan = plan_on(plan_in, dev);
  const auto i64 = idx.options(), i32 = idx.options().dtype(at::kInt);

  Tensor send_map = at::full({T, pairs ? K : R}, -1, i64);
  Tensor offs = at::empty({3 * R + E + 3}, i64);
  int64_t* op = offs.data_ptr<int64_t>();
  Pack a{};
  a.plan = plan.data_ptr<int64_t>();
  a.ip = idx.data_ptr<int64_t>();
  a.wp = wt.data_ptr<float>();
  a.xb = static_cast<const uint8_t*>(x.data_ptr());
  a.sb = send.data_ptr<uint8_t>();
  a.send_map = send_map.data_ptr<int64_t>();
  a.T = T; a.K = K; a.E = E; a.R = R; a.L = L; a.P = P; a.B = B;
  a.chunk = op; a.row_start = op + R + 1; a.slot_sec = op + 2 * R + 2; a.start = op + 3 * R + 2;
  setup_kernel<<<1, 512, 0, stream()>>>(a.plan, R, E, B, pairs, op, op + R + 1, op + 2 * R + 2,
                                        op + 3 * R + 2);
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  const int64_t chunks = ceil_div(T, kChunk);
  Tensor lrank = at::empty({T * K}, i32), ebase = at::empty({chunks * E}, i32);
  a.lrank = lrank.data_ptr<int32_t>();
  a.ebase = ebase.data_ptr<int32_t>();
  if (T > 0 && K > 0) {
    const size_t smem = stage_bytes(K) + E * sizeof(int32_t);
    set_smem(reinterpret_cast<const void*>(&rank_kernel), smem);
    rank_kernel<<<chunks, kWarp, smem, stream()>>>(a.ip, T, K, E, lrank.data_ptr<int32_t>(),
                                                   ebase.data_ptr<int32_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    scan_columns(ebase.data_ptr<int32_t>(), chunks, E);
  }
  Tensor tok_local, slot_local, tok_base, slot_base;
  if (!pairs && T > 0 && K > 0) {
    tok_local = at::full({T * R}, -1, i32);
    slot_local = at::empty({T * R}, i32);
    tok_base = at::empty({chunks * R}, i32);
    slot_base = at::empty({chunks * R}, i32);
    a.tok_local = tok_local.data_ptr<int32_t>();
    a.slot_local = slot_local.data_ptr<int32_t>();
    a.tok_base = tok_base.data_ptr<int32_t>();
    a.slot_base = slot_base.data_ptr<int32_t>();
    const size_t smem = stage_bytes(K) + 3 * R * sizeof(int32_t);
    set_smem(reinterpret_cast<const void*>(&dedup_index_kernel), smem);
    dedup_index_kernel<<<chunks, kWarp, smem, stream()>>>(
        a, tok_local.data_ptr<int32_t>(), slot_local.data_ptr<int32_t>(),
        tok_base.data_ptr<int32_t>(), slot_base.data_ptr<int32_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    scan_columns(tok_base.data_ptr<int32_t>(), chunks, R);
    scan_columns(slot_base.data_ptr<int32_t>(), chunks, R);
  }
  if (T > 0 && K > 0) {
    if (pairs) {
      const size_t smem = K * sizeof(void*);
      set_smem(reinterpret_cast<const void*>(&pairs_kernel), smem);
      pairs_kernel<<<T, kThreads, smem, stream()>>>(a);
    } else {
      const size_t smem = K * (sizeof(void*) + sizeof(int64_t) + 1);
      set_smem(reinterpret_cast<const void*>(&dedup_kernel), smem);
      dedup_kernel<<<T, kThreads, smem, stream()>>>(a);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (SB > 0 && R > 0) {
    fill_kernel<<<dim3(R, 8), 256, 0, stream()>>>(a, SB, pairs);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return send_map;
}

}  // namespace

std::tuple<Tensor, Tensor> pack_cuda(const Tensor& x_in, const Tensor& topk_idx,
                                     const Tensor& topk_weights, const Tensor& plan_in,
                                     int64_t transport, int64_t num_ranks, c10::SymInt send_bytes) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  const int64_t SB = send_bytes.expect_int();
  check_pack_args(x_in, topk_idx, topk_weights, plan_in, transport, SB);  // the plan on dev
  check_num_ranks("epkit.pack", num_ranks);
  Tensor send = at::empty({SB}, x_in.options().dtype(at::kByte));
  Tensor send_map = pack_into_send(x_in, topk_idx, topk_weights, plan_in, transport, num_ranks,
                                   send);
  return {send, send_map};
}

Tensor pack_into_cuda(const Tensor& x_in, const Tensor& topk_idx, const Tensor& topk_weights,
                      const Tensor& plan_in, int64_t transport, int64_t num_ranks,
                      const Tensor& send) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  constexpr const char* op = "epkit.pack_into";
  check_send_buffer(op, send, x_in.device());
  check_pack_args(x_in, topk_idx, topk_weights, plan_in, transport, send.numel(), op);
  check_num_ranks(op, num_ranks);
  return pack_into_send(x_in, topk_idx, topk_weights, plan_in, transport, num_ranks, send);
}

namespace {

// Into `out` [S, H], zeroed first: rows no slot names stay zero.
void scatter_rows_into_out(const Tensor& src_in, const Tensor& send_map_in, const Tensor& out) {
  const Tensor src = src_in.contiguous(), send_map = send_map_in.contiguous();
  const int64_t T = src.size(0), C = send_map.size(1), S = out.size(0);
  const int64_t nbytes = src.size(1) * src.element_size();
  out.zero_();
  if (T > 0 && C > 0 && nbytes > 0) {
    const size_t smem = C * sizeof(void*);
    set_smem(reinterpret_cast<const void*>(&scatter_rows_kernel), smem);
    scatter_rows_kernel<<<T, kThreads, smem, stream()>>>(
        static_cast<const uint8_t*>(src.data_ptr()), send_map.data_ptr<int64_t>(),
        static_cast<uint8_t*>(out.data_ptr()), C, nbytes, S);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace

Tensor scatter_rows_cuda(const Tensor& src, const Tensor& send_map, c10::SymInt send_rows) {
  const c10::cuda::CUDAGuard guard(src.device());
  const int64_t S = send_rows.expect_int();
  check_scatter_rows_args(src, send_map, S);
  Tensor out = at::empty({S, src.size(1)}, src.options());
  scatter_rows_into_out(src, send_map, out);
  return out;
}

void scatter_rows_into_cuda(const Tensor& src, const Tensor& send_map, const Tensor& out) {
  const c10::cuda::CUDAGuard guard(src.device());
  check_scatter_rows_into_args(src, send_map, out);
  scatter_rows_into_out(src, send_map, out);
}

// The device's caching allocator reuses memory already: a plain empty on like's device.
Tensor empty_large_cuda(const Tensor& like, c10::SymIntArrayRef size, at::ScalarType dtype) {
  return at::empty(C10_AS_INTARRAYREF_SLOW(size), like.options().dtype(dtype));
}

}  // namespace cuda
}  // namespace epkit
