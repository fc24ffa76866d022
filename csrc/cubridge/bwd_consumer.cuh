// The backward's math for one query block against a CTA's resident keys, per warp (16 keys, mma.sync m16n8k16,
// float32 accumulation). Everything is computed transposed, keys as rows, so the probabilities and dS leave the
// accumulators straight into the A operand of dV += P^T dO and dK += dS^T Q (gemm.cuh's P V step):
//   dP^T = V dO^T,  S^T = K Q^T,  X = score(S) (score hook),  P = exp2(X log2e - LSE log2e),
//   dS = P (dP - delta) * dscore/ds (score_grad hook), masked pairs and rows past the ends zero;
// then dS goes to shared memory as [query][key] and the CTA's warps share dQ += dS K, added to the float32
// accumulator by atomics.
#pragma once
#include "bwd_config.cuh"
#include "gemm.cuh"
#include "hooks.cuh"
#include "score_tile.cuh"
#include "sites.cuh"
#include "softmax.cuh"

namespace cubridge {

// p[0] += x and p[1] += y in global memory (p 8-byte aligned). sm_90 reduces both in one 2-wide request,
// half the L2 requests of two scalar atomics; dQ's accumulation issues one per pair of columns.
__device__ __forceinline__ void red_add2(float* p, float x, float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(x), "f"(y) : "memory");
#else
  atomicAdd(p, x);
  atomicAdd(p + 1, y);
#endif
}

// A warp's tile of NT * 8 queries by 16 keys in the m16n8 accumulator layout (keys as rows from kv_row0, queries
// as columns from q_lo): element (nt, e) is query nt * 8 + (lane % 4) * 2 + e % 2 and key kv_row0 + (e / 2) * 8.
//
// The mask's verdicts on a partial block (cls), first, as bits of one register (element nt * 4 + e) that drop
// the pair: as per-element predicates alive through the exponentials they take registers the masked variants
// lack at 32 rows a step.
template <class Variant, int NT>
__device__ __forceinline__ unsigned mask_drops(const FwdArgs& a, const typename Variant::Params& p, int b, int h,
                                               int q_lo, int cls, int kv_row0, int lane) {
  static_assert(NT * 4 <= 32, "a tile's mask bits fit one word");
  unsigned drop = 0;
  if constexpr (Variant::kHasMask)
    if (cls == kPartial) {
      const int sq = static_cast<int>(a.Sq), skv = static_cast<int>(a.Skv);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int q = imin(q_lo + nt * 8 + (lane % 4) * 2 + e % 2, sq - 1);
          const int kv = imin(kv_row0 + (e / 2) * 8, skv - 1);
          drop |= static_cast<unsigned>(!Hook<Variant>::mask(a, p, b, h, q, kv)) << (nt * 4 + e);
        }
    }
  return drop;
}

