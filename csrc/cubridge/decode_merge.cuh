// The decode kernel's split-KV merge (decode_kernel.cuh): each split's partial (O normalised over its chunk,
// with its max and sum) is merged by the last of a tile's splits to finish, and a row's output is normalised
// with the sink and stored, with its LSE.
#pragma once

#include "epilogue.cuh"
#include "hooks.cuh"
#include "softmax.cuh"
#include "variant.cuh"

namespace cubridge {

// Warp w's rows of O (accumulator fragments, DT 8-column tiles), their max m (score units: scaled only after
// a difference, as softmax_rows does) and their sum l, into shared memory at mo: O as [warp][row][PDV], then m
// and l as [warp][row] each.
template <int W, int R, int PDV, int DT>
__device__ __forceinline__ void stage_warp_rows(float* mo, const float (&o)[1][DT][4], const float (&m)[2],
                                                const float (&l)[2], int warp, int lane) {
  float* mm = mo + W * R * PDV;
  float* ml = mm + W * R;
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int r = lane / 4 + hf * 8;
    const float lw = quad_sum(l[hf]);
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
      float* dst = mo + (warp * R + r) * PDV + dt * 8 + (lane % 4) * 2;
      dst[0] = o[0][dt][2 * hf];
      dst[1] = o[0][dt][2 * hf + 1];
    }
    if (lane % 4 == 0) {
      mm[warp * R + r] = m[hf];
      ml[warp * R + r] = lw;
    }
  }
}

// Row r of the W warps' staged rows merged: its max m2, its sum lsum and this thread's 8-column chunks k0, k0 + 8,
// ... of O (unnormalised) in acc.
template <int W, int R, int PDV, int DV>
__device__ __forceinline__ void merge_warp_rows(float (&acc)[(DV / 8 + 7) / 8][8], float& m2, float& lsum,
                                                const float* mo, int r, int k0, float factor) {
  constexpr int CT = DV / 8;  // O's own 8-column chunks (the padded ones are not stored)
  constexpr int CH = (CT + 7) / 8;
  const float* mm = mo + W * R * PDV;
  const float* ml = mm + W * R;
  m2 = neg_inf();
#pragma unroll
  for (int w = 0; w < W; ++w) m2 = fmaxf(m2, mm[w * R + r]);
  float wgt[W];
  lsum = 0.f;
#pragma unroll
  for (int w = 0; w < W; ++w) {
    wgt[w] = m2 == neg_inf() ? 0.f : fast_exp2((mm[w * R + r] - m2) * factor);
    lsum = fmaf(ml[w * R + r], wgt[w], lsum);
  }
#pragma unroll
  for (int i = 0; i < CH; ++i)
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      acc[i][c] = 0.f;
      if (k0 + 8 * i < CT)
#pragma unroll
        for (int w = 0; w < W; ++w) acc[i][c] = fmaf(mo[(w * R + r) * PDV + (k0 + 8 * i) * 8 + c], wgt[w], acc[i][c]);
    }
}

// A split's partial of one row: O normalised over its chunk (fp32), with its max (-inf where the chunk held no
// live key) and its sum, written by the thread where `stats`; the sink joins at the merge.
template <int DV>
__device__ __forceinline__ void store_partial(float* part_o, float* part_lse, const float (&acc)[(DV / 8 + 7) / 8][8],
                                              float m2, float lsum, long long row, int n_split, int split, int k0,
                                              bool stats) {
  constexpr int CT = DV / 8, CH = (CT + 7) / 8;
  const float inv = lsum > 0.f ? 1.f / lsum : 0.f;
  float4* dst = reinterpret_cast<float4*>(part_o + (row * n_split + split) * DV);  // DV % 8 == 0: aligned
#pragma unroll
  for (int i = 0; i < CH; ++i)
    if (k0 + 8 * i < CT) {
      dst[(k0 + 8 * i) * 2] = make_float4(acc[i][0] * inv, acc[i][1] * inv, acc[i][2] * inv, acc[i][3] * inv);
      dst[(k0 + 8 * i) * 2 + 1] = make_float4(acc[i][4] * inv, acc[i][5] * inv, acc[i][6] * inv, acc[i][7] * inv);
    }
  if (stats) {  // the row's first thread
    part_lse[2 * (row * n_split + split)] = lsum > 0.f ? m2 : neg_inf();
    part_lse[2 * (row * n_split + split) + 1] = lsum;
  }
}

