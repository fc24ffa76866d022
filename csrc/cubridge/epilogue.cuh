// Forward epilogue: finish the softmax normaliser (with optional sink),
// stage O through shared memory and write it with 16-byte coalesced stores.
#pragma once
#include "mma.cuh"
#include "softmax.cuh"
#include "tile_scheduler.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace cubridge {

// The thread's index read afresh (volatile): addresses computed from it stay where they are
// used instead of being hoisted out of a loop and kept in registers (or spilled) across it.
__device__ __forceinline__ int fresh_thread_index() {
  int t;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(t));
  return t;
}

// Finish one row: m (x units), l_part (this lane's partial sum), sink2 (sink in
// log2 units or -inf). Returns the factor that turns the unnormalised O row into
// the output and the natural-log LSE. Empty rows give 0 and -inf.
// The same from a row's whole sum l and its max m2 in log2 units (the decode kernel's merge).
__device__ __forceinline__ void finish_stats(float m2, float l, float sink2, float& o_scale, float& lse) {
  const float mf = fmaxf(m2, sink2);
  float c = 1.f, lt = l;
  if (sink2 != neg_inf() && mf != neg_inf()) {
    // The sink joins the normaliser only: O is rescaled, not added to.
    c = fast_exp2(m2 - mf);
    lt = fmaf(l, c, fast_exp2(sink2 - mf));
  }
  o_scale = lt > 0.f ? c / lt : 0.f;
  lse = lt > 0.f ? (mf + fast_log2(lt)) * kLn2 : neg_inf();
}
__device__ __forceinline__ void finish_row(float m, float l_part, float factor, float sink2,
                                           float& o_scale, float& lse) {
  const float l = quad_sum(l_part);
  finish_stats(m * factor, l, sink2, o_scale, lse);  // -inf stays -inf (factor > 0)
  // A row a finite fill near finfo.min fills whole: m * factor overflows to -inf though the row has keys.
  // Where x is the score itself (factor log2(e): a score hook) its LSE is m + ln(l), finite (the fill, ln(l)
  // below its rounding), as the backward reads it; with a sink, the sink outweighs the fill.
  if (lse == neg_inf() && l > 0.f && m != neg_inf() && sink2 == neg_inf() && factor == kLog2e)
    lse = m + fast_log2(l) * kLn2;
}

// Write this warp's normalised O fragments (rows row0 .. row0 + 16*MT of the
// tile) into the shared staging tile as T.
template <class T, int MT, int DT, int LDS>
__device__ __forceinline__ void stage_o(T* s, const float (&o)[MT][DT][4],
                                        const float (&scale)[MT * 2], int row0, int lane) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int r = row0 + mt * 16 + lane / 4 + hf * 8;
      const float f = scale[2 * mt + hf];
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        *reinterpret_cast<unsigned*>(s + r * LDS + dt * 8 + (lane % 4) * 2) =
            pack2<T>(o[mt][dt][2 * hf] * f, o[mt][dt][2 * hf + 1] * f);
      }
    }
}

// Rare path for kEmptyRowMeanV: one 8-wide chunk of mean_k V[k, :] straight
// from global memory.
template <class T>
__device__ __forceinline__ uint4 mean_v_chunk(const T* v, long long ld, int skv, int c) {
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int k = 0; k < skv; ++k) {
    const T* row = v + (long long)k * ld + c * 8;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] += to_f32(row[e]);
  }
  const float inv = skv > 0 ? 1.f / skv : 0.f;
  uint4 out;
  out.x = pack2<T>(acc[0] * inv, acc[1] * inv);
  out.y = pack2<T>(acc[2] * inv, acc[3] * inv);
  out.z = pack2<T>(acc[4] * inv, acc[5] * inv);
  out.w = pack2<T>(acc[6] * inv, acc[7] * inv);
  return out;
}

// Copy ROWS staged rows (D columns) to global O (row stride ld), skipping rows >= nrows.
// With kMeanV, rows flagged empty (an int at column FLAG, in the row's pad past the staged
// columns, written by the kernel) get the mean of V over all skv keys instead.
template <int ROWS, int D, int LDS, bool kMeanV, int FLAG = D, class T>
__device__ __forceinline__ void store_rows(T* g, long long ld, const T* s, int row0, int nrows,
                                           int lane, const T* v, long long v_ld, int skv) {
  constexpr int kChunks = D / 8;
  constexpr int kAll = ROWS * kChunks;  // 5 chunks a row (D 40) over 16 rows: the last pass guards
#pragma unroll
  for (int i = 0; i < (kAll + 31) / 32; ++i) {
    const int idx = lane + 32 * i;
    if (kAll % 32 != 0 && idx >= kAll) break;
    const int r = idx / kChunks, c = idx % kChunks;
    if (row0 + r >= nrows) continue;
    uint4 val = *reinterpret_cast<const uint4*>(s + r * LDS + c * 8);
    if (kMeanV && *reinterpret_cast<const int*>(s + r * LDS + FLAG)) val = mean_v_chunk(v, v_ld, skv, c);
    *reinterpret_cast<uint4*>(g + (long long)(row0 + r) * ld + c * 8) = val;
  }
}

