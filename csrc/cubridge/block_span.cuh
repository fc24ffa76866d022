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

// A query tile's walk over its live key blocks, in order, for a producer that hands each block on with its
// class: the end of the live span is found once per tile (a tile's cost follows its live blocks, not the key
// length), and a run of empty blocks is passed over by one search. kSpans: the rule can empty a block (a mask);
// without one every block is live and no search is made.
template <bool kSpans, class Span>
struct LiveBlocks {
  const Span& span;
  int n_blk;
  int j_end;         // blocks at or past it are proven empty
  int cls = kEmpty;  // the class of the block next() returned last

  __device__ __forceinline__ LiveBlocks(const Span& s, int n) : span(s), n_blk(n), j_end(n) {
    if constexpr (kSpans) j_end = span(0, n_blk) == kEmpty ? 0 : live_end(span, 0, n_blk);
  }
  // The first block at or after j not proven empty (n_blk: none); its class goes to cls.
  __device__ __forceinline__ int next(int j) {
    while (j < j_end) {
      cls = span(j, j + 1);
      if (cls != kEmpty) return j;
      if (!kSpans) {
        ++j;
        continue;
      }
      if (j + 1 >= j_end || span(j + 1, j_end) == kEmpty) return n_blk;
      j = live_start(span, j + 1, j_end);  // (a conservative span rule may still call it empty: the loop checks)
    }
    return n_blk;
  }
};

}  // namespace cubridge
