// epkit CUDA kernels: shared device helpers.
//
// Everything here is exact: rows move as bytes; arithmetic is one rounded float32 operation at a
// time (__fmul_rn / __fadd_rn, the build passes --fmad=false as well); bfloat16 narrowing is
// c10's own round-to-nearest-even (c10::detail::round_to_nearest_even, __host__ __device__),
// which the CPU kernels use through c10::BFloat16(float); E4M3 is c10's bit-level conversion.
// So a CUDA kernel returns the CPU kernel's bits (NaN payloads aside: a float32 NaN produced by
// CUDA arithmetic is the canonical 0x7FFFFFFF where x86 keeps the operand's payload).
#pragma once

#include "../checks.h"  // argument checks shared with the CPU kernels (no data read)
#include "../epkit.h"

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>

#include <cstdint>

namespace epkit {
namespace cuda {

// ---- declarations of the CUDA ops (registration.cu) -------------------------------------
std::tuple<Tensor, Tensor, Tensor, Tensor> layout_cuda(const Tensor& topk_idx, int64_t num_experts,
                                                      int64_t num_ranks);
Tensor prepare_cuda(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_weights,
                    int64_t num_experts, int64_t num_ranks, at::IntArrayRef pre_error,
                    int64_t payload);
Tensor plan_cuda(const Tensor& words, int64_t rank, int64_t num_experts, int64_t align,
                 int64_t capacity, int64_t transport, int64_t exchange,
                 int64_t max_tokens_per_rank);
std::tuple<Tensor, Tensor> pack_cuda(const Tensor& x, const Tensor& topk_idx,
                                     const Tensor& topk_weights, const Tensor& plan,
                                     int64_t transport, int64_t num_ranks, c10::SymInt send_bytes);
std::tuple<Tensor, Tensor, Tensor, Tensor> unpack_cuda(const Tensor& recv, const Tensor& plan,
                                                       int64_t transport, int64_t hidden,
                                                       at::ScalarType dtype, int64_t topk,
                                                       c10::SymInt recv_rows,
                                                       c10::SymInt expert_rows);
Tensor gather_rows_cuda(const Tensor& expert_y, const Tensor& recv_map, const Tensor& row_weight,
                        int64_t transport, bool weighted);
void gather_units_cuda(const Tensor& expert_y, const Tensor& recv_map, const Tensor& row_weight,
                       int64_t transport, bool weighted, const std::optional<Tensor>& first,
                       const Tensor& out);
Tensor reduce_tokens_cuda(const Tensor& back, const Tensor& send_map, const Tensor& topk_idx,
                          const Tensor& topk_weights, int64_t num_experts, int64_t num_ranks,
                          int64_t transport, bool weighted, at::ScalarType out_dtype,
                          int64_t ranks_per_node, const std::optional<Tensor>& first);
Tensor scatter_rows_cuda(const Tensor& src, const Tensor& send_map, c10::SymInt send_rows);
void scatter_rows_into_cuda(const Tensor& src, const Tensor& send_map, const Tensor& out);
Tensor empty_large_cuda(const Tensor& like, c10::SymIntArrayRef size, at::ScalarType dtype);
Tensor pack_into_cuda(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_weights,
                     const Tensor& plan, int64_t transport, int64_t num_ranks, const Tensor& send);
std::tuple<Tensor, Tensor> combine_backward_dest_cuda(const Tensor& recv, const Tensor& recv_map,
                                                      const Tensor& row_weight,
                                                      const Tensor& expert_y, bool weighted);
std::tuple<Tensor, Tensor> quantize_mxfp8_cuda(const Tensor& x);
std::tuple<Tensor, Tensor> quantize_fp8_block128_cuda(const Tensor& x);
Tensor gather_slot_values_cuda(const Tensor& values, const Tensor& recv_map, const Tensor& first,
                               c10::SymInt out_rows);
Tensor scatter_slot_values_cuda(const Tensor& back, const Tensor& send_map, const Tensor& topk_idx,
                                const Tensor& first, int64_t num_experts, int64_t num_ranks,
                                int64_t transport);
Tensor unpack_status_word(const Tensor& like);

// ---- launch helpers ---------------------------------------------------------------------
inline cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream(); }
inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
constexpr int kWarp = 32;
constexpr unsigned kFull = 0xFFFFFFFFu;

// The plan a CUDA kernel reads: the tensor itself when it lives on `dev`, else a copy (a plan
// made on the host: an asynchronous upload, never a host wait).
inline Tensor plan_on(const Tensor& plan, const at::Device& dev) {
  TORCH_CHECK(plan.scalar_type() == at::kLong && plan.dim() == 1, "epkit: plan must be int64 [n]");
  if (plan.device() == dev) return plan.contiguous();
  return plan.to(dev, /*non_blocking=*/plan.is_pinned()).contiguous();
}

// E from the plan's length: PlanOffsets(R, E).size = 25 + 6R + E (2 + 3/R) (epkit.h). The CUDA
// kernels never read a plan on the host (it may be device-only, as in the static exchange).
inline int64_t experts_from_plan(int64_t plan_size, int64_t R) {
  TORCH_CHECK(R >= 1, "epkit: num_ranks must be >= 1");
  const int64_t num = (plan_size - 25 - 6 * R) * R, den = 2 * R + 3;
  const int64_t E = num >= 0 ? num / den : -1;
  TORCH_CHECK(E >= R && E % R == 0 && PlanOffsets(R, E).size == plan_size,
              "epkit: a plan of ", plan_size, " words does not fit ", R, " ranks");
  return E;
}

// ---- bytes --------------------------------------------------------------------------------
template <typename T>
__device__ __forceinline__ void dput(uint8_t* p, T v) { memcpy(p, &v, sizeof(T)); }
template <typename T>
__device__ __forceinline__ T dget(const uint8_t* p) { T v; memcpy(&v, p, sizeof(T)); return v; }

// Largest power of two <= 16 dividing every bit set in `bits` (an OR of addresses and lengths).
__device__ __forceinline__ int vec_width(uint64_t bits) {
  return bits & 1 ? 1 : bits & 2 ? 2 : bits & 4 ? 4 : bits & 8 ? 8 : 16;
}

// Copy n bytes src -> dst[0..nd) (one read of each source vector, nd writes), W-byte vectors;
// W divides n and every address. Threads tid..n step nthreads.
template <int W>
__device__ __forceinline__ void copy_vec(uint8_t* const* dst, int nd, const uint8_t* src,
                                         int64_t n, int tid, int nthreads) {
  using V = typename std::conditional<W == 16, uint4, typename std::conditional<W == 8, uint2,
            typename std::conditional<W == 4, uint32_t, typename std::conditional<W == 2,
            uint16_t, uint8_t>::type>::type>::type>::type;
  const V* s = reinterpret_cast<const V*>(src);
  for (int64_t v = tid; v < n / W; v += nthreads) {
    const V val = s[v];
    for (int i = 0; i < nd; ++i) reinterpret_cast<V*>(dst[i])[v] = val;
  }
}
__device__ __forceinline__ void copy_to_all(uint8_t* const* dst, int nd, const uint8_t* src,
                                            int64_t n, int width, int tid, int nthreads) {
  switch (width) {
    case 16: copy_vec<16>(dst, nd, src, n, tid, nthreads); break;
    case 8: copy_vec<8>(dst, nd, src, n, tid, nthreads); break;
    case 4: copy_vec<4>(dst, nd, src, n, tid, nthreads); break;
    case 2: copy_vec<2>(dst, nd, src, n, tid, nthreads); break;
    default: copy_vec<1>(dst, nd, src, n, tid, nthreads); break;
  }
}

// Zero bytes [begin, end) of base: byte head, 16-byte body, byte tail.
__device__ __forceinline__ void zero_range(uint8_t* base, int64_t begin, int64_t end, int64_t tid,
                                           int64_t nthreads) {
  if (end <= begin) return;
  const uint64_t a = reinterpret_cast<uint64_t>(base + begin);
  int64_t head = static_cast<int64_t>((16 - (a & 15)) & 15);
  if (head > end - begin) head = end - begin;
  for (int64_t i = tid; i < head; i += nthreads) base[begin + i] = 0;
  const int64_t body = (end - begin - head) / 16;
  uint4* b = reinterpret_cast<uint4*>(base + begin + head);
  for (int64_t i = tid; i < body; i += nthreads) b[i] = make_uint4(0, 0, 0, 0);
  for (int64_t i = begin + head + body * 16 + tid; i < end; i += nthreads) base[i] = 0;
}

// ---- exact arithmetic ---------------------------------------------------------------------
__device__ __forceinline__ float widen(float v) { return v; }
__device__ __forceinline__ float widen(c10::BFloat16 v) {
  return __uint_as_float(static_cast<uint32_t>(v.x) << 16);  // exact
}
template <typename T> __device__ __forceinline__ T narrow(float v);
template <> __device__ __forceinline__ float narrow<float>(float v) { return v; }
template <> __device__ __forceinline__ c10::BFloat16 narrow<c10::BFloat16>(float v) {
  return c10::BFloat16(c10::detail::round_to_nearest_even(v), c10::BFloat16::from_bits());
}

// Calls f(T{}) with T = float or c10::BFloat16 (host side; the kernels are templates).
template <typename F>
inline void dispatch_float(at::ScalarType dt, const char* name, F&& f) {
  if (dt == at::kFloat) f(float{});
  else if (dt == at::kBFloat16) f(c10::BFloat16{});
  else TORCH_CHECK(false, name, ": dtype must be float32 or bfloat16, got ", dt);
}

// ---- block-wide scans (one block; n arbitrary) ----------------------------------------------
// out[i] = sum(in[0..i)) for i <= n (out has n + 1 entries); in may alias nothing of out.
// Every thread of the block must call it. Needs blockDim.x a multiple of 32, <= 1024.
__device__ inline void block_exclusive_scan(const int64_t* in, int64_t* out, int64_t n) {
  __shared__ int64_t warp_sums[32];
  __shared__ int64_t carry;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int nwarps = blockDim.x / kWarp;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int64_t base = 0; base < n; base += blockDim.x) {
    const int64_t i = base + threadIdx.x;
    int64_t v = i < n ? in[i] : 0;
    int64_t incl = v;
    for (int o = 1; o < kWarp; o <<= 1) {
      const int64_t u = __shfl_up_sync(kFull, incl, o);
      if (lane >= o) incl += u;
    }
    if (lane == kWarp - 1) warp_sums[warp] = incl;
    __syncthreads();
    if (warp == 0) {
      int64_t w = lane < nwarps ? warp_sums[lane] : 0;
      for (int o = 1; o < kWarp; o <<= 1) {
        const int64_t u = __shfl_up_sync(kFull, w, o);
        if (lane >= o) w += u;
      }
      if (lane < nwarps) warp_sums[lane] = w;  // inclusive over warps
    }
    __syncthreads();
    const int64_t before = carry + (warp > 0 ? warp_sums[warp - 1] : 0);
    if (i < n) out[i] = before + incl - v;
    __syncthreads();
    if (threadIdx.x == 0) carry += warp_sums[nwarps - 1];
    __syncthreads();
  }
  if (threadIdx.x == 0) out[n] = carry;
  __syncthreads();
}

// Column-wise exclusive scan of an int32 matrix a [rows, cols] in place, one warp per column
// (lanes over rows, 32 at a time; common.cu). With cols_dev, the matrix is [rows, c] with
// c = min(*cols_dev, cols) read on the device (a plan word: the host knows only the bound cols).
void scan_columns(int32_t* a, int64_t rows, int64_t cols, const int64_t* cols_dev = nullptr);

// Lanes below this one in the warp.
__device__ __forceinline__ unsigned lanemask_lt() {
  unsigned m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

}  // namespace cuda
}  // namespace epkit
