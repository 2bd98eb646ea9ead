// Backward kernels on the device (cpu/backward.cpp is the specification).
//
// grad_y = cast(c * g) is bit for bit the CPU kernel's. The weight gradient <g, y> is a float32
// sum whose order over H the semantics leave free (docs/design.md: compared with a tolerance);
// here each thread sums its elements in order and the block adds the partials in a fixed tree,
// so it is deterministic, though not the CPU's serial order.
#include "vec.cuh"

namespace epkit {
namespace cuda {

namespace {

constexpr int kThreads = 128;

template <typename Y, typename G, int V>
__global__ void combine_backward_kernel(const G* rp, const int64_t* mp, const float* wp,
                                        const Y* yp, Y* gyp, float* gwp, int64_t C, int64_t H,
                                        int64_t M, bool weighted) {
  const int64_t n = blockIdx.x;
  for (int64_t c = 0; c < C; ++c) {
    const int64_t m = mp[n * C + c];  // the same for every thread: uniform branch
    if (m < 0 || m >= M) continue;
    const float w = weighted ? wp[m] : 1.0f;
    float dot = 0.0f;
    for (int64_t h = static_cast<int64_t>(threadIdx.x) * V; h < H;
         h += static_cast<int64_t>(blockDim.x) * V) {
      float g[V], gy[V];
      load_widen<G, V>(rp + n * H + h, g);
      if (weighted) {
        float y[V];
        load_widen<Y, V>(yp + m * H + h, y);
#pragma unroll
        for (int i = 0; i < V; ++i) {
          gy[i] = __fmul_rn(w, g[i]);
          dot = __fadd_rn(dot, __fmul_rn(g[i], y[i]));
        }
      } else {
#pragma unroll
        for (int i = 0; i < V; ++i) gy[i] = g[i];
      }
      narrow_store<Y, V>(gyp + m * H + h, gy);
    }
    if (weighted) {
      const float total = block_sum(dot);
      if (threadIdx.x == 0) gwp[m] = total;
    }
  }
}

// One thread per received row n: its named entries (c ascending) at first[n], first[n] + 1,
// ... (cpu/backward.cpp); out starts zeroed. Every write is bounded (< B); a map entry outside
// [0, M) names nothing.
__global__ void gather_slot_values_kernel(const float* vp, const int64_t* mp, const int64_t* fp,
                                          float* op, int64_t N, int64_t C, int64_t M,
                                          int64_t B) {
  const int64_t n = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n >= N) return;
  int64_t at = fp[n];
  for (int64_t c = 0; c < C; ++c) {
    const int64_t m = mp[n * C + c];
    if (m < 0 || m >= M) continue;
    if (at >= 0 && at < B) op[at] = vp[m];
    ++at;
  }
}

// Every index is bounded (issue 12): the expert (0 <= e < E: on CUDA static a bad index is a
// deferred error and this pass still runs on the caller's routing), the send_map column e / L
// (< C), the send row (< S) and the place in back (< B); a slot that fails any reads nothing
// and gets 0. ip is the kept routing (dedup: dropped slots -1); slot_rank is epkit.h's.
__global__ void scatter_slot_values_kernel(const float* bp, const int64_t* mp, const int64_t* ip,
                                           const int64_t* fp, float* op, int64_t T, int64_t K,
                                           int64_t E, int64_t L, int64_t C, int64_t S,
                                           int64_t B, bool pairs) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= T * K) return;
  const int64_t t = i / K, k = i % K, e = ip[i];
  float v = 0.0f;
  if (e >= 0 && e < E && (pairs || e / L < C)) {
    const int64_t r = pairs ? mp[t * K + k] : mp[t * C + e / L];  // pairs: C == K (host check)
    if (r >= 0 && r < S && fp[r] >= 0) {
      const int64_t at = fp[r] + (pairs ? 0 : slot_rank(ip + t * K, k, e / L, E, L));
      if (at < B) v = bp[at];
    }
  }
  op[i] = v;
}

}  // namespace

