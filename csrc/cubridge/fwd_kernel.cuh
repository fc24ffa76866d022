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

#include "consumer.cuh"
#include "epilogue.cuh"
#include "fwd_config.cuh"
#include "hooks.cuh"
#include "producer.cuh"
#include "softmax.cuh"
#include "tile_scheduler.cuh"
#include "variant.cuh"

namespace cubridge {

// kPaged: K and V read in place from pages through block tables (paged.cuh): FwdArgs' k and v point at
// the pages, k_sh/v_sh and k_ss/v_ss are the pages' head and row strides.
template <class Cfg, class Variant, class T, bool kPaged = false>
__device__ __forceinline__ void attention_fwd(const FwdArgs& a, const typename Variant::Params& p,
                                              const PagedKV& pg = PagedKV{}) {
  constexpr int BM = Cfg::kBlockM, BN = Cfg::kBlockN, ST = Cfg::kStages;
  using C = MmaConsumer<Cfg, Variant, T>;
  using Span = TileSpan<Variant, BN>;
  static_assert(!(kPaged && Variant::kEmptyRowMeanV), "empty rows' mean of V reads V in one piece");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);  // Q's rows, which stage O at the end
  T* sK = sQ + BM * Cfg::kSmemLdQ;
  T* sV = sK + ST * BN * Cfg::kSmemLd;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int sq = static_cast<int>(a.Sq), skv = static_cast<int>(a.Skv);

  // @cuir tile axis=q size=kBlockM
  const QueryTile t = cta_tile<Variant, BM>(a);
  const Span span{a, p, t, skv};
  const int n_blk = (skv + BN - 1) / BN;
  const SeqPages pages = SeqPages::of<kPaged>(pg, t.b);
  CpAsyncProducer<Cfg, T, kPaged, Span> producer(a, pages, t, span, sK, sV, n_blk, skv);

  // @cuir load tensor=q
  producer.load_q(sQ, t, sq, tid);
#pragma unroll
  for (int s = 0; s < ST - 1; ++s) producer.prefetch(s, tid);
  typename C::QFrags qa;
  producer.wait_q();
  C::load_q(qa, sQ, warp, lane);

  float o[C::MT][C::DT][4], m[2 * C::MT], l[2 * C::MT];
  start_rows(o, m, l);
  const float factor = C::kRaw ? static_cast<float>(a.scale) * kLog2e : kLog2e;
  const C c(sQ, sK, sV, warp, lane, t.q_lo);
  int stage = 0;  // ring slot of the current block

  // @cuir loop axis=kv size=kBlockN
  for (int j = 0; j < n_blk; ++j) {
    // @cuir hook name=block_class
    const int cls = span(j, j + 1);
    // @cuir skip when=empty
    if (cls == kEmpty) continue;
    // @cuir load tensor=k
    producer.wait_k();
    producer.prefetch(stage == 0 ? ST - 1 : stage - 1, tid);  // the slot every warp has left

    // @cuir mma name=qk
    float s[C::MT][C::NT][4];
    c.qk(s, qa, stage);

    // @cuir hook name=score
    // @cuir hook name=mask when=partial
    unsigned long long keep[C::MT][2];
    c.score(s, keep, a, p, t, j, cls, sq, skv);

    // @cuir softmax kind=online
    softmax_update<C::MT, C::NT, C::DT, Cfg::kLazyRescale>(s, o, m, l, factor);

    // @cuir load tensor=v
    producer.wait_v();
    // @cuir mma name=pv
    c.pv(o, s, stage);
    stage = stage + 1 == ST ? 0 : stage + 1;
  }
  // @cuir endloop axis=kv
  cp_async_wait<0>();  // drain the (empty) trailing groups

  // @cuir hook name=sink
  const float sink2 = Variant::kHasSink ? Hook<Variant>::sink(a, p, t.b, t.h) * kLog2e : neg_inf();

  // @cuir epilogue kind=normalise
  float o_scale[2 * C::MT], lse[2 * C::MT];
#pragma unroll
  for (int r = 0; r < 2 * C::MT; ++r) finish_row(m[r], l[r], factor, sink2, o_scale[r], lse[r]);
  const WarpRowsEpilogue<Cfg, Variant, T> epi{sQ, warp, lane, t.q_lo};
  epi.stage(o, o_scale, lse, m);

  // @cuir store tensor=o
  epi.store_o(a, t, sq, producer.gV, skv);

  // @cuir store tensor=lse when=requested
  epi.store_lse(a, t, sq);
}

}  // namespace cubridge
