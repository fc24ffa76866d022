// The decode kernel's loads (decode_kernel.cuh): K and V into its cp.async ring from wherever they lie, in one
// piece (copy.cuh's load_tile), as the pieces a spec concatenates (SegKV), or from pages through block tables
// (PagedKV), with each block's table entries loaded a block ahead of its copies.
#pragma once

#include "copy.cuh"
#include "gemm.cuh"
#include "paged.cuh"
#include "score_tile.cuh"

namespace cubridge {

// K and V kept as up to kMax pieces one after another along the keys (a KV cache and the new keys
// concatenated inside the spec, memory key/values before the sequence's), read where they lie where the
// kernel is built segmented: key s lies in the first piece whose cumulative end exceeds it, at row
// s - (the previous end). Each piece has its own strides (a batch stride of 0: one piece for every
// sequence). Pieces past the last have the last's end, so no key falls in them.
struct SegKV {
  static constexpr bool kSegmented = true;
  static constexpr int kMax = 4;
  const void* k[kMax];
  const void* v[kMax];
  long long k_sb[kMax], k_sh[kMax], k_ss[kMax];
  long long v_sb[kMax], v_sh[kMax], v_ss[kMax];
  long long k_end[kMax], v_end[kMax];
};

// Where key `row` of one (sequence, KV head) starts among the pieces; base[i]: piece i at (b, head).
template <class T>
__device__ __forceinline__ const T* segment_row(const T* const (&base)[SegKV::kMax], const long long* end,
                                                const long long* ss, int row) {
  const T* p = base[0];
  long long lo = 0, st = ss[0];
#pragma unroll
  for (int i = 1; i < SegKV::kMax; ++i)
    if (row >= end[i - 1]) {
      p = base[i];
      lo = end[i - 1];
      st = ss[i];
    }
  return p + (row - lo) * st;
}

// Rows [r0, r0 + BN) of one (sequence, KV head) from the pieces into a shared tile. A block that lies in
// one piece (all but the block where two pieces meet) is that piece's plain strided copy; the other looks
// up each row's piece.
template <int BN, int D, int LDS, int NTH, bool SWZ, class T>
__device__ __forceinline__ void load_tile_pieces(T* s, const T* const (&base)[SegKV::kMax], const long long* end,
                                                 const long long* ss, int r0, int nrows, int tid) {
  const int last = imin(r0 + BN, nrows) - 1;
  const T* p = base[0];
  long long lo = 0, st = ss[0];
  bool one = true;
#pragma unroll
  for (int i = 1; i < SegKV::kMax; ++i) {
    if (r0 >= end[i - 1]) {
      p = base[i];
      lo = end[i - 1];
      st = ss[i];
    } else if (last >= end[i - 1]) {
      one = false;
    }
  }
  if (one) {
    load_tile<BN, D, LDS, NTH, T, SWZ>(s, p, st, static_cast<int>(r0 - lo), static_cast<int>(nrows - lo), tid);
  } else {
    load_tile_at<BN, D, LDS, NTH, SWZ>(s, base[0], [&](int row) { return segment_row<T>(base, end, ss, row); }, r0, nrows, tid);
  }
}

__device__ __forceinline__ bool pages_shared(const PagedKV& pg) {
  return pg.k_table == pg.v_table && pg.kt_sb == pg.vt_sb && pg.kt_sp == pg.vt_sp && pg.k_pages == pg.v_pages;
}

// The per-row walk over a block's rows: a thread keeps one 16-byte column and walks rows kStep apart
// (r0 + kStep * i, r0 = tid / kChunks), where the thread count is a multiple of a row's chunks.
template <int BN, int D, int NTH>
struct RowWalk {
  static constexpr int kChunks = D / 8;
  static constexpr bool kOk = NTH % kChunks == 0 && BN % (NTH / kChunks) == 0;
  static constexpr int kStep = kOk ? NTH / kChunks : 1;
  static constexpr int kRows = kOk ? BN / kStep : 1;
};

// The table entries of one thread's rows of a paged block (for K, and for V where it reads its own table),
// loaded a block ahead of the block's copies: a lookup is a dependent load, and looked up at the copy it sat in
// front of every block's copies (B 8, 32k, pages of 16: 0.944 of contiguous K/V looked up at the copy, 0.962
// loaded ahead; 4k and B 1 unchanged; with three stages and one CTA per SM still 0.62-0.70: H100).
// Where the block lies in one page, entry 0 is its page.
template <int N>
struct BlockEntries {
  int blk;  // the block they are for (-1: none)
  Entry k[N], v[N];
};

template <int BN, int D, int NTH, int N>
__device__ __forceinline__ void load_block_entries(BlockEntries<N>& en, const PagedKV& pg, const PageDiv& pd, int b,
                                                   int blk, int nrows, int tid) {
  using W = RowWalk<BN, D, NTH>;
  const bool t64 = pg.table64 != 0, shared = pages_shared(pg);
  const bool in_page = pd.page % BN == 0;
  const int r0 = tid / W::kChunks;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    if (in_page && i > 0) continue;
    const int row = imin(blk * BN + r0 + W::kStep * i, nrows - 1);  // a row past the end: the last one's page
    const int pi = pd.div(row);
    en.k[i] = load_entry(pg.k_table, t64, b * pg.kt_sb + pi * pg.kt_sp);
    if (!shared) en.v[i] = load_entry(pg.v_table, t64, b * pg.vt_sb + pi * pg.vt_sp);
  }
  en.blk = blk;
}

