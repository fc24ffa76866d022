// Tile configurations for the forward kernel.
// FwdTile<D, BM, BN, Warps, Stages, QInRegs> is the general form; FwdConfig<D, T>
// picks the tuned default per head dim (sm_90 with mma.sync; also valid on sm_80).
#pragma once

namespace cubridge {

// Head dims in steps of 8: the tensor cores' k step is 16 columns and O's ldmatrix pairs are 16 wide,
// so a head dim that is not a multiple of 16 is computed over kPadD (D rounded up to 16), the columns
// past D held at zero in shared memory (the kernels zero them once; the copies never write them).
__host__ __device__ constexpr int pad16(int d) { return (d + 15) / 16 * 16; }
__host__ __device__ constexpr int imax_c(int a, int b) { return a > b ? a : b; }
// setmaxnreg budgets of a warp-specialised CTA of `threads` threads (whole warpgroups, one CTA an SM): a
// thread starts with the launch's share of the 64K register file (in steps of 8); the producer warpgroup gives
// its share down to `producer`, and the `consumers` warpgroups take what it gave, in steps of 8, at most 240.
// setmaxnreg.inc waits until the registers are free, so asking more than the producer gave hangs the CTA.
__host__ __device__ constexpr int consumer_regs(int threads, int consumers, int producer) {
  const int given = (65536 / threads / 8 * 8 * (consumers + 1) - producer) / consumers / 8 * 8;
  return given > 240 ? 240 : given;
}

template <int D, int BM, int BN, int Warps, int Stages, bool QInRegs = true,
          bool LazyRescale = true>
struct FwdTile {
  static constexpr int kHeadDim = D;
  static constexpr int kPadD = pad16(D);  // columns of Q.K^T's k steps
  static constexpr int kBlockM = BM;   // query rows per CTA
  static constexpr int kBlockN = BN;   // keys per pipeline step
  static constexpr int kWarps = Warps; // each warp owns BM / Warps query rows
  static constexpr int kStages = Stages;  // K/V shared-memory buffers (>= 2)
  static constexpr bool kQInRegs = QInRegs;  // false: Q re-read from shared each step
  static constexpr bool kLazyRescale = LazyRescale;  // skip O *= alpha when no row max moved
  static constexpr int kThreads = 32 * Warps;
  static constexpr int kSmemLd = kPadD + 8;  // padded row pitch (elements)
  static constexpr int kValueDim = D;    // V's and O's head dim (FwdValueDim sets another)
  static constexpr int kPadDv = kPadD;
  static constexpr int kSmemLdV = kSmemLd;
  static constexpr int kSmemLdQ = kSmemLd;  // Q's rows, which stage O at the end: the wider of the two
  // Q tile (reused to stage O) + Stages x (K tile + V tile), 2-byte elements.
  static constexpr int kSmemBytes = (BM * kSmemLdQ + Stages * BN * (kSmemLd + kSmemLdV)) * 2;

