// The backward's loads: a CTA's K and V block once, then, two stages deep, each live query block's Q, dO and its
// rows' LSE and delta (cp.async, every thread its share), walking the query heads that read the CTA's KV head
// and, per head, the query blocks the variant's block classes do not prove empty.
#pragma once
#include "bwd_config.cuh"
#include "copy.cuh"
#include "hooks.cuh"

namespace cubridge {

// 4-byte cp.async (L1-allocating; .cg copies 16 bytes only): a row's LSE or delta, zero past the end.
__device__ __forceinline__ void cp_async4(unsigned dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0));
}

// Work item w of a CTA: query head number w / n_m of the KV head's group (Variant::q_head), query block w % n_m.
// The class of the tile [q block] x [the CTA's keys] comes from the same block_class hook as the forward's, so
// every block the forward skips the backward skips too.
template <class Variant, int BM>
struct QueryWalk {
  const FwdArgs& a;
  const typename Variant::Params& p;
  int b, hk, n_m, n_items, kv_lo, kv_hi, sq;

  __device__ __forceinline__ QueryWalk(const FwdArgs& args, const typename Variant::Params& prm, int bb, int hkv,
                                       int k_lo, int k_hi)
      : a(args), p(prm), b(bb), hk(hkv), kv_lo(k_lo), kv_hi(k_hi) {
    sq = static_cast<int>(a.Sq);
    n_m = (sq + BM - 1) / BM;
    n_items = n_m * static_cast<int>(a.Hq / a.Hkv);
  }
  __device__ __forceinline__ int head(int w) const { return Variant::q_head(a, hk, w / n_m); }
  __device__ __forceinline__ int q_lo(int w) const { return (w % n_m) * BM; }
  __device__ __forceinline__ int cls(int w) const {
    const int lo = q_lo(w);
    return Hook<Variant>::block_class(a, p, b, head(w), lo, imin(lo + BM, sq), kv_lo, kv_hi);
  }
  // How many key blocks of BN after this CTA's are live for item w's query block: its turn, in descending key
  // order, to add its share of dQ (the deterministic mode).
  template <int BN>
  __device__ __forceinline__ int live_after(int w) const {
    const int lo = q_lo(w), hi = imin(lo + BM, sq), h = head(w), skv = static_cast<int>(a.Skv);
    int n = 0;
    for (int j0 = kv_lo + BN; j0 < skv; j0 += BN)
      n += Hook<Variant>::block_class(a, p, b, h, lo, hi, j0, imin(j0 + BN, skv)) != kEmpty;
    return n;
  }
  // The first item at or after w not proven empty (n_items: none).
  __device__ __forceinline__ int next(int w) const {
    while (w < n_items && cls(w) == kEmpty) ++w;
    return w;
  }
};

template <class Cfg, class T>
struct BwdLoads {
  static constexpr int D = Cfg::kHeadDim, BM = Cfg::kBlockM, BN = Cfg::kBlockN, LD = Cfg::kLd;
  static constexpr int NTH = Cfg::kThreads;
  const BwdArgs& a;
  int b;

  // The CTA's keys [kv_lo, kv_lo + BN) of K and V (one group), and zeros in every padded column.
  __device__ __forceinline__ void load_kv(T* sK, T* sV, T* sQ, T* sdO, int hk, int kv_lo, int tid) const {
    const T* gK = static_cast<const T*>(a.f.k) + b * a.f.k_sb + hk * a.f.k_sh;
    const T* gV = static_cast<const T*>(a.f.v) + b * a.f.v_sb + hk * a.f.v_sh;
    const int skv = static_cast<int>(a.f.Skv);
    load_tile<BN, D, LD, NTH>(sK, gK, a.f.k_ss, kv_lo, skv, tid);
    load_tile<BN, D, LD, NTH>(sV, gV, a.f.v_ss, kv_lo, skv, tid);
    cp_async_commit();
    zero_pad_columns<BN, D, Cfg::kPadD, LD, NTH>(sK, tid);
    zero_pad_columns<BN, D, Cfg::kPadD, LD, NTH>(sV, tid);
    zero_pad_columns<2 * BM, D, Cfg::kPadD, LD, NTH>(sQ, tid);
    zero_pad_columns<2 * BM, D, Cfg::kPadD, LD, NTH>(sdO, tid);
  }

  // Query rows [q_lo, q_lo + BM) of head h: Q, dO, the LSE and delta, into one stage (one group).
  __device__ __forceinline__ void load_q_block(T* sQ, T* sdO, float* sLse, float* sDelta, int h, int q_lo,
                                               int tid) const {
    const int sq = static_cast<int>(a.f.Sq);
    const T* gQ = static_cast<const T*>(a.f.q) + b * a.f.q_sb + h * a.f.q_sh;
    const T* gdO = static_cast<const T*>(a.dout) + b * a.do_sb + h * a.do_sh;
    load_tile<BM, D, LD, NTH>(sQ, gQ, a.f.q_ss, q_lo, sq, tid);
    load_tile<BM, D, LD, NTH>(sdO, gdO, a.do_ss, q_lo, sq, tid);
    const long long row0 = bwd_slot(a, b, h) * a.sq_pad;
    for (int r = tid; r < 2 * BM; r += NTH) {
      const int q = q_lo + r % BM;
      const bool ok = q < sq;
      const float* src = (r < BM ? a.lse_pad : a.delta) + row0 + (ok ? q : 0);
      cp_async4(smem_u32(r < BM ? sLse + r : sDelta + r - BM), src, ok);
    }
    cp_async_commit();
  }
};

}  // namespace cubridge
