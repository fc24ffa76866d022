// Expert backward attention kernel for Hopper (sm_90a): TMA copies, wgmma, warp specialisation. The same
// math, hooks, walk and launches as the FA2-class kernel (bwd_kernel.cuh):
//   P = exp(score(Q K^T) - LSE),  dV = P^T dO,  dS = P (dO V^T - delta) dscore/ds,  dK = dS^T Q,  dQ = dS K.
//
// Three launches (lower/backward.py names them): the preprocess and postprocess of bwd_prepost.cuh around
//   main  grid (ceil(Skv / Cfg::kBlockN), Hkv, B), block Cfg::kThreads, Cfg::kSmemBytes of dynamic shared
//         memory; parameters (BwdArgs, Params, tensor maps of Q, K, V, dO, boxes of 64 columns by 64 rows for
//         Q and dO and by kBlockN rows for K and V).
//
// The roles, each in its own file:
// - the producer warp (bwd_producer_sm90.cuh): K and V of the CTA's keys once, then each live query block's
//   Q, dO, LSE and delta into a kStages-deep ring (pipeline.cuh, QueryRing); it gives its registers away;
// - the consumer warpgroups (bwd_consumer_sm90.cuh), 64 keys each: the five products on the tensor cores,
//   dK and dV in registers for the whole walk, dQ's share staged in shared memory and added to its float32
//   accumulator by one bulk reduction per warpgroup and block;
// - the epilogue: dK and dV in the input dtype (bwd_consumer.cuh, store_dkdv), and dQ by the postprocess.
// A variant whose score reads learnable tensors (Variant::kSites: point and diagonal sites, lower/sites.py) stages
// each step's shares in shared memory past the tile's, flushed by the consumers while the tensor cores take dQ.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "bwd_config.cuh"
#include "bwd_consumer_sm90.cuh"
#include "bwd_prepost.cuh"
#include "bwd_producer_sm90.cuh"

namespace cubridge {

template <class Cfg>
struct BwdSm90Smem {
  static constexpr int ST = Cfg::kStages;
  unsigned sK, sV, sQ, sdO, sdS, sDq, sLse, sDelta;  // shared addresses (Q, dO, LSE, delta: stage 0)
  float* dq_stage;                                    // consumer 0's dQ share, generic
  const float *lse, *delta;                      // stage 0's rows, generic
  QueryRing<ST> ring;
  int* info;  // per stage: the item, and its class | 4 where it is the walk's last

