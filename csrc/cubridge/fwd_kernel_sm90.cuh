// Expert forward attention kernel for Hopper (sm_90a): TMA loads, wgmma,
// warp specialisation. Same hooks, same semantics as fwd_kernel.cuh:
//
//   O[b, h, q, :] = sum_kv softmax_kv(score(q.k)) V[b, kv_head(h), kv, :]
//
// Launch: grid = (min(tiles, SMs), 1, 1) where Cfg::kPersistent, else (tiles, 1, 1)
//   (lower/tiles.py decides, Tile.persistent); block = Sm90Tile::kThreads
//   (one producer and kConsumers warpgroups), dynamic shared memory =
//   Sm90Tile::kSmemBytes; parameters (FwdArgs, Params, tensor maps of Q, K, V).
//   A tile is kBlockM = 64 x kConsumers query rows of one
//   (batch, head); tiles are numbered heaviest first (the last query rows of a
//   causal mask) and CTA c takes tiles c, c + grid, ... The producer loads the
//   next tile's Q and K/V while the consumers finish the current one.
//
// Warpgroup 0 is the producer: one thread walks the non-empty key blocks and
// issues TMA copies of K and V into a kStages-deep shared-memory ring, each
// buffer completing on its own mbarrier; it gives most of its registers away
// (setmaxnreg). Warpgroups 1.. are consumers, 64 query rows each:
// S = Q K^T (wgmma, both operands in shared memory), score/mask hooks, online
// softmax in registers, O += P V (wgmma, P from registers). P V of one block
// is issued behind the next block's Q K^T, so it overlaps that block's softmax.
// Consumers release K after its Q K^T and V after its P V, and Q after the
// tile's last Q K^T (kOwnO) or after the epilogue. Epilogue: O / l (sink joins
// l), staged in shared memory (an O buffer where it fits, else the consumer's
// own Q rows), 16-byte coalesced stores.
//
// kPaged: K and V read in place from pages through block tables (paged.cuh). The tensor maps of K
// and V then describe the pages as [pages][Hkv][page rows][D] with boxes of page_box_rows rows (at
// least lower/tiles.py's PAGED_TMA_ROWS), and the producer copies a block as the boxes of the pages its keys lie in;
// boxes past Skv read as zeros.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "block_span.cuh"
#include "epilogue.cuh"
#include "fwd_config.cuh"
#include "hooks.cuh"
#include "mma.cuh"
#include "paged.cuh"
#include "score_tile.cuh"
#include "softmax.cuh"
#include "tma.cuh"
#include "variant.cuh"
#include "wgmma.cuh"

