// The decode kernel's loads (decode_kernel.cuh): K and V into its cp.async ring from wherever they lie, in one
// piece (copy.cuh's load_tile), as the pieces a spec concatenates (SegKV), or from pages through block tables
// (PagedKV), with each block's table entries loaded a block ahead of its copies.
#pragma once

#include "copy.cuh"
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

}  // namespace cubridge
