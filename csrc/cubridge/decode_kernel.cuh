// Expert decode kernel: few queries (Sq <= 16) against a long KV cache, at memory speed.
//
// GQA packing: the G = Hq / Hkv query heads that read one KV head, times Sq queries, are the
// rows of one 16-row tile (row r: g = r / Sq, q = r % Sq), so each K/V byte is read once for all
// of them. Split-KV: the key range is cut into chunks of whole 64-key blocks, one CTA each, so a
// small batch still fills the GPU. The splits' partial results merge in the same launch: each
// CTA writes its partial, and the last of a tile's splits to finish (a counter per tile) merges
// them, so there is no second kernel and no gap between two launches.
//
// Launch: grid = (n_split, Hkv * row_tiles, B), block = 128 threads (4 warps), dynamic shared
// memory = DecodeTile::kSmemBytes. part_o / part_lse: [B, Hq, Sq, n_split, DV] / [.., n_split, 2]
// fp32 when n_split > 1 (part_lse: each split's max in score units and its sum, kept apart: a
// log2 LSE m * log2e + log2(l) overflows at a finfo.min fill and loses l at a -1e9 one) (null otherwise: the CTA writes O itself). counters: one int per
// (b, blockIdx.y), zero before the launch; the merging CTA sets its own back to zero, so a buffer
// serves every launch of one stream (and every replay of a CUDA graph). pg: K/V pages and block
// tables, read only where the kernel is built paged (kPaged).
//
// Per CTA: Q rows -> shared -> registers; for every non-empty 64-key block of its chunk, all
// warps load K and V (cp.async, a ring of kStages blocks) and warp w takes its quarter of the keys with its own
// online softmax (m, l, O in registers); the four warps merge through shared memory at the end.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "copy.cuh"
#include "epilogue.cuh"
#include "fwd_config.cuh"
#include "gemm.cuh"
#include "block_span.cuh"
#include "hooks.cuh"
#include "mma.cuh"
#include "paged.cuh"
#include "score_tile.cuh"
#include "softmax.cuh"
#include "variant.cuh"

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
// loaded ahead; 4k and B 1 unchanged; with three stages and one CTA per SM still 0.62-0.70: H100, NOTES v29).
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
// entries staged in shared memory, whole pages copied with running pointers (NOTES v25), 32-bit addresses
// with no division per row (v29: pages of 24 +9%, pages of 16 at 32k -1.7%).
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
template <int D, int DV = D, int ST = 2, int BLOCK_N = 64>
struct DecodeTile {
  static constexpr int kHeadDim = D;
  static constexpr int kValueDim = DV;  // V's and O's head dim (multi-head latent attention: below Q's)
  static constexpr int kPadD = pad16(D);    // computed over head dims padded to 16 (fwd_config.cuh)
  static constexpr int kPadDv = pad16(DV);
  static constexpr int kRows = 16;    // packed (head, query) rows per CTA
  static constexpr int kBlockN = BLOCK_N;  // keys per block: a quarter per warp
  static constexpr int kWarpKeys = BLOCK_N / 4;
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 128;
  static constexpr int kStages = ST;  // K/V blocks in the ring: ST - 1 load while one is used
  static constexpr int kSmemLd = kPadD + 8;
  static constexpr int kSmemLdV = kPadDv + 8;
  // Q, the K/V ring; the merge (4 warps x 16 rows x DV fp32, then m and l) reuses the ring
  static constexpr int kRingBytes = (kRows * kSmemLd + kStages * kBlockN * (kSmemLd + kSmemLdV)) * 2;
  static constexpr int kMergeBytes = kWarps * kRows * (kPadDv + 2) * 4;
  static constexpr int kSmemBytes = kRingBytes > kMergeBytes ? kRingBytes : kMergeBytes;
  static_assert(D % 8 == 0 && D <= 256 && DV % 8 == 0 && DV <= 256, "head dims in steps of 8, at most 256");
  static_assert(BLOCK_N % 64 == 0, "whole k16 steps of keys per warp");
};

