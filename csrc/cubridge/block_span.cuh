// Binary searches for a tile's live key blocks, over a block rule that answers for a range of blocks:
// span(j0, j1) is the class (kEmpty, kPartial, kFull) of key blocks [j0, j1). The Hopper prefill and the
// decode kernel find a tile's live span with them, so a tile's cost follows its live blocks and a rule that
// reads data (a length, a block map) is evaluated a few times, not once per block.
#pragma once

#include "variant.cuh"

namespace cubridge {

// [lo, hi) holds a block not proven empty: the smallest e in (lo, hi] with [e, hi) proven empty.
template <class Span>
__device__ __forceinline__ int live_end(const Span& span, int lo, int hi) {
  while (hi - lo > 1) {  // invariant: [lo, hi) holds a block not proven empty
    const int mid = (lo + hi) / 2;
    if (span(mid, hi) == kEmpty) hi = mid;
    else lo = mid;
  }
  return hi;
}

// [lo, hi) holds a block not proven empty: the first, i.e. the largest s in [lo, hi) with [lo, s) proven
// empty (a conservative rule may still call block s empty on its own: callers check it).
template <class Span>
__device__ __forceinline__ int live_start(const Span& span, int lo, int hi) {
  while (hi - lo > 1) {  // invariant: [lo, hi) holds a block not proven empty, and blocks before lo are empty
    const int mid = (lo + hi) / 2;
    if (span(lo, mid) == kEmpty) lo = mid;
    else hi = mid;
  }
  return lo;
}

}  // namespace cubridge
