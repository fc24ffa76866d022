// The Hopper backward's producer (bwd_kernel_sm90.cuh): one thread, per key tile, copies its K and V, then walks
// the live query blocks (QueryWalk, the same walk and block classes as the FA2-class kernel) and, stages deep,
// copies each one's Q and dO (TMA, 128-byte swizzled chunks) and its rows' LSE and delta (bulk copies of the
// padded rows the preprocess wrote), handing the consumers the item and its class through shared memory.
#pragma once
#include "bwd_config.cuh"
#include "bwd_producer.cuh"
#include "pipeline.cuh"
#include "tile_scheduler.cuh"
#include "tma.cuh"

namespace cubridge {

template <class Cfg>
struct BwdTmaProducer {
  static constexpr int BM = Cfg::kBlockM, BN = Cfg::kBlockN, CH = Cfg::kPadD / 64, CHV = Cfg::kPadDv / 64;
  using R = QueryRing<Cfg::kStages>;
  const TmaDesc *tq, *tk, *tv, *tdo;

  // Tile after tile (tile_scheduler.cuh, KeyTiles): posts the tile in the consumers' slot (-1: none left),
  // copies its K and V once the consumers are done with the last tile's, then its live query blocks.
  template <class Variant, class Smem, class Tiles>
  __device__ __forceinline__ void run(const Smem& sm, const Tiles& tiles, const BwdArgs& a,
                                      const typename Variant::Params& p) const {
    tma_prefetch_desc(tq);
    tma_prefetch_desc(tk);
    tma_prefetch_desc(tv);
    tma_prefetch_desc(tdo);
    int i = 0;  // ring position, run on across tiles
    for (int tile = blockIdx.x, t = 0;; ++t) {
      if (t > 0) mbar_wait(sm.ring.kv_empty(), (t - 1) & 1);
      sm.tile[t & 1] = tile < tiles.n_tiles ? tile : -1;  // read after kv_full's phase t (the arrival releases it)
      if (tile >= tiles.n_tiles) {
        mbar_arrive(sm.ring.kv_full());
        return;
      }
      // the next tile drawn now, its latency behind this one's copies
      const int next = Cfg::kDeterministic ? tiles.n_tiles : gridDim.x + atomicAdd(a.tile_next, 1);
      const KeyTile kt = tiles.template tile<Cfg::kDeterministic>(a.f, tile);
      const QueryWalk<Variant, BM> walk(a.f, p, kt.b, kt.hk, kt.kv_lo, kt.kv_hi);
      mbar_expect_tx(sm.ring.kv_full(), Cfg::kKBytes + Cfg::kVBytes);
      for (int c = 0; c < CH; ++c)
        tma_load_4d(sm.sK + c * BN * 128, tk, sm.ring.kv_full(), c * 64, kt.kv_lo, kt.hk, kt.b);
      for (int c = 0; c < CHV; ++c)
        tma_load_4d(sm.sV + c * BN * 128, tv, sm.ring.kv_full(), c * 64, kt.kv_lo, kt.hk, kt.b);
      for (int item = walk.next(0); item < walk.n_items; ++i) {
        const int nxt = walk.next(item + 1), s = R::stage(i);
        mbar_wait(sm.ring.empty(s), R::free_phase(i));
        const int h = walk.head(item), q_lo = walk.q_lo(item);
        sm.info[2 * s] = item;
        sm.info[2 * s + 1] = walk.cls(item) | (nxt >= walk.n_items ? 4 : 0);
        const unsigned full = sm.ring.full(s);
        mbar_expect_tx(full, Cfg::kQBytes + Cfg::kOBytes + 2 * Cfg::kRowBytes);
        for (int c = 0; c < CH; ++c)
          tma_load_4d(sm.sQ + s * Cfg::kQBytes + c * BM * 128, tq, full, c * 64, q_lo, h, kt.b);
        for (int c = 0; c < CHV; ++c)
          tma_load_4d(sm.sdO + s * Cfg::kOBytes + c * BM * 128, tdo, full, c * 64, q_lo, h, kt.b);
        const long long row0 = (kt.b * a.f.Hq + h) * a.sq_pad + q_lo;
        bulk_load(sm.sLse + s * Cfg::kRowBytes, a.lse_pad + row0, Cfg::kRowBytes, full);
        bulk_load(sm.sDelta + s * Cfg::kRowBytes, a.delta + row0, Cfg::kRowBytes, full);
        item = nxt;
      }
      tile = next;
    }
  }
};

}  // namespace cubridge