// One K/V block's rows [row0, row0 + BN) from their pages into the ring, through the entries
// load_block_entries loaded for it: a block inside one page by copy.cuh's load_block_in_page, else the
// per-row walk, each row at its own entry, V at K's where both read one table (a lookup per row per tensor
// at the copy cost 18% at 4k keys, pages of 16). Tried at pages of 16 on the H100 and not kept: the split's
// entries staged in shared memory, whole pages copied with running pointers, 32-bit addresses with no
// division per row (pages of 24 +9%, pages of 16 at 32k -1.7%).
template <int BN, int D, int LDS, int NTH, bool SWZ, int N, class T>
__device__ __forceinline__ void load_kv_paged(T* sK, T* sV, const T* gK, const T* gV, const FwdArgs& a,
                                              const PagedKV& pg, const PageDiv& pd, const BlockEntries<N>& en,
                                              int row0, int nrows, int tid) {
  using W = RowWalk<BN, D, NTH>;
  const bool shared = pages_shared(pg);
  auto k_at = [&](int i) { return entry_index(en.k[i], pg.k_pages); };
  auto v_at = [&](int i) { return entry_index(shared ? en.k[i] : en.v[i], pg.v_pages); };
  if (load_block_in_page<BN, D, LDS, NTH, SWZ>(sK, gK, a.k_ss, pg.k_sp, pd, [&](int) { return k_at(0); }, row0,
                                               nrows, tid)) {
    load_block_in_page<BN, D, LDS, NTH, SWZ>(sV, gV, a.v_ss, pg.v_sp, pd, [&](int) { return v_at(0); }, row0, nrows,
                                             tid);
    return;
  }
  const int r0 = tid / W::kChunks, c = tid % W::kChunks;
  static_assert(!SWZ || W::kStep % 8 == 0, "a thread's swizzled column is the same in each of its rows");
  const unsigned k0 = smem_u32(sK) + tile_chunk<LDS, SWZ>(r0, c) * 2, v0 = smem_u32(sV) + tile_chunk<LDS, SWZ>(r0, c) * 2;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const int row = row0 + r0 + W::kStep * i;
    const bool ok = row < nrows;
    const int slot = row - pd.div(row) * pd.page;  // (row < 2^31)
    cp_async16(k0 + i * W::kStep * LDS * 2, ok ? gK + k_at(i) * pg.k_sp + slot * a.k_ss + c * 8 : gK, ok);
    cp_async16(v0 + i * W::kStep * LDS * 2, ok ? gV + v_at(i) * pg.v_sp + slot * a.v_ss + c * 8 : gV, ok);
  }
}

