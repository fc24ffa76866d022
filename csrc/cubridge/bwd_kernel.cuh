// Expert backward attention kernel (FlashAttention-2 style, mma.sync tensor cores), from the forward's saved
// O and natural-log LSE:
//   P = exp(score(Q K^T) - LSE),  dV = P^T dO,  dS = P (dO V^T - delta) dscore/ds,  dK = dS^T Q,  dQ = dS K.
//
// Three launches (lower/backward.py names them):
//   preprocess  (bwd_prepost.cuh): delta = rowsum(dO * O), dQ's float32 accumulator zeroed;
//   main        grid (ceil(Skv / Cfg::kBlockN), Hkv, B), block Cfg::kThreads, Cfg::kSmemBytes of dynamic shared
//               memory: one CTA per key block of one KV head, which walks the query blocks of every query head
//               reading that KV head (GQA's group inside the CTA: dK and dV sum over the group in registers, with
//               no atomics and the same order every run), skipping the blocks the variant's block_class proves
//               empty and calling the mask hook on partial ones;
//   postprocess (bwd_prepost.cuh): dQ from the accumulator.
// A variant whose score reads learnable tensors (Variant::kSites) adds each step's share of their gradients:
// gathered in shared memory past the tile's (Variant::kSiteFloats, zeroed here) and flushed to the float32
// gradients after the step's second barrier (lower/sites.py).
//
// Compiles under nvcc and NVRTC: only cuda_bf16.h / cuda_fp16.h and our headers.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "bwd_config.cuh"
#include "bwd_consumer.cuh"
#include "bwd_prepost.cuh"
#include "bwd_producer.cuh"

namespace cubridge {

template <class Cfg, class Variant, class T>
__device__ __forceinline__ void attention_bwd(const BwdArgs& a, const typename Variant::Params& p) {
  constexpr int BM = Cfg::kBlockM, BN = Cfg::kBlockN, LD = Cfg::kLd;
  using W = BwdWarp<Cfg, Variant, T>;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = sK + BN * LD;
  T* sQ = sV + BN * LD;       // two stages
  T* sdO = sQ + 2 * BM * LD;  // two stages
  T* sdS = sdO + 2 * BM * LD;
  float* sLse = reinterpret_cast<float*>(sdS + BM * Cfg::kLdS);  // two stages
  float* sDelta = sLse + 2 * BM;                                  // two stages
  float* sWin = reinterpret_cast<float*>(smem_raw + Cfg::kSmemBytes);  // the learnable sites', if any
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int b = blockIdx.z + a.b0, hk = blockIdx.y + a.hk0, kv_lo = blockIdx.x * BN;
  const int kv_hi = imin(kv_lo + BN, static_cast<int>(a.f.Skv));

  const QueryWalk<Variant, BM> walk(a.f, p, b, hk, kv_lo, kv_hi);
  const BwdLoads<Cfg, T> loads{a, b};
  const W w(warp, lane, kv_lo);

  float dk[1][W::DT][4], dv[1][W::DT][4];
#pragma unroll
  for (int t = 0; t < W::DT; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[0][t][e] = dv[0][t][e] = 0.f;

  loads.load_kv(sK, sV, sQ, sdO, hk, kv_lo, tid);
  if constexpr (Variant::kSites > 0)  // read by the first step after its first barrier
    for (int i = tid; i < Variant::kSiteFloats; i += Cfg::kThreads) sWin[i] = 0.f;
  int item = walk.next(0), stage = 0;
  if (item < walk.n_items) loads.load_q_block(sQ, sdO, sLse, sDelta, walk.head(item), walk.q_lo(item), tid);

  // Shared buffers and the barriers between their writers and readers, the same on every path (only live
  // items are visited, each takes both barriers, full and partial alike; rows past Sq are zero-filled copies):
  //   sK, sV: copied once before the loop, read by every step (products, dq) after its first barrier.
  //   stage s of sQ, sdO, sLse, sDelta: copied (cp.async) by step i - 1 after its first barrier, read by step i
  //     (products, grads, accumulate) after its wait and first barrier; copied over again by step i + 1, after
  //     step i + 1's first barrier, which every warp reaches only past its step-i reads.
  //   sdS: written by stage_ds before step i's second barrier, read by dq after it; written again by step
  //     i + 1 only after its first barrier, which every warp reaches only past its step-i dq.
  while (item < walk.n_items) {
    const int h = walk.head(item), q_lo = walk.q_lo(item), cls = walk.cls(item);
    cp_async_wait<0>();
    __syncthreads();  // this stage landed for every warp; every warp is done with the other stage and with dS
    const int nxt = walk.next(item + 1);
    if (nxt < walk.n_items)
      loads.load_q_block(sQ + (1 - stage) * BM * LD, sdO + (1 - stage) * BM * LD, sLse + (1 - stage) * BM,
                         sDelta + (1 - stage) * BM, walk.head(nxt), walk.q_lo(nxt), tid);
    const T* q_st = sQ + stage * BM * LD;
    const T* do_st = sdO + stage * BM * LD;

    float s[1][W::NT][4], dp[1][W::NT][4];
    typename Variant::Sites sites;
    if constexpr (Variant::kSites > 0)
      Variant::site_tile(sites, a.f, p, b, h, q_lo, imin(q_lo + BM, static_cast<int>(a.f.Sq)), kv_lo, kv_hi);
    w.products(s, dp, sK, sV, q_st, do_st);
    w.grads(s, dp, sLse + stage * BM, sDelta + stage * BM, a.f, p, b, h, q_lo, cls, sites, sWin);
    w.accumulate(dv, dk, s, dp, q_st, do_st);
    w.stage_ds(sdS, dp);
    __syncthreads();  // every warp's dS staged, every site addition in its window
    // the windows flushed and zeroed before the next step's first barrier, after which its additions begin
    if constexpr (Variant::kSites > 0)
      Variant::site_flush(sites, sWin, a.f, p, b, h, q_lo, imin(q_lo + BM, static_cast<int>(a.f.Sq)), kv_lo, kv_hi,
                          tid, Cfg::kThreads, lane);
    w.dq(sdS, sK, a, b, h, q_lo);
    item = nxt;
    stage ^= 1;
  }
  cp_async_wait<0>();  // K and V's group where no query block was live
  w.store(dk, dv, a, b, hk);
}

}  // namespace cubridge