#ifdef CUBRIDGE_TRACE
// Diagnostics only (benchmarks/diag_decode_timeline.py defines it): per CTA, the global timer at entry, when its
// first block's data is in, after its last block, and at its end (after the merge for the merging CTA).
extern "C" __device__ unsigned long long cubridge_trace[4 * 65536];
extern "C" __device__ unsigned cubridge_trace_sm[65536];  // the multiprocessor each CTA ran on
__device__ __forceinline__ void trace_at(int slot) {
  if (threadIdx.x != 0) return;
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  const unsigned cta = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  if (cta < 65536) cubridge_trace[4 * cta + slot] = t;
  if (cta < 65536 && slot == 0) {
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    cubridge_trace_sm[cta] = sm;
  }
}
#define CUBRIDGE_TRACE_AT(slot) trace_at(slot)
#else
#define CUBRIDGE_TRACE_AT(slot)
#endif

// A row's output from this thread's 8-column chunks k0, k0 + 8, ... of acc, unnormalised, with the row's max m
// (score units) and sum l: normalised with the sink, stored as T 16 bytes a chunk, and the row's LSE from its
// first thread. kMeanV: a row with every key masked takes V's mean where the variant asks (V in one piece).
template <class Variant, class T, int DV, bool kMeanV>
__device__ __forceinline__ void store_row(const FwdArgs& a, const typename Variant::Params& p,
                                          const float (&acc)[(DV / 8 + 7) / 8][8], float m, float l, float factor,
                                          int b, int h, long long q, long long row, int k0, int skv) {
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr int CT = DV / 8, CH = (CT + 7) / 8;
  const float sink2 = Variant::kHasSink ? Hook<Variant>::sink(a, p, b, h) * kLog2e : neg_inf();
  float o_scale, lse;
  finish_stats(m * factor, l, sink2, o_scale, lse);  // o_scale = 1 / (l + sink)
  T* gO = static_cast<T*>(a.o) + b * a.o_sb + h * a.o_sh + q * a.o_ss;
  const T* gV = static_cast<const T*>(a.v) + b * a.v_sb + Variant::kv_head(a, h) * a.v_sh;
#pragma unroll
  for (int i = 0; i < CH; ++i) {
    const int ch = k0 + 8 * i;
    if (ch >= CT) continue;
    uint4 val;
    val.x = pack2<T>(acc[i][0] * o_scale, acc[i][1] * o_scale);
    val.y = pack2<T>(acc[i][2] * o_scale, acc[i][3] * o_scale);
    val.z = pack2<T>(acc[i][4] * o_scale, acc[i][5] * o_scale);
    val.w = pack2<T>(acc[i][6] * o_scale, acc[i][7] * o_scale);
    if (kMeanV && Variant::kEmptyRowMeanV && m == neg_inf()) val = mean_v_chunk(gV, a.v_ss, skv, ch);
    *reinterpret_cast<uint4*>(gO + ch * 8) = val;
  }
  if (a.lse != nullptr && k0 == 0) a.lse[row] = lse;
}

template <class Variant, class T, int DV>
__device__ __forceinline__ void merge_splits(const FwdArgs& a, const typename Variant::Params& p,
                                             const float* part_o, const float* part_lse, int n_split, float factor,
                                             long long row, int b, int h, int q, int k0);

