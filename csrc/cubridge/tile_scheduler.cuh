// Tile schedulers: which query tile (or, in the decode kernel, which packed rows and which split of the keys)
// a CTA works on, and in which order. Each kernel's entry asks one of these for its work; the kernels' loops
// over key blocks start from what they return.
#pragma once

#include "block_span.cuh"
#include "score_tile.cuh"
#include "variant.cuh"

namespace cubridge {

// One query tile: rows [q_lo, q_hi) of query head h of sequence b, which reads K/V head hk.
struct QueryTile {
  int b, h, hk, q_lo, q_hi;
};

// FA2-class kernel: one CTA per tile, grid (query tiles, Hq, B). blockIdx.x is reversed: CTA 0 takes the last
// query tile, which under a causal mask is the heaviest, so the long tiles start first.
template <class Variant, int BM>
__device__ __forceinline__ QueryTile cta_tile(const FwdArgs& a) {
  QueryTile t;
  const int m_blk = gridDim.x - 1 - blockIdx.x;
  t.h = blockIdx.y;
  t.b = blockIdx.z;
  t.hk = Variant::kv_head(a, t.h);  // GQA/MQA: shared K/V head, by the variant's head map
  t.q_lo = m_blk * BM;
  t.q_hi = imin(t.q_lo + BM, static_cast<int>(a.Sq));
  return t;
}

// Hopper kernel: tiles numbered as (batch, head) pairs in groups whose K and V fit in L2 together (the CTAs
// running at one time share them), and within a group the heaviest (last) query tiles first. CTA c takes tiles
// c, c + grid, ... where the kernel is persistent (grid = min(tiles, SMs)), else tile c only (grid = tiles):
//   for (int tile = first(); tile < n_tiles; tile = next(tile)) { ...; if (!persistent) break; }
template <int BM, int D, int DV>
struct GroupedTiles {
  int n_m, n_hb, n_tiles, group;

  __device__ __forceinline__ explicit GroupedTiles(const FwdArgs& a) {
    const int sq = static_cast<int>(a.Sq), skv = static_cast<int>(a.Skv);
    n_m = (sq + BM - 1) / BM;
    n_hb = static_cast<int>(a.Hq * a.B);
    n_tiles = n_m * n_hb;
    constexpr long long kL2Budget = 24ll << 20;  // bytes of K and V one group may keep in L2
    const long long fit = kL2Budget / (2ll * (D + DV) * (skv > 0 ? skv : 1));
    group = fit < 1 ? 1 : fit > n_hb ? n_hb : static_cast<int>(fit);
  }
  __device__ __forceinline__ static int first() { return blockIdx.x; }
  __device__ __forceinline__ static int next(int tile) { return tile + gridDim.x; }

