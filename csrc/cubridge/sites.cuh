// The backward's learnable sites (lower/sites.py generates the hooks that call these): a pair's share of the
// gradient of a tensor the score reads, added by every lane of a warp at once.
#pragma once

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

}  // namespace cubridge