  __device__ __forceinline__ explicit BwdSm90Smem(unsigned char* smem_raw) {
    const unsigned raw = smem_u32(smem_raw);
    const unsigned pad = ((raw + 1023u) & ~1023u) - raw;
    unsigned char* base = smem_raw + pad;
    sK = raw + pad;
    sV = sK + Cfg::kKBytes;
    sQ = sV + Cfg::kVBytes;
    sdO = sQ + ST * Cfg::kQBytes;
    sdS = sdO + ST * Cfg::kOBytes;
    sDq = sdS + 2 * Cfg::kSBytes;
    sLse = sDq + Cfg::kConsumers * Cfg::kDqBytes;
    sDelta = sLse + ST * Cfg::kRowBytes;
    dq_stage = reinterpret_cast<float*>(base + (sDq - sK));
    lse = reinterpret_cast<const float*>(base + (sLse - sK));
    delta = reinterpret_cast<const float*>(base + (sDelta - sK));
    ring.bars = sDelta + ST * Cfg::kRowBytes;
    info = reinterpret_cast<int*>(base + (ring.bars - sK) + 8 * QueryRing<ST>::kBarriers);
  }
};

template <class Cfg, class Variant, class T>
__device__ __forceinline__ void attention_bwd_sm90(const BwdArgs& a, const typename Variant::Params& p,
                                                   const TmaDesc* tq, const TmaDesc* tk, const TmaDesc* tv,
                                                   const TmaDesc* tdo) {
  constexpr int BM = Cfg::kBlockM, BN = Cfg::kBlockN, NC = Cfg::kConsumers;
  using C = WgmmaBwdConsumer<Cfg, Variant, T>;
  using R = QueryRing<Cfg::kStages>;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const BwdSm90Smem<Cfg> sm(smem_raw);
  const int tid = threadIdx.x, wg = tid / 128;
  // The deterministic mode adds dQ's shares of a query block in descending key order and dispatches a head's
  // key blocks in that order too, so a CTA waits only on CTAs launched before it. Where the walk starts at the
  // diagonal (causal, windows, documents) the CTA one key block further has then reached each query block a
  // step earlier, and nothing waits; in ascending order the CTA of key block j waited for j CTAs' walks.
  const int kv_block = Cfg::kDeterministic ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const int b = blockIdx.z + a.b0, hk = blockIdx.y + a.hk0, kv_lo = kv_block * BN;
  const int kv_hi = imin(kv_lo + BN, static_cast<int>(a.f.Skv));
  const QueryWalk<Variant, BM> walk(a.f, p, b, hk, kv_lo, kv_hi);
  if (tid == 0) sm.ring.init(4 * NC);  // one arrival per consumer warp empties a stage
  __syncthreads();

  // The producer warpgroup comes last (wgmma's warpgroups start at a multiple of 4 warps). Its registers go
  // to the consumers (setmaxnreg): a CTA's threads are counted in whole warpgroups, which caps each at 168
  // registers, below a consumer's dK and dV rows plus its products.
  if (wg == NC) {
    regs_dealloc<Cfg::kProducerRegs>();
    if (tid == 128 * NC) BwdTmaProducer<Cfg>{tq, tk, tv, tdo}.run(sm, walk, a, b, hk, kv_lo);
    return;
  }
  regs_alloc<Cfg::kConsumerRegs>();
  const C c(wg, tid, kv_lo, sm.sK, sm.sV);
  float dk[1][C::DT][4], dv[1][C::DTV][4];
#pragma unroll
  for (int t = 0; t < C::DT; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[0][t][e] = 0.f;
#pragma unroll
  for (int t = 0; t < C::DTV; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) dv[0][t][e] = 0.f;

  constexpr bool kSites = Variant::kSites > 0;
  constexpr bool kTimesGrad = !kSites && !ds_unscaled<Variant>();  // dscore/ds in P's half (bwd_probs)
  float* sWin = reinterpret_cast<float*>(smem_raw + Cfg::kSmemBytes);  // the learnable sites', if any
  if constexpr (kSites) {  // read after the first step's site barrier
    for (int i = tid; i < Variant::kSiteFloats; i += 128 * NC) sWin[i] = 0.f;
  }
  bool more = walk.next(0) < walk.n_items;  // the producer's walk, computed alike
  mbar_wait(sm.ring.kv_full(), 0);  // always: no copy may still fly into a CTA that has left
  for (int i = 0; more; ++i) {
    const int s = R::stage(i);
    mbar_wait(sm.ring.full(s), R::full_phase(i));
    const int item = sm.info[2 * s], cls = sm.info[2 * s + 1] & 3;
    more = !(sm.info[2 * s + 1] >> 2);
    const int h = walk.head(item), q_lo = walk.q_lo(item);
    const unsigned sQ = sm.sQ + s * Cfg::kQBytes, sdO = sm.sdO + s * Cfg::kOBytes;

    // the tensor cores take S^T, dP^T, then dV while dS is made, then dK while dS is staged, then dQ
    float sc[1][C::NT][4], dp[1][C::NT][4];
    unsigned pa[C::PK][4], da[C::PK][4];
    const int q_hi = imin(q_lo + BM, static_cast<int>(a.f.Sq));
    typename Variant::Sites sites;
    if constexpr (kSites) Variant::site_tile(sites, a.f, p, b, h, q_lo, q_hi, kv_lo, kv_hi);
    c.products(sc, dp, sQ, sdO);
    wgmma_wait<1>();
    wgmma_hold<4 * C::NT>(&sc[0][0][0]);
    // a tile with every pair live (most of a walk) tests none
    if (cls == kPartial || q_hi - q_lo < BM || kv_hi - kv_lo < BN)
      bwd_probs<Variant, C::NT, T, kTimesGrad, true>(sc, pa, sm.lse + s * BM, a.f, p, b, h, q_lo, cls, c.kv_row0,
                                                  c.lane);
    else
      bwd_probs<Variant, C::NT, T, kTimesGrad, false>(sc, pa, sm.lse + s * BM, a.f, p, b, h, q_lo, cls, c.kv_row0,
                                                   c.lane);
    c.accumulate(dv, pa, sdO);  // dV += P^T dO
    wgmma_wait<1>();
    wgmma_hold<4 * C::NT>(&dp[0][0][0]);
    // dscore/ds: one value over the tile where the score reads learnable tensors (lower/sites.py)
    const float g = kSites ? Hook<Variant>::score_grad(a.f, p, 0.f, b, h, q_lo, kv_lo) : 0.f;
    if constexpr (kSites)
      bwd_dscores_sites<Variant, C::NT, T>(sc, dp, da, sm.delta + s * BM, a.f, p, b, h, q_lo, c.kv_row0,
                                           c.kv_row0 - kv_lo, c.lane, g, sites, sWin);
    else
      bwd_dscores<C::NT, T>(sc, dp, da, sm.delta + s * BM, c.lane);
    c.accumulate(dk, da, sQ);  // dK += dS^T Q
    // dS for dQ, from its packed operand while the tensor cores take dV and dK: the buffers alternate, so a
    // warpgroup writes one while the other may still read the last (it passed this item's barrier only after
    // its last dQ completed)
    const int buf = i & 1;
    c.stage_ds(sm.sdS + buf * Cfg::kSBytes, da);
    fence_proxy_async();  // the generic writes, before the tensor cores read them
    c.dq_stage_free();    // the issuer's last reduction has read the staging buffer, before the barrier below
    if constexpr (Cfg::kDqSplitN)
      named_sync(1, 128 * NC);  // every warpgroup's keys of dS staged
    else
      named_sync(1 + c.cw, 128);  // this warpgroup's
    float dq[1][C::QT][4];
    c.dq(dq, sm.sdS + buf * Cfg::kSBytes);
    if constexpr (kSites) {  // while the tensor cores take dQ: every consumer's shares staged, flushed, and read
      if constexpr (!Cfg::kDqSplitN) named_sync(5, 128 * NC);  // before the next step's are staged
      Variant::site_flush(sites, sWin, a.f, p, b, h, q_lo, q_hi, kv_lo, kv_hi, tid, 128 * NC, c.lane);
      named_sync(6, 128 * NC);
    }
    wgmma_wait<0>();
    wgmma_hold<4 * C::DTV>(&dv[0][0][0]);
    wgmma_hold<4 * C::DT>(&dk[0][0][0]);
    wgmma_hold_a<4 * C::PK>(&pa[0][0]);
    wgmma_hold_a<4 * C::PK>(&da[0][0]);
    wgmma_hold<4 * C::QT>(&dq[0][0][0]);
    c.release(sm.ring.empty(s));  // Q, dO, LSE and delta of this stage read
    // the last block's reduction has read the staging buffer: its issuer waited before this item's dS barrier
    const int rank = Cfg::kDeterministic && c.issuer() ? walk.template live_after<BN>(item) : 0;
    c.add_dq(dq, sm.dq_stage, sm.sDq, a, b, h, q_lo, rank);
  }
  c.finish_dq();
  if constexpr (ds_unscaled<Variant>()) {
    const float scale = static_cast<float>(a.f.scale);
#pragma unroll
    for (int t = 0; t < C::DT; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) dk[0][t][e] *= scale;
  }
  store_rows<Cfg::kHeadDim, C::DT, T>(dk, a.dk, a.dk_sb, a.dk_sh, a.dk_ss, a.f.Skv, b, hk, c.kv_row0, c.lane);
  store_rows<Cfg::kValueDim, C::DTV, T>(dv, a.dv, a.dv_sb, a.dv_sh, a.dv_ss, a.f.Skv, b, hk, c.kv_row0, c.lane);
}

}  // namespace cubridge