namespace cubridge {

// Byte offset of element (r, c) of a 128B-swizzled [rows][D] tile (wgmma.cuh).
template <int ROWS>
__device__ __forceinline__ unsigned sw128_offset(int r, int c) {
  return (c / 64) * (ROWS * 128) + r * 128 + ((((c % 64) / 8) ^ (r % 8)) * 16) + (c % 8) * 2;
}

template <class Cfg, class Variant, class T, bool kPaged = false>
__device__ __forceinline__ void attention_fwd_sm90(const FwdArgs& a, const typename Variant::Params& p,
                                                   const TmaDesc* tq, const TmaDesc* tk,
                                                   const TmaDesc* tv, const PagedKV& pg) {
  constexpr int D = Cfg::kHeadDim, DV = Cfg::kValueDim, BM = Cfg::kBlockM, BN = Cfg::kBlockN, ST = Cfg::kStages;
  constexpr int NC = Cfg::kConsumers, kConsumerWarps = 4 * NC;
  constexpr int DP = Cfg::kPadD, DVP = Cfg::kPadDv;  // shared tiles: whole 64-column chunks
  // Q K^T steps stop at the last 16 columns holding data (the copy engine zero-fills past D);
  // O is computed over the padded width and stored up to DV.
  constexpr int NT = BN / 8, DT = DVP / 8, KC = (D + 15) / 16, PK = BN / 16, CH = DP / 64, CHV = DVP / 64;
  constexpr unsigned kQBytes = BM * DP * 2, kKBytes = BN * DP * 2, kVBytes = BN * DVP * 2;
  constexpr bool kOwnO = Cfg::kOwnO;  // a separate O staging buffer: Q of the next tile loads early
  constexpr unsigned kOBytes = kOwnO ? BM * DVP * 2 : 0;
  constexpr bool kRaw = score_is_default<Variant>(0);
  using H = Hook<Variant>;
  constexpr float kLog2e = 1.4426950408889634f;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // Swizzled tiles need 1024-byte alignment; the launch reserves the slack.
  const unsigned raw = smem_u32(smem_raw);
  const unsigned pad = ((raw + 1023u) & ~1023u) - raw;
  unsigned char* base = smem_raw + pad;
  const unsigned sQ = raw + pad, sK = sQ + kQBytes, sV = sK + ST * kKBytes;
  constexpr unsigned kRings = ST * (kKBytes + kVBytes);
  unsigned char* o_stage = base + (kOwnO ? kQBytes + kRings : 0);  // else Q's rows
  // mbarriers: q_full, q_empty, then per stage k_full, v_full, k_empty, v_empty
  const unsigned bars = sV + ST * kVBytes + kOBytes;
  const unsigned q_full = bars, q_empty = bars + 8u;
  auto k_full = [&](int s) { return bars + 8u * (2 + s); };
  auto v_full = [&](int s) { return bars + 8u * (2 + ST + s); };
  auto k_empty = [&](int s) { return bars + 8u * (2 + 2 * ST + s); };
  auto v_empty = [&](int s) { return bars + 8u * (2 + 3 * ST + s); };
  int* row_info = reinterpret_cast<int*>(base + kQBytes + kRings + kOBytes + 8 * (2 + 4 * ST));

  const int tid = threadIdx.x, wg = tid / 128;
  const int sq = static_cast<int>(a.Sq), skv = static_cast<int>(a.Skv);

  // Tile numbering: (batch, head) pairs in groups whose K and V fit in L2 together (the CTAs
  // running at one time share them), and within a group the heaviest (last) query tiles first.
  const int n_m = (sq + BM - 1) / BM, n_hb = static_cast<int>(a.Hq * a.B), n_tiles = n_m * n_hb;
  constexpr long long kL2Budget = 24ll << 20;  // bytes of K and V one group may keep in L2
  const long long fit = kL2Budget / (2ll * (D + DV) * (skv > 0 ? skv : 1));
  const int group = fit < 1 ? 1 : fit > n_hb ? n_hb : static_cast<int>(fit);
  int h = 0, b = 0, hk = 0, q_lo = 0, q_hi = 0;
  auto enter = [&](int tile) {
    const int first = tile / (group * n_m) * group, size = imin(group, n_hb - first);
    const int in = tile - first * n_m;
    const int m_blk = n_m - 1 - in / size, hb = first + in % size;
    h = hb % static_cast<int>(a.Hq);
    b = hb / static_cast<int>(a.Hq);
    hk = Variant::kv_head(a, h);
    q_lo = m_blk * BM;
    q_hi = imin(q_lo + BM, sq);
  };
  const int n_blk = (skv + BN - 1) / BN;
  // The class of key blocks [j0, j1) against this tile's query rows.
  auto span = [&](int j0, int j1) {
    return H::block_class(a, p, b, h, q_lo, q_hi, j0 * BN, imin(j1 * BN, skv));
  };
  // A tile's live blocks: the end j_end and the first one are found once per tile by binary search
  // over spans (block_span.cuh; block_class answers for a range of key blocks), so a tile's cost follows its live
  // blocks, not the key length, and a block-map rule costs a few reads, not one per block.
  constexpr bool kSpans = Variant::kHasMask;
  int j_end = n_blk;
  auto find_end = [&]() {
    j_end = n_blk;
    if constexpr (kSpans) {
      j_end = span(0, n_blk) == kEmpty ? 0 : live_end(span, 0, n_blk);
    }
  };
  // The first block at or after j not proven empty (n_blk: none); its class goes to live_cls.
  int live_cls = kEmpty;
  auto next_live = [&](int j) {
    while (j < j_end) {
      live_cls = span(j, j + 1);
      if (live_cls != kEmpty) return j;
      if (!kSpans) {
        ++j;
        continue;
      }
      if (j + 1 >= j_end || span(j + 1, j_end) == kEmpty) return n_blk;
      j = live_start(span, j + 1, j_end);  // (a conservative span rule may still call it empty: the loop checks)
    }
    return n_blk;
  };
  // Only the producer walks the blocks. It hands the consumers whether a tile has a live block
  // with Q, and each block's index, class and whether it is the tile's last with its K stage
  // (written before the full barrier's arrival, read after its wait, rewritten only after the
  // stage's or Q's empty barrier), so no consumer waits on a block-map read.
  int* tile_info = row_info + BM;
  int* stage_info = tile_info + 4;
  static_assert(ST <= 6, "tile and stage info fit in 64 bytes");

  if (tid == 0) {
    mbar_init(q_full, 1);
    mbar_init(q_empty, kConsumerWarps);  // one arrival per consumer warp
    for (int s = 0; s < ST; ++s) {
      mbar_init(k_full(s), 1);
      mbar_init(v_full(s), 1);
      mbar_init(k_empty(s), kConsumerWarps);  // one arrival per consumer warp
      mbar_init(v_empty(s), kConsumerWarps);
    }
    mbar_init_fence();
  }
  __syncthreads();

  // Key block j of K or V (`chunks` 64-column chunks) into the ring stage at dst. Paged: box by box,
  // each inside one page (the table entry of its first key); a box past the keys takes the page index
  // past the buffer, which the copy engine reads as zeros (and counts in full).
  const int box = kPaged ? page_box_rows(static_cast<int>(pg.page), BN) : BN;
  PageDiv pd;
  if constexpr (kPaged) pd = PageDiv(pg);
  // One thread issues a block's few large boxes. Boxes of fewer than 64 rows are issued by the producer
  // warp's 32 lanes, a (box, chunk) each: a box costs its issuing thread about the same whatever its size
  // (pages of 16 at 0.52 of contiguous K/V from one thread, 0.79 from 32 lanes; one machine, H100 run 12,
  // NOTES v26). The row in the page is key - page * rows, not key % rows: a modulo per box cost pages of
  // 64 a tenth (run 11).
  const int lanes = kPaged && box < 64 ? 32 : 1;
  auto load_block = [&](int chunks, unsigned dst, const TmaDesc* d, unsigned bar, int j, const void* table,
                        long long t_sb, long long t_sp, long long n_pages) {
    if constexpr (!kPaged) {
#pragma unroll
      for (int c = 0; c < chunks; ++c) tma_load_4d(dst + c * BN * 128, d, bar, c * 64, j * BN, hk, b);
    } else {
      // the key's index in the table; a box past the keys takes the page index past the buffer, read as zeros
      auto index_of = [&](int key) { return pd.div(key); };
      auto page_at = [&](int key, int pi) {
        return key < skv ? static_cast<int>(page_entry(table, pg.table64 != 0, b * t_sb + pi * t_sp, n_pages))
                         : static_cast<int>(n_pages);
      };
      if (lanes == 1) {  // large boxes: one table read a box for all its column chunks
        for (int r = 0; r < BN; r += box) {
          const int key = j * BN + r, pi = index_of(key), page = page_at(key, pi);
#pragma unroll
          for (int c = 0; c < chunks; ++c)
            tma_load_4d(dst + c * BN * 128 + r * 128, d, bar, c * 64, key - pi * pd.page, hk, page);
        }
      } else {  // small boxes: the producer warp's lanes take one (box, chunk) each
        for (int x = tid; x < BN / box * chunks; x += lanes) {
          const int r = x / chunks * box, c = x % chunks, key = j * BN + r, pi = index_of(key);
          tma_load_4d(dst + c * BN * 128 + r * 128, d, bar, c * 64, key - pi * pd.page, hk, page_at(key, pi));
        }
      }
    }
  };

  if (wg == 0) {
    regs_dealloc<Cfg::kProducerRegs>();
    if (tid < lanes) {  // paged in small boxes: the whole producer warp walks the blocks
      if (tid == 0) {
        tma_prefetch_desc(tk);
        tma_prefetch_desc(tv);
      }
      int i = 0, it = 0;  // ring position and tile count, both run on across tiles
      for (int tile = blockIdx.x; tile < n_tiles; tile += gridDim.x, ++it) {
      // @cuir tile axis=q size=kBlockM
      enter(tile);
      find_end();
      const int j_first = next_live(0);
      // @cuir load tensor=q
      mbar_wait(q_empty, (it & 1) ^ 1);  // the consumers are done with the last tile's Q
      if (tid == 0) {
        tile_info[0] = j_first;
        mbar_expect_tx(q_full, kQBytes);
#pragma unroll
        for (int c = 0; c < CH; ++c) tma_load_4d(sQ + c * BM * 128, tq, q_full, c * 64, q_lo, h, b);
      }
      // K and V of a stage are released separately: K once its QK^T is done,
      // V once its PV is, a block later.
      for (int j = j_first; j < n_blk;) {
        const int cls = live_cls;
        const int j_next = next_live(j + 1);  // one ahead: the consumers learn which block is last
        const int s = i % ST;
        const unsigned free_ph = ((i / ST) & 1) ^ 1;  // a fresh barrier passes parity 1
        mbar_wait(k_empty(s), free_ph);
        if (tid == 0) {  // before its arrival; other lanes' boxes may land first (the count goes below zero)
          stage_info[2 * s] = j;
          stage_info[2 * s + 1] = cls | (j_next >= n_blk ? 4 : 0);
          mbar_expect_tx(k_full(s), kKBytes);  // boxes count whole, zero-filled columns included
        }
        load_block(CH, sK + s * kKBytes, tk, k_full(s), j, pg.k_table, pg.kt_sb, pg.kt_sp, pg.k_pages);
        mbar_wait(v_empty(s), free_ph);
        if (tid == 0) mbar_expect_tx(v_full(s), kVBytes);
        load_block(CHV, sV + s * kVBytes, tv, v_full(s), j, pg.v_table, pg.vt_sb, pg.vt_sp, pg.v_pages);
        ++i;
        j = j_next;
      }
      if constexpr (!Cfg::kPersistent) break;
      }
    }
    return;
  }

  regs_alloc<Cfg::kConsumerRegs>();
  const int cw = wg - 1, t = tid - 128 * wg, warp = t / 32, lane = t % 32;
  const int r0 = cw * 64 + warp * 16 + lane / 4;  // this thread's first row in the tile (+8: second)

  float o[1][DT][4];
  float m[2], l[2];
  const float factor = kRaw ? static_cast<float>(a.scale) * kLog2e : kLog2e;
  const unsigned q_tile = sQ + cw * 64 * 128;

  // Software pipeline (intra-warpgroup overlap): P V of block i-1 runs on the
  // tensor cores while block i's scores go through the hooks and the softmax.
  unsigned pa[PK][4];  // P of the previous block, as the A operand
  int prev = -1;       // its ring stage, -1 before the first block
  unsigned prev_ph = 0;
  auto release = [&](unsigned bar) {
    __syncwarp();
    if (lane == 0) mbar_arrive(bar);  // this warp is done with the buffer
  };
  auto issue_pv = [&]() {  // the caller waited for V
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < PK; ++kk)
      Wgmma<DVP, T>::rs(&o[0][0][0], pa[kk], sw128_desc(sV + prev * kVBytes + kk * 16 * 128, BN * 128, 1024));
    wgmma_commit();
  };