// The same block where V has another head dim (multi-head latent attention) or the threads do not split a
// row's chunks evenly: each operand by its own page's strided copy, or row by row with a lookup per row.
template <int BN, int D, int DV, int LDS, int LDSV, int NTH, bool SWZ, class T>
__device__ __forceinline__ void load_kv_paged_rows(T* sK, T* sV, const T* gK, const T* gV, const FwdArgs& a,
                                                   const PagedKV& pg, const PageDiv& pd, int b, int row0, int nrows,
                                                   int tid) {
  const bool t64 = pg.table64 != 0;
  auto k_page = [&](int i) { return page_entry(pg.k_table, t64, b * pg.kt_sb + i * pg.kt_sp, pg.k_pages); };
  auto v_page = [&](int i) { return page_entry(pg.v_table, t64, b * pg.vt_sb + i * pg.vt_sp, pg.v_pages); };
  load_block_paged<BN, D, LDS, NTH, SWZ>(sK, gK, a.k_ss, pg.k_sp, pd, k_page, row0, nrows, tid);
  load_block_paged<BN, DV, LDSV, NTH, SWZ>(sV, gV, a.v_ss, pg.v_sp, pd, v_page, row0, nrows, tid);
}

// The K/V ring without row padding, each row's 16-byte chunks XOR-swizzled within their 128-byte group by the
// row (copy.cuh tile_chunk): the copies fill whole 128-byte lines and the ldmatrix rows still fall in distinct
// banks. CUBRIDGE_DECODE_SWZ=0 turns it off (A/B).
#ifndef CUBRIDGE_DECODE_SWZ
#define CUBRIDGE_DECODE_SWZ 1
#endif
// The registers Q's fragments and O's accumulators may take together before Q is read from shared memory instead
// (attention_decode's kQRegs; 256: Q always in registers, as before, for A/B).
#ifndef CUBRIDGE_DECODE_Q_REGS
#define CUBRIDGE_DECODE_Q_REGS 128
#endif

// The decode kernel's K/V ring swizzled (copy.cuh tile_chunk) where whole 128-byte groups tile both head dims
// and the threads split a row's chunks evenly (64, 128, 256), but not in a paged walk of rows fewer than 8 apart
// (D 256): its pages of 16 read 10-17% slower swizzled, with or without each row's own place.
template <class Cfg, bool kPaged>
__host__ __device__ constexpr bool decode_ring_swizzled() {
  constexpr int D = Cfg::kHeadDim, DV = Cfg::kValueDim, NTH = Cfg::kThreads;
  return CUBRIDGE_DECODE_SWZ && D == Cfg::kPadD && DV == Cfg::kPadDv && D % 64 == 0 && DV % 64 == 0 &&
         NTH % (D / 8) == 0 && NTH % (DV / 8) == 0 && (!kPaged || (NTH / (D / 8)) % 8 == 0);
}

// Q's fragments stay in registers where they and O's accumulators take at most CUBRIDGE_DECODE_Q_REGS of a
// thread's 255 (PD / 4 and PDV / 2); past that Q is re-read from shared memory each k16 step (at D 256 the two
// took 192, and the paged kernel spilled 344 bytes).
template <class Cfg>
__host__ __device__ constexpr bool decode_q_in_regs() {
  return Cfg::kPadD / 4 + Cfg::kPadDv / 2 <= CUBRIDGE_DECODE_Q_REGS;
}

