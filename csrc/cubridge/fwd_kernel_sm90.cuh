// Expert forward attention kernel for Hopper (sm_90a): TMA loads, wgmma,
// warp specialisation. Same hooks, same semantics as fwd_kernel.cuh:
//
//   O[b, h, q, :] = sum_kv softmax_kv(score(q.k)) V[b, kv_head(h), kv, :]
//
// Launch: grid = (min(tiles, SMs), 1, 1) where Cfg::kPersistent, else (tiles, 1, 1)
//   (lower/tiles.py decides, Tile.persistent); block = Sm90Tile::kThreads
//   (one producer and kConsumers warpgroups), dynamic shared memory =
//   Sm90Tile::kSmemBytes; parameters (FwdArgs, Params, tensor maps of Q, K, V).
//   A tile is kBlockM = 64 x kConsumers query rows of one (batch, head), in
//   tile_scheduler.cuh's order (GroupedTiles). The producer loads the next
//   tile's Q and K/V while the consumers finish the current one.
//
// The roles, each in its own file:
// - the producer warp (producer.cuh, TmaProducer): one thread walks the tile's
//   live key blocks (block_span.cuh, LiveBlocks) and issues TMA copies of K and
//   V into a kStages-deep ring, each buffer completing on its own mbarrier
//   (pipeline.cuh, KVRing); it gives most of its registers away (setmaxnreg);
// - the consumer warpgroups (consumer.cuh, WgmmaConsumer), 64 query rows each:
//   S = Q K^T (wgmma, both operands in shared memory), score/mask hooks, online
//   softmax in registers (softmax.cuh), O += P V (wgmma, P from registers).
//   P V of one block is issued behind the next block's Q K^T, so it overlaps
//   that block's softmax; the warpgroups take turns at the tensor cores
//   (pipeline.cuh, Pingpong). Consumers release K after its Q K^T and V after
//   its P V, and Q after the tile's last Q K^T (kOwnO) or after the epilogue;
// - the epilogue (epilogue.cuh, SwizzledEpilogue): O / l (sink joins l),
//   staged in shared memory (an O buffer where it fits, else the consumer's own
//   Q rows), 16-byte coalesced stores.
// kPaged: K and V read in place from pages through block tables (paged.cuh, producer.cuh).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "block_span.cuh"
#include "consumer.cuh"
#include "epilogue.cuh"
#include "fwd_config.cuh"
#include "hooks.cuh"
#include "paged.cuh"
#include "pipeline.cuh"
#include "producer.cuh"
#include "tile_scheduler.cuh"
#include "variant.cuh"

namespace cubridge {

// Shared memory (Sm90Tile::kSmemBytes): 1024-byte alignment slack (swizzled tiles start 1024-aligned), Q, the
// K and V rings, the O buffer (kOwnO), the ring's barriers, one int per row (empty-row flags), then the tile
// and stage info the producer hands the consumers (tile_info[0]: the tile's first live block; stage_info[2s],
// [2s + 1]: the block in stage s and its class | 4 where it is the tile's last).
template <class Cfg>
struct Sm90Smem {
  static constexpr int BM = Cfg::kBlockM, ST = Cfg::kStages;
  static constexpr unsigned kQBytes = BM * Cfg::kPadD * 2, kKBytes = Cfg::kBlockN * Cfg::kPadD * 2;
  static constexpr unsigned kVBytes = Cfg::kBlockN * Cfg::kPadDv * 2;
  static constexpr unsigned kOBytes = Cfg::kOwnO ? BM * Cfg::kPadDv * 2 : 0, kRings = ST * (kKBytes + kVBytes);
  static_assert(ST <= 6, "tile and stage info fit in 64 bytes");
  unsigned sQ, sK, sV;  // shared addresses
  unsigned char* o_stage;
  KVRing<ST> ring;
  int *row_info, *tile_info, *stage_info;

