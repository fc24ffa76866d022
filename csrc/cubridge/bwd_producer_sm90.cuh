// The Hopper backward's producer (bwd_kernel_sm90.cuh): one thread copies the CTA's K and V once, then walks
// the live query blocks (QueryWalk, the same walk and block classes as the FA2-class kernel) and, stages deep,
// copies each one's Q and dO (TMA, 128-byte swizzled chunks) and its rows' LSE and delta (bulk copies of the
// padded rows the preprocess wrote), handing the consumers the item and its class through shared memory.
#pragma once
#include "bwd_config.cuh"
#include "bwd_producer.cuh"
#include "pipeline.cuh"
#include "tma.cuh"

namespace cubridge {

template <class Cfg>
struct BwdTmaProducer {
  static constexpr int BM = Cfg::kBlockM, BN = Cfg::kBlockN, CH = Cfg::kPadD / 64, CHV = Cfg::kPadDv / 64;
  using R = QueryRing<Cfg::kStages>;
  const TmaDesc *tq, *tk, *tv, *tdo;

  template <class Smem, class Walk>
  __device__ __forceinline__ void run(const Smem& sm, const Walk& walk, const BwdArgs& a, int b, int hk,
                                      int kv_lo) const {
    tma_prefetch_desc(tq);
    tma_prefetch_desc(tk);
    tma_prefetch_desc(tv);
    tma_prefetch_desc(tdo);
    mbar_expect_tx(sm.ring.kv_full(), Cfg::kKBytes + Cfg::kVBytes);
    for (int c = 0; c < CH; ++c) tma_load_4d(sm.sK + c * BN * 128, tk, sm.ring.kv_full(), c * 64, kv_lo, hk, b);
    for (int c = 0; c < CHV; ++c) tma_load_4d(sm.sV + c * BN * 128, tv, sm.ring.kv_full(), c * 64, kv_lo, hk, b);
    int i = 0;
    for (int item = walk.next(0); item < walk.n_items; ++i) {
      const int nxt = walk.next(item + 1), s = R::stage(i);
      mbar_wait(sm.ring.empty(s), R::free_phase(i));
      const int h = walk.head(item), q_lo = walk.q_lo(item);
      sm.info[2 * s] = item;
      sm.info[2 * s + 1] = walk.cls(item) | (nxt >= walk.n_items ? 4 : 0);
      const unsigned full = sm.ring.full(s);
      mbar_expect_tx(full, Cfg::kQBytes + Cfg::kOBytes + 2 * Cfg::kRowBytes);
      for (int c = 0; c < CH; ++c) tma_load_4d(sm.sQ + s * Cfg::kQBytes + c * BM * 128, tq, full, c * 64, q_lo, h, b);
      for (int c = 0; c < CHV; ++c)
        tma_load_4d(sm.sdO + s * Cfg::kOBytes + c * BM * 128, tdo, full, c * 64, q_lo, h, b);
      const long long row0 = bwd_slot(a, b, h) * a.sq_pad + q_lo;
      bulk_load(sm.sLse + s * Cfg::kRowBytes, a.lse_pad + row0, Cfg::kRowBytes, full);
      bulk_load(sm.sDelta + s * Cfg::kRowBytes, a.delta + row0, Cfg::kRowBytes, full);
      item = nxt;
    }
  }
};

}  // namespace cubridge
