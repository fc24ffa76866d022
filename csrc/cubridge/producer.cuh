// Producers: the loads of Q, K and V into shared memory, apart from the math that reads them.
//
// TmaProducer (Hopper): the producer warp of a warp-specialised kernel. One thread (or, for pages in small
// boxes, the warp's 32 lanes) walks a tile's live key blocks and issues TMA copies of K and V into the ring
// of pipeline.cuh, handing the consumers each block's index and class beside it.
// CpAsyncProducer (FA2-class): every thread copies its share of a block with cp.async, a ring of stages
// ahead of the math.
#pragma once

#include "copy.cuh"
#include "paged.cuh"
#include "pipeline.cuh"
#include "tile_scheduler.cuh"
#include "tma.cuh"

namespace cubridge {

// kPaged: the tensor maps of K and V describe the pages as [pages][Hkv][page rows][D] with boxes of
// page_box_rows rows (at least lower/tiles.py's PAGED_TMA_ROWS), and a block is copied as the boxes of the
// pages its keys lie in; boxes past Skv read as zeros.
template <class Cfg, bool kPaged>
struct TmaProducer {
  static constexpr int BM = Cfg::kBlockM, BN = Cfg::kBlockN, ST = Cfg::kStages;
  static constexpr int CH = Cfg::kPadD / 64, CHV = Cfg::kPadDv / 64;  // 64-column chunks of Q/K and of V
  static constexpr unsigned kQBytes = BM * Cfg::kPadD * 2, kKBytes = BN * Cfg::kPadD * 2;
  static constexpr unsigned kVBytes = BN * Cfg::kPadDv * 2;
  const TmaDesc *tq, *tk, *tv;
  const PagedKV& pg;
  int skv, box, lanes;
  PageDiv pd;

  // One thread issues a block's few large boxes. Boxes of fewer than 64 rows are issued by the producer
  // warp's 32 lanes, a (box, chunk) each: a box costs its issuing thread about the same whatever its size
  // (pages of 16 at 0.52 of contiguous K/V from one thread, 0.79 from 32 lanes, H100).
  __device__ __forceinline__ TmaProducer(const TmaDesc* q, const TmaDesc* k, const TmaDesc* v, const PagedKV& pages,
                                         int n_keys)
      : tq(q), tk(k), tv(v), pg(pages), skv(n_keys) {
    box = kPaged ? page_box_rows(static_cast<int>(pg.page), BN) : BN;
    if constexpr (kPaged) pd = PageDiv(pg);
    lanes = kPaged && box < 64 ? 32 : 1;
  }

  __device__ __forceinline__ void prefetch_maps(int tid) const {
    if (tid == 0) {
      tma_prefetch_desc(tk);
      tma_prefetch_desc(tv);
    }
  }

  // The tile's Q once the consumers are done with the last tile's (the it-th tile of this CTA), with the
  // tile's first live block (n_blk: none) in tile_info[0].
  template <class Smem>
  __device__ __forceinline__ void load_q(const Smem& sm, const QueryTile& t, int j_first, int it, int tid) const {
    mbar_wait(sm.ring.q_empty(), (it & 1) ^ 1);
    if (tid == 0) {
      sm.tile_info[0] = j_first;
      mbar_expect_tx(sm.ring.q_full(), kQBytes);
#pragma unroll
      for (int c = 0; c < CH; ++c) tma_load_4d(sm.sQ + c * BM * 128, tq, sm.ring.q_full(), c * 64, t.q_lo, t.h, t.b);
    }
  }

