// Runtime pre-pass for masks that read data (document ids, prefix lengths):
// one CTA per (query tile, key tile, batch*head) evaluates the variant's mask
// over its tile and writes the tile class the forward kernel's block_class
// hook then reads. Interval analysis cannot see data; this sees all of it.
#pragma once
#include "variant.cuh"

namespace cubridge {

// Table layout: [z = b * hb + h][i = query tile][j = key tile], one byte each.
template <class Variant, int BM, int BN, int NTH>
__device__ __forceinline__ void block_prepass(const FwdArgs& a, const typename Variant::Params& p,
                                              signed char* table, int hb) {
  const int j = blockIdx.x, i = blockIdx.y, z = blockIdx.z;
  const int b = z / hb, h = z % hb;
  const int sq = static_cast<int>(a.Sq), skv = static_cast<int>(a.Skv);
  const int q_lo = i * BM, kv_lo = j * BN;
  bool any = false, all = true;
  for (int e = threadIdx.x; e < BM * BN; e += NTH) {
    const int q = q_lo + e / BN, kv = kv_lo + e % BN;
    if (q < sq && kv < skv) {
      const bool keep = Variant::mask(a, p, b, h, q, kv);
      any |= keep;
      all &= keep;
    }
  }
  any = __syncthreads_or(any);
  all = __syncthreads_and(all);
  if (threadIdx.x == 0)
    table[(static_cast<long long>(z) * gridDim.y + i) * gridDim.x + j] = any ? (all ? kFull : kPartial) : kEmpty;
}

}  // namespace cubridge