template <class Cfg, class Variant, class T, bool kPaged = false, class KV = PagedKV>
__device__ __forceinline__ void attention_decode(const FwdArgs& a, const typename Variant::Params& p,
                                                 float* part_o, float* part_lse, int* counters, int chunk,
                                                 const KV& pg) {
  constexpr int D = Cfg::kHeadDim, DV = Cfg::kValueDim, R = Cfg::kRows, BN = Cfg::kBlockN;
  constexpr int LDS = Cfg::kSmemLd, LDSV = Cfg::kSmemLdV;
  constexpr int NTH = Cfg::kThreads, ST = Cfg::kStages;
  constexpr int PD = Cfg::kPadD, PDV = Cfg::kPadDv;
  constexpr int KC = PD / 16, DT = PDV / 8;  // k steps of Q.K; 8-column tiles of O (padded columns: zero)
  constexpr int KW = Cfg::kWarpKeys, NT = KW / 8;  // a warp's keys of each block, as 8-key tiles
  constexpr bool kRaw = score_is_default<Variant>(0);
  constexpr bool kSeg = KV::kSegmented;
  static_assert(!((kPaged || kSeg) && Variant::kEmptyRowMeanV), "empty rows' mean of V reads V in one piece");
  using H = Hook<Variant>;
  constexpr float kLog2e = 1.4426950408889634f;
  CUBRIDGE_TRACE_AT(0);

  // the K/V ring swizzled (copy.cuh tile_chunk) where whole 128-byte groups tile both head dims and the threads
  // split a row's chunks evenly (64, 128, 256), but not in a paged walk of rows fewer than 8 apart (D 256): its
  // pages of 16 read 10-17% slower swizzled, with or without each row's own place (NOTES v37)
  constexpr bool kSwz = CUBRIDGE_DECODE_SWZ && D == PD && DV == PDV && D % 64 == 0 && DV % 64 == 0 &&
                        NTH % (D / 8) == 0 && NTH % (DV / 8) == 0 && (!kPaged || (NTH / (D / 8)) % 8 == 0);
  constexpr int LK = kSwz ? PD : LDS, LV = kSwz ? PDV : LDSV;  // K's and V's ring row pitches
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + R * LDS;
  T* sV = sK + ST * BN * LK;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int sq = static_cast<int>(a.Sq), skv = static_cast<int>(a.Skv);
  const int G = static_cast<int>(a.Hq / a.Hkv), rows = G * sq;
  const int row_tiles = (rows + R - 1) / R;
  const int split = blockIdx.x, n_split = gridDim.x;
  const int hk = blockIdx.y / row_tiles, r_lo = (blockIdx.y % row_tiles) * R;
  const int b = blockIdx.z;
  // packed row -> (query head, query); rows past the group repeat the last valid one
  auto head_of = [&](int r) { return Variant::q_head(a, hk, imin(r_lo + r, rows - 1) / sq); };
  auto query_of = [&](int r) { return imin(r_lo + r, rows - 1) % sq; };
  const int g_first = r_lo / sq, g_last = (imin(r_lo + R, rows) - 1) / sq;  // the tile's heads of the group

  // @cuir tile axis=q size=kRows
  const T* gK = static_cast<const T*>(a.k) + (kPaged ? 0 : b * a.k_sb) + hk * a.k_sh;
  const T* gV = static_cast<const T*>(a.v) + (kPaged ? 0 : b * a.v_sb) + hk * a.v_sh;
  const T* seg_k[SegKV::kMax];  // each piece at (b, hk), where K and V are pieces (unused otherwise)
  const T* seg_v[SegKV::kMax];
  if constexpr (kSeg) {
#pragma unroll
    for (int i = 0; i < SegKV::kMax; ++i) {
      seg_k[i] = static_cast<const T*>(pg.k[i]) + b * pg.k_sb[i] + hk * pg.k_sh[i];
      seg_v[i] = static_cast<const T*>(pg.v[i]) + b * pg.v_sb[i] + hk * pg.v_sh[i];
    }
  }

  // The tile's class for key blocks [j_lo, j_hi): every query head of the tile over all Sq queries
  // (a superset of its rows: empty and full stay sound).
  auto span_cls = [&](int j_lo, int j_hi) -> int {
    if constexpr (!Variant::kClassByHead)  // one class for every head of the tile
      return H::block_class(a, p, b, Variant::q_head(a, hk, g_first), 0, sq, j_lo * BN, imin(j_hi * BN, skv));
    bool any = false, all = true;
    for (int g = g_first; g <= g_last; ++g) {
      const int c = H::block_class(a, p, b, Variant::q_head(a, hk, g), 0, sq, j_lo * BN, imin(j_hi * BN, skv));
      any |= c != kEmpty;
      all &= c == kFull;
    }
    return any ? (all ? kFull : kPartial) : kEmpty;
  };
  auto tile_cls = [&](int j) { return span_cls(j, j + 1); };

  // This split's blocks [j0, j1). Where a mask can empty blocks, the splits share the tile's live span, not
  // the whole key range: a sequence shorter than its block table (continuous batching) or a window of a
  // long cache is then read by every split, not by the few whose chunks it falls in. The span's ends are
  // found by binary search over span_cls (block_span.cuh), as the Hopper prefill finds them.
  const int n_blk = (skv + BN - 1) / BN;
  int j0 = imin(split * (chunk / BN), n_blk), j1 = imin(j0 + chunk / BN, n_blk);
  if constexpr (Variant::kHasMask) {
    if (n_split > 1) {
      int lo = 0, hi = n_blk;  // [0, lo) and [hi, n_blk) proven empty
      const int whole = span_cls(0, n_blk);  // full (every key live, the common case): no search
      if (whole == kEmpty) {
        hi = 0;
      } else if (whole == kPartial) {
        hi = live_end(span_cls, 0, n_blk);
        lo = live_start(span_cls, 0, hi);
      }
      const int per = (hi - lo + n_split - 1) / n_split;
      j0 = imin(lo + split * per, hi);
      j1 = imin(j0 + per, hi);
    }
  }
  const int kv_end = imin(j1 * BN, skv);

  int pf = j0;
  // paged K/V of one head dim, walked row by row: each block's table entries loaded a block ahead
  constexpr bool kAhead = kPaged && DV == D && RowWalk<BN, D, NTH>::kOk;
  BlockEntries<RowWalk<BN, D, NTH>::kRows> ent;
  ent.blk = -1;
  PageDiv pd;
  if constexpr (kPaged) pd = PageDiv(pg);
  // Each block's class is evaluated once, where prefetch reaches it; the blocks loaded and not yet used wait
  // in `ahead` (block << 2 | class, oldest first; -1: none), so the loop takes its next block and class with
  // no load of its own (a mask reading a sequence length, evaluated again in the loop, cost 16% at pages of
  // 16 against the same kernel without it: H100, NOTES v31).
  static_assert(ST >= 2, "a ring of at least two blocks");
  int ahead[ST - 1];
  auto prefetch = [&](int stage) {
    int cls = kEmpty;
    while (pf < j1 && (cls = tile_cls(pf)) == kEmpty) ++pf;
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
    } else if constexpr (kSeg) {
      if (ok) load_tile_pieces<BN, D, LK, NTH, kSwz>(sK + stage * BN * LK, seg_k, pg.k_end, pg.k_ss, pf * BN, kv_end, tid);
      if (ok) load_tile_pieces<BN, DV, LV, NTH, kSwz>(sV + stage * BN * LV, seg_v, pg.v_end, pg.v_ss, pf * BN, kv_end, tid);
    } else {
      if (ok) load_tile<BN, D, LK, NTH, T, kSwz>(sK + stage * BN * LK, gK, a.k_ss, pf * BN, kv_end, tid);
      if (ok) load_tile<BN, DV, LV, NTH, T, kSwz>(sV + stage * BN * LV, gV, a.v_ss, pf * BN, kv_end, tid);
    }
    cp_async_commit();
    ++pf;
  };
  zero_pad_columns<R, D, PD, LDS, NTH>(sQ, tid);
  if constexpr (!kSwz) {  // (a swizzled ring has no pad columns)
    zero_pad_columns<ST * BN, D, PD, LDS, NTH>(sK, tid);
    zero_pad_columns<ST * BN, DV, PDV, LDSV, NTH>(sV, tid);
  }
  // Q's rows into registers, once the first K/V blocks are out (its loads wait for their data): the loop's
  // first ST - 1 turns only prefetch, so the copy code is compiled once, not once more per ring slot.
  // Q's fragments stay in registers where they and O's accumulators take at most CUBRIDGE_DECODE_Q_REGS of a
  // thread's 255 (PD / 4 and PDV / 2); past that Q is re-read from shared memory each k16 step (at D 256 the
  // two took 192, and the paged kernel spilled 344 bytes)
  constexpr bool kQRegs = PD / 4 + PDV / 2 <= CUBRIDGE_DECODE_Q_REGS;
  unsigned qa[1][kQRegs ? KC : 1][4];
  auto load_q = [&] {
    // @cuir load tensor=q
    for (int idx = tid; idx < R * (D / 8); idx += NTH) {
      const int r = idx / (D / 8), c = idx % (D / 8);
      const T* src = static_cast<const T*>(a.q) + b * a.q_sb + head_of(r) * a.q_sh + query_of(r) * a.q_ss + c * 8;
      *reinterpret_cast<uint4*>(sQ + r * LDS + c * 8) = *reinterpret_cast<const uint4*>(src);
    }
    __syncthreads();
    if constexpr (kQRegs) load_q_frags<1, KC, LDS>(qa, smem_u32(sQ) + lane_off_a<LDS>(lane) * 2);
  };

  float o[1][DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt) o[0][dt][0] = o[0][dt][1] = o[0][dt][2] = o[0][dt][3] = 0.f;
  float m[2] = {neg_inf(), neg_inf()}, l[2] = {0.f, 0.f};
  const float factor = kRaw ? static_cast<float>(a.scale) * kLog2e : kLog2e;
  int hr[2], qr[2];  // this lane's two rows
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) hr[hf] = head_of(lane / 4 + hf * 8), qr[hf] = query_of(lane / 4 + hf * 8);
  const unsigned k_lane = kSwz ? smem_u32(sK) + ((lane % 8 + (lane / 16) * 8) + warp * KW) * LK * 2
                              : smem_u32(sK) + (lane_off_k<LDS>(lane) + warp * KW * LDS) * 2;
  const unsigned v_lane = kSwz ? smem_u32(sV) + ((lane % 8 + ((lane / 8) % 2) * 8) + warp * KW) * LV * 2
                              : smem_u32(sV) + (lane_off_v<LDSV>(lane) + warp * KW * LDSV) * 2;

  int stage = 0, slot = 0, fill = ST - 1;  // slot: the ring slot prefetch fills next; fill: first turns left
  // @cuir loop axis=kv size=kBlockN
  for (;;) {
    // @cuir hook name=block_class
    const int next = fill > 0 ? 0 : ahead[0];  // (evaluated by prefetch)
    // @cuir skip when=empty
    if (next < 0) break;  // prefetch passed over the empty blocks; none left
    const int j = next >> 2, cls = next & 3;
    // @cuir load tensor=k
    prefetch(slot);  // after the first turns, the slot the last block used (freed by its barrier)
    slot = slot == ST - 1 ? 0 : slot + 1;
    if (fill > 0) {
      if (--fill == 0) load_q();
      continue;
    }
    cp_async_wait<ST - 1>();
    __syncthreads();
#ifdef CUBRIDGE_TRACE
    if (j == j0) CUBRIDGE_TRACE_AT(1);
#endif
    // @cuir mma name=qk
    float s[1][NT][4];
    if constexpr (kQRegs)
      gemm_qk<T, 1, NT, KC, LK, kSwz>(s, qa, k_lane + stage * BN * LK * 2, lane);
    else
      gemm_qk_smem<T, 1, NT, KC, LK, LDS, kSwz>(s, smem_u32(sQ) + lane_off_a<LDS>(lane) * 2, k_lane + stage * BN * LK * 2, lane);
    // @cuir hook name=score
    // @cuir hook name=mask when=partial
    const int kv0 = j * BN + warp * KW + (lane % 4) * 2;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int hf = e / 2, kv = kv0 + nt * 8 + e % 2, kc = imin(kv, skv - 1);
        float x = s[0][nt][e];
        if constexpr (!kRaw) x = H::score(a, p, x, b, hr[hf], qr[hf], kc);
        bool keep = kv < kv_end;
        if constexpr (Variant::kHasMask)
          if (cls == kPartial) keep = keep && H::mask(a, p, b, hr[hf], qr[hf], kc);
        s[0][nt][e] = keep ? x : neg_inf();
      }
    // @cuir softmax kind=online
    softmax_update<1, NT, DT, true>(s, o, m, l, factor);
    // @cuir load tensor=v
    // @cuir mma name=pv
    gemm_pv<T, 1, NT, DT, LV, kSwz>(o, s, v_lane + stage * BN * LV * 2, lane);
    __syncthreads();  // every warp is done with this stage before the next prefetch refills it
    stage = stage == ST - 1 ? 0 : stage + 1;
  }
  // @cuir endloop axis=kv
  cp_async_wait<0>();
  __syncthreads();
  CUBRIDGE_TRACE_AT(2);

  // Merge the four warps: O and m, l per row through shared memory (the ring is free now).
  float* mo = reinterpret_cast<float*>(smem_raw);  // [warp][row][PDV]
  float* mm = mo + Cfg::kWarps * R * PDV;          // [warp][row]
  float* ml = mm + Cfg::kWarps * R;
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int r = lane / 4 + hf * 8;
    const float lw = quad_sum(l[hf]);
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
      float* dst = mo + (warp * R + r) * PDV + dt * 8 + (lane % 4) * 2;
      dst[0] = o[0][dt][2 * hf];
      dst[1] = o[0][dt][2 * hf + 1];
    }
    if (lane % 4 == 0) {
      mm[warp * R + r] = m[hf];  // score units: scaled only after a difference, as softmax_rows does
      ml[warp * R + r] = lw;
    }
  }
  __syncthreads();

  // @cuir hook name=sink
  // @cuir epilogue kind=normalise
  // Thread t: row t / 8, and the row's 8-column chunks t % 8, t % 8 + 8, ...: every store is 16 bytes
  // at a 16-byte offset whatever DV is (a thread's own span of DV / 8 columns was not, at DV 48 or 96).
  constexpr int CT = DV / 8;  // O's own 8-column chunks (the padded ones are not stored)
  constexpr int CH = (CT + 7) / 8;
  const int r = tid / 8, k0 = tid % 8;
  const bool valid = r_lo + r < rows;  // (no early return: the split hand-over below syncs the CTA)
  const int h = head_of(r), q = query_of(r);
  float m2 = neg_inf();
