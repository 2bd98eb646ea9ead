// Combine on the device (cpu/combine.cpp is the specification, bit for bit).
//
// out[t] = sum over d ascending of P_d(t), P_d(t) = sum over k ascending of c_k * y(t, k): every
// product __fmul_rn, every sum __fadd_rn, both from +0.0f, in exactly the CPU kernel's order per
// element; threads split the hidden dimension only, never a sum.
#include "vec.cuh"

#include <algorithm>

namespace epkit {
namespace cuda {

namespace {

constexpr int kThreads = 128;

// pairs, expert side: row n of the returned rows is expert_y[recv_map[n]] as bytes, or zeros
// (static-exchange header and gap rows).
__global__ void gather_pairs_kernel(const uint8_t* yp, const int64_t* mp, uint8_t* op,
                                    int64_t nbytes, int64_t M) {
  __shared__ uint8_t* dst[1];
  const int64_t n = blockIdx.x, m = mp[n];
  uint8_t* out = op + n * nbytes;
  if (m < 0 || m >= M) { zero_range(out, 0, nbytes, threadIdx.x, blockDim.x); return; }
  const uint8_t* src = yp + m * nbytes;
  if (threadIdx.x == 0) dst[0] = out;
  __syncthreads();
  const uint64_t bits = reinterpret_cast<uint64_t>(src) | reinterpret_cast<uint64_t>(out) |
                        static_cast<uint64_t>(nbytes);
  copy_to_all(dst, 1, src, nbytes, vec_width(bits), threadIdx.x, blockDim.x);
}

// A float32 partial's element at a unit boundary (dedup's compact way back): 4-byte aligned only
// when the unit's bytes are, so the element-wise path moves it as bytes.
__device__ __forceinline__ float load_f32(const uint8_t* p) {
  float v;
  memcpy(&v, p, sizeof(float));
  return v;
}
__device__ __forceinline__ void store_f32(uint8_t* p, float v) { memcpy(p, &v, sizeof(float)); }

// dedup, expert side, per received row with n kept slots (cpu/combine.cpp): its u = min(n, per)
// units of H elements of T at unit fp[n] of ob (fp null: at n * per, the rest of its 4H bytes
// zero): the n rows of y as bytes (c order) when n <= per = 4 / sizeof(T), else one float32
// partial, its slots in c order.
template <typename T, int V>
__global__ void gather_dedup_kernel(const T* yp, const int64_t* mp, const float* wp, uint8_t* ob,
                                    const int64_t* fp, int64_t C, int64_t H, int64_t M,
                                    int64_t U, bool weighted) {
  const int64_t n = blockIdx.x;
  constexpr int64_t per = 4 / static_cast<int64_t>(sizeof(T));
  const int64_t rb = H * static_cast<int64_t>(sizeof(T));
  int64_t kept = 0;
  for (int64_t c = 0; c < C; ++c) kept += mp[n * C + c] >= 0 && mp[n * C + c] < M;
  if (fp != nullptr && kept == 0) return;  // no units
  const int64_t u = kept < per ? kept : per;
  if (fp != nullptr && (fp[n] < 0 || fp[n] + u > U)) return;  // bounded: never outside out
  uint8_t* raw = ob + (fp != nullptr ? fp[n] : n * per) * rb;
  if (kept <= per) {  // the rows themselves: the source multiplies
    int64_t i = 0;
    for (int64_t c = 0; c < C; ++c) {
      const int64_t m = mp[n * C + c];
      if (m < 0 || m >= M) continue;
      const uint8_t* src = reinterpret_cast<const uint8_t*>(yp + m * H);
      for (int64_t b = threadIdx.x; b < rb; b += blockDim.x) raw[i * rb + b] = src[b];
      ++i;
    }
    if (fp == nullptr) zero_range(raw, i * rb, per * rb, threadIdx.x, blockDim.x);
    return;
  }
  const int64_t step = static_cast<int64_t>(blockDim.x) * V;
  for (int64_t h = static_cast<int64_t>(threadIdx.x) * V; h < H; h += step) {
    float acc[V];
#pragma unroll
    for (int i = 0; i < V; ++i) acc[i] = 0.0f;
    for (int64_t c = 0; c < C; ++c) {
      const int64_t m = mp[n * C + c];
      if (m < 0 || m >= M) continue;  // bounded like every map read (issue 12)
      float y[V];
      load_widen<T, V>(yp + m * H + h, y);
      if (weighted) {
        const float w = wp[m];
#pragma unroll
        for (int i = 0; i < V; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(w, y[i]));
      } else {
#pragma unroll
        for (int i = 0; i < V; ++i) acc[i] = __fadd_rn(acc[i], y[i]);
      }
    }
    if constexpr (V == 1) store_f32(raw + h * sizeof(float), acc[0]);
    else narrow_store<float, V>(reinterpret_cast<float*>(raw) + h, acc);
  }
}

// Source side, one block per token: its slots with a row in (destination rank, k) order, a
// partial per rank (pairs: from each slot's row; dedup: the token row's n raw rows when
// n <= per, else its float32 partial's bits), the partials added over d ascending. dedup: back
// rows of BW = per * H elements of Bt, ip the kept routing. G = ranks_per_node > 1: the partials
// of a node's ranks are added into its node partial first, the node partials over nodes
// ascending (cpu/combine.cpp; G = 1 is the plain sum over d, bit for bit). dedup: token row r's
// units start at unit fp[r] of back (fp null: at r * per); U units in all.
template <typename O, typename Bt, int V>
__global__ void reduce_kernel(const Bt* bp, const int64_t* mp, const int64_t* ip, const float* wp,
                              const int64_t* fp, O* op, int64_t C, int64_t K, int64_t H,
                              int64_t L, int64_t S, int64_t U, int64_t E, bool dedup,
                              bool weighted, int64_t G) {
  extern __shared__ int64_t sh[];  // ord [K] | rank [K]
  __shared__ int64_t nslots;
  constexpr int64_t per = 4 / static_cast<int64_t>(sizeof(Bt));
  const int64_t t = blockIdx.x;
  int64_t* ord = sh;
  int64_t* rk = sh + K;
  if (threadIdx.x == 0) {
    // A stable insertion sort of the ks by destination rank.
    int64_t n = 0;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = ip[t * K + k];
      if (e < 0 || e >= E) continue;
      const int64_t r = mp[t * C + (dedup ? e / L : k)];
      if (r < 0 || r >= S) continue;  // rows of back: [0, S)
      const int64_t d = e / L;
      int64_t at = n++;
      while (at > 0 && rk[at - 1] > d) { ord[at] = ord[at - 1]; rk[at] = rk[at - 1]; --at; }
      ord[at] = k;
      rk[at] = d;
    }
    nslots = n;
  }
  __syncthreads();
  const int64_t step = static_cast<int64_t>(blockDim.x) * V;
  for (int64_t h = static_cast<int64_t>(threadIdx.x) * V; h < H; h += step) {
    float total[V], node[V];
#pragma unroll
    for (int i = 0; i < V; ++i) total[i] = node[i] = 0.0f;
    int64_t open_node = -1;  // G > 1: the node whose partial `node` holds
    for (int64_t s = 0; s < nslots;) {  // one destination rank d at a time
      const int64_t d = rk[s];
      int64_t cnt = 0;
      while (s + cnt < nslots && rk[s + cnt] == d) ++cnt;
      float part[V];
#pragma unroll
      for (int i = 0; i < V; ++i) part[i] = 0.0f;
      const int64_t r0 = dedup ? mp[t * C + d] : 0;
      const int64_t at0 = !dedup ? 0 : fp != nullptr ? fp[r0] : r0 * per;  // its first unit
      if (dedup && (at0 < 0 || at0 + (cnt < per ? cnt : per) > U)) {
        // units outside back (a bad first): this rank's partial stays 0 (the CPU kernel raises)
      } else if (dedup && cnt > per) {  // the float32 partial P_d(t), formed on the expert side
        if constexpr (V == 1)
          part[0] = load_f32(reinterpret_cast<const uint8_t*>(bp + at0 * H) + h * sizeof(float));
        else
          load_widen<float, V>(reinterpret_cast<const float*>(bp + at0 * H) + h, part);
      } else {
        for (int64_t q = 0; q < cnt; ++q) {
          const int64_t k = ord[s + q];
          const Bt* row = dedup ? bp + (at0 + q) * H : bp + mp[t * K + k] * H;
          float b[V];
          load_widen<Bt, V>(row + h, b);
          if (weighted) {
            const float w = wp[t * K + k];
#pragma unroll
            for (int i = 0; i < V; ++i) part[i] = __fadd_rn(part[i], __fmul_rn(w, b[i]));
          } else {
#pragma unroll
            for (int i = 0; i < V; ++i) part[i] = __fadd_rn(part[i], b[i]);
          }
        }
      }
      if (G == 1) {
#pragma unroll
        for (int i = 0; i < V; ++i) total[i] = __fadd_rn(total[i], part[i]);
      } else {  // N_n = +0.0 + P_d + ..., added to the total when the next node opens
        if (d / G != open_node) {
          if (open_node >= 0) {
#pragma unroll
            for (int i = 0; i < V; ++i) total[i] = __fadd_rn(total[i], node[i]);
          }
#pragma unroll
          for (int i = 0; i < V; ++i) node[i] = 0.0f;
          open_node = d / G;
        }
#pragma unroll
        for (int i = 0; i < V; ++i) node[i] = __fadd_rn(node[i], part[i]);
      }
      s += cnt;
    }
    if (open_node >= 0) {
#pragma unroll
      for (int i = 0; i < V; ++i) total[i] = __fadd_rn(total[i], node[i]);
    }
    narrow_store<O, V>(op + t * H + h, total);
  }
}

}  // namespace

namespace {

// The expert side's pass into `out` (cpu/combine.cpp's gather_into): pairs, row n at n; dedup,
// token row n's units at unit first[n] (undefined first: at n * per, the 4H-byte form).
void gather_into(const Tensor& y, const Tensor& recv_map, const Tensor& w, int64_t transport,
                 bool weighted, const Tensor& first, const Tensor& out) {
  const int64_t N = recv_map.size(0), C = recv_map.size(1), H = y.size(1), M = y.size(0);
  if (transport == kPairs) {
    const int64_t nbytes = H * y.element_size();
    if (N > 0 && nbytes > 0) {
      gather_pairs_kernel<<<N, kThreads, 0, stream()>>>(
          static_cast<const uint8_t*>(y.data_ptr()), recv_map.data_ptr<int64_t>(),
          static_cast<uint8_t*>(out.data_ptr()), nbytes, M);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    return;
  }
  const bool compact = first.defined();
  if (N == 0 || H == 0) return;
  dispatch_float(y.scalar_type(), "epkit.gather_rows", [&](auto tag) {
    using T = decltype(tag);
    // every unit (and so every float32 partial) starts 16-byte aligned where the rows do
    const bool al = aligned16(y.data_ptr(), H * sizeof(T)) &&
                    aligned16(out.data_ptr(), compact ? H * sizeof(T) : H * 4);
    const int V = vec_elems(H, 4, al);
    const float* wp = weighted ? w.data_ptr<float>() : nullptr;
    const int64_t U = compact ? out.size(0) : N * (4 / static_cast<int64_t>(sizeof(T)));
    auto launch = [&](auto kernel) {
      kernel<<<N, kThreads, 0, stream()>>>(
          reinterpret_cast<const T*>(y.data_ptr()), recv_map.data_ptr<int64_t>(), wp,
          static_cast<uint8_t*>(out.data_ptr()), compact ? first.data_ptr<int64_t>() : nullptr,
          C, H, M, U, weighted);
    };
    if (V == 4) launch(gather_dedup_kernel<T, 4>);
    else launch(gather_dedup_kernel<T, 1>);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace

Tensor gather_rows_cuda(const Tensor& y_in, const Tensor& recv_map_in, const Tensor& row_weight_in,
                        int64_t transport, bool weighted) {
  check_gather_rows_args(y_in, recv_map_in, row_weight_in, transport, weighted);
  const c10::cuda::CUDAGuard guard(y_in.device());
  const Tensor y = y_in.contiguous(), recv_map = recv_map_in.contiguous();
  const Tensor w = weighted ? row_weight_in.contiguous() : row_weight_in;
  Tensor out = at::empty({recv_map.size(0), y.size(1)},
                         transport == kPairs ? y.options() : y.options().dtype(at::kFloat));
  gather_into(y, recv_map, w, transport, weighted, Tensor(), out);
  return out;
}

void gather_units_cuda(const Tensor& y_in, const Tensor& recv_map_in, const Tensor& row_weight_in,
                       int64_t transport, bool weighted, const std::optional<Tensor>& first,
                       const Tensor& out) {
  check_gather_units_args(y_in, recv_map_in, row_weight_in, transport, weighted, first, out);
  const c10::cuda::CUDAGuard guard(y_in.device());
  const Tensor y = y_in.contiguous(), recv_map = recv_map_in.contiguous();
  const Tensor w = weighted ? row_weight_in.contiguous() : row_weight_in;
  // the kernel writes only the units; the gaps (fixed chunks' padding) are zero, as on the CPU
  if (transport != kPairs) out.zero_();
  gather_into(y, recv_map, w, transport, weighted,
              first.has_value() ? first->contiguous() : Tensor(), out);
}

Tensor reduce_tokens_cuda(const Tensor& back_in, const Tensor& send_map_in, const Tensor& topk_idx,
                          const Tensor& topk_weights, int64_t E, int64_t R, int64_t transport,
                          bool weighted, at::ScalarType out_dtype, int64_t G,
                          const std::optional<Tensor>& first_in) {
  check_reduce_tokens_args(back_in, send_map_in, topk_idx, topk_weights, E, R, transport, weighted,
                           out_dtype, G, first_in);
  const c10::cuda::CUDAGuard guard(back_in.device());
  const Tensor back = back_in.contiguous(), send_map = send_map_in.contiguous();
  const Tensor idx = topk_idx.to(at::kLong).contiguous();
  const bool dedup = transport == kDedup;
  const Tensor wt = weighted ? topk_weights.contiguous() : topk_weights;
  const int64_t per = dedup ? 4 / back.element_size() : 1;  // y rows in one float32 row
  const bool compact = first_in.has_value();                 // dedup's units at first[r]
  const Tensor first = compact ? first_in->contiguous() : Tensor();
  const int64_t T = send_map.size(0), C = send_map.size(1), L = E / R;
  const int64_t H = compact ? back.size(1) : back.size(1) / per;
  const int64_t K = idx.size(1), S = compact ? first.size(0) : back.size(0);
  const int64_t U = compact ? back.size(0) : S * per;
  Tensor out = at::empty({T, H}, back.options().dtype(out_dtype));
  if (T == 0 || H == 0) return out;
  dispatch_float(out_dtype, "epkit.reduce_tokens", [&](auto otag) {
    using O = decltype(otag);
    dispatch_float(back.scalar_type(), "epkit.reduce_tokens", [&](auto btag) {
      using Bt = decltype(btag);
      // dedup also loads float32 partials from its rows
      const size_t wider = std::max({sizeof(O), sizeof(Bt), dedup ? sizeof(float) : size_t(1)});
      const bool al = aligned16(back.data_ptr(), H * sizeof(Bt)) &&
                      aligned16(out.data_ptr(), H * sizeof(O)) &&
                      (!dedup || aligned16(back.data_ptr(), H * sizeof(float)));
      const int V = vec_elems(H, wider, al);
      const float* wp = weighted ? wt.data_ptr<float>() : nullptr;
      const size_t smem = 2 * K * sizeof(int64_t);
      auto launch = [&](auto kernel) {
        if (smem > 48 * 1024)
          C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              static_cast<int>(smem)));
        kernel<<<T, kThreads, smem, stream()>>>(
            reinterpret_cast<const Bt*>(back.data_ptr()), send_map.data_ptr<int64_t>(),
            idx.data_ptr<int64_t>(), wp, compact ? first.data_ptr<int64_t>() : nullptr,
            reinterpret_cast<O*>(out.data_ptr()), C, K, H, L, S, U, E, dedup, weighted, G);
      };
      if (V == 8) launch(reduce_kernel<O, Bt, 8>);
      else if (V == 4) launch(reduce_kernel<O, Bt, 4>);
      else launch(reduce_kernel<O, Bt, 1>);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return out;
}

}  // namespace cuda
}  // namespace epkit