// Hopper: a consumer warpgroup's 64 rows of O, normalised, staged in a 128B-swizzled [BM][DVP] tile (the O
// buffer, or Q's rows once every Q K^T that read them has completed), then stored 16 bytes a thread; the
// padded columns stay in shared memory. kEmptyRowMeanV: a row with every key masked takes V's mean, flagged in
// row_info while staging.
template <class Cfg, class Variant, class T>
struct SwizzledEpilogue {
  static constexpr int BM = Cfg::kBlockM, DV = Cfg::kValueDim, DVP = Cfg::kPadDv, DT = DVP / 8;
  unsigned char* o_stage;
  int* row_info;
  int cw;
  int et = 0, elane = 0, er0 = 0;  // set by stage(): thread in the warpgroup, lane, first row

  // Between two barriers of the warpgroup: the first orders the writes after the last tile's reads of these
  // rows, the second the stores' reads after every warp's writes. The addresses come from a fresh read of the
  // thread index: hoisted out of the tile loop they would be held across it, and at 160 registers a thread
  // (three consumers) spilled.
  __device__ __forceinline__ void stage(const float (&o)[1][DT][4], const float (&o_scale)[2], const float (&m)[2],
                                        int wg) {
    named_sync(1 + cw, 128);
    et = fresh_thread_index() - 128 * wg, elane = et % 32, er0 = cw * 64 + et / 32 * 16 + elane / 4;
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
  }

  __device__ __forceinline__ void store_o(const FwdArgs& a, const QueryTile& t, int sq, int skv) const {
    T* gO = static_cast<T*>(a.o) + t.b * a.o_sb + t.h * a.o_sh;
    const T* gV = static_cast<const T*>(a.v) + t.b * a.v_sb + t.hk * a.v_sh;
#pragma unroll
    for (int rep = 0; rep < 64 * DT / 128; ++rep) {
      const int idx = et + 128 * rep;
      const int r = cw * 64 + idx / DT, c = (idx % DT) * 8;
      if (t.q_lo + r >= sq || (DV < DVP && c >= DV)) continue;  // padded columns stay in shared memory
      uint4 val = *reinterpret_cast<const uint4*>(o_stage + sw128_offset<BM>(r, c));
      if (Variant::kEmptyRowMeanV && row_info[r]) val = mean_v_chunk(gV, a.v_ss, skv, c / 8);
      *reinterpret_cast<uint4*>(gO + (long long)(t.q_lo + r) * a.o_ss + c) = val;
    }
  }

  // The rows' natural-log LSE, where the caller asked for it (a.lse).
  __device__ __forceinline__ void store_lse(const FwdArgs& a, const QueryTile& t, const float (&lse)[2],
                                            int sq) const {
    if (a.lse != nullptr && elane % 4 == 0) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf)
        if (t.q_lo + er0 + hf * 8 < sq) a.lse[(t.b * a.Hq + t.h) * a.Sq + t.q_lo + er0 + hf * 8] = lse[hf];
    }
  }
};

// FA2-class: each warp's rows of O, normalised, staged in its own Q rows (so a warp-level sync suffices), then
// stored 16 bytes a lane. The row pad (columns PDV..PDV+7 of Q's rows, past O; never read by ldmatrix) carries
// per-row extras: the LSE (float at PDV+2) and the empty-row flag (int at PDV).
template <class Cfg, class Variant, class T>
struct WarpRowsEpilogue {
  static constexpr int RW = Cfg::kBlockM / Cfg::kWarps, MT = RW / 16, LDQ = Cfg::kSmemLdQ;
  static constexpr int DV = Cfg::kValueDim, PDV = Cfg::kPadDv, DT = PDV / 8;
  T* sQ;
  int warp, lane, q_lo;

  // This warp's rows of the tile (the first of them: its row0 in the sequence).
  __device__ __forceinline__ T* rows() const { return sQ + warp * RW * LDQ; }
  __device__ __forceinline__ int row0() const { return q_lo + warp * RW; }

  // O times o_scale (finish_row's: 1 / l) and the rows' extras (lse, and whether m is still -inf) into the
  // warp's rows.
  __device__ __forceinline__ void stage(const float (&o)[MT][DT][4], const float (&o_scale)[2 * MT],
                                        const float (&lse)[2 * MT], const float (&m)[2 * MT]) const {
    T* sRows = rows();
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
  }

  // gV: V of the tile's head, for the mean of an empty row (kEmptyRowMeanV).
  __device__ __forceinline__ void store_o(const FwdArgs& a, const QueryTile& t, int sq, const T* gV, int skv) const {
    T* gO = static_cast<T*>(a.o) + t.b * a.o_sb + t.h * a.o_sh;
    store_rows<RW, DV, LDQ, Variant::kEmptyRowMeanV, PDV>(gO, a.o_ss, rows(), row0(), sq, lane, gV, a.v_ss, skv);
  }

  // The rows' natural-log LSE, where the caller asked for it (a.lse).
  __device__ __forceinline__ void store_lse(const FwdArgs& a, const QueryTile& t, int sq) const {
    const int r0 = row0();
    if (a.lse != nullptr && lane < RW && r0 + lane < sq)
      a.lse[(t.b * a.Hq + t.h) * a.Sq + r0 + lane] = *reinterpret_cast<const float*>(rows() + lane * LDQ + PDV + 2);
  }
};

}  // namespace cubridge
