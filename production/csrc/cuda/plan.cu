// Layout, local validation (the count words) and the plan, on the device.
//
// The plan is computed where the gathered words are, so a rank never needs a count on the host
// to build it: the eager dispatch copies it once to pinned host memory (its one host wait); the
// static exchange never does. Integer arithmetic only: the plan equals plan_cpu's word for word.
#include "common.cuh"

#include <limits>

namespace epkit {
namespace cuda {

namespace {

// reference/errors.py codes (as in cpu/layout.cpp, cpu/plan.cpp)
using reason::kDuplicateExpert, reason::kHiddenNotMult32, reason::kIndexOutOfRange,
    reason::kNonfinitePayload, reason::kNonfiniteWeight, reason::kStaticOverflow;
using reason::kDtypeMismatch, reason::kHiddenMismatch, reason::kTopkMismatch;
constexpr unsigned long long kNone = std::numeric_limits<unsigned long long>::max();

// flags: [first flat index out of range, first token with a duplicate, first token with a
// non-finite weight, first token with a non-finite payload value]; kNone where none.
__device__ __forceinline__ void first(unsigned long long* flag, int64_t i) {
  atomicMin(flag, static_cast<unsigned long long>(i));
}

// One thread per token: used-slot counts per expert and per rank (atomics: integer sums, so the
// result does not depend on the order), is_token_in_rank, and the value checks of prepare.
__global__ void count_kernel(const int64_t* ip, const float* wp, int64_t T, int64_t K, int64_t E,
                             int64_t R, int64_t* tpe, int64_t* tpr, int64_t* spr, bool* in_rank,
                             unsigned long long* flags, bool below_is_error) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= T) return;
  const int64_t L = E / R;
  const int64_t* row = ip + t * K;
  bool dup = false, nonfinite = false;
  for (int64_t k = 0; k < K; ++k) {
    const int64_t e = row[k];
    if (e < -1 || e >= E) {  // prepare: both sides are errors; layout: only e >= E
      if (flags && (e >= E || below_is_error)) first(&flags[0], t * K + k);
      continue;
    }
    if (e < 0) continue;
    bool seen_rank = false;
    for (int64_t k2 = 0; k2 < k; ++k2) {
      const int64_t e2 = row[k2];
      if (e2 == e) dup = true;
      if (e2 >= 0 && e2 < E && e2 / L == e / L) seen_rank = true;
    }
    const int64_t d = e / L;
    atomicAdd(reinterpret_cast<unsigned long long*>(&tpe[e]), 1ull);
    if (spr) atomicAdd(reinterpret_cast<unsigned long long*>(&spr[d]), 1ull);
    if (!seen_rank) {
      atomicAdd(reinterpret_cast<unsigned long long*>(&tpr[d]), 1ull);
      if (in_rank) in_rank[t * R + d] = true;
    }
  }
  if (wp)
    for (int64_t k = 0; k < K; ++k)
      if (!isfinite(wp[t * K + k])) nonfinite = true;
  if (flags && dup) first(&flags[1], t);
  if (flags && nonfinite) first(&flags[2], t);
}

template <typename X>
__global__ void nonfinite_kernel(const X* xp, int64_t n, int64_t H, unsigned long long* flags) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    if (!isfinite(widen(xp[i]))) first(&flags[3], i / H);
}

