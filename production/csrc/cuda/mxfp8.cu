// MXFP8 quantization on the device (cpu/mxfp8.cpp is the specification, bit for bit).
//
// One warp per block of 32 elements, a lane per element. amax: a max over the lanes (order-free;
// NaN counts as 0, as the CPU's std::max(amax, |v|) skips it). e = floor(log2(amax)) - 8 from
// frexpf (exact), clamped to [-127, 127]; 2^e built from its bits (2^-127 is the subnormal
// 0x00400000); v / 2^e is one correctly rounded division (__fdiv_rn); the clamp to +-448 is the
// CPU's std::clamp expression; E4M3 is c10's own bit-level conversion. A NaN element is sign |
// 0x7F, its sign kept as the CPU's division keeps it (0xFF for -NaN).
#include "common.cuh"

namespace epkit {
namespace cuda {

namespace {

template <typename X>
__global__ void quantize_kernel(const X* xp, uint8_t* qp, uint8_t* cp, int64_t nblocks) {
  const int64_t b = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (b >= nblocks) return;  // whole warps: the shuffles below see all 32 lanes
  const float v = widen(xp[b * 32 + lane]);
  float amax = isnan(v) ? 0.0f : fabsf(v);
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, o));
  if (amax == 0.0f) {
    qp[b * 32 + lane] = c10::detail::fp8e4m3fn_from_fp32_value(0.0f);
    if (lane == 0) cp[b] = 0;
    return;
  }
  int ex = 0;
  frexpf(amax, &ex);
  const int e = min(max(ex - 1 - 8, -127), 127);
  const float scale = e >= -126 ? __int_as_float((e + 127) << 23) : __int_as_float(0x00400000);
  if (isnan(v)) {
    // The CPU divides on x86, which keeps the NaN operand's sign, and E4M3 NaN is sign | 0x7F:
    // -NaN gives 0xFF. __fdiv_rn returns the canonical (positive) NaN, so decide here.
    qp[b * 32 + lane] = signbit(v) ? 0xFF : 0x7F;
  } else {
    float u = __fdiv_rn(v, scale);
    u = (u < -448.0f) ? -448.0f : (448.0f < u) ? 448.0f : u;  // std::clamp(u, -448, 448)
    qp[b * 32 + lane] = c10::detail::fp8e4m3fn_from_fp32_value(u);
  }
  if (lane == 0) cp[b] = static_cast<uint8_t>(e + 127);
}

}  // namespace

std::tuple<Tensor, Tensor> quantize_mxfp8_cuda(const Tensor& x_in) {
  check_quantize_mxfp8_args(x_in);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const Tensor x = x_in.contiguous();
  const int64_t T = x.size(0), H = x.size(1), NB = H / kMxfp8Block;
  Tensor q = at::empty({T, H}, x.options().dtype(at::kFloat8_e4m3fn));
  Tensor codes = at::empty({T, NB}, x.options().dtype(at::kByte));
  const int64_t nblocks = T * NB;
  if (nblocks == 0) return {q, codes};
  dispatch_float(x.scalar_type(), "epkit.quantize_mxfp8", [&](auto tag) {
    using X = decltype(tag);
    constexpr int kThreads = 256;  // 8 blocks of 32 per CUDA block
    quantize_kernel<X><<<ceil_div(nblocks * kWarp, kThreads), kThreads, 0, stream()>>>(
        reinterpret_cast<const X*>(x.data_ptr()), reinterpret_cast<uint8_t*>(q.data_ptr()),
        codes.data_ptr<uint8_t>(), nblocks);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {q, codes};
}

}  // namespace cuda
}  // namespace epkit