#pragma unroll
  for (int w = 0; w < Cfg::kWarps; ++w) m2 = fmaxf(m2, mm[w * R + r]);
  float wgt[Cfg::kWarps], lsum = 0.f;
#pragma unroll
  for (int w = 0; w < Cfg::kWarps; ++w) {
    wgt[w] = m2 == neg_inf() ? 0.f : fast_exp2((mm[w * R + r] - m2) * factor);
    lsum = fmaf(ml[w * R + r], wgt[w], lsum);
  }
  float acc[CH][8];
#pragma unroll
  for (int i = 0; i < CH; ++i)
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      acc[i][c] = 0.f;
      if (k0 + 8 * i < CT)
#pragma unroll
        for (int w = 0; w < Cfg::kWarps; ++w) acc[i][c] = fmaf(mo[(w * R + r) * PDV + (k0 + 8 * i) * 8 + c], wgt[w], acc[i][c]);
    }
  const long long row = (static_cast<long long>(b) * a.Hq + h) * a.Sq + q;
  if (n_split > 1) {  // partial: normalised over this chunk, with its max and sum; the sink joins later
    if (valid) {
      const float inv = lsum > 0.f ? 1.f / lsum : 0.f;
      float4* dst = reinterpret_cast<float4*>(part_o + (row * n_split + split) * DV);  // DV % 8 == 0: aligned
#pragma unroll
      for (int i = 0; i < CH; ++i)
        if (k0 + 8 * i < CT) {
          dst[(k0 + 8 * i) * 2] = make_float4(acc[i][0] * inv, acc[i][1] * inv, acc[i][2] * inv, acc[i][3] * inv);
          dst[(k0 + 8 * i) * 2 + 1] = make_float4(acc[i][4] * inv, acc[i][5] * inv, acc[i][6] * inv, acc[i][7] * inv);
        }
      if (tid % 8 == 0) {
        part_lse[2 * (row * n_split + split)] = lsum > 0.f ? m2 : neg_inf();
        part_lse[2 * (row * n_split + split) + 1] = lsum;
      }
    }
    // The last split of this tile to finish merges all of them: the partials are made visible
    // before the count, and read after it past L1 (merge_splits' __ldcg).
    __shared__ int last;
    __threadfence();
    __syncthreads();
    if (tid == 0) {
      int* cnt = counters + static_cast<long long>(b) * gridDim.y + blockIdx.y;
      last = atomicAdd(cnt, 1) == n_split - 1;
      if (last) *cnt = 0;  // ready for the next launch on this stream
    }
    __syncthreads();
    CUBRIDGE_TRACE_AT(3);
    if (!last) return;
    __threadfence();
    if (valid) merge_splits<Variant, T, DV>(a, p, part_o, part_lse, n_split, factor, row, b, h, q, k0);
#ifdef CUBRIDGE_TRACE
    __syncthreads();
    CUBRIDGE_TRACE_AT(3);
#endif
    return;
  }
  if (!valid) return;
  // @cuir store tensor=o
  // @cuir store tensor=lse when=requested
  store_row<Variant, T, DV, !kPaged && !kSeg>(a, p, acc, m2, lsum, factor, b, h, q, row, k0, skv);
}

