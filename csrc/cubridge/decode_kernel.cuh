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

  // the K/V ring swizzled (copy.cuh tile_chunk) where whole 128-byte groups tile both head dims and the threads
  // split a row's chunks evenly (64, 128, 256), but not in a paged walk of rows fewer than 8 apart (D 256): its
  // pages of 16 read 10-17% slower swizzled, with or without each row's own place
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

  // This split's blocks [j0, j1) (tile_scheduler.cuh).
  const int n_blk = (skv + BN - 1) / BN;
  int j0, j1;
  split_blocks<Variant::kHasMask>(span_cls, n_blk, split, n_split, chunk / BN, j0, j1);
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
  // 16 against the same kernel without it: H100).
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

  // The four warps' O, m and l per row through shared memory (the ring is free now).
  float* mo = reinterpret_cast<float*>(smem_raw);
  stage_warp_rows<Cfg::kWarps, R, PDV, DT>(mo, o, m, l, warp, lane);
  __syncthreads();

  // @cuir hook name=sink
  // @cuir epilogue kind=normalise
  // Thread t: row t / 8, and the row's 8-column chunks t % 8, t % 8 + 8, ...: every store is 16 bytes
  // at a 16-byte offset whatever DV is (a thread's own span of DV / 8 columns was not, at DV 48 or 96).
  constexpr int CH = (DV / 8 + 7) / 8;
  const int r = tid / 8, k0 = tid % 8;
  const bool valid = r_lo + r < rows;  // (no early return: the split hand-over below syncs the CTA)
  const int h = head_of(r), q = query_of(r);
  float m2, lsum, acc[CH][8];
  merge_warp_rows<Cfg::kWarps, R, PDV, DV>(acc, m2, lsum, mo, r, k0, factor);
  const long long row = (static_cast<long long>(b) * a.Hq + h) * a.Sq + q;
  if (n_split > 1) {  // partial: normalised over this chunk, with its max and sum; the sink joins later
    if (valid) store_partial<DV>(part_o, part_lse, acc, m2, lsum, row, n_split, split, k0, tid % 8 == 0);
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
    if (!last) return;
    __threadfence();
    if (valid) merge_splits<Variant, T, DV>(a, p, part_o, part_lse, n_split, factor, row, b, h, q, k0);
    return;
  }
  if (!valid) return;
  // @cuir store tensor=o
  // @cuir store tensor=lse when=requested
  store_row<Variant, T, DV, !kPaged && !kSeg>(a, p, acc, m2, lsum, factor, b, h, q, row, k0, skv);
}

}  // namespace cubridge
