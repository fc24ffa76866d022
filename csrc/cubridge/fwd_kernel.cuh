// Expert forward attention kernel (FlashAttention-2 style, mma.sync tensor cores).
//
//   O[b, h, q, :] = sum_kv softmax_kv(score(q.k)) V[b, h / (Hq / Hkv), kv, :]
//
// Launch (one CTA per query tile of one head):
//   grid  = (ceil(Sq / Cfg::kBlockM), Hq, B)
//   block = Cfg::kThreads,  dynamic shared memory = Cfg::kSmemBytes
//           (raise cudaFuncAttributeMaxDynamicSharedMemorySize above 48 KB).
//   blockIdx.x is reversed: CTA 0 takes the last query tile, which under a
//   causal mask is the heaviest, so the long tiles start first.
//
// Per CTA: Q tile -> shared (-> registers when Cfg::kQInRegs; each warp owns
// kBlockM / kWarps query rows, i.e. one or two m16 tiles), then
// for every non-empty key block: K/V tiles stream through a kStages-deep
// cp.async ring, S = Q K^T, score/mask hooks, online softmax (exp2, fp32),
// O += P V; finally O / l (sink joins l), optional LSE (natural log).
//
// Compiles under nvcc and NVRTC: only cuda_bf16.h / cuda_fp16.h and our headers.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "copy.cuh"
#include "epilogue.cuh"
#include "fwd_config.cuh"
#include "gemm.cuh"
#include "hooks.cuh"
#include "mma.cuh"
#include "paged.cuh"
#include "score_tile.cuh"
#include "softmax.cuh"
#include "variant.cuh"