  // K and V of the tile's live blocks from j_first on, the i-th block of the CTA into stage i % ST (i runs on
  // across tiles). Each block's index, class and whether it is the tile's last go to stage_info with its K
  // stage (written before the full barrier's arrival, read after its wait, rewritten only after the stage's
  // empty barrier), so no consumer waits on a block-map read.
  template <class Smem, class Live>
  __device__ __forceinline__ void load_kv(const Smem& sm, const QueryTile& t, Live& live, int j_first, int& i,
                                          int tid) const {
    using R = KVRing<ST>;
    for (int j = j_first; j < live.n_blk;) {
      const int cls = live.cls;
      const int j_next = live.next(j + 1);  // one ahead: the consumers learn which block is last
      const int s = R::stage(i);
      const unsigned free_ph = R::free_phase(i);
      mbar_wait(sm.ring.k_empty(s), free_ph);
      if (tid == 0) {  // before its arrival; other lanes' boxes may land first (the count goes below zero)
        sm.stage_info[2 * s] = j;
        sm.stage_info[2 * s + 1] = cls | (j_next >= live.n_blk ? 4 : 0);
        mbar_expect_tx(sm.ring.k_full(s), kKBytes);  // boxes count whole, zero-filled columns included
      }
      load_block(CH, sm.sK + s * kKBytes, tk, sm.ring.k_full(s), j, t, pg.k_table, pg.kt_sb, pg.kt_sp, pg.k_pages,
                 tid);
      mbar_wait(sm.ring.v_empty(s), free_ph);
      if (tid == 0) mbar_expect_tx(sm.ring.v_full(s), kVBytes);
      load_block(CHV, sm.sV + s * kVBytes, tv, sm.ring.v_full(s), j, t, pg.v_table, pg.vt_sb, pg.vt_sp, pg.v_pages,
                 tid);
      ++i;
      j = j_next;
    }
  }

  // Key block j of K or V (`chunks` 64-column chunks) into the ring stage at dst. Paged: box by box, each
  // inside one page (the table entry of its first key); a box past the keys takes the page index past the
  // buffer, which the copy engine reads as zeros (and counts in full). The row in the page is
  // key - page * rows, not key % rows: a modulo per box cost pages of 64 a tenth.
  __device__ __forceinline__ void load_block(int chunks, unsigned dst, const TmaDesc* d, unsigned bar, int j,
                                             const QueryTile& t, const void* table, long long t_sb, long long t_sp,
                                             long long n_pages, int tid) const {
    if constexpr (!kPaged) {
#pragma unroll
      for (int c = 0; c < chunks; ++c) tma_load_4d(dst + c * BN * 128, d, bar, c * 64, j * BN, t.hk, t.b);
    } else if (lanes == 1) {  // large boxes: one table read a box for all its column chunks
      for (int r = 0; r < BN; r += box) {
        const int key = j * BN + r, pi = pd.div(key), page = page_at(table, t.b, key, pi, t_sb, t_sp, n_pages);
#pragma unroll
        for (int c = 0; c < chunks; ++c)
          tma_load_4d(dst + c * BN * 128 + r * 128, d, bar, c * 64, key - pi * pd.page, t.hk, page);
      }
    } else {  // small boxes: the producer warp's lanes take one (box, chunk) each
      for (int x = tid; x < BN / box * chunks; x += lanes) {
        const int r = x / chunks * box, c = x % chunks, key = j * BN + r, pi = pd.div(key);
        tma_load_4d(dst + c * BN * 128 + r * 128, d, bar, c * 64, key - pi * pd.page, t.hk,
                    page_at(table, t.b, key, pi, t_sb, t_sp, n_pages));
      }
    }
  }

  // The page of `key` (table index pi); a key past the end takes the page index past the buffer, read as zeros.
  __device__ __forceinline__ int page_at(const void* table, int b, int key, int pi, long long t_sb, long long t_sp,
                                         long long n_pages) const {
    return key < skv ? static_cast<int>(page_entry(table, pg.table64 != 0, b * t_sb + pi * t_sp, n_pages))
                     : static_cast<int>(n_pages);
  }
};

// The FA2-class kernel's loads: Q once, then K and V of the tile's non-empty blocks through a ring of ST stages
// (cp.async, every thread its share). A cursor walks the non-empty blocks in the main loop's order, the i-th one
// into stage i % ST; two groups (K, V) per block, and empty groups past the end, so the wait counts stay fixed.
// kPaged: K and V read in place from pages through block tables (paged.cuh SeqPages). The tables' fields live
// in their own object, which the page lookups capture: captured with the K/V pointers (this object) they
// changed the paged kernel's machine code.
template <class Cfg, class T, bool kPaged, class Span>
struct CpAsyncProducer {
  static constexpr int D = Cfg::kHeadDim, DV = Cfg::kValueDim, BM = Cfg::kBlockM, BN = Cfg::kBlockN;
  static constexpr int ST = Cfg::kStages, NTH = Cfg::kThreads;
  static constexpr int LDS = Cfg::kSmemLd, LDV = Cfg::kSmemLdV, LDQ = Cfg::kSmemLdQ;
  const FwdArgs& a;
  const SeqPages& pages;
  const Span& span;  // the class of a key block (tile_scheduler.cuh TileSpan)
  T *sK, *sV;
  const T *gQ, *gK, *gV;
  int n_blk, skv;
  int pf = 0;  // the cursor: the next block to look at