// A row's output from this thread's 8-column chunks k0, k0 + 8, ... of acc, unnormalised, with the row's max m
// (score units) and sum l: normalised with the sink, stored as T 16 bytes a chunk, and the row's LSE from its
// first thread. kMeanV: a row with every key masked takes V's mean where the variant asks (V in one piece).
template <class Variant, class T, int DV, bool kMeanV>
__device__ __forceinline__ void store_row(const FwdArgs& a, const typename Variant::Params& p,
                                          const float (&acc)[(DV / 8 + 7) / 8][8], float m, float l, float factor,
                                          int b, int h, long long q, long long row, int k0, int skv) {
  constexpr int CT = DV / 8, CH = (CT + 7) / 8;
  const float sink2 = Variant::kHasSink ? Hook<Variant>::sink(a, p, b, h) * kLog2e : neg_inf();
  float o_scale, lse;
  finish_stats(m * factor, l, sink2, o_scale, lse);  // o_scale = 1 / (l + sink)
  T* gO = static_cast<T*>(a.o) + b * a.o_sb + h * a.o_sh + q * a.o_ss;
  const T* gV = static_cast<const T*>(a.v) + b * a.v_sb + Variant::kv_head(a, h) * a.v_sh;
#pragma unroll
  for (int i = 0; i < CH; ++i) {
    const int ch = k0 + 8 * i;
    if (ch >= CT) continue;
    uint4 val;
    val.x = pack2<T>(acc[i][0] * o_scale, acc[i][1] * o_scale);
    val.y = pack2<T>(acc[i][2] * o_scale, acc[i][3] * o_scale);
    val.z = pack2<T>(acc[i][4] * o_scale, acc[i][5] * o_scale);
    val.w = pack2<T>(acc[i][6] * o_scale, acc[i][7] * o_scale);
    if (kMeanV && Variant::kEmptyRowMeanV && m == neg_inf()) val = mean_v_chunk(gV, a.v_ss, skv, ch);
    *reinterpret_cast<uint4*>(gO + ch * 8) = val;
  }
  if (a.lse != nullptr && k0 == 0) a.lse[row] = lse;
}

