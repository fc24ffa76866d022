// Consumers: the math of one key block against the resident query rows, S = Q K^T, the score and mask hooks,
// the online softmax, O += P V; the loop that orders these steps is the kernel's own.
//
// WgmmaConsumer (Hopper): a warpgroup of 64 query rows; both GEMMs asynchronous on the tensor cores (wgmma),
// Q and K from the shared ring, P from registers. MmaConsumer (FA2-class): each warp its own query rows, the
// GEMMs warp-synchronous (mma.sync, gemm.cuh), as in the decode kernel. All share the hooks (score_tile.cuh)
// and the softmax (softmax.cuh).
#pragma once

#include "gemm.cuh"
#include "mma.cuh"
#include "pipeline.cuh"
#include "score_tile.cuh"
#include "softmax.cuh"
#include "tile_scheduler.cuh"
#include "wgmma.cuh"

namespace cubridge {

template <class Cfg, class Variant, class T>
struct WgmmaConsumer {
  static constexpr int BM = Cfg::kBlockM, BN = Cfg::kBlockN, DVP = Cfg::kPadDv;
  // Q K^T steps stop at the last 16 columns holding data (the copy engine zero-fills past D); O is computed
  // over the padded width.
  static constexpr int NT = BN / 8, DT = DVP / 8, KC = (Cfg::kHeadDim + 15) / 16, PK = BN / 16;
  static constexpr unsigned kKBytes = BN * Cfg::kPadD * 2, kVBytes = BN * DVP * 2;
  static constexpr bool kRaw = score_is_default<Variant>(0);  // s * scale folded into the exp2 factor
  int cw, lane, r0;  // warpgroup among the consumers, lane, this thread's first row in the tile (+8: second)
  unsigned q_tile, sK, sV;

  __device__ __forceinline__ WgmmaConsumer(int wg, int tid, unsigned sQ, unsigned k_ring, unsigned v_ring) {
    cw = wg - 1;
    const int t = tid - 128 * wg, warp = t / 32;
    lane = t % 32;
    r0 = cw * 64 + warp * 16 + lane / 4;
    q_tile = sQ + cw * 64 * 128;
    sK = k_ring;
    sV = v_ring;
  }

  // S = Q K^T of the block in stage s (asynchronous: wgmma_wait before reading sc).
  __device__ __forceinline__ void qk(float (&sc)[1][NT][4], int s) const {
    wgmma_fence();
#pragma unroll
    for (int kc = 0; kc < KC; ++kc) {
      const unsigned off = (kc % 4) * 32;  // 16 columns further inside the 128-byte row
      Wgmma<BN, T>::ss(&sc[0][0][0], sw128_desc(q_tile + (kc / 4) * BM * 128 + off, 16, 1024),
                       sw128_desc(sK + s * kKBytes + (kc / 4) * BN * 128 + off, 16, 1024), kc > 0);
    }
    wgmma_commit();
  }

  // O += P V of the block in stage s, P as the A operand (asynchronous; the caller waited for V).
  __device__ __forceinline__ void pv(float (&o)[1][DT][4], const unsigned (&pa)[PK][4], int s) const {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < PK; ++kk)
      Wgmma<DVP, T>::rs(&o[0][0][0], pa[kk], sw128_desc(sV + s * kVBytes + kk * 16 * 128, BN * 128, 1024));
    wgmma_commit();
  }

  // The mask of block j (the mask reads no score: computed before the wait for them, its loads overlap it).
  __device__ __forceinline__ void mask(unsigned long long (&keep)[1][2], const FwdArgs& a,
                                       const typename Variant::Params& p, const QueryTile& t, int j, int cls,
                                       int sq, int skv) const {
    mask_bits<Variant, 1, NT>(keep, a, p, t.b, t.h, t.q_lo + r0, j * BN + (lane % 4) * 2, sq, skv,
                              Variant::kHasMask && cls == kPartial);
  }

