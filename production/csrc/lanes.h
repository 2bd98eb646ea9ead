// 16-lane float32 row arithmetic shared by the CPU row kernels (cpu/combine.cpp, cpu/backward.cpp).
//
// 16 float32 lanes and their bit patterns are one GCC / Clang vector: on the AVX-512 clone one
// register, on AVX2 two, on the baseline four. Element-wise IEEE operations only (no FMA:
// -ffp-contract=off), so every width gives the same bits, and the same bits as the scalar loop
// over h that the spec's order describes (each element's operations are the same, in order).
#pragma once

#include "epkit.h"

namespace epkit {

// Every helper below is inlined into its caller, so it runs at the caller's clone's width.
#define EPKIT_LANES inline __attribute__((always_inline))

typedef float V16f __attribute__((vector_size(64)));
typedef uint32_t V16u __attribute__((vector_size(64)));
typedef uint16_t V16h __attribute__((vector_size(32)));
typedef uint16_t V32h __attribute__((vector_size(64)));  // a V16u's halves, low half first

// 16 consecutive values widened to float32 (bfloat16: its bits as the high half, a zero low
// half: exact), one shuffle. Unaligned addresses are fine (memcpy).
EPKIT_LANES void load16(const float* p, V16f& v) { std::memcpy(&v, p, sizeof(v)); }
EPKIT_LANES void load16(const at::BFloat16* p, V16f& v) {
  V16h h;
  std::memcpy(&h, p, sizeof(h));
  const V32h w = __builtin_shufflevector(V16h{}, h, 0, 16, 0, 17, 0, 18, 0, 19, 0, 20, 0, 21, 0,
                                         22, 0, 23, 0, 24, 0, 25, 0, 26, 0, 27, 0, 28, 0, 29, 0,
                                         30, 0, 31);
  v = reinterpret_cast<V16f>(w);
}
// 16 float32 stored narrowed: float32 as is; bfloat16 by narrow<BFloat16>'s rule, lane by lane
// (NaN -> 0x7FC0, else round to nearest even: the high half of u + 0x7FFF + its last bit).
EPKIT_LANES void store16(float* p, const V16f& v) { std::memcpy(p, &v, sizeof(v)); }
EPKIT_LANES void store16(at::BFloat16* p, const V16f& v) {
  const V16u u = reinterpret_cast<V16u>(v);
  const V16u nan = (u & 0x7FFFFFFFu) > 0x7F800000u;  // all ones where NaN
  const V16u sum = u + (((u >> 16) & 1u) + 0x7FFFu);
  const V32h halves = reinterpret_cast<V32h>((sum & ~nan) | (0x7FC00000u & nan));
  const V16h h = __builtin_shufflevector(halves, halves, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21,
                                         23, 25, 27, 29, 31);
  std::memcpy(p, &h, sizeof(h));
}

// One group of a token's sum (the rows it has from one rank): `cnt` rows of rows[] with their
// weights, or (partial != nullptr) a float32 partial formed elsewhere, read unaligned; `node`:
// the node of the rank, for ranks_per_node > 1.
struct RowGroup {
  int64_t cnt;
  const uint8_t* partial;
  int64_t node;
};

// The scalar tail's element access, overloaded like load16 / store16 (a partial's float may be
// unaligned: memcpy).
EPKIT_LANES void load1(const float* p, float& v) { std::memcpy(&v, p, sizeof(v)); }
EPKIT_LANES void load1(const at::BFloat16* p, float& v) { v = widen(*p); }
EPKIT_LANES void load_lanes(const float* p, V16f& v) { load16(p, v); }
EPKIT_LANES void load_lanes(const at::BFloat16* p, V16f& v) { load16(p, v); }
EPKIT_LANES void load_lanes(const float* p, float& v) { load1(p, v); }
EPKIT_LANES void load_lanes(const at::BFloat16* p, float& v) { load1(p, v); }
template <typename O> EPKIT_LANES void store_lanes(O* p, const V16f& v) { store16(p, v); }
template <typename O> EPKIT_LANES void store_lanes(O* p, float v) {
  const O n = narrow<O>(v);
  std::memcpy(p, &n, sizeof(O));  // gather_rows' partial may start unaligned
}

// N blocks of 16 columns at once: N independent chains per row read, so the adds of one block
// wait on nothing of the next (more in flight), with the same operations per element.
template <int N>
struct Lanes {
  V16f v[N];
};
template <int N>
EPKIT_LANES Lanes<N> operator+(const Lanes<N>& a, const Lanes<N>& b) {
  Lanes<N> r;
  for (int i = 0; i < N; ++i) r.v[i] = a.v[i] + b.v[i];
  return r;
}
template <int N>
EPKIT_LANES Lanes<N> operator*(float w, const Lanes<N>& a) {
  Lanes<N> r;
  for (int i = 0; i < N; ++i) r.v[i] = w * a.v[i];
  return r;
}
template <typename T, int N>
EPKIT_LANES void load_lanes(const T* p, Lanes<N>& v) {
  for (int i = 0; i < N; ++i) load16(p + 16 * i, v.v[i]);
}
template <typename O, int N>
EPKIT_LANES void store_lanes(O* p, const Lanes<N>& v) {
  for (int i = 0; i < N; ++i) store16(p + 16 * i, v.v[i]);
}

// Columns [h, h + width(Vec)) of sum_groups: Vec is Lanes<N> (16 N columns), V16f (16) or float
// (one).
template <typename Vec, typename O, typename Bt>
EPKIT_LANES void sum_block(O* out, int64_t h, const RowGroup* groups,
                                                     int64_t ngroups, const Bt* const* rows,
                                                     const float* w, bool weighted, bool grouped) {
  Vec total = Vec{}, node = Vec{};
  int64_t open = -1, at = 0;
  for (int64_t g = 0; g < ngroups; ++g) {
    const RowGroup& grp = groups[g];
    Vec part = Vec{};
    if (grp.partial != nullptr) {
      load_lanes(reinterpret_cast<const float*>(grp.partial) + h, part);
    } else {
      for (int64_t i = 0; i < grp.cnt; ++i, ++at) {
        Vec r;
        load_lanes(rows[at] + h, r);
        part = weighted ? part + w[at] * r : part + r;
      }
    }
    if (!grouped) {
      total = total + part;
      continue;
    }
    if (grp.node != open) {  // N_n = +0.0 + P_d + ..., added when the next node opens
      if (open >= 0) total = total + node;
      node = Vec{};
      open = grp.node;
    }
    node = node + part;
  }
  if (open >= 0) total = total + node;
  store_lanes(out + h, total);
}

// out[h] = cast_O(the spec's sum over the groups): per group P = +0.0 + c_0 * r_0 + c_1 * r_1
// + ... (c = 1 unweighted: no multiply), the groups' P added in order into total = +0.0 + P + ...
// (grouped: into a node partial N = +0.0 + P + ... per node, the N added into total when the
// next node opens). Loops swapped for speed: each 16-column block of every row is read once and
// the output written once, the partials living in registers; element h's operations are the
// scalar loop's, in its order. Serves reduce_tokens (a token's ranks) and gather_rows (one group:
// total = +0.0 + P is P's bits, P never being -0.0).
template <typename O, typename Bt>
EPKIT_ROW_CLONES void sum_groups(O* __restrict out, int64_t H, const RowGroup* groups,
                                 int64_t ngroups, const Bt* const* rows, const float* w,
                                 bool weighted, bool grouped) {
  int64_t h = 0;
  for (; h + 64 <= H; h += 64)
    sum_block<Lanes<4>>(out, h, groups, ngroups, rows, w, weighted, grouped);
  for (; h + 16 <= H; h += 16)
    sum_block<V16f>(out, h, groups, ngroups, rows, w, weighted, grouped);
  for (; h < H; ++h) sum_block<float>(out, h, groups, ngroups, rows, w, weighted, grouped);
}

}  // namespace epkit