// The header words, and the error in cpu/layout.cpp's order; counts are zeroed on an error.
__global__ void finalize_kernel(int64_t* w, const int64_t* ip, const unsigned long long* flags,
                                int64_t E, int64_t R, int64_t T, int64_t H, int64_t K,
                                int64_t pre_code, int64_t pre_a, int64_t pre_b, int64_t dtype_code,
                                int64_t payload, bool hidden_bad, int64_t max_tokens) {
  __shared__ int64_t err[3];
  if (threadIdx.x == 0) {
    int64_t code = pre_code, a = pre_a, b = pre_b;
    if (code == 0) {
      if (flags[0] != kNone) {
        code = kIndexOutOfRange; a = ip[flags[0]]; b = E;
      } else if (flags[1] != kNone) {
        const int64_t t = static_cast<int64_t>(flags[1]);
        int64_t dup = -1;
        for (int64_t k = 0; k < K; ++k) {
          const int64_t e = ip[t * K + k];
          if (e < 0) continue;
          for (int64_t k2 = 0; k2 < k; ++k2)
            if (ip[t * K + k2] == e && (dup < 0 || e < dup)) dup = e;
        }
        code = kDuplicateExpert; a = t; b = dup;
      } else if (flags[2] != kNone) {
        code = kNonfiniteWeight; a = static_cast<int64_t>(flags[2]); b = 0;
      } else if (payload && hidden_bad) {
        code = kHiddenNotMult32; a = H; b = payload;
      } else if (payload && flags[3] != kNone) {
        code = kNonfinitePayload; a = static_cast<int64_t>(flags[3]); b = payload;
      } else if (max_tokens >= 0 && T > max_tokens) {
        code = kStaticOverflow; a = T; b = max_tokens;
      }
      w[kWordTokens] = T; w[kWordHidden] = H; w[kWordTopK] = K;
    }
    err[0] = code; err[1] = a; err[2] = b;
    w[kWordErrorCode] = code; w[kWordErrorA] = a; w[kWordErrorB] = b;
    w[kWordXDtype] = dtype_code;
    w[kWordPayload] = payload;
  }
  __syncthreads();
  if (err[0] != 0)
    for (int64_t i = threadIdx.x; i < E + R; i += blockDim.x) w[kWordHeader + i] = 0;
}

// The plan (cpu/plan.cpp, step by step) in one block. kept: scratch [R * E].
__global__ void plan_kernel(const int64_t* g, int64_t R, int64_t E, int64_t rank, int64_t align,
                            int64_t capacity, int64_t transport, int64_t exchange,
                            int64_t max_tokens, int64_t* p, int64_t* kept) {
  const int64_t L = E / R, W = kWordHeader + E + R;
  const PlanOffsets o(R, E);
  const int tid = threadIdx.x, nt = blockDim.x;
  auto row = [&](int64_t s) { return g + s * W; };
  auto cnt = [&](int64_t s, int64_t e) { return row(s)[kWordHeader + e]; };
  auto tpr = [&](int64_t s, int64_t d) { return row(s)[kWordHeader + E + d]; };
  __shared__ int failed;
  __shared__ long long maxrows, maxslots, S, N;
  __shared__ int uniform, dropped_any;
  __shared__ unsigned long long first_unlike;  // lowest s * R + d whose count differs from (0, 0)
  __shared__ int64_t rows00, slots00;

  // 1. The error.
  if (tid == 0) {
    p[kRanks] = R; p[kLocalExperts] = L; p[kExperts] = E; p[kTransport] = transport;
    p[kCapacity] = capacity; p[kAlign] = align; p[kStaticCap] = -1;
    int64_t fs = -1, code = 0, a = 0, b = 0;
    for (int64_t s = 0; s < R && fs < 0; ++s)
      if (row(s)[kWordErrorCode] != 0) {
        fs = s; code = row(s)[kWordErrorCode]; a = row(s)[kWordErrorA]; b = row(s)[kWordErrorB];
      }
    const int64_t* r0 = row(0);
    for (int64_t s = 1; s < R && fs < 0; ++s) {
      const int64_t* r = row(s);
      const int64_t H = kWordHidden, X = kWordXDtype, K = kWordTopK;
      if (r[H] != r0[H]) { fs = s; code = kHiddenMismatch; a = r[H]; b = r0[H]; }
      else if (r[X] != r0[X]) { fs = s; code = kDtypeMismatch; a = r[X]; b = r0[X]; }
      else if (r[K] != r0[K]) { fs = s; code = kTopkMismatch; a = r[K]; b = r0[K]; }
    }
    if (fs >= 0) { p[kErrCode] = code; p[kErrA] = a; p[kErrB] = b; p[kErrRank] = fs; }
    else p[kTopK] = r0[kWordTopK];
    failed = fs >= 0;
    maxrows = 0; maxslots = 0; S = 0; N = 0; uniform = 1; dropped_any = 0; first_unlike = kNone;
  }
  __syncthreads();
  if (failed) return;

  // 2. Kept slots per (source, expert): each expert's prefix over sources.
  for (int64_t e = tid; e < E; e += nt) {
    int64_t prefix = 0;
    for (int64_t s = 0; s < R; ++s) {
      const int64_t c = cnt(s, e);
      const int64_t k = capacity < 0 ? c : min(max(capacity - prefix, int64_t(0)), c);
      kept[s * E + e] = k;
      if (k != c) atomicOr(&dropped_any, 1);  // cpu/plan.cpp's kDroppedAny
      prefix += c;
    }
  }
  __syncthreads();
  if (tid == 0) p[kDroppedAny] = dropped_any;
  auto slots = [&](int64_t s, int64_t d) {
    int64_t n = 0;
    for (int64_t j = 0; j < L; ++j) n += kept[s * E + d * L + j];
    return n;
  };
  auto rows = [&](int64_t s, int64_t d) { return transport == kDedup ? tpr(s, d) : slots(s, d); };
  if (tid == 0) { rows00 = rows(0, 0); slots00 = slots(0, 0); }
  __syncthreads();

  // 3. Rows (and dedup slot rows) from s to d, every pair.
  for (int64_t i = tid; i < R * R; i += nt) {
    const int64_t s = i / R, d = i % R;
    const int64_t n = rows(s, d), sl = slots(s, d);
    if (!((n == rows00) && (transport == kPairs || sl == slots00))) {
      atomicAnd(&uniform, 0);
      atomicMin(&first_unlike, static_cast<unsigned long long>(i));
    }
    atomicMax(&maxrows, static_cast<long long>(n));
    atomicMax(&maxslots, static_cast<long long>(sl));
    if (s == rank) {
      p[o.send_counts + d] = n; p[o.send_slots + d] = sl;
      atomicAdd(reinterpret_cast<unsigned long long*>(&S), static_cast<unsigned long long>(n));
    }
    if (d == rank) {
      p[o.recv_counts + s] = n; p[o.recv_slots + s] = sl;
      atomicAdd(reinterpret_cast<unsigned long long*>(&N), static_cast<unsigned long long>(n));
    }
  }

  // 4. This rank's experts (padded sizes parked in offsets, prefixed below) and own kept.
  for (int64_t j = tid; j < L; j += nt)
    p[o.offsets + j] = plan_expert(p, o, g, W, kept, R, E, L, rank, j, align);
  for (int64_t e = tid; e < E; e += nt) p[o.own_kept + e] = kept[rank * E + e];
  __syncthreads();
  if (tid != 0) return;

  int64_t M = 0;
  for (int64_t j = 0; j < L; ++j) {
    const int64_t padded = p[o.offsets + j];
    p[o.offsets + j] = M;
    M += padded;
  }
  p[o.offsets + L] = M;
  p[kSendRows] = S; p[kRecvRows] = N; p[kExpertRows] = M;
  p[kUniform] = uniform; p[kMaxChunk] = maxrows;
  p[kNonUniformRank] = first_unlike == kNone ? -1 : static_cast<int64_t>(first_unlike) / R;

  plan_exchange(p, o, R, L, row(0), transport, exchange, max_tokens, align, uniform, maxrows,
                maxslots);
}