// Merge the splits of one (b, h, q) row, in the thread that finished it: the row's eight threads take its
// 8-column chunks k0, k0 + 8, ... as in the partial's store. Online over the splits in their order (so the
// result does not depend on which split came last), kBatch splits at a time with all their loads in flight:
// one trip to L2 a batch. With M the largest split max and w_i = l_i 2^((m_i - M) factor),
// O = sum_i w_i o_i / (sum_i w_i + sink). (A warp a row, four rows a warp, took three dependent trips a row:
// 4.6 us from the last block to the end at B 8, 4k, H100, NOTES v35.)
template <class Variant, class T, int DV>
__device__ __forceinline__ void merge_splits(const FwdArgs& a, const typename Variant::Params& p,
                                             const float* part_o, const float* part_lse, int n_split, float factor,
                                             long long row, int b, int h, int q, int k0) {
  constexpr int CT = DV / 8, CH = (CT + 7) / 8, kBatch = 4;
  const float2* ml = reinterpret_cast<const float2*>(part_lse) + row * n_split;  // (max, sum) per split
  const float4* po = reinterpret_cast<const float4*>(part_o + row * n_split * DV);
  float M = neg_inf(), L = 0.f, acc[CH][8];
#pragma unroll
  for (int i = 0; i < CH; ++i)
#pragma unroll
    for (int c = 0; c < 8; ++c) acc[i][c] = 0.f;
  for (int s0 = 0; s0 < n_split; s0 += kBatch) {
    float2 st[kBatch];
    float4 v[kBatch][CH][2];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const bool ok = s0 + j < n_split;
      st[j] = ok ? __ldcg(ml + s0 + j) : make_float2(neg_inf(), 0.f);
#pragma unroll
      for (int i = 0; i < CH; ++i)
#pragma unroll
        for (int e = 0; e < 2; ++e)
          v[j][i][e] = ok && k0 + 8 * i < CT ? __ldcg(po + (s0 + j) * (DV / 4) + (k0 + 8 * i) * 2 + e)
                                             : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    float mn = M;
#pragma unroll
    for (int j = 0; j < kBatch; ++j) mn = fmaxf(mn, st[j].x);
    if (mn == neg_inf()) continue;  // every split so far masked whole: nothing to add
    const float c0 = fast_exp2((M - mn) * factor);  // 0 where M is still -inf (acc and L are 0)
    L *= c0;
#pragma unroll
    for (int i = 0; i < CH; ++i)
#pragma unroll
      for (int c = 0; c < 8; ++c) acc[i][c] *= c0;
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const float w = st[j].x == neg_inf() ? 0.f : st[j].y * fast_exp2((st[j].x - mn) * factor);  // masked: 0
      L += w;
#pragma unroll
      for (int i = 0; i < CH; ++i) {
        const float4 x = v[j][i][0], y = v[j][i][1];
        acc[i][0] = fmaf(x.x, w, acc[i][0]), acc[i][1] = fmaf(x.y, w, acc[i][1]);
        acc[i][2] = fmaf(x.z, w, acc[i][2]), acc[i][3] = fmaf(x.w, w, acc[i][3]);
        acc[i][4] = fmaf(y.x, w, acc[i][4]), acc[i][5] = fmaf(y.y, w, acc[i][5]);
        acc[i][6] = fmaf(y.z, w, acc[i][6]), acc[i][7] = fmaf(y.w, w, acc[i][7]);
      }
    }
    M = mn;
  }
  store_row<Variant, T, DV, true>(a, p, acc, M, L, factor, b, h, q, row, k0, static_cast<int>(a.Skv));
}

}  // namespace cubridge