std::tuple<Tensor, Tensor> combine_backward_dest_cuda(const Tensor& recv_in,
                                                      const Tensor& recv_map_in,
                                                      const Tensor& row_weight,
                                                      const Tensor& y_in, bool weighted) {
  check_combine_backward_dest_args(recv_in, recv_map_in, row_weight, y_in, weighted);
  const c10::cuda::CUDAGuard guard(y_in.device());
  const Tensor recv = recv_in.contiguous(), y = y_in.contiguous();
  const Tensor recv_map = recv_map_in.contiguous(), w = row_weight.contiguous();
  const int64_t N = recv_map.size(0), C = recv_map.size(1), H = y.size(1), M = y.size(0);
  Tensor grad_y = at::zeros({M, H}, y.options());
  Tensor grad_w = at::zeros({M}, y.options().dtype(at::kFloat));
  if (N == 0 || C == 0 || H == 0) return {grad_y, grad_w};
  dispatch_float(y.scalar_type(), "epkit.combine_backward", [&](auto ytag) {
    using Y = decltype(ytag);
    dispatch_float(recv.scalar_type(), "epkit.combine_backward", [&](auto gtag) {
      using G = decltype(gtag);
      const size_t wider = std::max(sizeof(Y), sizeof(G));
      const bool al = aligned16(recv.data_ptr(), H * sizeof(G)) &&
                      aligned16(y.data_ptr(), H * sizeof(Y)) &&
                      aligned16(grad_y.data_ptr(), H * sizeof(Y));
      const int V = vec_elems(H, wider, al);
      auto launch = [&](auto kernel) {
        kernel<<<N, kThreads, 0, stream()>>>(
            reinterpret_cast<const G*>(recv.data_ptr()), recv_map.data_ptr<int64_t>(),
            weighted ? w.data_ptr<float>() : nullptr, reinterpret_cast<const Y*>(y.data_ptr()),
            reinterpret_cast<Y*>(grad_y.data_ptr()), grad_w.data_ptr<float>(), C, H, M, weighted);
      };
      if (V == 8) launch(combine_backward_kernel<Y, G, 8>);
      else if (V == 4) launch(combine_backward_kernel<Y, G, 4>);
      else launch(combine_backward_kernel<Y, G, 1>);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return {grad_y, grad_w};
}

Tensor gather_slot_values_cuda(const Tensor& values, const Tensor& recv_map_in,
                               const Tensor& first_in, c10::SymInt out_rows) {
  const int64_t B = out_rows.expect_int();
  check_gather_slot_values_args(values, recv_map_in, first_in, B);
  const c10::cuda::CUDAGuard guard(values.device());
  const Tensor v = values.contiguous(), recv_map = recv_map_in.contiguous();
  const Tensor first = first_in.contiguous();
  Tensor out = at::zeros({B}, v.options().dtype(at::kFloat));
  const int64_t N = recv_map.size(0), C = recv_map.size(1);
  if (N > 0 && C > 0 && B > 0) {
    gather_slot_values_kernel<<<ceil_div(N, 256), 256, 0, stream()>>>(
        v.data_ptr<float>(), recv_map.data_ptr<int64_t>(), first.data_ptr<int64_t>(),
        out.data_ptr<float>(), N, C, v.numel(), B);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return out;
}

Tensor scatter_slot_values_cuda(const Tensor& back_in, const Tensor& send_map_in,
                                const Tensor& topk_idx, const Tensor& first_in, int64_t E,
                                int64_t R, int64_t transport) {
  check_scatter_slot_values_args(back_in, send_map_in, topk_idx, first_in, E, R, transport);
  const c10::cuda::CUDAGuard guard(back_in.device());
  const Tensor back = back_in.contiguous(), send_map = send_map_in.contiguous();
  const Tensor idx = topk_idx.to(at::kLong).contiguous(), first = first_in.contiguous();
  const int64_t T = idx.size(0), K = idx.size(1), L = E / R, C = send_map.size(1);
  Tensor out = at::empty({T, K}, back.options().dtype(at::kFloat));
  if (T * K > 0) {
    scatter_slot_values_kernel<<<ceil_div(T * K, 256), 256, 0, stream()>>>(
        back.data_ptr<float>(), send_map.data_ptr<int64_t>(), idx.data_ptr<int64_t>(),
        first.data_ptr<int64_t>(), out.data_ptr<float>(), T, K, E, L, C, first.size(0),
        back.size(0), transport == kPairs);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return out;
}

}  // namespace cuda
}  // namespace epkit
