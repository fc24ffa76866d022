// Score and mask hooks applied to a tile of accumulator fragments in the
// mma m16n8 layout (mma.sync, and each warp's slice of a wgmma accumulator).
#pragma once
#include "hooks.cuh"
#include "softmax.cuh"
#include "variant.cuh"

namespace cubridge {

__device__ __forceinline__ int imin(int x, int y) { return x < y ? x : y; }

// Apply the score hook (unless kRaw: the default s * scale is folded into the
// exp2 factor) and, when kMask, the key bound and the mask hook, in place.
// q0/kv0 are this lane's first query row / key; hooks see indices clamped to
// the valid range (out-of-range rows are never stored).
template <class Variant, bool kRaw, bool kMask, int MT, int NT>
__device__ __forceinline__ void apply_score(float (&s)[MT][NT][4], const FwdArgs& a,
                                            const typename Variant::Params& p, int b, int h,
                                            int q0, int kv0, int sq, int skv, bool call_mask) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int q = imin(q0 + mt * 16 + (e / 2) * 8, sq - 1);
        const int kv = kv0 + nt * 8 + (e % 2);
        float x = s[mt][nt][e];
        if constexpr (!kRaw) x = Hook<Variant>::score(a, p, x, b, h, q, imin(kv, skv - 1));
        if constexpr (kMask) {
          bool keep = kv < skv;
          if constexpr (Variant::kHasMask) keep = keep && (!call_mask || Hook<Variant>::mask(a, p, b, h, q, kv));
          if (!keep) x = neg_inf();
        }
        s[mt][nt][e] = x;
      }
}

}  // namespace cubridge
