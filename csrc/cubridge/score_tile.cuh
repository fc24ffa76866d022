// Score and mask hooks applied to a tile of accumulator fragments in the
// mma m16n8 layout (mma.sync, and each warp's slice of a wgmma accumulator).
#pragma once
#include "hooks.cuh"
#include "softmax.cuh"
#include "variant.cuh"

namespace cubridge {

__device__ __forceinline__ int imin(int x, int y) { return x < y ? x : y; }

// Which of this lane's (row, key) pairs the mask hook keeps, one bit per key of a row pair:
// all ones unless call_mask (a partial tile). The mask does not read the scores, so the kernel
// computes it before waiting for Q K^T and its loads' latency hides behind the GEMM.
// q0/kv0 are this lane's first query row / key; hooks see indices clamped to the valid range.
template <class Variant, int MT, int NT>
__device__ __forceinline__ void mask_bits(unsigned long long (&keep)[MT][2], const FwdArgs& a,
                                          const typename Variant::Params& p, int b, int h,
                                          int q0, int kv0, int sq, int skv, bool call_mask) {
  static_assert(2 * NT <= 64, "one bit per key of a row");
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) keep[mt][0] = keep[mt][1] = ~0ull;
  if constexpr (Variant::kHasMask) {
    if (call_mask) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) keep[mt][0] = keep[mt][1] = 0;
      auto bit = [&](int mt, int hf, int c) {
        const int q = imin(q0 + mt * 16 + hf * 8, sq - 1), kv = imin(kv0 + (c / 2) * 8 + c % 2, skv - 1);
        keep[mt][hf] |= static_cast<unsigned long long>(Hook<Variant>::mask(a, p, b, h, q, kv)) << c;
      };
      // One row pair per lane (a wgmma slice): keys outer, so each key's loads serve both rows.
      // Several (mma.sync): rows outer, which keeps fewer loaded values live (no spills).
      if constexpr (MT == 1) {
#pragma unroll
        for (int c = 0; c < 2 * NT; ++c) bit(0, 0, c), bit(0, 1, c);
      } else {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int hf = 0; hf < 2; ++hf)
#pragma unroll
            for (int c = 0; c < 2 * NT; ++c) bit(mt, hf, c);
      }
    }
  }
}

// Apply the score hook (unless kRaw: the default s * scale is folded into the exp2 factor) and,
// when kMask, the key bound and the mask bits, in place. Out-of-range rows are never stored.
template <class Variant, bool kRaw, bool kMask, int MT, int NT>
__device__ __forceinline__ void apply_score(float (&s)[MT][NT][4], const unsigned long long (&keep)[MT][2],
                                            const FwdArgs& a, const typename Variant::Params& p,
                                            int b, int h, int q0, int kv0, int sq, int skv) {
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
          if (!(kv < skv && (keep[mt][e / 2] >> (nt * 2 + e % 2) & 1ull))) x = neg_inf();
        }
        s[mt][nt][e] = x;
      }
}

// The decode kernel's scores of one warp's keys (rows hr/qr of a lane's two row halves, keys from kv0): the
// score hook (unless kRaw), the split's key bound kv_end, and on a partial block the mask, each key at a time.
template <class Variant, bool kRaw, int NT>
__device__ __forceinline__ void score_rows(float (&s)[1][NT][4], const FwdArgs& a, const typename Variant::Params& p,
                                           int b, const int (&hr)[2], const int (&qr)[2], int kv0, int skv,
                                           int kv_end, int cls) {
  using H = Hook<Variant>;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int hf = e / 2, kv = kv0 + nt * 8 + e % 2, kc = imin(kv, skv - 1);
      float x = s[0][nt][e];
      if constexpr (!kRaw) x = H::score(a, p, x, b, hr[hf], qr[hf], kc);
      bool keep = kv < kv_end;
      if constexpr (Variant::kHasMask)
        if (cls == kPartial) keep = keep && H::mask(a, p, b, hr[hf], qr[hf], kc);
      s[0][nt][e] = keep ? x : neg_inf();
    }
}

}  // namespace cubridge