  template <class Variant>
  __device__ __forceinline__ QueryTile tile(const FwdArgs& a, int tile) const {
    QueryTile t;
    const int first = tile / (group * n_m) * group, size = imin(group, n_hb - first);
    const int in = tile - first * n_m;
    const int m_blk = n_m - 1 - in / size, hb = first + in % size;
    t.h = hb % static_cast<int>(a.Hq);
    t.b = hb / static_cast<int>(a.Hq);
    t.hk = Variant::kv_head(a, t.h);
    t.q_lo = m_blk * BM;
    t.q_hi = imin(t.q_lo + BM, static_cast<int>(a.Sq));
    return t;
  }
};

// The class of key blocks [j0, j1) (BN keys each, the last cut at the keys' end) against one query tile's
// rows: the variant's block_class hook. block_span.cuh's searches and LiveBlocks walk over it.
template <class Variant, int BN>
struct TileSpan {
  const FwdArgs& a;
  const typename Variant::Params& p;
  const QueryTile& t;
  int skv;
  __device__ __forceinline__ int operator()(int j0, int j1) const {
    return Hook<Variant>::block_class(a, p, t.b, t.h, t.q_lo, t.q_hi, j0 * BN, imin(j1 * BN, skv));
  }
};

// Decode kernel: grid (n_split, Hkv * row_tiles, B). The G = Hq / Hkv query heads that read KV head hk, times Sq
// queries, are packed as rows (row g * Sq + q), so each K/V byte is read once for all of them; CTA y takes rows
// [r_lo, r_lo + R) of KV head y / row_tiles, which hold query heads g_first..g_last of the group. A tile's row
// past the group repeats the last valid one.
template <class Variant, int R>
struct PackedRows {
  const FwdArgs& a;
  int sq, rows, hk, r_lo, g_first, g_last;
  __device__ __forceinline__ PackedRows(const FwdArgs& args, int n_q) : a(args), sq(n_q) {
    const int G = static_cast<int>(a.Hq / a.Hkv);
    rows = G * sq;
    const int row_tiles = (rows + R - 1) / R;
    hk = blockIdx.y / row_tiles;
    r_lo = (blockIdx.y % row_tiles) * R;
    g_first = r_lo / sq;
    g_last = (imin(r_lo + R, rows) - 1) / sq;
  }
  __device__ __forceinline__ int head(int r) const { return Variant::q_head(a, hk, imin(r_lo + r, rows - 1) / sq); }
  __device__ __forceinline__ int query(int r) const { return imin(r_lo + r, rows - 1) % sq; }
  __device__ __forceinline__ bool valid(int r) const { return r_lo + r < rows; }
  // The (query head, query) of a lane's two rows of an m16 tile: lane / 4 and lane / 4 + 8.
  __device__ __forceinline__ void lane_rows(int (&hr)[2], int (&qr)[2], int lane) const {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) hr[hf] = head(lane / 4 + hf * 8), qr[hf] = query(lane / 4 + hf * 8);
  }
};

// Decode kernel: the class of key blocks [j_lo, j_hi) for a tile of packed rows, over every query head of the
// tile (g_first..g_last of KV head hk's group) and all Sq queries: a superset of its rows, so empty and full
// stay sound. Without kClassByHead one head answers for all.
template <class Variant, int BN>
struct HeadsSpan {
  const FwdArgs& a;
  const typename Variant::Params& p;
  int b, hk, g_first, g_last, sq, skv;
  __device__ __forceinline__ int operator()(int j_lo, int j_hi) const {
    using H = Hook<Variant>;
    if constexpr (!Variant::kClassByHead)  // one class for every head of the tile
      return H::block_class(a, p, b, Variant::q_head(a, hk, g_first), 0, sq, j_lo * BN, imin(j_hi * BN, skv));
    bool any = false, all = true;
    for (int g = g_first; g <= g_last; ++g) {
      const int c = H::block_class(a, p, b, Variant::q_head(a, hk, g), 0, sq, j_lo * BN, imin(j_hi * BN, skv));
      any |= c != kEmpty;
      all &= c == kFull;
    }
    return any ? (all ? kFull : kPartial) : kEmpty;
  }
};

// Decode kernel (split-KV): split `split` of `n_split` takes key blocks [j0, j1), chunks of `per_split` blocks.
// Where a mask can empty blocks (kSpans), the splits share the tile's live span, not the whole key range: a
// sequence shorter than its block table (continuous batching) or a window of a long cache is then read by every
// split, not by the few whose chunks it falls in. The span's ends are found by binary search over span
// (block_span.cuh), as the Hopper prefill finds them.
template <bool kSpans, class Span>
__device__ __forceinline__ void split_blocks(const Span& span, int n_blk, int split, int n_split, int per_split,
                                             int& j0, int& j1) {
  j0 = imin(split * per_split, n_blk), j1 = imin(j0 + per_split, n_blk);
  if constexpr (kSpans) {
    if (n_split > 1) {
      int lo = 0, hi = n_blk;  // [0, lo) and [hi, n_blk) proven empty
      const int whole = span(0, n_blk);  // full (every key live, the common case): no search
      if (whole == kEmpty) {
        hi = 0;
      } else if (whole == kPartial) {
        hi = live_end(span, 0, n_blk);
        lo = live_start(span, 0, hi);
      }
      const int per = (hi - lo + n_split - 1) / n_split;
      j0 = imin(lo + split * per, hi);
      j1 = imin(j0 + per, hi);
    }
  }
}

}  // namespace cubridge
