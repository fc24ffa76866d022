// Tile configurations and arguments of the FA2-class backward kernel (bwd_kernel.cuh).
//
// One CTA owns BN keys of one KV head and walks the query blocks (BM rows each) of every query head that reads
// that KV head; each warp owns 16 of the keys, so its rows of dK and dV stay in registers for the whole walk and
// are written once, with no atomics. dQ, which every key block touches, goes through a float32 accumulator by
// atomicAdd.
#pragma once
#include "fwd_config.cuh"
#include "variant.cuh"

namespace cubridge {

// Everything the three backward kernels read and write. `f` is the forward's problem (q, k, v, o, the forward's
// natural-log LSE in f.lse, strides, sizes, scale): the hooks see it as in the forward. Every field is 8 bytes
// wide, in declaration order, so the host packs it as a flat array of 64-bit words.
struct BwdArgs {
  FwdArgs f;
  const void* dout;  // dO [B, Hq, Sq, Dv] through the strides below
  long long do_sb, do_sh, do_ss;
  float* delta;      // [B, Hq, sq_pad] contiguous: rowsum(dO * O), written by the preprocess kernel
  float* dq_acc;     // float32, zeroed by the preprocess before the main kernel adds into it: [B, Hq, Sq, D]
                     // (FA2-class kernel), or 64 x 64 blocks (the Hopper kernel's; bwd_prepost.cuh dq_tiled_at)
  void* dq;          // [B, Hq, Sq, D] in the input dtype, written by the postprocess kernel
  long long dq_sb, dq_sh, dq_ss;
  void* dk;          // [B, Hkv, Skv, D]
  long long dk_sb, dk_sh, dk_ss;
  void* dv;          // [B, Hkv, Skv, Dv]
  long long dv_sb, dv_sh, dv_ss;
  float* lse_pad;    // [B, Hq, sq_pad]: f.lse copied by the preprocess kernel, whole blocks for bulk copies
  long long sq_pad;  // Sq rounded up to a whole number of 64-row blocks (pad rows: LSE and delta zero)
  int* dq_sem;       // the Hopper kernel's deterministic mode: one zeroed counter per block of dQ's accumulator
  // This launch's share (the host splits a large backward so dQ's float32 accumulator stays small,
  // ops/backward_shares.py): batches from b0, KV heads from hk0 and query heads from h0 (the grids' z and y
  // count them). Its scratch (delta, lse_pad, dq_acc, dq_sem) holds the share's (batch, query head) pairs
  // alone: pair (b, h) at b * slot_heads + h - slot_base (bwd_slot).
  long long b0, hk0, h0, slot_heads, slot_base;
};

__device__ __forceinline__ long long bwd_slot(const BwdArgs& a, int b, int h) {
  return b * static_cast<int>(a.slot_heads) + h - static_cast<int>(a.slot_base);  // fewer than 2^31 pairs
}

// D: the head dim (Q, K and V alike for now); BM query rows per step; Warps warps of 16 keys each (BN = 16 Warps).
// lower/backward.py picks BM (bwd_block_m: registers and the arch's shared memory) and checks its copy of
// kSmemBytes against this one in the generated source.
template <int D, int BM, int Warps>
struct BwdTile {
  static constexpr int kHeadDim = D;
  static constexpr int kPadD = pad16(D);
  static constexpr int kBlockM = BM;
  static constexpr int kWarps = Warps;
  static constexpr int kBlockN = 16 * Warps;
  static constexpr int kThreads = 32 * Warps;
  static constexpr int kLd = kPadD + 8;           // padded row pitch of Q, K, V, dO (ldmatrix rows in distinct banks)
  static constexpr int kLdS = kBlockN + 8;        // dS staged as [query][key] for dQ = dS K
  // The dQ step: warps tile dQ's BM x kPadD as (BM / 16) row tiles by kDqGroups column groups; group g takes
  // the 16-column pairs g, g + kDqGroups, ... (kDqPairs at most; fewer where the pairs do not split evenly,
  // as 96 columns over 4 groups).
  static constexpr int kDqGroups = Warps / (BM / 16);
  static constexpr int kDqPairs = (kPadD / 16 + kDqGroups - 1) / kDqGroups;
  // K and V (resident), two stages of Q and dO, dS, two stages of the rows' LSE and delta (floats).
  static constexpr int kSmemBytes =
      (2 * kBlockN * kLd + 4 * BM * kLd + BM * kLdS) * 2 + 4 * BM * 4;