  // The score hook, the mask and the key bound, then the online softmax: sc becomes P (unnormalised), and
  // alpha the factor O's rows must be rescaled by.
  __device__ __forceinline__ void score_softmax(float (&sc)[1][NT][4], const unsigned long long (&keep)[1][2],
                                                const FwdArgs& a, const typename Variant::Params& p,
                                                const QueryTile& t, int j, int cls, int sq, int skv, float factor,
                                                float (&m)[2], float (&l)[2], float (&alpha)[2]) const {
    const int kv0 = j * BN + (lane % 4) * 2;
    if ((Variant::kHasMask && cls == kPartial) || j * BN + BN > skv)
      apply_score<Variant, kRaw, true>(sc, keep, a, p, t.b, t.h, t.q_lo + r0, kv0, sq, skv);
    else
      apply_score<Variant, kRaw, false>(sc, keep, a, p, t.b, t.h, t.q_lo + r0, kv0, sq, skv);
    softmax_rows<1, NT>(sc, m, l, factor, alpha);
  }

  // P in registers as the A operand of the next P V.
  __device__ __forceinline__ static void p_operand(unsigned (&pa)[PK][4], const float (&sc)[1][NT][4]) {
#pragma unroll
    for (int kk = 0; kk < PK; ++kk) {
      pa[kk][0] = pack2<T>(sc[0][2 * kk][0], sc[0][2 * kk][1]);
      pa[kk][1] = pack2<T>(sc[0][2 * kk][2], sc[0][2 * kk][3]);
      pa[kk][2] = pack2<T>(sc[0][2 * kk + 1][0], sc[0][2 * kk + 1][1]);
      pa[kk][3] = pack2<T>(sc[0][2 * kk + 1][2], sc[0][2 * kk + 1][3]);
    }
  }

  __device__ __forceinline__ void release(unsigned bar) const { release_warp(bar, lane); }

  // The tile's first live block, in ring stage s (full at phase ph): its Q K^T, score and softmax, and P as the A
  // operand of the next P V. It has no P V to overlap with, so the kernel's loop runs the rest with the pipeline
  // full (no branches around the wgmmas). Its index, class and whether it is the tile's last come from the stage
  // (take). O is still zero: nothing to rescale. sc, alpha and keep are the kernel's (arrays declared in an
  // inlined function moved its registers).
  template <class Smem, class Turn>
  __device__ __forceinline__ void first_block(const Smem& sm, const Turn& turn, int s, unsigned ph, const FwdArgs& a,
                                              const typename Variant::Params& p, const QueryTile& t, int sq,
                                              int skv, float factor, float (&m)[2], float (&l)[2],
                                              float (&sc)[1][NT][4], float (&alpha)[2],
                                              unsigned long long (&keep)[1][2], unsigned (&pa)[PK][4], int& j,
                                              int& cls, bool& last) const {
    if (turn.last()) turn.open_first();
    mbar_wait(sm.ring.k_full(s), ph);
    sm.take(s, j, cls, last);
    mask(keep, a, p, t, j, cls, sq, skv);  // before the turn: the mask's loads overlap the wait
    turn.wait();
    qk(sc, s);
    turn.pass();
    wgmma_wait<0>();
    wgmma_hold<4 * NT>(&sc[0][0][0]);
    release(sm.ring.k_empty(s));
    score_softmax(sc, keep, a, p, t, j, cls, sq, skv, factor, m, l, alpha);
    p_operand(pa, sc);
  }

  // The tile's last P V (the block in stage `prev`, full at phase prev_ph), in this warpgroup's turn; the last
  // warpgroup keeps the turn it would pass (Pingpong). Its V stage is released for a later tile.
  template <class Ring, class Turn>
  __device__ __forceinline__ void last_pv(const Ring& ring, const Turn& turn, float (&o)[1][DT][4],
                                          const unsigned (&pa)[PK][4], int prev, unsigned prev_ph) const {
    mbar_wait(ring.v_full(prev), prev_ph);
    turn.wait();
    pv(o, pa, prev);
    if (!turn.last()) turn.pass();
    wgmma_wait<0>();
    wgmma_hold<4 * DT>(&o[0][0][0]);
    release(ring.v_empty(prev));
  }
};