// The tile's S^T and dP^T become P and dS, in place: P = exp(score(s) - LSE), dS = P (dP - delta) dscore/ds,
// zero where the mask drops the pair, past the keys' or queries' end, and on empty rows (the FA2-class warp,
// BwdWarp). A variant whose score reads learnable tensors (kSites) is handed each pair's dX = P (dP - delta)
// (d loss / d score), whether it is live, the raw s, the clamped coordinates and the tile's own (ql, kl; kl0:
// the thread's first key's), for site_add to gather into those tensors' gradients (win: its shared memory).
template <class Variant, int NT>
__device__ __forceinline__ void bwd_grads(float (&s)[1][NT][4], float (&dp)[1][NT][4], const float* sLse,
                                          const float* sDelta, const FwdArgs& a, const typename Variant::Params& p,
                                          int b, int h, int q_lo, int cls, int kv_row0, int lane,
                                          typename Variant::Sites& sites, float* win, int kl0) {
  constexpr bool kRaw = score_is_default<Variant>(0);
  const float factor = kRaw ? static_cast<float>(a.scale) * kLog2e : kLog2e;
  const int sq = static_cast<int>(a.Sq), skv = static_cast<int>(a.Skv);
  const unsigned drop = mask_drops<Variant, NT>(a, p, b, h, q_lo, cls, kv_row0, lane);
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int ql = nt * 8 + (lane % 4) * 2 + e % 2, q = q_lo + ql, kv = kv_row0 + (e / 2) * 8;
      const int qc = imin(q, sq - 1), kc = imin(kv, skv - 1);
      const bool keep = q < sq && kv < skv && !((drop >> (nt * 4 + e)) & 1u);
      const float raw = s[0][nt][e];
      const float x = kRaw ? raw : Hook<Variant>::score(a, p, raw, b, h, qc, kc);
      const float lse = sLse[ql];
      // An empty row (LSE -inf: every key masked, no sink) has no probabilities: P and dS are zero. A hooked
      // score is in the LSE's own units, and is subtracted before it is scaled (as softmax.cuh does): a row
      // a fill near finfo.min fills whole has x and LSE at the fill, where lse * log2(e) overflows.
      const float pr = !keep || lse == neg_inf() ? 0.f
                       : kRaw ? fast_exp2(fmaf(x, factor, -lse * kLog2e)) : fast_exp2((x - lse) * kLog2e);
      const float g = kRaw ? static_cast<float>(a.scale) : Hook<Variant>::score_grad(a, p, raw, b, h, qc, kc);
      s[0][nt][e] = pr;
      const float dx = pr * (dp[0][nt][e] - sDelta[ql]);
      if constexpr (Variant::kSites > 0)  // by every lane (site_window_add sums a warp's shares of one element)
        Variant::site_add(sites, win, a, p, raw, pr != 0.f, dx, b, h, qc, kc, ql, kl0 + (e / 2) * 8);
      dp[0][nt][e] = pr != 0.f ? dx * g : 0.f;
    }
}

// The same in two halves, so the tensor cores take dV = P^T dO while dP^T is still on them (the Hopper
// kernel): bwd_probs makes P, as the A operand pa (input dtype), from S^T alone, and leaves s holding
// P dscore/ds in float32 (P alone where kTimesGrad is false: bwd_dscores_sites); bwd_dscores then makes dS from
// it and dP^T, as the A operand da. kEdge false: the caller knows every pair of the tile live (a full block,
// all its queries and keys before the ends), so no pair is tested; a plain score's row then has a finite LSE.
template <class Variant, int NT, class T, bool kTimesGrad = true, bool kEdge = true>
__device__ __forceinline__ void bwd_probs(float (&s)[1][NT][4], unsigned (&pa)[NT / 2][4], const float* sLse,
                                          const FwdArgs& a, const typename Variant::Params& p, int b, int h,
                                          int q_lo, int cls, int kv_row0, int lane) {
  constexpr bool kRaw = score_is_default<Variant>(0);
  const float factor = kRaw ? static_cast<float>(a.scale) * kLog2e : kLog2e;
  const int sq = static_cast<int>(a.Sq), skv = static_cast<int>(a.Skv);
  const unsigned drop = mask_drops<Variant, NT>(a, p, b, h, q_lo, cls, kv_row0, lane);
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    float pr[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int ql = nt * 8 + (lane % 4) * 2 + e % 2, q = q_lo + ql, kv = kv_row0 + (e / 2) * 8;
      const int qc = imin(q, sq - 1), kc = imin(kv, skv - 1);
      const bool keep = !kEdge || (q < sq && kv < skv && !((drop >> (nt * 4 + e)) & 1u));
      const float raw = s[0][nt][e];
      const float x = kRaw ? raw : Hook<Variant>::score(a, p, raw, b, h, qc, kc);
      const float lse = sLse[ql];
      // P as bwd_grads makes it: one helper for both element loops moved ptxas's allocation (two more spills
      // in the Hopper kernel at 128 columns), so the loops stay apart and share the mask's bits
      if (kRaw && !kEdge)
        pr[e] = fast_exp2(fmaf(x, factor, -lse * kLog2e));
      else
        pr[e] = !keep || lse == neg_inf() ? 0.f
                : kRaw ? fast_exp2(fmaf(x, factor, -lse * kLog2e)) : fast_exp2((x - lse) * kLog2e);
      if constexpr (kTimesGrad) {
        // a hook's dscore/ds may be infinite or NaN where the pair is dropped; the plain score's is the scale
        const float g = kRaw ? static_cast<float>(a.scale) : Hook<Variant>::score_grad(a, p, raw, b, h, qc, kc);
        s[0][nt][e] = kRaw ? pr[e] * g : pr[e] != 0.f ? pr[e] * g : 0.f;
      } else {
        s[0][nt][e] = pr[e];
      }
    }
    pa[nt / 2][(nt % 2) * 2] = pack2<T>(pr[0], pr[1]);
    pa[nt / 2][(nt % 2) * 2 + 1] = pack2<T>(pr[2], pr[3]);
  }
}