namespace cubridge {

// kPaged: K and V read in place from pages through block tables (paged.cuh): FwdArgs' k and v point at
// the pages, k_sh/v_sh and k_ss/v_ss are the pages' head and row strides.
template <class Cfg, class Variant, class T, bool kPaged = false>
__device__ __forceinline__ void attention_fwd(const FwdArgs& a, const typename Variant::Params& p,
                                              const PagedKV& pg = PagedKV{}) {
  constexpr int D = Cfg::kHeadDim, DV = Cfg::kValueDim, BM = Cfg::kBlockM, BN = Cfg::kBlockN;
  constexpr int NW = Cfg::kWarps, ST = Cfg::kStages, LDS = Cfg::kSmemLd, LDV = Cfg::kSmemLdV, NTH = Cfg::kThreads;
  constexpr int LDQ = Cfg::kSmemLdQ;  // Q's rows, which stage O at the end
  constexpr int PD = Cfg::kPadD, PDV = Cfg::kPadDv;  // head dims padded to 16 (fwd_config.cuh)
  constexpr int RW = BM / NW;  // query rows per warp
  constexpr int MT = RW / 16;  // m16 tiles per warp
  constexpr int NT = BN / 8;   // n8 key tiles per block
  constexpr int KC = PD / 16;  // k16 steps over the head dim
  constexpr int DT = PDV / 8;  // n8 tiles of O (the padded columns stay zero: V's are)
  // Default score (s * scale): keep raw dot products and fold scale * log2(e)
  // into the single FFMA in front of each exp2 (assumes scale > 0, so the
  // running max of raw s is the max of the logits).
  constexpr bool kRaw = score_is_default<Variant>(0);
  using H = Hook<Variant>;
  constexpr float kLog2e = 1.4426950408889634f;
  static_assert(!(kPaged && Variant::kEmptyRowMeanV), "empty rows' mean of V reads V in one piece");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + BM * LDQ;
  T* sV = sK + ST * BN * LDS;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int sq = static_cast<int>(a.Sq), skv = static_cast<int>(a.Skv);

  // @cuir tile axis=q size=kBlockM
  const int m_blk = gridDim.x - 1 - blockIdx.x;  // heaviest (last) tiles launch first
  const int h = blockIdx.y, b = blockIdx.z;
  const int hk = Variant::kv_head(a, h);  // GQA/MQA: shared K/V head, by the variant's head map
  const int q_lo = m_blk * BM, q_hi = imin(q_lo + BM, sq);
  const T* gQ = static_cast<const T*>(a.q) + b * a.q_sb + h * a.q_sh;
  const T* gK = static_cast<const T*>(a.k) + (kPaged ? 0 : b * a.k_sb) + hk * a.k_sh;
  const T* gV = static_cast<const T*>(a.v) + (kPaged ? 0 : b * a.v_sb) + hk * a.v_sh;
  const bool t64 = pg.table64 != 0;
  PageDiv pd;
  if constexpr (kPaged) pd = PageDiv(pg);
  auto k_page = [&](int i) { return page_entry(pg.k_table, t64, b * pg.kt_sb + i * pg.kt_sp, pg.k_pages); };
  auto v_page = [&](int i) { return page_entry(pg.v_table, t64, b * pg.vt_sb + i * pg.vt_sp, pg.v_pages); };

  const int n_blk = (skv + BN - 1) / BN;
  auto block_cls = [&](int j) {
    return H::block_class(a, p, b, h, q_lo, q_hi, j * BN, imin(j * BN + BN, skv));
  };

  // @cuir load tensor=q
  load_tile<BM, D, LDQ, NTH>(sQ, gQ, a.q_ss, q_lo, sq, tid);
  cp_async_commit();
  zero_pad_columns<BM, D, PD, LDQ, NTH>(sQ, tid);
  zero_pad_columns<ST * BN, D, PD, LDS, NTH>(sK, tid);
  zero_pad_columns<ST * BN, DV, PDV, LDV, NTH>(sV, tid);

  // Prefetch cursor: walks the non-empty blocks in the same order as the main
  // loop; the i-th one lands in stage i % ST. Two groups (K, V) per block, empty
  // groups past the end, so the wait counts below stay fixed.
  int pf = 0;
  auto prefetch = [&](int stage) {
    while (pf < n_blk && block_cls(pf) == kEmpty) ++pf;
    const bool ok = pf < n_blk;
    if constexpr (kPaged) {
      if (ok) load_block_paged<BN, D, LDS, NTH>(sK + stage * BN * LDS, gK, a.k_ss, pg.k_sp, pd, k_page, pf * BN, skv, tid);
      cp_async_commit();
      if (ok) load_block_paged<BN, DV, LDV, NTH>(sV + stage * BN * LDV, gV, a.v_ss, pg.v_sp, pd, v_page, pf * BN, skv, tid);
    } else {
      if (ok) load_tile<BN, D, LDS, NTH>(sK + stage * BN * LDS, gK, a.k_ss, pf * BN, skv, tid);
      cp_async_commit();
      if (ok) load_tile<BN, DV, LDV, NTH>(sV + stage * BN * LDV, gV, a.v_ss, pf * BN, skv, tid);
    }
    cp_async_commit();
    ++pf;
  };
#pragma unroll
  for (int s = 0; s < ST - 1; ++s) prefetch(s);

  // Q fragments (or, for large D, Q stays in shared memory).
  const unsigned q_addr = smem_u32(sQ) + (warp * RW * LDQ + lane_off_a<LDQ>(lane)) * 2;
  unsigned qa[Cfg::kQInRegs ? MT : 1][Cfg::kQInRegs ? KC : 1][4];
  cp_async_wait<2 * (ST - 1)>();
  __syncthreads();
  if constexpr (Cfg::kQInRegs) load_q_frags<MT, KC, LDQ>(qa, q_addr);

  float o[MT][DT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) o[mt][dt][0] = o[mt][dt][1] = o[mt][dt][2] = o[mt][dt][3] = 0.f;
  float m[2 * MT], l[2 * MT];
#pragma unroll
  for (int r = 0; r < 2 * MT; ++r) m[r] = neg_inf(), l[r] = 0.f;
  const float factor = kRaw ? static_cast<float>(a.scale) * kLog2e : kLog2e;

  const unsigned k_lane = smem_u32(sK) + lane_off_k<LDS>(lane) * 2;
  const unsigned v_lane = smem_u32(sV) + lane_off_v<LDV>(lane) * 2;
  const int q_row0 = q_lo + warp * RW + lane / 4;  // this lane's first query row
  int stage = 0;                                   // ring slot of the current block

  // @cuir loop axis=kv size=kBlockN
  for (int j = 0; j < n_blk; ++j) {
    // @cuir hook name=block_class
    const int cls = block_cls(j);
    // @cuir skip when=empty
    if (cls == kEmpty) continue;
    // @cuir load tensor=k
    cp_async_wait<2 * ST - 3>();  // this block's K has landed (its V may still fly)
    __syncthreads();              // visible to all; and every warp left the slot refilled next
    prefetch(stage == 0 ? ST - 1 : stage - 1);

    // @cuir mma name=qk
    float s[MT][NT][4];
    if constexpr (Cfg::kQInRegs)
      gemm_qk<T, MT, NT, KC, LDS>(s, qa, k_lane + stage * BN * LDS * 2);
    else
      gemm_qk_smem<T, MT, NT, KC, LDS, LDQ>(s, q_addr, k_lane + stage * BN * LDS * 2);

    // @cuir hook name=score
    // @cuir hook name=mask when=partial
    const bool call_mask = Variant::kHasMask && cls == kPartial;
    const int kv0 = j * BN + (lane % 4) * 2;
    unsigned long long keep[MT][2];
    mask_bits<Variant, MT, NT>(keep, a, p, b, h, q_row0, kv0, sq, skv, call_mask);
    if (call_mask || j * BN + BN > skv)
      apply_score<Variant, kRaw, true>(s, keep, a, p, b, h, q_row0, kv0, sq, skv);
    else
      apply_score<Variant, kRaw, false>(s, keep, a, p, b, h, q_row0, kv0, sq, skv);

    // @cuir softmax kind=online
    softmax_update<MT, NT, DT, Cfg::kLazyRescale>(s, o, m, l, factor);

    // @cuir load tensor=v
    cp_async_wait<2 * ST - 2>();
    __syncthreads();
    // @cuir mma name=pv
    gemm_pv<T, MT, NT, DT, LDV>(o, s, v_lane + stage * BN * LDV * 2);
    stage = stage + 1 == ST ? 0 : stage + 1;
  }
  // @cuir endloop axis=kv
  cp_async_wait<0>();  // drain the (empty) trailing groups

  // @cuir hook name=sink
  const float sink2 = Variant::kHasSink ? H::sink(a, p, b, h) * kLog2e : neg_inf();

  // @cuir epilogue kind=normalise
  float o_scale[2 * MT], lse[2 * MT];
#pragma unroll
  for (int r = 0; r < 2 * MT; ++r) finish_row(m[r], l[r], factor, sink2, o_scale[r], lse[r]);
  // Each warp restages only its own Q rows, so a warp-level sync suffices.
  // The row pad (columns PDV..PDV+7 of Q's rows, past O; never read by ldmatrix) carries
  // per-row extras: the LSE (float at PDV+2) and the empty-row flag (int at PDV).
  T* sRows = sQ + warp * RW * LDQ;
  stage_o<T, MT, DT, LDQ>(sQ, o, o_scale, warp * RW, lane);
  if (lane % 4 == 0) {
#pragma unroll
    for (int r = 0; r < 2 * MT; ++r) {
      T* pad = sRows + ((r / 2) * 16 + lane / 4 + (r % 2) * 8) * LDQ + PDV;
      *reinterpret_cast<float*>(pad + 2) = lse[r];
      if constexpr (Variant::kEmptyRowMeanV) *reinterpret_cast<int*>(pad) = m[r] == neg_inf();
    }
  }
  __syncwarp();

  // @cuir store tensor=o
  const int row0 = q_lo + warp * RW;
  T* gO = static_cast<T*>(a.o) + b * a.o_sb + h * a.o_sh;
  store_rows<RW, DV, LDQ, Variant::kEmptyRowMeanV, PDV>(gO, a.o_ss, sRows, row0, sq, lane, gV, a.v_ss,
                                                       skv);

  // @cuir store tensor=lse when=requested
  if (a.lse != nullptr && lane < RW && row0 + lane < sq)
    a.lse[(b * a.Hq + h) * a.Sq + row0 + lane] = *reinterpret_cast<const float*>(sRows + lane * LDQ + PDV + 2);
}

}  // namespace cubridge
