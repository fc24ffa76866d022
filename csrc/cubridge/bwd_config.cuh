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
  float* delta;      // [B, Hq, Sq] contiguous: rowsum(dO * O), written by the preprocess kernel
  float* dq_acc;     // [B, Hq, Sq, D] contiguous float32: zeroed by the preprocess kernel, summed by atomics
  void* dq;          // [B, Hq, Sq, D] in the input dtype, written by the postprocess kernel
  long long dq_sb, dq_sh, dq_ss;
  void* dk;          // [B, Hkv, Skv, D]
  long long dk_sb, dk_sh, dk_ss;
  void* dv;          // [B, Hkv, Skv, Dv]
  long long dv_sb, dv_sh, dv_ss;
};

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

}  // namespace cubridge