constexpr int kThreads = 256;

}  // namespace

std::tuple<Tensor, Tensor, Tensor, Tensor> layout_cuda(const Tensor& topk_idx, int64_t E,
                                                      int64_t R) {
  check_layout_args(topk_idx, E, R);
  const c10::cuda::CUDAGuard guard(topk_idx.device());
  const Tensor idx = topk_idx.to(at::kLong).contiguous();
  const int64_t T = idx.size(0), K = idx.size(1);
  const auto opts = idx.options();
  Tensor tpe = at::zeros({E}, opts), tpr = at::zeros({R}, opts), spr = at::zeros({R}, opts);
  Tensor in_rank = at::zeros({T, R}, opts.dtype(at::kBool));
  Tensor flags = at::full({4}, -1, opts);  // all bits set: kNone
  if (T > 0) {
    count_kernel<<<ceil_div(T, kThreads), kThreads, 0, stream()>>>(
        idx.data_ptr<int64_t>(), nullptr, T, K, E, R, tpe.data_ptr<int64_t>(),
        tpr.data_ptr<int64_t>(), spr.data_ptr<int64_t>(), in_rank.data_ptr<bool>(),
        reinterpret_cast<unsigned long long*>(flags.data_ptr<int64_t>()), false);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    // The one host read of the standalone layout op: its range check (cpu/layout.cpp raises).
    const int64_t bad = flags[0].item<int64_t>();
    if (bad != -1) {
      const int64_t e = idx.view(-1)[bad].item<int64_t>();
      TORCH_CHECK(false, "epkit.layout: expert index ", e, " outside [-1, ", E, ")");
    }
  }
  return {tpe, tpr, spr, in_rank};
}

