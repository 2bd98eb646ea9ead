// Shared kernels of the CUDA build.
#include "common.cuh"

namespace epkit {
namespace cuda {

// One warp per column: an exclusive prefix over rows, 32 rows per step with a running carry.
__global__ void scan_columns_kernel(int32_t* a, int64_t rows, int64_t cols_bound,
                                    const int64_t* cols_dev) {
  const int64_t col = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  const int lane = threadIdx.x % kWarp;
  int64_t cols = cols_bound;
  if (cols_dev != nullptr && *cols_dev < cols) cols = *cols_dev < 0 ? 0 : *cols_dev;
  if (col >= cols) return;  // whole warps: the shuffles below see all 32 lanes
  int32_t carry = 0;
  for (int64_t base = 0; base < rows; base += kWarp) {
    const int64_t r = base + lane;
    const int32_t v = r < rows ? a[r * cols + col] : 0;
    int32_t incl = v;
    for (int o = 1; o < kWarp; o <<= 1) {
      const int32_t u = __shfl_up_sync(kFull, incl, o);
      if (lane >= o) incl += u;
    }
    if (r < rows) a[r * cols + col] = carry + incl - v;
    carry += __shfl_sync(kFull, incl, kWarp - 1);
  }
}

void scan_columns(int32_t* a, int64_t rows, int64_t cols, const int64_t* cols_dev) {
  if (rows == 0 || cols == 0) return;
  constexpr int kThreads = 256;
  const int64_t blocks = ceil_div(cols * kWarp, kThreads);
  scan_columns_kernel<<<blocks, kThreads, 0, stream()>>>(a, rows, cols, cols_dev);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda
}  // namespace epkit
