// Tile configurations for the forward kernel.
// FwdTile<D, BM, BN, Warps, Stages, QInRegs> is the general form; FwdConfig<D, T>
// picks the tuned default per head dim (sm_90 with mma.sync; also valid on sm_80).
#pragma once

namespace cubridge {

template <int D, int BM, int BN, int Warps, int Stages, bool QInRegs = true,
          bool LazyRescale = true>
struct FwdTile {
  static constexpr int kHeadDim = D;
  static constexpr int kBlockM = BM;   // query rows per CTA
  static constexpr int kBlockN = BN;   // keys per pipeline step
  static constexpr int kWarps = Warps; // each warp owns BM / Warps query rows
  static constexpr int kStages = Stages;  // K/V shared-memory buffers (>= 2)
  static constexpr bool kQInRegs = QInRegs;  // false: Q re-read from shared each step
  static constexpr bool kLazyRescale = LazyRescale;  // skip O *= alpha when no row max moved
  static constexpr int kThreads = 32 * Warps;
  static constexpr int kSmemLd = D + 8;  // padded row pitch (elements)
  // Q tile (reused to stage O) + Stages x (K tile + V tile), 2-byte elements.
  static constexpr int kSmemBytes = (BM + 2 * Stages * BN) * kSmemLd * 2;

  static_assert(D % 32 == 0 && D <= 256, "head dim must be a multiple of 32, at most 256");
  static_assert(BM % (16 * Warps) == 0, "each warp owns whole m16 tiles");
  static_assert(BN % 16 == 0, "key block must be a multiple of 16");
  static_assert(Stages >= 2, "need at least double buffering");
};

// Tuned on H100 (see benchmarks/kernel_dev/RESULTS.md). Warps owning 32 query
// rows (two m16 tiles) halve the shared-memory fragment traffic per mma compared
// with 16-row warps, which is what sm_90 mma.sync needs to keep up with SDPA.
//   D   BM  BN  warps stages Q     lazy-rescale  threads smem
//   64  128 64  4     2      regs  no            128     55296
//   96  128 64  4     2      smem  yes           128     79872
//   128 128 64  4     2      smem  yes           128     104448
//   256 128 64  8     2      smem  no            256     202752
template <int D, class T> struct FwdConfig;
template <class T> struct FwdConfig<64, T> : FwdTile<64, 128, 64, 4, 2, true, false> {};
template <class T> struct FwdConfig<96, T> : FwdTile<96, 128, 64, 4, 2, false> {};
template <class T> struct FwdConfig<128, T> : FwdTile<128, 128, 64, 4, 2, false> {};
template <class T> struct FwdConfig<256, T> : FwdTile<256, 128, 64, 8, 2, false, false> {};

}  // namespace cubridge