  auto qk = [&](float (&sc)[1][NT][4], int s) {
    wgmma_fence();
#pragma unroll
    for (int kc = 0; kc < KC; ++kc) {
      const unsigned off = (kc % 4) * 32;  // 16 columns further inside the 128-byte row
      Wgmma<BN, T>::ss(&sc[0][0][0], sw128_desc(q_tile + (kc / 4) * BM * 128 + off, 16, 1024),
                       sw128_desc(sK + s * kKBytes + (kc / 4) * BN * 128 + off, 16, 1024), kc > 0);
    }
    wgmma_commit();
  };
  // The mask of block j (before the wait for its scores: the mask reads no score).
  auto block_mask = [&](unsigned long long (&keep)[1][2], int j, int cls) {
    mask_bits<Variant, 1, NT>(keep, a, p, b, h, q_lo + r0, j * BN + (lane % 4) * 2, sq, skv,
                              Variant::kHasMask && cls == kPartial);
  };
  auto score_softmax = [&](float (&sc)[1][NT][4], const unsigned long long (&keep)[1][2], int j, int cls,
                           float (&alpha)[2]) {
    const int kv0 = j * BN + (lane % 4) * 2;
    if ((Variant::kHasMask && cls == kPartial) || j * BN + BN > skv)
      apply_score<Variant, kRaw, true>(sc, keep, a, p, b, h, q_lo + r0, kv0, sq, skv);
    else
      apply_score<Variant, kRaw, false>(sc, keep, a, p, b, h, q_lo + r0, kv0, sq, skv);
    softmax_rows<1, NT>(sc, m, l, factor, alpha);
  };
  auto keep_p = [&](const float (&sc)[1][NT][4]) {
#pragma unroll
    for (int kk = 0; kk < PK; ++kk) {
      pa[kk][0] = pack2<T>(sc[0][2 * kk][0], sc[0][2 * kk][1]);
      pa[kk][1] = pack2<T>(sc[0][2 * kk][2], sc[0][2 * kk][3]);
      pa[kk][2] = pack2<T>(sc[0][2 * kk + 1][0], sc[0][2 * kk + 1][1]);
      pa[kk][3] = pack2<T>(sc[0][2 * kk + 1][2], sc[0][2 * kk + 1][3]);
    }
  };

