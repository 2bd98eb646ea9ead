// fp8_block128 quantization on the device (cpu/fp8_block128.cpp is the specification, bit for
// bit).
//
// One warp per block of 128 elements, four consecutive elements per lane. amax: each lane's max,
// then a max over the lanes (order-free; NaN counts as 0, as the CPU's std::max(amax, |v|) skips
// it). scale = max(amax, 1e-4f) / 448 and v / scale are correctly rounded float32 divisions
// (__fdiv_rn), as on the CPU; the clamp to +-448 is the CPU's std::clamp expression; E4M3 is
// c10's own bit-level conversion, the function the CPU kernel calls. A NaN quotient is the E4M3
// NaN with v's sign, as the CPU decides it explicitly (__fdiv_rn's NaN is canonical).
#include "common.cuh"

namespace epkit {
namespace cuda {

namespace {

constexpr float kE4m3Max = 448.0f;
constexpr float kAmaxMin = 1e-4f;  // DeepEP's clamp of the block maximum (bits 0x38D1B717)
constexpr uint8_t kE4m3Nan = 0x7F;  // | 0x80 for the sign
constexpr uint8_t kSignBit = 0x80;
constexpr int kPerLane = static_cast<int>(kFp8Block128Block) / kWarp;

template <typename X>
__global__ void quantize_fp8_block128_kernel(const X* xp, uint8_t* qp, float* sp,
                                             int64_t nblocks) {
  const int64_t b = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (b >= nblocks) return;  // whole warps: the shuffles below see all 32 lanes
  const int64_t at = b * kFp8Block128Block + static_cast<int64_t>(lane) * kPerLane;
  float v[kPerLane];
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    v[i] = widen(xp[at + i]);
    amax = fmaxf(amax, isnan(v[i]) ? 0.0f : fabsf(v[i]));
  }
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, o));
  const float s = __fdiv_rn(fmaxf(amax, kAmaxMin), kE4m3Max);  // amax is never NaN here
  if (lane == 0) sp[b] = s;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    float u = __fdiv_rn(v[i], s);
    if (isnan(u)) {
      qp[at + i] = static_cast<uint8_t>(kE4m3Nan | (signbit(v[i]) ? kSignBit : 0));
    } else {
      u = (u < -kE4m3Max) ? -kE4m3Max : (kE4m3Max < u) ? kE4m3Max : u;  // std::clamp(u, ...)
      qp[at + i] = c10::detail::fp8e4m3fn_from_fp32_value(u);
    }
  }
}

}  // namespace

std::tuple<Tensor, Tensor> quantize_fp8_block128_cuda(const Tensor& x_in) {
  check_quantize_fp8_block128_args(x_in);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const Tensor x = x_in.contiguous();
  const int64_t T = x.size(0), H = x.size(1), NB = H / kFp8Block128Block;
  Tensor q = at::empty({T, H}, x.options().dtype(at::kFloat8_e4m3fn));
  Tensor scale = at::empty({T, NB}, x.options().dtype(at::kFloat));
  const int64_t nblocks = T * NB;
  if (nblocks == 0) return {q, scale};
  dispatch_float(x.scalar_type(), "epkit.quantize_fp8_block128", [&](auto tag) {
    using X = decltype(tag);
    constexpr int kThreads = 256;  // 8 blocks of 128 per CUDA block
    quantize_fp8_block128_kernel<X><<<ceil_div(nblocks * kWarp, kThreads), kThreads, 0,
                                      stream()>>>(
        reinterpret_cast<const X*>(x.data_ptr()), reinterpret_cast<uint8_t*>(q.data_ptr()),
        scale.data_ptr<float>(), nblocks);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {q, scale};
}

}  // namespace cuda
}  // namespace epkit
