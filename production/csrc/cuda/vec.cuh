// Vectorized element access for the arithmetic kernels: V consecutive elements of a row per
// thread, one 16- or 8-byte load or store where V * sizeof(T) is 16 or 8 (the caller checks that
// the rows are aligned), element by element otherwise. Arithmetic stays per element.
#pragma once

#include "common.cuh"

namespace epkit {
namespace cuda {

template <typename T, int V>
__device__ __forceinline__ void load_widen(const T* p, float (&out)[V]) {
  if constexpr (V * sizeof(T) == 16) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
    for (int i = 0; i < V; ++i) out[i] = widen(e[i]);
  } else if constexpr (V * sizeof(T) == 8) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
    for (int i = 0; i < V; ++i) out[i] = widen(e[i]);
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) out[i] = widen(p[i]);
  }
}

template <typename T, int V>
__device__ __forceinline__ void narrow_store(T* p, const float (&in)[V]) {
  if constexpr (V * sizeof(T) == 16 || V * sizeof(T) == 8 || V * sizeof(T) == 32) {
    alignas(16) T e[V];  // read back through uint4 / uint2 below: 16-byte aligned (issue 12)
#pragma unroll
    for (int i = 0; i < V; ++i) e[i] = narrow<T>(in[i]);
    if constexpr (V * sizeof(T) == 8) {
      *reinterpret_cast<uint2*>(p) = *reinterpret_cast<const uint2*>(e);
    } else {
#pragma unroll
      for (int i = 0; i < static_cast<int>(V * sizeof(T) / 16); ++i)
        reinterpret_cast<uint4*>(p)[i] = reinterpret_cast<const uint4*>(e)[i];
    }
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) p[i] = narrow<T>(in[i]);
  }
}

// Elements per thread for rows of H elements of types A and B: 16 bytes of the wider type
// when every row of both is 16-byte aligned, else 1.
inline int vec_elems(int64_t H, size_t wider, bool aligned) {
  const int64_t v = 16 / static_cast<int64_t>(wider);
  return aligned && H % v == 0 ? static_cast<int>(v) : 1;
}
inline bool aligned16(const void* p, int64_t row_bytes) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0 && row_bytes % 16 == 0;
}

// Deterministic block sum (fixed tree for a given blockDim): every thread gets the total.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float warp_part[32];
  __shared__ float total;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) v = __fadd_rn(v, __shfl_down_sync(kFull, v, o));
  if (lane == 0) warp_part[warp] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0.0f;
    for (int w = 0; w < static_cast<int>(blockDim.x / kWarp); ++w) s = __fadd_rn(s, warp_part[w]);
    total = s;
  }
  __syncthreads();
  const float out = total;
  __syncthreads();
  return out;
}

}  // namespace cuda
}  // namespace epkit
