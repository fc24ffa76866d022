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
#include "decode_loads.cuh"
#include "decode_merge.cuh"
#include "tile_scheduler.cuh"

namespace cubridge {

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

  constexpr bool kSwz = decode_ring_swizzled<Cfg, kPaged>();  // (decode_loads.cuh)
  constexpr int LK = kSwz ? PD : LDS, LV = kSwz ? PDV : LDSV;  // K's and V's ring row pitches
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + R * LDS;
  T* sV = sK + ST * BN * LK;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int sq = static_cast<int>(a.Sq), skv = static_cast<int>(a.Skv);
  const PackedRows<Variant, R> pr(a, sq);  // this CTA's rows (tile_scheduler.cuh)
  const int split = blockIdx.x, n_split = gridDim.x;
  const int hk = pr.hk, b = blockIdx.z;

  // @cuir tile axis=q size=kRows
  const T* gK = static_cast<const T*>(a.k) + (kPaged ? 0 : b * a.k_sb) + hk * a.k_sh;
  const T* gV = static_cast<const T*>(a.v) + (kPaged ? 0 : b * a.v_sb) + hk * a.v_sh;
  const T* seg_k[SegKV::kMax];  // each piece at (b, hk), where K and V are pieces (unused otherwise)
  const T* seg_v[SegKV::kMax];
  piece_heads(seg_k, seg_v, pg, b, hk);

  const HeadsSpan<Variant, BN> span_cls{a, p, b, hk, pr.g_first, pr.g_last, sq, skv};  // (tile_scheduler.cuh)

  // This split's blocks [j0, j1) (tile_scheduler.cuh).
  const int n_blk = (skv + BN - 1) / BN;
  int j0, j1;
  split_blocks<Variant::kHasMask>(span_cls, n_blk, split, n_split, chunk / BN, j0, j1);
  const int kv_end = imin(j1 * BN, skv);

  int pf = j0;
  // paged K/V of one head dim, walked row by row: each block's table entries loaded a block ahead
  BlockEntries<RowWalk<BN, D, NTH>::kRows> ent;
  ent.blk = -1;
  PageDiv pd;
  if constexpr (kPaged) pd = PageDiv(pg);
  static_assert(ST >= 2, "a ring of at least two blocks");
  int ahead[ST - 1];  // the blocks loaded and not yet used (decode_loads.cuh DecodePrefetch)
  const DecodePrefetch<Cfg, T, KV, kPaged, kSwz, HeadsSpan<Variant, BN>> prefetch{
      span_cls, pf, ahead, ent, a, pg, pd, sK, sV, gK, gV, seg_k, seg_v, b, j1, kv_end, tid};
  zero_decode_pads<Cfg, kSwz>(sQ, sK, sV, tid);
  // @cuir load tensor=q
  // Q's rows into registers, once the first K/V blocks are out (its loads wait for their data): the loop's
  // first ST - 1 turns only prefetch, so the copy code is compiled once, not once more per ring slot.
  constexpr bool kQRegs = decode_q_in_regs<Cfg>();
  unsigned qa[1][kQRegs ? KC : 1][4];

  float o[1][DT][4], m[2], l[2];
  start_rows(o, m, l);
  const float factor = kRaw ? static_cast<float>(a.scale) * kLog2e : kLog2e;
  int hr[2], qr[2];  // this lane's two rows
  pr.lane_rows(hr, qr, lane);
  const unsigned k_lane = decode_k_lane<Cfg, kSwz, LK>(sK, lane, warp);
  const unsigned v_lane = decode_v_lane<Cfg, kSwz, LV>(sV, lane, warp);

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
      if (--fill == 0) load_q_rows<R, D, LDS, NTH, kQRegs>(sQ, qa, a, pr, b, tid, lane);
      continue;
    }
    cp_async_wait<ST - 1>();
    __syncthreads();
    // @cuir mma name=qk
    float s[1][NT][4];
    if constexpr (kQRegs)
      gemm_qk<T, 1, NT, KC, LK, kSwz>(s, qa, k_lane + stage * BN * LK * 2, lane);
    else
      gemm_qk_smem<T, 1, NT, KC, LK, LDS, kSwz>(s, smem_u32(sQ) + lane_off_a<LDS>(lane) * 2, k_lane + stage * BN * LK * 2, lane);
    // @cuir hook name=score
    // @cuir hook name=mask when=partial
    score_rows<Variant, kRaw>(s, a, p, b, hr, qr, j * BN + warp * KW + (lane % 4) * 2, skv, kv_end, cls);
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

  // The four warps' O, m and l per row through shared memory (the ring is free now).
  float* mo = reinterpret_cast<float*>(smem_raw);
  stage_warp_rows<Cfg::kWarps, R, PDV, DT>(mo, o, m, l, warp, lane);
  __syncthreads();

  // @cuir hook name=sink
  // @cuir epilogue kind=normalise
  const OutRow t(pr, tid);  // (decode_merge.cuh)
  float m2, lsum, acc[(DV / 8 + 7) / 8][8];
  merge_warp_rows<Cfg::kWarps, R, PDV, DV>(acc, m2, lsum, mo, t.r, t.k0, factor);
  const long long row = t.index(a, b);
  if (n_split > 1) {  // partial: normalised over this chunk, with its max and sum; the sink joins later
    if (t.valid) store_partial<DV>(part_o, part_lse, acc, m2, lsum, row, n_split, split, t.k0, tid % 8 == 0);
    if (!last_split(counters, b, n_split, tid)) return;  // the last split of this tile to finish merges them all
    __threadfence();
    if (t.valid) merge_splits<Variant, T, DV>(a, p, part_o, part_lse, n_split, factor, row, b, t.h, t.q, t.k0);
    return;
  }
  if (!t.valid) return;
  // @cuir store tensor=o
  // @cuir store tensor=lse when=requested
  store_row<Variant, T, DV, !kPaged && !kSeg>(a, p, acc, m2, lsum, factor, b, t.h, t.q, row, t.k0, skv);
}

}  // namespace cubridge