  __device__ __forceinline__ CpAsyncProducer(const FwdArgs& args, const SeqPages& pg, const QueryTile& t,
                                             const Span& s, T* k_ring, T* v_ring, int n, int n_keys)
      : a(args), pages(pg), span(s), sK(k_ring), sV(v_ring), n_blk(n), skv(n_keys) {
    gQ = static_cast<const T*>(a.q) + t.b * a.q_sb + t.h * a.q_sh;
    gK = static_cast<const T*>(a.k) + (kPaged ? 0 : t.b * a.k_sb) + t.hk * a.k_sh;
    gV = static_cast<const T*>(a.v) + (kPaged ? 0 : t.b * a.v_sb) + t.hk * a.v_sh;
  }

  // The tile's Q rows (one group), and zeros in the padded columns of Q and of the ring (fwd_config.cuh: the
  // head dims padded to 16), which no copy writes.
  __device__ __forceinline__ void load_q(T* sQ, const QueryTile& t, int sq, int tid) const {
    load_tile<BM, D, LDQ, NTH>(sQ, gQ, a.q_ss, t.q_lo, sq, tid);
    cp_async_commit();
    zero_pad_columns<BM, D, Cfg::kPadD, LDQ, NTH>(sQ, tid);
    zero_pad_columns<ST * BN, D, Cfg::kPadD, LDS, NTH>(sK, tid);
    zero_pad_columns<ST * BN, DV, Cfg::kPadDv, LDV, NTH>(sV, tid);
  }

  // The next non-empty block's K and V into `stage`, or two empty groups past the last.
  __device__ __forceinline__ void prefetch(int stage, int tid) {
    while (pf < n_blk && span(pf, pf + 1) == kEmpty) ++pf;
    const bool ok = pf < n_blk;
    if constexpr (kPaged) {
      const PagedKV& pg = pages.pg;
      auto k_page = [&sp = pages](int i) { return sp.k_page(i); };
      auto v_page = [&sp = pages](int i) { return sp.v_page(i); };
      if (ok) load_block_paged<BN, D, LDS, NTH>(sK + stage * BN * LDS, gK, a.k_ss, pg.k_sp, pages.pd, k_page, pf * BN, skv, tid);
      cp_async_commit();
      if (ok) load_block_paged<BN, DV, LDV, NTH>(sV + stage * BN * LDV, gV, a.v_ss, pg.v_sp, pages.pd, v_page, pf * BN, skv, tid);
    } else {
      if (ok) load_tile<BN, D, LDS, NTH>(sK + stage * BN * LDS, gK, a.k_ss, pf * BN, skv, tid);
      cp_async_commit();
      if (ok) load_tile<BN, DV, LDV, NTH>(sV + stage * BN * LDV, gV, a.v_ss, pf * BN, skv, tid);
    }
    cp_async_commit();
    ++pf;
  }

  // The waits, counted in groups still in flight, each followed by a CTA barrier (the data visible to every
  // warp, and every warp done with the stage the next prefetch refills):
  // Q, with the first ST - 1 blocks' groups behind it;
  __device__ __forceinline__ static void wait_q() {
    cp_async_wait<2 * (ST - 1)>();
    __syncthreads();
  }
  // the current block's K (its V may still fly), before the next prefetch;
  __device__ __forceinline__ static void wait_k() {
    cp_async_wait<2 * ST - 3>();
    __syncthreads();
  }
  // the current block's V, the next block's two groups behind it.
  __device__ __forceinline__ static void wait_v() {
    cp_async_wait<2 * ST - 2>();
    __syncthreads();
  }
};

}  // namespace cubridge