  // Pingpong: the consumer warpgroups take turns issuing their GEMMs, in a ring,
  // so one's softmax runs while another's GEMMs hold the tensor cores. Barrier
  // kTurn + w opens warpgroup w's turn; its predecessor in the ring opens it
  // after issuing. Warpgroup 0 goes first: the last one opens its first turn and
  // skips its own last hand-over, so every barrier phase completes.
  constexpr int kTurn = 1 + NC;  // barriers 1..NC: each warpgroup's epilogue
  const bool ring_last = cw == NC - 1;
  auto my_turn = [&]() { named_sync(kTurn + cw, 256); };
  auto pass_turn = [&]() { named_arrive(kTurn + (cw + 1) % NC, 256); };

  int i = 0, it = 0;  // ring position and tile count, as the producer's
  for (int tile = blockIdx.x; tile < n_tiles; tile += gridDim.x, ++it) {
  enter(tile);
#pragma unroll
  for (int dt = 0; dt < DT; ++dt) o[0][dt][0] = o[0][dt][1] = o[0][dt][2] = o[0][dt][3] = 0.f;
  m[0] = m[1] = neg_inf();
  l[0] = l[1] = 0.f;
  prev = -1;
  mbar_wait(q_full, it & 1);
  bool last = tile_info[0] >= n_blk;  // no live block: straight to the epilogue
  int j = 0, cls = kEmpty;
  auto take = [&](int s) {  // the block in stage s, after its K's full barrier
    j = stage_info[2 * s];
    cls = stage_info[2 * s + 1] & 3;
    last = stage_info[2 * s + 1] >> 2;
  };

  // The first non-empty block has no P V to overlap with; the loop below
  // runs the rest with the pipeline full (no branches around the wgmmas).
  if (!last) {
    float sc[1][NT][4], alpha[2];
    const int s = i % ST;
    const unsigned ph = (i / ST) & 1;
    if (ring_last) named_arrive(kTurn, 256);
    mbar_wait(k_full(s), ph);
    take(s);
    unsigned long long keep[1][2];
    block_mask(keep, j, cls);  // before the turn: the mask's loads overlap the wait
    my_turn();
    qk(sc, s);
    pass_turn();
    wgmma_wait<0>();
    wgmma_hold<4 * NT>(&sc[0][0][0]);
    release(k_empty(s));
    score_softmax(sc, keep, j, cls, alpha);
    keep_p(sc);  // O is still zero: nothing to rescale
    prev = s;
    prev_ph = ph;
    ++i;
  }
  // @cuir loop axis=kv size=kBlockN
  while (prev >= 0 && !last) {
    // @cuir hook name=block_class
    // @cuir skip when=empty
    // (the producer hands over live blocks only, with their class: take below)
    const int s = i % ST;
    const unsigned ph = (i / ST) & 1;
    // @cuir load tensor=k
    mbar_wait(k_full(s), ph);
    take(s);
    unsigned long long keep[1][2];
    block_mask(keep, j, cls);  // applied after the score hook; its loads overlap the waits below
    // @cuir mma name=qk
    float sc[1][NT][4];
    mbar_wait(v_full(prev), prev_ph);
    my_turn();
    qk(sc, s);
    issue_pv();  // the previous block's P V, behind this Q K^T
    pass_turn();
    wgmma_wait<1>();
    wgmma_hold<4 * NT>(&sc[0][0][0]);
    release(k_empty(s));
    // @cuir hook name=score
    // @cuir hook name=mask when=partial
    // @cuir softmax kind=online
    float alpha[2];
    score_softmax(sc, keep, j, cls, alpha);
    wgmma_wait<0>();  // O is the previous P V's accumulator: complete before rescaling
    wgmma_hold<4 * DT>(&o[0][0][0]);
    release(v_empty(prev));
    rescale_o<1, DT, Cfg::kLazyRescale>(o, alpha);
    keep_p(sc);
    // @cuir load tensor=v
    // @cuir mma name=pv
    // (issued at the top of the next block, or after the loop for the last one)
    prev = s;
    prev_ph = ph;
    ++i;
  }
  // @cuir endloop axis=kv
  if constexpr (kOwnO) release(q_empty);  // the tile's last Q K^T is complete: the next Q may load
  if (prev >= 0) {
    mbar_wait(v_full(prev), prev_ph);
    my_turn();
    issue_pv();
    if (!ring_last) pass_turn();
    wgmma_wait<0>();
    wgmma_hold<4 * DT>(&o[0][0][0]);
    release(v_empty(prev));  // the producer reuses this stage in a later tile
  }

  // @cuir hook name=sink
  const float sink2 = Variant::kHasSink ? H::sink(a, p, b, h) * kLog2e : neg_inf();

  // @cuir epilogue kind=normalise
  float o_scale[2], lse[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) finish_row(m[r], l[r], factor, sink2, o_scale[r], lse[r]);
  // Stage O in this warpgroup's own rows of the O buffer or of Q (every Q K^T that read
  // them has completed); the barrier orders this after the last tile's reads of them.
  named_sync(1 + cw, 128);
  // The epilogue's addresses come from a fresh read of the thread index: hoisted out of the tile loop
  // they would be held across it, and at 160 registers a thread (three consumers) spilled.
  const int et = fresh_thread_index() - 128 * wg, elane = et % 32, er0 = cw * 64 + et / 32 * 16 + elane / 4;
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int r = er0 + hf * 8;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
      *reinterpret_cast<unsigned*>(o_stage + sw128_offset<BM>(r, dt * 8 + (elane % 4) * 2)) =
          pack2<T>(o[0][dt][2 * hf] * o_scale[hf], o[0][dt][2 * hf + 1] * o_scale[hf]);
    if constexpr (Variant::kEmptyRowMeanV)
      if (elane % 4 == 0) row_info[r] = m[hf] == neg_inf();
  }
  named_sync(1 + cw, 128);