// dS of the tile packed as the A operand da (input dtype), element (nt, e) from rule(nt, e, ql) (ql: its query
// in the block): the element loop both dS halves below share.
template <int NT, class T, class Rule>
__device__ __forceinline__ void pack_dscores(unsigned (&da)[NT / 2][4], int lane, Rule&& rule) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    float ds[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) ds[e] = rule(nt, e, nt * 8 + (lane % 4) * 2 + e % 2);
    da[nt / 2][(nt % 2) * 2] = pack2<T>(ds[0], ds[1]);
    da[nt / 2][(nt % 2) * 2 + 1] = pack2<T>(ds[2], ds[3]);
  }
}

template <int NT, class T>
__device__ __forceinline__ void bwd_dscores(const float (&pg)[1][NT][4], const float (&dp)[1][NT][4],
                                            unsigned (&da)[NT / 2][4], const float* sDelta, int lane) {
  // pg is exactly zero on dropped pairs (bwd_probs), and dP and delta are finite (the copy engine zero-fills
  // rows past the ends): no pair is tested
  pack_dscores<NT, T>(da, lane, [&](int nt, int e, int ql) { return pg[0][nt][e] * (dp[0][nt][e] - sDelta[ql]); });
}

// bwd_dscores where the score reads learnable tensors (the Hopper kernel; lower/sites.py gives it only variants
// whose dscore/ds is one value g over the tile and whose sites' derivatives do not read s): pr holds P alone
// (bwd_probs<..., false>), each pair's dX = P (dP - delta) goes to site_add, and dS = dX g.
template <class Variant, int NT, class T>
__device__ __forceinline__ void bwd_dscores_sites(const float (&pr)[1][NT][4], const float (&dp)[1][NT][4],
                                                  unsigned (&da)[NT / 2][4], const float* sDelta, const FwdArgs& a,
                                                  const typename Variant::Params& p, int b, int h, int q_lo,
                                                  int kv_row0, int kl0, int lane, float g,
                                                  typename Variant::Sites& sites, float* win) {
  const int sq = static_cast<int>(a.Sq), skv = static_cast<int>(a.Skv);
  pack_dscores<NT, T>(da, lane, [&](int nt, int e, int ql) {
    const int qc = imin(q_lo + ql, sq - 1), kc = imin(kv_row0 + (e / 2) * 8, skv - 1);
    const float pv = pr[0][nt][e], dx = pv * (dp[0][nt][e] - sDelta[ql]);
    Variant::site_add(sites, win, a, p, 0.f, pv != 0.f, dx, b, h, qc, kc, ql, kl0 + (e / 2) * 8);
    return pv != 0.f ? dx * g : 0.f;
  });
}

