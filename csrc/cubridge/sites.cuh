// The backward's learnable sites (lower/sites.py generates the hooks that call these): a pair's share of the
// gradient of a tensor the score reads, added by every lane of a warp at once.
#pragma once
#include "interval.cuh"

namespace cubridge {

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// v into the step's window at l; true where the element lies outside the window (l < 0) and the caller adds v
// to global memory itself (its address computed there alone: the window takes nearly every pair).
// Shared float atomics are compare-and-swap loops on sm_80 and sm_90, which serialise lanes that hit one
// element: where the whole warp adds to one element (a clamped relative table's far tiles, every pair at its
// clamp) its sum goes by one atomic.
__device__ __forceinline__ bool site_window_add(float* win, int l, float v) {
  const int l0 = __shfl_sync(0xffffffffu, l, 0);
  if (__all_sync(0xffffffffu, l == l0 && l0 >= 0)) {
    v = warp_sum(v);
    if ((threadIdx.x & 31) == 0 && v != 0.f) atomicAdd(win + l0, v);
    return false;
  }
  if (v == 0.f) return false;
  if (l < 0) return true;
  atomicAdd(win + l, v);
  return false;
}

// A moving index's span over the tile (its interval), clipped to the n elements of its dim: the first
// element lo and the width w (0: none).
__device__ __forceinline__ void site_span(Iv v, long long n, int& lo, int& w) {
  const float l = fmaxf(v.lo, 0.f), hi = fminf(v.hi, static_cast<float>(n - 1));
  lo = static_cast<int>(floorf(l));
  w = hi >= l ? static_cast<int>(ceilf(hi)) - lo + 1 : 0;
}

// A point site's step: the warp's sum of its lanes' parts, add(sum) by lane 0 where it is not zero.
template <class Add>
__device__ __forceinline__ void flush_point(float part, int lane, Add&& add) {
  const float v = warp_sum(part);
  if (lane == 0 && v != 0.f) add(v);
}

// A diagonal site's step: the staged [query][key] tile (rows of LD floats) summed, for each of the n elements
// from lo, over the one key of each query row that reads it, c = B (w - rest - A q) - kv_lo; add(w, sum) where
// a pair added to it. A thread per element, the loop rolled (the step's dK and dV accumulators are live around
// it); the rows four at a time, their loads issued together (rolled, each waited on its load's latency).
template <int LD, int A, int B, class Add>
__device__ __forceinline__ void flush_diagonal(const float* tile, int n, int lo, int rest, int q_lo, int q_hi,
                                               int kv_lo, int kv_hi, int tid, int nthreads, Add&& add) {
#pragma unroll 1
  for (int e = tid; e < n; e += nthreads) {
    const int w = e + lo;
    float sum = 0.f;
#pragma unroll 4
    for (int r = 0; r < q_hi - q_lo; ++r) {
      const int c = B * (w - rest - (A) * (q_lo + r)) - kv_lo;
      if ((unsigned)c < (unsigned)(kv_hi - kv_lo)) sum += tile[r * LD + c];
    }
    if (sum == 0.f) continue;
    add(w, sum);
  }
}

// A window site's step: each of its n elements that a pair added to, zeroed for the next step, and add(e, v).
template <class Add>
__device__ __forceinline__ void flush_window(float* win, int n, int tid, int nthreads, Add&& add) {
#pragma unroll 1
  for (int e = tid; e < n; e += nthreads) {
    float* c = win + e;
    const float v = *c;
    if (v == 0.f) continue;
    *c = 0.f;
    add(e, v);
  }
}

}  // namespace cubridge