  // @cuir store tensor=o
  T* gO = static_cast<T*>(a.o) + b * a.o_sb + h * a.o_sh;
  const T* gV = static_cast<const T*>(a.v) + b * a.v_sb + hk * a.v_sh;
#pragma unroll
  for (int rep = 0; rep < 64 * DT / 128; ++rep) {
    const int idx = et + 128 * rep;
    const int r = cw * 64 + idx / DT, c = (idx % DT) * 8;
    if (q_lo + r >= sq || (DV < DVP && c >= DV)) continue;  // padded columns stay in shared memory
    uint4 val = *reinterpret_cast<const uint4*>(o_stage + sw128_offset<BM>(r, c));
    if (Variant::kEmptyRowMeanV && row_info[r]) val = mean_v_chunk(gV, a.v_ss, skv, c / 8);
    *reinterpret_cast<uint4*>(gO + (long long)(q_lo + r) * a.o_ss + c) = val;
  }

  // @cuir store tensor=lse when=requested
  if (a.lse != nullptr && elane % 4 == 0) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf)
      if (q_lo + er0 + hf * 8 < sq) a.lse[(b * a.Hq + h) * a.Sq + q_lo + er0 + hf * 8] = lse[hf];
  }
  if constexpr (!kOwnO) {  // Q's rows held O: the copy engine may overwrite them once read
    fence_proxy_async();
    release(q_empty);
  }
  if constexpr (!Cfg::kPersistent) break;
  }
}

}  // namespace cubridge
