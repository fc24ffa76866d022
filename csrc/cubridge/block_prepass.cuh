// Runtime pre-pass for masks that read data (document ids, prefix lengths).
// One CTA per (query tile, key tile, batch*head) classifies its tile, cheapest
// test first:
//   1. the mask's interval rule with every load unknown (causal parts, windows);
//   2. the same rule with each load bounded by the [min, max] of the values it
//      reads over the tile's rows or columns (document ids: disjoint ranges are
//      empty, one equal id is full);
//   3. only then the mask itself over every element.
// A scan then turns each row of the table into counts, so that the forward
// kernel's block_class answers for a span of key blocks with two reads.
#pragma once
#include "interval.cuh"
#include "variant.cuh"

namespace cubridge {

// Table layout: [z = b * hb + h][i = query tile][j = key tile, then one more], one int each.
// After block_scan, entry j is (live blocks before j) << 2 | class of j; entry nk is the total << 2.
__device__ __forceinline__ int table_class(const int* row, int j0, int j1) {
  return j1 - j0 == 1 ? (row[j0] & 3) : ((row[j1] >> 2) != (row[j0] >> 2) ? kPartial : kEmpty);
}

template <int NTH>
__device__ __forceinline__ float block_min(float x, float* red) {
  for (int o = 16; o > 0; o /= 2) x = fminf(x, __shfl_xor_sync(~0u, x, o));
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = x;
  __syncthreads();
  x = red[0];
  for (int w = 1; w < NTH / 32; ++w) x = fminf(x, red[w]);
  __syncthreads();
  return x;
}

template <class Variant, int BM, int BN, int NTH>
__device__ __forceinline__ void block_prepass(const FwdArgs& a, const typename Variant::Params& p,
                                              int* table, int hb) {
  const int j = blockIdx.x, i = blockIdx.y, z = blockIdx.z;
  const int b = z / hb, h = z % hb;
  const int sq = static_cast<int>(a.Sq), skv = static_cast<int>(a.Skv);
  const int q_lo = i * BM, kv_lo = j * BN;
  const int q_hi = q_lo + BM < sq ? q_lo + BM : sq, kv_hi = kv_lo + BN < skv ? kv_lo + BN : skv;
  int cls = Variant::index_class(a, p, b, h, q_lo, q_hi, kv_lo, kv_hi);
  constexpr int NS = Variant::kBoundSites;
  if constexpr (NS > 0) {
    if (cls == kPartial) {
      __shared__ float red[NTH / 32];
      Iv lb[NS];
      bool exact = true;
#pragma unroll
      for (int s = 0; s < NS; ++s) {
        const bool rows = Variant::bound_axis(s) == 0;
        const int lo = rows ? q_lo : kv_lo, hi = rows ? q_hi : kv_hi;
        float mn = 3.0e38f, mx = -3.0e38f;
        for (int x = lo + threadIdx.x; x < hi; x += NTH) {
          const double v = Variant::bound_value(a, p, s, b, h, x);
          // float bounds are exact below 2^24; beyond (or NaN) the site stays unknown
          if (!(v > -16777216.0 && v < 16777216.0)) exact = false;
          mn = fminf(mn, static_cast<float>(v));
          mx = fmaxf(mx, static_cast<float>(v));
        }
        lb[s] = iv(block_min<NTH>(mn, red), -block_min<NTH>(-mx, red));
      }
      if (__syncthreads_and(exact)) cls = Variant::data_class(a, p, b, h, q_lo, q_hi, kv_lo, kv_hi, lb);
    }
  }
  if (cls == kPartial) {
    bool any = false, all = true;
    for (int e = threadIdx.x; e < BM * BN && !(any && !all); e += NTH) {  // a mixed thread settles it
      const int q = q_lo + e / BN, kv = kv_lo + e % BN;
      if (q < sq && kv < skv) {
        const bool keep = Variant::mask(a, p, b, h, q, kv);
        any |= keep;
        all &= keep;
      }
    }
    any = __syncthreads_or(any);
    all = __syncthreads_and(all);
    cls = any ? (all ? kFull : kPartial) : kEmpty;
  }
  if (threadIdx.x == 0) table[(static_cast<long long>(z) * gridDim.y + i) * (gridDim.x + 1) + j] = cls;
}

// One warp per table row: classes to (live count before j) << 2 | class.
template <int NTH>
__device__ __forceinline__ void block_scan(int* table, long long rows, int nk) {
  const long long r = static_cast<long long>(blockIdx.x) * (NTH / 32) + threadIdx.x / 32;
  if (r >= rows) return;
  const int lane = threadIdx.x % 32;
  int* row = table + r * (nk + 1);
  int base = 0;
  for (int j0 = 0; j0 < nk; j0 += 32) {
    const int j = j0 + lane;
    const int c = j < nk ? row[j] : kEmpty;
    const unsigned live = __ballot_sync(~0u, c != kEmpty);
    if (j < nk) row[j] = ((base + __popc(live & ((1u << lane) - 1u))) << 2) | c;
    base += __popc(live);
  }
  if (lane == 0) row[nk] = base << 2;
}

}  // namespace cubridge