  __device__ __forceinline__ explicit Sm90Smem(unsigned char* smem_raw) {
    const unsigned raw = smem_u32(smem_raw);
    const unsigned pad = ((raw + 1023u) & ~1023u) - raw;
    unsigned char* base = smem_raw + pad;
    sQ = raw + pad, sK = sQ + kQBytes, sV = sK + ST * kKBytes;
    o_stage = base + (Cfg::kOwnO ? kQBytes + kRings : 0);  // else Q's rows
    ring.bars = sV + ST * kVBytes + kOBytes;
    row_info = reinterpret_cast<int*>(base + kQBytes + kRings + kOBytes + 8 * KVRing<ST>::kBarriers);
    tile_info = row_info + BM;
    stage_info = tile_info + 4;
  }
  // The block in stage s, after its K's full barrier: its index, class and whether it is the tile's last.
  __device__ __forceinline__ void take(int s, int& j, int& cls, bool& last) const {
    j = stage_info[2 * s];
    cls = stage_info[2 * s + 1] & 3;
    last = stage_info[2 * s + 1] >> 2;
  }
};

template <class Cfg, class Variant, class T, bool kPaged = false>
__device__ __forceinline__ void attention_fwd_sm90(const FwdArgs& a, const typename Variant::Params& p,
                                                   const TmaDesc* tq, const TmaDesc* tk,
                                                   const TmaDesc* tv, const PagedKV& pg) {
  constexpr int BN = Cfg::kBlockN, ST = Cfg::kStages, NC = Cfg::kConsumers, DT = Cfg::kPadDv / 8;
  using C = WgmmaConsumer<Cfg, Variant, T>;
  using R = KVRing<ST>;
  using Span = TileSpan<Variant, BN>;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const Sm90Smem<Cfg> sm(smem_raw);
  const int tid = threadIdx.x, wg = tid / 128;
  const int sq = static_cast<int>(a.Sq), skv = static_cast<int>(a.Skv);
  const GroupedTiles<Cfg::kBlockM, Cfg::kHeadDim, Cfg::kValueDim> tiles(a);
  const int n_blk = (skv + BN - 1) / BN;
  if (tid == 0) sm.ring.init(4 * NC);  // one arrival per consumer warp empties a buffer
  __syncthreads();

  const TmaProducer<Cfg, kPaged> producer(tq, tk, tv, pg, skv);
  if (wg == 0) {
    regs_dealloc<Cfg::kProducerRegs>();
    if (tid < producer.lanes) {  // paged in small boxes: the whole producer warp walks the blocks
      producer.prefetch_maps(tid);
      int i = 0, it = 0;  // ring position and tile count, both run on across tiles
      for (int tile = tiles.first(); tile < tiles.n_tiles; tile = tiles.next(tile), ++it) {
        // @cuir tile axis=q size=kBlockM
        const QueryTile t = tiles.template tile<Variant>(a, tile);
        const Span span{a, p, t, skv};
        LiveBlocks<Variant::kHasMask, Span> live(span, n_blk);
        const int j_first = live.next(0);
        // @cuir load tensor=q
        producer.load_q(sm, t, j_first, it, tid);
        producer.load_kv(sm, t, live, j_first, i, tid);
        if constexpr (!Cfg::kPersistent) break;
      }
    }
    return;
  }

  regs_alloc<Cfg::kConsumerRegs>();
  const C c(wg, tid, sm.sQ, sm.sK, sm.sV);
  float o[1][DT][4];
  float m[2], l[2];
  const float factor = C::kRaw ? static_cast<float>(a.scale) * kLog2e : kLog2e;
  unsigned pa[C::PK][4];  // P of the previous block, as the A operand
  int prev = -1;          // its ring stage, -1 before the first block
  unsigned prev_ph = 0;
  const Pingpong<NC> turn{c.cw};

  int i = 0, it = 0;  // ring position and tile count, as the producer's
  for (int tile = tiles.first(); tile < tiles.n_tiles; tile = tiles.next(tile), ++it) {
  const QueryTile t = tiles.template tile<Variant>(a, tile);
  start_rows(o, m, l);
  prev = -1;
  mbar_wait(sm.ring.q_full(), it & 1);
  bool last = sm.tile_info[0] >= n_blk;  // no live block: straight to the epilogue
  int j = 0, cls = kEmpty;

  // The first live block has no P V to overlap with; the loop below runs the rest with the pipeline full
  // (no branches around the wgmmas).
  if (!last) {
    float sc[1][C::NT][4], alpha[2];
    const int s = R::stage(i);
    const unsigned ph = R::full_phase(i);
    unsigned long long keep[1][2];
    c.first_block(sm, turn, s, ph, a, p, t, sq, skv, factor, m, l, sc, alpha, keep, pa, j, cls, last);
    prev = s;
    prev_ph = ph;
    ++i;
  }
  // @cuir loop axis=kv size=kBlockN
  while (prev >= 0 && !last) {
    // @cuir hook name=block_class
    // @cuir skip when=empty
    // (the producer hands over live blocks only, with their class: take below)
    const int s = R::stage(i);
    const unsigned ph = R::full_phase(i);
    // @cuir load tensor=k
    mbar_wait(sm.ring.k_full(s), ph);
    sm.take(s, j, cls, last);
    unsigned long long keep[1][2];
    c.mask(keep, a, p, t, j, cls, sq, skv);  // applied after the score hook; its loads overlap the waits below
    // @cuir mma name=qk
    float sc[1][C::NT][4];
    mbar_wait(sm.ring.v_full(prev), prev_ph);
    turn.wait();
    c.qk(sc, s);
    c.pv(o, pa, prev);  // the previous block's P V, behind this Q K^T
    turn.pass();
    wgmma_wait<1>();
    wgmma_hold<4 * C::NT>(&sc[0][0][0]);
    c.release(sm.ring.k_empty(s));
    // @cuir hook name=score
    // @cuir hook name=mask when=partial
    // @cuir softmax kind=online
    float alpha[2];
    c.score_softmax(sc, keep, a, p, t, j, cls, sq, skv, factor, m, l, alpha);
    wgmma_wait<0>();  // O is the previous P V's accumulator: complete before rescaling
    wgmma_hold<4 * DT>(&o[0][0][0]);
    c.release(sm.ring.v_empty(prev));
    rescale_o<1, DT, Cfg::kLazyRescale>(o, alpha);
    C::p_operand(pa, sc);
    // @cuir load tensor=v
    // @cuir mma name=pv
    // (issued at the top of the next block, or after the loop for the last one)
    prev = s;
    prev_ph = ph;
    ++i;
  }
  // @cuir endloop axis=kv
  if constexpr (Cfg::kOwnO) c.release(sm.ring.q_empty());  // the tile's last Q K^T is complete: the next Q may load
  if (prev >= 0) c.last_pv(sm.ring, turn, o, pa, prev, prev_ph);

  // @cuir hook name=sink
  const float sink2 = Variant::kHasSink ? Hook<Variant>::sink(a, p, t.b, t.h) * kLog2e : neg_inf();

  // @cuir epilogue kind=normalise
  float o_scale[2], lse[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) finish_row(m[r], l[r], factor, sink2, o_scale[r], lse[r]);
  SwizzledEpilogue<Cfg, Variant, T> epi{sm.o_stage, sm.row_info, c.cw};
  epi.stage(o, o_scale, m, wg);
  // @cuir store tensor=o
  epi.store_o(a, t, sq, skv);
  // @cuir store tensor=lse when=requested
  epi.store_lse(a, t, lse, sq);
  if constexpr (!Cfg::kOwnO) {  // Q's rows held O: the copy engine may overwrite them once read
    fence_proxy_async();
    c.release(sm.ring.q_empty());
  }
  if constexpr (!Cfg::kPersistent) break;
  }
}

}  // namespace cubridge
