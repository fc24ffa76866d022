// The Hopper backward's consumer (bwd_kernel_sm90.cuh): a warpgroup owns 64 of the CTA's keys and, per query
// block, computes on the tensor cores (wgmma, float32 accumulation), keys as rows as the FA2-class warp does
// (bwd_consumer.cuh), so P and dS leave the accumulators as the A operands of the dV and dK products:
//   S^T = K Q^T, dP^T = V dO^T          (both operands in shared memory)
//   P, dS                                (bwd_grads: the score, score_grad and mask hooks)
//   dV += P^T dO, dK += dS^T Q           (P and dS from registers)
//   dQ = dS K                            (dS staged in shared memory as [query][key]), added to dQ's float32
//                                        accumulator by a bulk reduction of the warpgroup's 64 x 64 share.
// Its m64nN accumulators hold, per 16-row warp slice, the m16n8 layout the FA2-class pieces use.
#pragma once
#include "bwd_config.cuh"
#include "bwd_consumer.cuh"
#include "pipeline.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace cubridge {

// Whether the Hopper kernel leaves dscore/ds out of dS: the plain score's is the scale, one value over the call,
// so dK takes it once at its store and dQ in the postprocess (bwd_postprocess's kScaleDq), not every pair. Not
// where the score reads learnable tensors (their gradients take dX = P (dP - delta) beside dS).
template <class Variant>
__host__ __device__ constexpr bool ds_unscaled() {
  return score_is_default<Variant>(0) && Variant::kSites == 0;
}

template <class Cfg, class Variant, class T>
struct WgmmaBwdConsumer {
  static constexpr int BM = Cfg::kBlockM, BN = Cfg::kBlockN, PD = Cfg::kPadD, PDV = Cfg::kPadDv;
  static constexpr int NT = BM / 8;                    // n8 query tiles of S^T
  static constexpr int DT = PD / 8;                    // n8 tiles of a dK row
  static constexpr int DTV = PDV / 8;                  // ... of a dV row
  static constexpr int KCV = (Cfg::kValueDim + 15) / 16;  // k16 steps over V's head dim holding data
  static constexpr int KC = (Cfg::kHeadDim + 15) / 16; // k16 steps over the head dim holding data
  static constexpr int PK = BM / 16;                   // k16 steps over the queries (dV, dK)
  static constexpr int NQ = 64;                        // dQ columns a warpgroup computes
  static constexpr int QT = NQ / 8;
  static_assert(PD == 64 || (PD == 128 && Cfg::kDqSplitN && Cfg::kConsumers == 2), "dQ's split");
  int cw, warp, lane, kv_row0;  // kv_row0: this thread's first key (+8: its second)
  unsigned sK, sV;

  __device__ __forceinline__ WgmmaBwdConsumer(int wg, int tid, int kv_lo, unsigned k_tile, unsigned v_tile) {
    cw = wg;
    const int t = tid - 128 * wg;
    warp = t / 32;
    lane = t % 32;
    kv_row0 = kv_lo + cw * 64 + warp * 16 + lane / 4;
    sK = k_tile;
    sV = v_tile;
  }

  // S^T and dP^T of this warpgroup's keys against the block in shared memory at sQ, sdO (asynchronous: two
  // groups, S^T's first: its probabilities are made while dP^T is computed).
  __device__ __forceinline__ void products(float (&sc)[1][NT][4], float (&dp)[1][NT][4], unsigned sQ,
                                           unsigned sdO) const {
    // descriptors made here from opaque bases (desc_here): hoisted out of the walk, the 16 of K and V spilled
    const unsigned long long dk = desc_here(sw128_desc(sK + cw * 64 * 128, 16, 1024));
    const unsigned long long dv = desc_here(sw128_desc(sV + cw * 64 * 128, 16, 1024));
    wgmma_fence();
    rows_by_block<KC>(sc, dk, sw128_desc(sQ, 16, 1024));
    rows_by_block<KCV>(dp, dv, sw128_desc(sdO, 16, 1024));
  }

  // acc = this warpgroup's 64 rows of the key-major tile described by `keys` times the block's rows described
  // by `block`, transposed (both K-major over the first Steps k16 columns), issued as one group (after the
  // caller's fence).
  template <int Steps>
  __device__ __forceinline__ void rows_by_block(float (&acc)[1][NT][4], unsigned long long keys,
                                                unsigned long long block) const {
#pragma unroll
    for (int kc = 0; kc < Steps; ++kc)
      Wgmma<BM, T>::ss(&acc[0][0][0], desc_plus(keys, (kc / 4) * BN * 128 + (kc % 4) * 32),
                       desc_plus(block, (kc / 4) * BM * 128 + (kc % 4) * 32), kc > 0);
    wgmma_commit();
  }