// Rows kv_row0 and kv_row0 + 8 of a key-major gradient (dK or dV; the m16n8 accumulator layout, DT n8 tiles,
// D columns of data) to global memory in the input dtype at g + b sb + hk sh + kv ss, rows past the keys' end
// skipped.
template <int D, int DT, class T>
__device__ __forceinline__ void store_rows(const float (&x)[1][DT][4], void* g, long long sb, long long sh,
                                           long long ss, long long skv, int b, int hk, int kv_row0, int lane) {
  T* rows = static_cast<T*>(g) + b * sb + hk * sh;
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int kv = kv_row0 + hf * 8;
    if (kv >= skv) continue;
#pragma unroll
    for (int t = 0; t < DT; ++t) {
      const int c = t * 8 + (lane % 4) * 2;
      if (D % 64 != 0 && c >= D) continue;  // the padded columns
      *reinterpret_cast<unsigned*>(rows + kv * ss + c) = pack2<T>(x[0][t][2 * hf], x[0][t][2 * hf + 1]);
    }
  }
}

// dK's and dV's rows of one warp (head dims alike).
template <int D, int DT, class T>
__device__ __forceinline__ void store_dkdv(const float (&dk)[1][DT][4], const float (&dv)[1][DT][4],
                                           const BwdArgs& a, int b, int hk, int kv_row0, int lane) {
  store_rows<D, DT, T>(dk, a.dk, a.dk_sb, a.dk_sh, a.dk_ss, a.f.Skv, b, hk, kv_row0, lane);
  store_rows<D, DT, T>(dv, a.dv, a.dv_sb, a.dv_sh, a.dv_ss, a.f.Skv, b, hk, kv_row0, lane);
}

template <class Cfg, class Variant, class T>
struct BwdWarp {
  static constexpr int BM = Cfg::kBlockM, BN = Cfg::kBlockN, LD = Cfg::kLd, LDS = Cfg::kLdS;
  static constexpr int NT = BM / 8;             // n8 query tiles of S^T
  static constexpr int KC = Cfg::kPadD / 16;    // k16 steps over the head dim
  static constexpr int DT = Cfg::kPadD / 8;     // n8 tiles of a dK / dV row
  static constexpr int QP = Cfg::kDqPairs;      // 16-column pairs of a warp's dQ share
  // The default score s * scale: X kept as the raw dot product, scale * log2e folded into the exponent
  // (softmax.cuh's factor), and dscore/ds is the scale.
  static constexpr bool kRaw = score_is_default<Variant>(0);
  static_assert(kRaw || !score_grad_is_default<Variant>(0),
                "a variant with its own score hook needs its own score_grad hook");
  int warp, lane, kv_row0;  // kv_row0: this lane's first key (+8: its second)

  __device__ __forceinline__ BwdWarp(int w, int ln, int kv_lo) : warp(w), lane(ln) {
    kv_row0 = kv_lo + w * 16 + ln / 4;
  }

  // dP^T = V dO^T and S^T = K Q^T over this warp's 16 keys and the block's BM queries.
  __device__ __forceinline__ void products(float (&s)[1][NT][4], float (&dp)[1][NT][4], const T* sK, const T* sV,
                                           const T* sQ, const T* sdO) const {
    const int a_off = (warp * 16 * LD + lane_off_a<LD>(lane)) * 2, b_off = lane_off_k<LD>(lane) * 2;
    gemm_qk_smem<T, 1, NT, KC, LD, LD>(dp, smem_u32(sV) + a_off, smem_u32(sdO) + b_off);
    gemm_qk_smem<T, 1, NT, KC, LD, LD>(s, smem_u32(sK) + a_off, smem_u32(sQ) + b_off);
  }

  // s becomes P and dp becomes dS, in place (bwd_grads). cls: the block's class.
  __device__ __forceinline__ void grads(float (&s)[1][NT][4], float (&dp)[1][NT][4], const float* sLse,
                                        const float* sDelta, const FwdArgs& a, const typename Variant::Params& p,
                                        int b, int h, int q_lo, int cls, typename Variant::Sites& sites,
                                        float* win) const {
    bwd_grads<Variant, NT>(s, dp, sLse, sDelta, a, p, b, h, q_lo, cls, kv_row0, lane, sites, win,
                           warp * 16 + lane / 4);
  }