// Zeros in the padded columns (head dims padded to 16) of Q's rows and, unswizzled, of the K/V ring (a swizzled
// ring has no pad columns).
template <class Cfg, bool kSwz, class T>
__device__ __forceinline__ void zero_decode_pads(T* sQ, T* sK, T* sV, int tid) {
  constexpr int D = Cfg::kHeadDim, DV = Cfg::kValueDim, NTH = Cfg::kThreads, ST = Cfg::kStages, BN = Cfg::kBlockN;
  zero_pad_columns<Cfg::kRows, D, Cfg::kPadD, Cfg::kSmemLd, NTH>(sQ, tid);
  if constexpr (!kSwz) {
    zero_pad_columns<ST * BN, D, Cfg::kPadD, Cfg::kSmemLd, NTH>(sK, tid);
    zero_pad_columns<ST * BN, DV, Cfg::kPadDv, Cfg::kSmemLdV, NTH>(sV, tid);
  }
}

// This lane's ldmatrix addresses of warp `warp`'s keys in ring stage 0: K (Q K^T's B operand) and V (P V's).
template <class Cfg, bool kSwz, int LK, class T>
__device__ __forceinline__ unsigned decode_k_lane(const T* sK, int lane, int warp) {
  constexpr int KW = Cfg::kWarpKeys, LDS = Cfg::kSmemLd;
  return kSwz ? smem_u32(sK) + ((lane % 8 + (lane / 16) * 8) + warp * KW) * LK * 2
              : smem_u32(sK) + (lane_off_k<LDS>(lane) + warp * KW * LDS) * 2;
}
template <class Cfg, bool kSwz, int LV, class T>
__device__ __forceinline__ unsigned decode_v_lane(const T* sV, int lane, int warp) {
  constexpr int KW = Cfg::kWarpKeys, LDSV = Cfg::kSmemLdV;
  return kSwz ? smem_u32(sV) + ((lane % 8 + ((lane / 8) % 2) * 8) + warp * KW) * LV * 2
              : smem_u32(sV) + (lane_off_v<LDSV>(lane) + warp * KW * LDSV) * 2;
}

// Each piece's rows at (b, hk), where K and V are pieces (SegKV); nothing otherwise.
template <class T, class KV>
__device__ __forceinline__ void piece_heads(const T* (&seg_k)[SegKV::kMax], const T* (&seg_v)[SegKV::kMax],
                                            const KV& pg, int b, int hk) {
  if constexpr (KV::kSegmented) {
#pragma unroll
    for (int i = 0; i < SegKV::kMax; ++i) {
      seg_k[i] = static_cast<const T*>(pg.k[i]) + b * pg.k_sb[i] + hk * pg.k_sh[i];
      seg_v[i] = static_cast<const T*>(pg.v[i]) + b * pg.v_sb[i] + hk * pg.v_sh[i];
    }
  }
}

// The tile's packed Q rows (tile_scheduler.cuh PackedRows) into shared memory, 16 bytes a thread a step, and
// with kQRegs their fragments into registers.
template <int R, int D, int LDS, int NTH, bool kQRegs, int KC, class T, class Rows>
__device__ __forceinline__ void load_q_rows(T* sQ, unsigned (&qa)[1][KC][4], const FwdArgs& a, const Rows& pr,
                                            int b, int tid, int lane) {
  for (int idx = tid; idx < R * (D / 8); idx += NTH) {
    const int r = idx / (D / 8), c = idx % (D / 8);
    const T* src = static_cast<const T*>(a.q) + b * a.q_sb + pr.head(r) * a.q_sh + pr.query(r) * a.q_ss + c * 8;
    *reinterpret_cast<uint4*>(sQ + r * LDS + c * 8) = *reinterpret_cast<const uint4*>(src);
  }
  __syncthreads();
  if constexpr (kQRegs) load_q_frags<1, KC, LDS>(qa, smem_u32(sQ) + lane_off_a<LDS>(lane) * 2);
}