  // acc += A^T block, A the operand a_operand packs (P or dS, keys as rows) and `block` the query block's rows
  // in shared memory (dO for dV, Q for dK), 8 N8 columns wide (V's or K's padded head dim), as one group
  // (asynchronous).
  template <int N8>
  __device__ __forceinline__ void accumulate(float (&acc)[1][N8][4], const unsigned (&a)[PK][4], unsigned block) const {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < PK; ++kk)
      Wgmma<8 * N8, T>::rs(&acc[0][0][0], a[kk], desc_plus(sw128_desc(block, BM * 128, 1024), kk * 16 * 128));
    wgmma_commit();
  }

  // This warpgroup's dS^T into the [query][key] tile at shared address `tile` (128-byte swizzled, chunk cw: its
  // 64 keys), from its A operand (a_operand's packing: word da[kk][r] is the 8 x 8 block of keys 8 (r % 2) on
  // from the warp's 16, queries 8 (2 kk + r / 2) on, a thread's row lane / 4 and columns 2 (lane % 4), +1):
  // four transposing matrix stores a step, lane l addressing row l % 8 of block l / 8 (16-bit stores of each
  // element took 64 instructions more a step).
  __device__ __forceinline__ void stage_ds(unsigned tile, const unsigned (&da)[PK][4]) const {
    const int blk = lane / 8, row = lane % 8;
    const unsigned base = tile + cw * BM * 128 + (((warp * 2 + blk % 2) ^ row) * 16);  // a query row's 16-byte piece
#pragma unroll
    for (int kk = 0; kk < PK; ++kk) stsm_x4_t(base + ((2 * kk + blk / 2) * 8 + row) * 128, da[kk]);
  }

  // dQ's share of this warpgroup (asynchronous): columns [64 cw, 64 cw + 64) over every key where the
  // warpgroups split dQ's columns, else all 64 columns over its own keys.
  __device__ __forceinline__ void dq(float (&acc)[1][QT][4], unsigned sdS) const {
    constexpr int KS = Cfg::kDqSplitN ? BN / 16 : 4;
    const int k0 = Cfg::kDqSplitN ? 0 : cw * 4;
    const unsigned long long da = sw128_desc(sdS, 16, 1024);
    const unsigned long long db = desc_here(sw128_desc(sK + (Cfg::kDqSplitN ? cw * BN * 128 : 0) + k0 * 16 * 128, BN * 128, 1024));
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
      const int k = k0 + kk;
      Wgmma<NQ, T>::ss_t(&acc[0][0][0], desc_plus(da, (k / 4) * BM * 128 + (k % 4) * 32), desc_plus(db, kk * 16 * 128),
                         kk > 0);
    }
    wgmma_commit();
  }

  // dQ's share added to the float32 accumulator of head h: staged in this warpgroup's 64 x 64 buffer in
  // dq_tiled_at's order (a warp's float2 stores consecutive: no bank conflicts), then one bulk reduction into
  // the block's tile (rows past Sq and the padded columns land in the padding, which nothing reads).
  __device__ __forceinline__ void add_dq(const float (&acc)[1][QT][4], float* stage0, unsigned sdq0,
                                         const BwdArgs& a, int b, int h, int q_lo, int rank) const {
    float* st = stage0 + cw * 64 * 64;
#pragma unroll
    for (int j = 0; j < QT; ++j)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf)
        *reinterpret_cast<float2*>(st + ((warp * 8 + j) * 2 + hf) * 64 + lane * 2) =
            make_float2(acc[0][j][2 * hf], acc[0][j][2 * hf + 1]);
    fence_proxy_async();
    named_sync(3 + cw, 128);  // the warpgroup's share staged
    if (issuer()) {
      constexpr int CH = Cfg::kDqSplitN ? PD / 64 : 1;
      const long long nmb = a.sq_pad / 64, blk = (bwd_slot(a, b, h) * nmb + q_lo / 64) * CH + (Cfg::kDqSplitN ? cw : 0);
      if constexpr (Cfg::kDeterministic) {
        // rank: the live key blocks after this CTA's for this query block; where the warpgroups split the keys
        // (one accumulator block for both), warpgroup 0's share goes first
        const int turn = Cfg::kDqSplitN ? rank : rank * Cfg::kConsumers + cw;
        while (ld_acquire_gpu(a.dq_sem + blk) != turn) {
        }
        fence_proxy_async_global();
      }
      bulk_reduce_add_f32(a.dq_acc + blk * 64 * 64, sdq0 + cw * Cfg::kDqBytes, Cfg::kDqBytes);
      if constexpr (Cfg::kDeterministic) {  // complete in global memory before the next share may go
        bulk_wait();
        fence_proxy_async_global();
        red_release_gpu(a.dq_sem + blk, 1);
      }
    }
  }
  // The thread of the warpgroup that issues its bulk reductions.
  __device__ __forceinline__ bool issuer() const { return warp == 0 && lane == 0; }
  // The issuer's last reduction has read the staging buffer (before the barrier after which it is rewritten).
  __device__ __forceinline__ void dq_stage_free() const {
    if (issuer()) bulk_wait_read();
  }
  // Every reduction complete before the thread exits.
  __device__ __forceinline__ void finish_dq() const {
    if (issuer()) bulk_wait();
  }

  __device__ __forceinline__ void release(unsigned bar) const { release_warp(bar, lane); }
};

}  // namespace cubridge