Tensor prepare_cuda(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_weights, int64_t E,
                    int64_t R, at::IntArrayRef pre_error, int64_t payload) {
  check_prepare_args(x, topk_idx, topk_weights, E, R, pre_error, payload);
  const c10::cuda::CUDAGuard guard(topk_idx.device());
  const auto opts = at::TensorOptions().dtype(at::kLong).device(topk_idx.device());
  Tensor words = at::zeros({kWordHeader + E + R}, opts);
  int64_t* w = words.data_ptr<int64_t>();
  const int64_t dtype_code =
      int64_t(pre_error.size()) > kPreErrorXDtype ? pre_error[kPreErrorXDtype] : 0;
  if (pre_error[kPreErrorCode] != 0) {  // shapes or dtypes may be anything: read no tensor
    finalize_kernel<<<1, kThreads, 0, stream()>>>(w, nullptr, nullptr, E, R, 0, 0, 0,
                                                  pre_error[kPreErrorCode],
                                                  pre_error[kPreErrorA], pre_error[kPreErrorB],
                                                  dtype_code, payload, false, -1);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return words;
  }
  const Tensor idx = topk_idx.to(at::kLong).contiguous();
  const Tensor wt = topk_weights.contiguous();
  const int64_t T = idx.size(0), K = idx.size(1), H = x.size(1);
  Tensor flags = at::full({4}, -1, opts);
  auto* fp = reinterpret_cast<unsigned long long*>(flags.data_ptr<int64_t>());
  if (T > 0) {
    count_kernel<<<ceil_div(T, kThreads), kThreads, 0, stream()>>>(
        idx.data_ptr<int64_t>(), wt.data_ptr<float>(), T, K, E, R, w + kWordHeader,
        w + kWordHeader + E, nullptr, nullptr, fp, true);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const int64_t block = payload_block(payload);  // 0: not quantized (no payload checks)
  const bool hidden_bad = block != 0 && H % block != 0;
  if (payload != 0 && !hidden_bad && T * H > 0) {
    const Tensor xc = x.contiguous();
    const int64_t n = T * H;
    const int64_t blocks = std::min<int64_t>(ceil_div(n, kThreads), 4096);
    dispatch_float(xc.scalar_type(), "epkit.prepare", [&](auto tag) {
      using X = decltype(tag);
      nonfinite_kernel<X><<<blocks, kThreads, 0, stream()>>>(
          reinterpret_cast<const X*>(xc.data_ptr()), n, H, fp);
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const int64_t max_tokens =
      int64_t(pre_error.size()) > kPreErrorMaxTokens ? pre_error[kPreErrorMaxTokens] : -1;
  finalize_kernel<<<1, kThreads, 0, stream()>>>(w, idx.data_ptr<int64_t>(), fp, E, R, T, H, K, 0,
                                                0, 0, dtype_code, payload, hidden_bad, max_tokens);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return words;
}

Tensor plan_cuda(const Tensor& words_in, int64_t rank, int64_t E, int64_t align, int64_t capacity,
                 int64_t transport, int64_t exchange, int64_t max_tokens) {
  // The option values (align, capacity, max_tokens) are checked by the CPU kernel only once no
  // rank's words carry an error, which on CUDA is known on the device only: the callers check
  // them first (api.py), as they do for every mode.
  check_plan_args(words_in, rank, E, transport, exchange);
  const c10::cuda::CUDAGuard guard(words_in.device());
  const Tensor words = words_in.contiguous();
  const int64_t R = words.size(0);
  const PlanOffsets o(R, E);
  Tensor plan = at::zeros({o.size}, words.options());
  Tensor kept = at::empty({R * E}, words.options());
  plan_kernel<<<1, 512, 0, stream()>>>(words.data_ptr<int64_t>(), R, E, rank, align, capacity,
                                       transport, exchange, max_tokens, plan.data_ptr<int64_t>(),
                                       kept.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return plan;
}

}  // namespace cuda
}  // namespace epkit