  static_assert(D % 8 == 0 && D >= 8 && D <= 256, "head dim in steps of 8, at most 256");
  static_assert(BM % (16 * Warps) == 0, "each warp owns whole m16 tiles");
  static_assert(BN % 16 == 0, "key block must be a multiple of 16");
  static_assert(Stages >= 2, "need at least double buffering");
};

// Tuned on H100 (see benchmarks/kernel_dev/RESULTS.md), per band of head dims (the larger of Q's and
// V's, rounded up to 32). Warps owning 32 query rows (two m16 tiles) halve the shared-memory fragment
// traffic per mma compared with 16-row warps, which is what sm_90 mma.sync needs to keep up with SDPA.
//   band BM  BN  warps stages Q     lazy-rescale  threads smem (D = band)
//   64   128 64  4     2      regs  no            128     55296
//   96   128 64  4     2      smem  yes           128     79872
//   128  128 64  4     2      smem  yes           128     104448
//   256  128 64  8     2      smem  no            256     202752
template <int D, int Band> struct FwdBand;
template <int D> struct FwdBand<D, 32> : FwdTile<D, 128, 64, 4, 2, true, false> {};
template <int D> struct FwdBand<D, 64> : FwdTile<D, 128, 64, 4, 2, true, false> {};
template <int D> struct FwdBand<D, 96> : FwdTile<D, 128, 64, 4, 2, false> {};
template <int D> struct FwdBand<D, 128> : FwdTile<D, 128, 64, 4, 2, false> {};
template <int D> struct FwdBand<D, 160> : FwdTile<D, 128, 64, 8, 2, false> {};
template <int D> struct FwdBand<D, 192> : FwdTile<D, 128, 64, 8, 2, false> {};
template <int D> struct FwdBand<D, 224> : FwdTile<D, 128, 64, 8, 2, false, false> {};
template <int D> struct FwdBand<D, 256> : FwdTile<D, 128, 64, 8, 2, false, false> {};

// A value head dim of its own (multi-head latent attention one way, a wide V the other), in steps of 8:
// V tiles have their own pitch, and O is staged in Q's rows, whose pitch is the wider of the two.
template <class Base, int DV>
struct FwdValueDim : Base {
  static constexpr int kValueDim = DV;
  static constexpr int kPadDv = pad16(DV);
  static constexpr int kSmemLdV = kPadDv + 8;
  static constexpr int kSmemLdQ = imax_c(Base::kSmemLd, kSmemLdV);
  static constexpr int kSmemBytes =
      (Base::kBlockM * kSmemLdQ + Base::kStages * Base::kBlockN * (Base::kSmemLd + kSmemLdV)) * 2;
  static_assert(DV % 8 == 0 && DV >= 8 && DV <= 256, "value head dim in steps of 8, at most 256");
};

// The FA2-class kernel's configuration for Q/K head dim D and V head dim DV: the band of the wider; a V
// wider than Q takes 8 warps at least (16-row warps: O's accumulators, which V's width sets, spilled at
// 4 warps of 32 rows for 64 x 128, sm_80).
__host__ __device__ constexpr int fwd_band(int d, int dv) {
  return dv > d ? imax_c((dv + 31) / 32 * 32, 160) : (imax_c(d, dv) + 31) / 32 * 32;
}
template <int D, class T, int DV = D>
struct FwdConfig : FwdValueDim<FwdBand<D, fwd_band(D, DV)>, DV> {};

// Hopper kernel (fwd_kernel_sm90.cuh): BM query rows per tile in BM / 64 consumer
// warpgroups of 64 rows (two, or three for narrow heads) plus one producer
// warpgroup; K/V tiles of BN keys in a Stages-deep TMA ring. D is the query/key
// head dim, DV the value's; both are multiples of 8 up to 256. Shared tiles are
// whole 64-column chunks (TMA boxes with the 128-byte swizzle), so a head dim is
// padded up to kPadD / kPadDv; the copy engine fills the columns past D with
// zeros, the Q K^T steps stop at the last 16 columns holding data, and the store
// skips the padded O columns.
// Shared memory: 1024 alignment slack, Q, the K and V rings, the O staging
// buffer where OwnO (else O is staged in Q's rows and the next tile's Q loads
// after the epilogue), the mbarriers and one int per row (empty-row flags).
// Persistent: one CTA per SM walks the tiles (lower/tiles.py chooses it with
// the launch grid).
template <int D, int DV, int BM, int BN, int Stages, int OwnO, int Persistent, bool LazyRescale = true>
struct Sm90Tile {
  static constexpr int kHeadDim = D;
  static constexpr int kValueDim = DV;
  static constexpr int kPadD = (D + 63) / 64 * 64;
  static constexpr int kPadDv = (DV + 63) / 64 * 64;
  static constexpr int kBlockM = BM;
  static constexpr int kConsumers = BM / 64;  // consumer warpgroups
  static constexpr int kBlockN = BN;
  static constexpr int kStages = Stages;
  static constexpr bool kOwnO = OwnO != 0;
  static constexpr bool kPersistent = Persistent != 0;
  static constexpr bool kLazyRescale = LazyRescale;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  // setmaxnreg budgets: the producer keeps 24 registers a thread, the consumers share the rest
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = consumer_regs(kThreads, kConsumers, kProducerRegs);
  static constexpr int kSmemBytes = 1024 + (BM * kPadD + Stages * BN * (kPadD + kPadDv) + OwnO * BM * kPadDv) * 2 + 8 * (2 + 4 * Stages) + 4 * BM + 64;

  static_assert(D % 8 == 0 && D <= 256 && DV % 8 == 0 && DV <= 256, "head dims in steps of 8, at most 256");
  static_assert(BM % 64 == 0 && BM >= 128 && BM <= 192, "two or three consumer warpgroups of 64 rows");
  static_assert(OwnO || kPadDv <= kPadD, "without an O buffer, O is staged in Q's rows");
  static_assert(BN % 16 == 0 && BN <= 256, "wgmma n is a multiple of 16, at most 256");
  static_assert(kSmemBytes <= 232448, "at most 227 KB of shared memory per CTA");
};

// The tile per head dim is chosen in torch_cubridge/lower/tiles.py (TILES_SM90).

}  // namespace cubridge