  // dV += P^T dO and dK += dS^T Q (P and dS rounded to T, as the tensor cores take them).
  __device__ __forceinline__ void accumulate(float (&dv)[1][DT][4], float (&dk)[1][DT][4], const float (&s)[1][NT][4],
                                             const float (&ds)[1][NT][4], const T* sQ, const T* sdO) const {
    const int off = lane_off_v<LD>(lane) * 2;
    gemm_pv<T, 1, NT, DT, LD>(dv, s, smem_u32(sdO) + off);
    gemm_pv<T, 1, NT, DT, LD>(dk, ds, smem_u32(sQ) + off);
  }

  // This warp's dS^T into the [query][key] tile.
  __device__ __forceinline__ void stage_ds(T* sdS, const float (&ds)[1][NT][4]) const {
    const int kl = warp * 16 + lane / 4;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) sdS[(nt * 8 + (lane % 4) * 2 + e % 2) * LDS + kl + (e / 2) * 8] = from_f32<T>(ds[0][nt][e]);
  }

  // dQ[q_lo.., :] += dS K: this warp's 16 rows (row tile warp % (BM / 16)) and its column group's 16-column
  // pairs (group warp / (BM / 16)), added to the float32 accumulator of head h. After a barrier past every
  // warp's stage_ds.
  __device__ __forceinline__ void dq(const T* sdS, const T* sK, const BwdArgs& a, int b, int h, int q_lo) const {
    constexpr int D = Cfg::kHeadDim, G = Cfg::kDqGroups, PAIRS = Cfg::kPadD / 16;
    const int mt = warp % (BM / 16), g = warp / (BM / 16);
    float acc[QP][2][4];
#pragma unroll
    for (int j = 0; j < QP; ++j)
#pragma unroll
      for (int t = 0; t < 2; ++t) acc[j][t][0] = acc[j][t][1] = acc[j][t][2] = acc[j][t][3] = 0.f;
    const unsigned a_addr = smem_u32(sdS) + (mt * 16 * LDS + lane_off_a<LDS>(lane)) * 2;
    const unsigned b_addr = smem_u32(sK) + (lane_off_v<LD>(lane) + g * 16) * 2;
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      unsigned fa[4];
      ldsm_x4(fa, a_addr + kk * 16 * 2);
#pragma unroll
      for (int j = 0; j < QP; ++j) {
        if (PAIRS % G != 0 && g + j * G >= PAIRS) continue;  // warp-uniform: this group has fewer pairs
        unsigned fb[4];
        ldsm_x4_t(fb, b_addr + (kk * 16 * LD + j * G * 16) * 2);
        mma16816<T>(acc[j][0], fa, fb[0], fb[1]);
        mma16816<T>(acc[j][1], fa, fb[2], fb[3]);
      }
    }
    const int sq = static_cast<int>(a.f.Sq);
    float* row = a.dq_acc + bwd_slot(a, b, h) * a.f.Sq * D;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int q = q_lo + mt * 16 + lane / 4 + hf * 8;
      if (q >= sq) continue;
#pragma unroll
      for (int j = 0; j < QP; ++j) {
        if (PAIRS % G != 0 && g + j * G >= PAIRS) continue;
#pragma unroll
        for (int t = 0; t < 2; ++t) {
          const int c = (g + j * G) * 16 + t * 8 + (lane % 4) * 2;
          if (D % 16 != 0 && c >= D) continue;  // the padded columns
          red_add2(row + static_cast<long long>(q) * D + c, acc[j][t][2 * hf], acc[j][t][2 * hf + 1]);
        }
      }
    }
  }

  // This warp's rows of dK and dV (in the input dtype) to global memory, rows past the keys' end skipped.
  __device__ __forceinline__ void store(const float (&dk)[1][DT][4], const float (&dv)[1][DT][4], const BwdArgs& a,
                                        int b, int hk) const {
    store_dkdv<Cfg::kHeadDim, DT, T>(dk, dv, a, b, hk, kv_row0, lane);
  }
};

}  // namespace cubridge