// Merge the splits of one (b, h, q) row, in the thread that finished it: the row's eight threads take its
// 8-column chunks k0, k0 + 8, ... as in the partial's store. Online over the splits in their order (so the
// result does not depend on which split came last), kBatch splits at a time with all their loads in flight:
// one trip to L2 a batch. With M the largest split max and w_i = l_i 2^((m_i - M) factor),
// O = sum_i w_i o_i / (sum_i w_i + sink). (A warp a row, four rows a warp, took three dependent trips a row:
// 4.6 us from the last block to the end at B 8, 4k, H100.)
template <class Variant, class T, int DV>
__device__ __forceinline__ void merge_splits(const FwdArgs& a, const typename Variant::Params& p,
                                             const float* part_o, const float* part_lse, int n_split, float factor,
                                             long long row, int b, int h, int q, int k0) {
  constexpr int CT = DV / 8, CH = (CT + 7) / 8, kBatch = 4;
  const float2* ml = reinterpret_cast<const float2*>(part_lse) + row * n_split;  // (max, sum) per split
  const float4* po = reinterpret_cast<const float4*>(part_o + row * n_split * DV);
  float M = neg_inf(), L = 0.f, acc[CH][8];
#pragma unroll
  for (int i = 0; i < CH; ++i)
#pragma unroll
    for (int c = 0; c < 8; ++c) acc[i][c] = 0.f;
  for (int s0 = 0; s0 < n_split; s0 += kBatch) {
    float2 st[kBatch];
    float4 v[kBatch][CH][2];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const bool ok = s0 + j < n_split;
      st[j] = ok ? __ldcg(ml + s0 + j) : make_float2(neg_inf(), 0.f);
#pragma unroll
      for (int i = 0; i < CH; ++i)
#pragma unroll
        for (int e = 0; e < 2; ++e)
          v[j][i][e] = ok && k0 + 8 * i < CT ? __ldcg(po + (s0 + j) * (DV / 4) + (k0 + 8 * i) * 2 + e)
                                             : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    float mn = M;
#pragma unroll
    for (int j = 0; j < kBatch; ++j) mn = fmaxf(mn, st[j].x);
    if (mn == neg_inf()) continue;  // every split so far masked whole: nothing to add
    const float c0 = fast_exp2((M - mn) * factor);  // 0 where M is still -inf (acc and L are 0)
    L *= c0;
#pragma unroll
    for (int i = 0; i < CH; ++i)
#pragma unroll
      for (int c = 0; c < 8; ++c) acc[i][c] *= c0;
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const float w = st[j].x == neg_inf() ? 0.f : st[j].y * fast_exp2((st[j].x - mn) * factor);  // masked: 0
      L += w;
#pragma unroll
      for (int i = 0; i < CH; ++i) {
        const float4 x = v[j][i][0], y = v[j][i][1];
        acc[i][0] = fmaf(x.x, w, acc[i][0]), acc[i][1] = fmaf(x.y, w, acc[i][1]);
        acc[i][2] = fmaf(x.z, w, acc[i][2]), acc[i][3] = fmaf(x.w, w, acc[i][3]);
        acc[i][4] = fmaf(y.x, w, acc[i][4]), acc[i][5] = fmaf(y.y, w, acc[i][5]);
        acc[i][6] = fmaf(y.z, w, acc[i][6]), acc[i][7] = fmaf(y.w, w, acc[i][7]);
      }
    }
    M = mn;
  }
  store_row<Variant, T, DV, true>(a, p, acc, M, L, factor, b, h, q, row, k0, static_cast<int>(a.Skv));
}

// The row a thread finishes after the warps' merge: thread t takes packed row t / 8 and the row's 8-column chunks
// t % 8, t % 8 + 8, ...: every store is 16 bytes at a 16-byte offset whatever DV is (a thread's own span of
// DV / 8 columns was not, at DV 48 or 96). valid: a row of the group (no early return before the split
// hand-over, which syncs the CTA).
struct OutRow {
  int r, k0;
  bool valid;
  int h, q;
  template <class Rows>
  __device__ __forceinline__ OutRow(const Rows& pr, int tid)
      : r(tid / 8), k0(tid % 8), valid(pr.valid(tid / 8)), h(pr.head(tid / 8)), q(pr.query(tid / 8)) {}
  // Its index in O's [B, Hq, Sq] rows.
  __device__ __forceinline__ long long index(const FwdArgs& a, int b) const {
    return (static_cast<long long>(b) * a.Hq + h) * a.Sq + q;
  }
};

// Whether this CTA is the last of its tile's splits to finish, the one that merges them all: its partials are
// made visible before the count, and read after it past L1 (merge_splits' __ldcg). The counter goes back to
// zero for the next launch on this stream. Every thread of the CTA calls it.
__device__ __forceinline__ bool last_split(int* counters, int b, int n_split, int tid) {
  __shared__ int last;
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    int* cnt = counters + static_cast<long long>(b) * gridDim.y + blockIdx.y;
    last = atomicAdd(cnt, 1) == n_split - 1;
    if (last) *cnt = 0;  // ready for the next launch on this stream
  }
  __syncthreads();
  return last;
}

}  // namespace cubridge