// The decode kernel's prefetch: the next non-empty block of the split (before j1) into ring stage `stage`, one
// commit group a block (an empty group past the last). Each block's class is evaluated once, here; the blocks
// loaded and not yet used wait in `ahead` (block << 2 | class, oldest first; -1: none), so the loop takes its
// next block and class with no load of its own (a mask reading a sequence length, evaluated again in the loop,
// cost 16% at pages of 16 against the same kernel without it: H100). Paged K/V of one head dim walked row by
// row (kAhead) load each block's table entries a block ahead. The state it walks is the kernel's own.
template <class Cfg, class T, class KV, bool kPaged, bool kSwz, class Span>
struct DecodePrefetch {
  static constexpr int D = Cfg::kHeadDim, DV = Cfg::kValueDim, BN = Cfg::kBlockN, NTH = Cfg::kThreads;
  static constexpr int ST = Cfg::kStages;
  static constexpr int LK = kSwz ? Cfg::kPadD : Cfg::kSmemLd, LV = kSwz ? Cfg::kPadDv : Cfg::kSmemLdV;
  static constexpr bool kAhead = kPaged && DV == D && RowWalk<BN, D, NTH>::kOk;
  using Entries = BlockEntries<RowWalk<BN, D, NTH>::kRows>;
  const Span& span;  // the class of a span of blocks (tile_scheduler.cuh HeadsSpan)
  int& pf;
  int (&ahead)[ST - 1];
  Entries& ent;
  const FwdArgs& a;
  const KV& pg;
  const PageDiv& pd;
  T *sK, *sV;
  const T *gK, *gV;
  const T* (&seg_k)[SegKV::kMax];
  const T* (&seg_v)[SegKV::kMax];
  int b, j1, kv_end, tid;

  __device__ __forceinline__ void operator()(int stage) const {
    int cls = kEmpty;
    while (pf < j1 && (cls = span(pf, pf + 1)) == kEmpty) ++pf;
    const bool ok = pf < j1;
#pragma unroll
    for (int i = 0; i + 1 < ST - 1; ++i) ahead[i] = ahead[i + 1];
    ahead[ST - 2] = ok ? (pf << 2 | cls) : -1;
    if constexpr (kAhead) {
      if (ok) {
        if (ent.blk != pf) load_block_entries<BN, D, NTH>(ent, pg, pd, b, pf, kv_end, tid);  // the first, or after a skip
        load_kv_paged<BN, D, LK, NTH, kSwz>(sK + stage * BN * LK, sV + stage * BN * LV, gK, gV, a, pg, pd, ent, pf * BN, kv_end, tid);
        if (pf + 1 < j1) load_block_entries<BN, D, NTH>(ent, pg, pd, b, pf + 1, kv_end, tid);
      }
    } else if constexpr (kPaged) {
      if (ok) load_kv_paged_rows<BN, D, DV, LK, LV, NTH, kSwz>(sK + stage * BN * LK, sV + stage * BN * LV, gK, gV, a, pg, pd, b, pf * BN, kv_end, tid);
    } else if constexpr (KV::kSegmented) {
      if (ok) load_tile_pieces<BN, D, LK, NTH, kSwz>(sK + stage * BN * LK, seg_k, pg.k_end, pg.k_ss, pf * BN, kv_end, tid);
      if (ok) load_tile_pieces<BN, DV, LV, NTH, kSwz>(sV + stage * BN * LV, seg_v, pg.v_end, pg.v_ss, pf * BN, kv_end, tid);
    } else {
      if (ok) load_tile<BN, D, LK, NTH, T, kSwz>(sK + stage * BN * LK, gK, a.k_ss, pf * BN, kv_end, tid);
      if (ok) load_tile<BN, DV, LV, NTH, T, kSwz>(sV + stage * BN * LV, gV, a.v_ss, pf * BN, kv_end, tid);
    }
    cp_async_commit();
    ++pf;
  }
};

}  // namespace cubridge