// FA2-class: warp w takes query rows [w * RW, (w + 1) * RW) of the tile, one or two m16 tiles, Q's fragments in
// registers (Cfg::kQInRegs) or read from shared memory at each step (large head dims). Arrays the kernel keeps
// (Q's fragments, O, m, l, the mask bits) are the caller's, and the kernel makes its consumer after O's start:
// an array declared in an inlined function, or these addresses computed earlier, gave O other registers and
// the machine code changed.
template <class Cfg, class Variant, class T>
struct MmaConsumer {
  static constexpr int BN = Cfg::kBlockN, LDS = Cfg::kSmemLd, LDV = Cfg::kSmemLdV, LDQ = Cfg::kSmemLdQ;
  static constexpr int RW = Cfg::kBlockM / Cfg::kWarps;  // query rows per warp
  static constexpr int MT = RW / 16;                      // m16 tiles per warp
  static constexpr int NT = BN / 8;                       // n8 key tiles per block
  static constexpr int KC = Cfg::kPadD / 16;              // k16 steps over the head dim
  static constexpr int DT = Cfg::kPadDv / 8;              // n8 tiles of O (the padded columns stay zero: V's are)
  // Default score (s * scale): keep raw dot products and fold scale * log2(e) into the single FFMA in front of
  // each exp2 (assumes scale > 0, so the running max of raw s is the max of the logits).
  static constexpr bool kRaw = score_is_default<Variant>(0);
  // Q's fragments, where they stay in registers (one placeholder otherwise).
  using QFrags = unsigned[Cfg::kQInRegs ? MT : 1][Cfg::kQInRegs ? KC : 1][4];
  unsigned q_addr, k_lane, v_lane;  // this lane's ldmatrix addresses: its warp's Q rows, K and V of stage 0
  int lane, q_row0;                 // q_row0: this lane's first query row

  // This lane's ldmatrix address of its warp's Q rows.
  __device__ __forceinline__ static unsigned q_addr_of(const T* sQ, int warp, int lane) {
    return smem_u32(sQ) + (warp * RW * LDQ + lane_off_a<LDQ>(lane)) * 2;
  }
  __device__ __forceinline__ MmaConsumer(const T* sQ, const T* sK, const T* sV, int warp, int ln, int q_lo)
      : lane(ln) {
    q_addr = q_addr_of(sQ, warp, lane);
    k_lane = smem_u32(sK) + lane_off_k<LDS>(lane) * 2;
    v_lane = smem_u32(sV) + lane_off_v<LDV>(lane) * 2;
    q_row0 = q_lo + warp * RW + lane / 4;
  }

  // Q's fragments into registers, once Q has landed (or nothing: Q stays in shared memory).
  __device__ __forceinline__ static void load_q(QFrags& qa, const T* sQ, int warp, int lane) {
    if constexpr (Cfg::kQInRegs) load_q_frags<MT, KC, LDQ>(qa, q_addr_of(sQ, warp, lane));
  }

  // S = Q K^T of the block in stage s.
  __device__ __forceinline__ void qk(float (&sc)[MT][NT][4], const QFrags& qa, int s) const {
    if constexpr (Cfg::kQInRegs)
      gemm_qk<T, MT, NT, KC, LDS>(sc, qa, k_lane + s * BN * LDS * 2);
    else
      gemm_qk_smem<T, MT, NT, KC, LDS, LDQ>(sc, q_addr, k_lane + s * BN * LDS * 2);
  }

  // The mask bits of block j (a partial block's; the mask reads no score), then the score hook, the mask and the
  // key bound (the last block), in place.
  __device__ __forceinline__ void score(float (&sc)[MT][NT][4], unsigned long long (&keep)[MT][2], const FwdArgs& a,
                                        const typename Variant::Params& p, const QueryTile& t, int j, int cls, int sq,
                                        int skv) const {
    const bool call_mask = Variant::kHasMask && cls == kPartial;
    const int kv0 = j * BN + (lane % 4) * 2;
    mask_bits<Variant, MT, NT>(keep, a, p, t.b, t.h, q_row0, kv0, sq, skv, call_mask);
    if (call_mask || j * BN + BN > skv)
      apply_score<Variant, kRaw, true>(sc, keep, a, p, t.b, t.h, q_row0, kv0, sq, skv);
    else
      apply_score<Variant, kRaw, false>(sc, keep, a, p, t.b, t.h, q_row0, kv0, sq, skv);
  }

  // O += P V of the block in stage s, P re-packed from the scores.
  __device__ __forceinline__ void pv(float (&o)[MT][DT][4], const float (&sc)[MT][NT][4], int s) const {
    gemm_pv<T, MT, NT, DT, LDV>(o, sc, v_lane + s * BN * LDV * 2);
  }
};

}  // namespace cubridge