  static_assert(D % 8 == 0 && D >= 8 && D <= 256, "head dim in steps of 8, at most 256");
  static_assert(BM % 16 == 0 && Warps % (BM / 16) == 0, "dQ's row tiles split the warps evenly");
};

// Hopper backward (bwd_kernel_sm90.cuh): a CTA owns BN = 64 * kConsumers keys of one KV head, a consumer
// warpgroup 64 of them, and walks BM = 64 query rows a step behind a producer warp's TMA copies. Head dims in
// steps of 8 up to 128 (whole 64-column chunks in shared memory, the copy engine zero-filling past D): a
// thread keeps kPadD / 2 floats of dK and as many of dV for the whole walk, which past 128 columns is more
// than the 240 registers a consumer thread may take.
// dQ = dS K: past 64 columns each warpgroup takes its own 64 columns over all BN keys (kDqSplitN, the
// warpgroups' dS shared through shared memory); at 64 columns each takes its own keys, all columns, and
// both add their share.
// Shared memory: 1024 alignment slack, K, V, kStages x (Q, dO), two dS buffers [BM][BN], a warpgroup's dQ
// share staged per consumer (64 x 64 float32, added to global memory by one bulk reduction), kStages x (LSE,
// delta) rows, the barriers (K and V full, then per stage full and empty) and two ints per stage (the item
// and its class, which the producer hands the consumers).
// Deterministic: dQ's shares are added in a fixed (descending) key-block order (a counter per accumulator
// block: bitwise-equal dQ run to run), not in the order the CTAs reach them.
// DV: V's head dim (dO's and dV's columns), in steps of 8 up to 128 as Q's.
template <int D, int DV, int BN, int Stages, int Deterministic = 0>
struct BwdSm90Tile {
  static constexpr int kHeadDim = D;
  static constexpr int kValueDim = DV;
  static constexpr int kPadD = (D + 63) / 64 * 64;
  static constexpr int kPadDv = (DV + 63) / 64 * 64;
  static constexpr int kBlockM = 64;
  static constexpr int kBlockN = BN;
  static constexpr int kConsumers = BN / 64;
  static constexpr int kStages = Stages;
  static constexpr bool kDqSplitN = kPadD > 64;
  static constexpr bool kDeterministic = Deterministic != 0;
  static constexpr int kThreads = 128 * (kConsumers + 1);  // the consumer warpgroups, then the producer's
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = consumer_regs(kThreads, kConsumers, kProducerRegs);
  static constexpr unsigned kQBytes = kBlockM * kPadD * 2, kKBytes = BN * kPadD * 2, kSBytes = kBlockM * BN * 2;
  static constexpr unsigned kOBytes = kBlockM * kPadDv * 2, kVBytes = BN * kPadDv * 2;  // a dO stage, V
  static constexpr unsigned kRowBytes = kBlockM * 4;  // one stage's LSE (or delta) rows
  static constexpr unsigned kDqBytes = 64 * 64 * 4;    // a warpgroup's staged dQ share
  static constexpr int kBarriers = 1 + 2 * Stages;
  static constexpr int kSmemBytes =
      1024 + kKBytes + kVBytes + Stages * (kQBytes + kOBytes) + 2 * kSBytes + kConsumers * kDqBytes + Stages * 2 * kRowBytes +
      8 * kBarriers + 8 * Stages;

  static_assert(D % 8 == 0 && D >= 8 && D <= 128 && DV % 8 == 0 && DV >= 8 && DV <= 128,
                "head dims in steps of 8, at most 128");
  static_assert(BN == 128, "two consumer warpgroups of 64 keys");
  static_assert(Stages >= 2 && Stages <= 4, "two to four stages of Q and dO");
  static_assert(kSmemBytes <= 232448, "at most 227 KB of shared memory per CTA");
};

}  // namespace cubridge
