// Warp-level tile products on m16n8k16 tensor cores.
//   S[16*MT x 8*NT]  = Q . K^T   (Q from registers or shared, K row-major in shared)
//   O[16*MT x 8*DT] += P . V     (P re-packed from the S accumulators, V via ldmatrix.trans)
// Shared tiles have a row pitch of LDS elements (D + 8: the 16-byte pad puts the
// 8 rows of every ldmatrix in distinct banks), or with SWZ are unpadded and swizzled (copy.cuh tile_chunk:
// chunk c of row r at c ^ (r & 7)). A lane's ldmatrix rows start 8-aligned, so its XOR is lane % 8, and
// with SWZ its address is its row's start and each step adds its chunk (swz_col).
#pragma once
#include "mma.cuh"

namespace cubridge {

// Per-lane ldmatrix row offsets (elements) inside a 16x16 sub-tile.
// A operand (Q): matrices {rows 0-7, 8-15} x {k 0-7, 8-15}.
template <int LDS>
__device__ __forceinline__ int lane_off_a(int lane) { return (lane % 16) * LDS + (lane / 16) * 8; }
// B operand from K[key][d]: matrices {keys 0-7: k 0-7, k 8-15}, {keys 8-15: ...}.
template <int LDS>
__device__ __forceinline__ int lane_off_k(int lane) {
  return (lane % 8 + (lane / 16) * 8) * LDS + ((lane / 8) % 2) * 8;
}
// B operand from V[key][d] (transposed): {keys 0-7, 8-15} x {d 0-7, 8-15}.
template <int LDS>
__device__ __forceinline__ int lane_off_v(int lane) {
  return (lane % 8 + ((lane / 8) % 2) * 8) * LDS + (lane / 16) * 8;
}
// With SWZ, bytes from a lane's row start to its 16-byte chunk of k16 step (or d pair) `step`: chunk 2 step + hi
// (hi: the lane's half of the 16 columns) XOR x (x: lane % 8).
__device__ __forceinline__ unsigned swz_col(int step, int hi, int x) {
  return static_cast<unsigned>(((2 * step + hi) ^ x) * 16);
}
// A lane's K fragment of keys np * 16.. and k16 step kc (gemm_qk's and gemm_qk_smem's B operand); hi and x as
// swz_col's for the K layout.
template <int LDS, bool SWZ>
__device__ __forceinline__ unsigned k_frag_addr(unsigned k_addr, int np, int kc, int hi, int x) {
  return SWZ ? k_addr + np * 16 * LDS * 2 + swz_col(kc, hi, x) : k_addr + (np * 16 * LDS + kc * 16) * 2;
}

// Load this warp's Q fragments for every k16 step into registers.
template <int MT, int KC, int LDS>
__device__ __forceinline__ void load_q_frags(unsigned (&qa)[MT][KC][4], unsigned q_addr) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int kc = 0; kc < KC; ++kc) ldsm_x4(qa[mt][kc], q_addr + (mt * 16 * LDS + kc * 16) * 2);
}

// S = Q K^T with Q already in registers. k_addr: the lane's address (lane_off_k), or with SWZ its row's start.
template <class T, int MT, int NT, int KC, int LDS, bool SWZ = false>
__device__ __forceinline__ void gemm_qk(float (&s)[MT][NT][4], const unsigned (&qa)[MT][KC][4],
                                        unsigned k_addr, int lane = 0) {
  const int hi = (lane / 8) % 2, x = lane % 8;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
#pragma unroll
  for (int kc = 0; kc < KC; ++kc) {
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      unsigned kb[4];
      ldsm_x4(kb, k_frag_addr<LDS, SWZ>(k_addr, np, kc, hi, x));
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma16816<T>(s[mt][2 * np], qa[mt][kc], kb[0], kb[1]);
        mma16816<T>(s[mt][2 * np + 1], qa[mt][kc], kb[2], kb[3]);
      }
    }
  }
}

// S = Q K^T re-reading Q from shared memory per k16 step (saves registers
// for large head dims). Q's rows have pitch LDQ (they stage O later, which may be wider), K's LDS; k_addr as
// gemm_qk's.
template <class T, int MT, int NT, int KC, int LDS, int LDQ = LDS, bool SWZ = false>
__device__ __forceinline__ void gemm_qk_smem(float (&s)[MT][NT][4], unsigned q_addr,
                                             unsigned k_addr, int lane = 0) {
  const int hi = (lane / 8) % 2, x = lane % 8;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
#pragma unroll
  for (int kc = 0; kc < KC; ++kc) {
    unsigned qa[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) ldsm_x4(qa[mt], q_addr + (mt * 16 * LDQ + kc * 16) * 2);
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      unsigned kb[4];
      ldsm_x4(kb, k_frag_addr<LDS, SWZ>(k_addr, np, kc, hi, x));
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma16816<T>(s[mt][2 * np], qa[mt], kb[0], kb[1]);
        mma16816<T>(s[mt][2 * np + 1], qa[mt], kb[2], kb[3]);
      }
    }
  }
}

// O += P V. The S accumulator layout of two adjacent n8 tiles is exactly the
// A-operand layout of one k16 step, so P never leaves registers.
template <class T, int MT, int NT, int DT, int LDS, bool SWZ = false>
__device__ __forceinline__ void gemm_pv(float (&o)[MT][DT][4], const float (&s)[MT][NT][4],
                                        unsigned v_addr, int lane = 0) {
  const int hi = lane / 16, x = lane % 8;
#pragma unroll
  for (int kk = 0; kk < NT / 2; ++kk) {
    unsigned pa[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      pa[mt][0] = pack2<T>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
      pa[mt][1] = pack2<T>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
      pa[mt][2] = pack2<T>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
      pa[mt][3] = pack2<T>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
    }
#pragma unroll
    for (int dp = 0; dp < DT / 2; ++dp) {
      unsigned vb[4];
      ldsm_x4_t(vb, SWZ ? v_addr + kk * 16 * LDS * 2 + swz_col(dp, hi, x)
                        : v_addr + (kk * 16 * LDS + dp * 16) * 2);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma16816<T>(o[mt][2 * dp], pa[mt], vb[0], vb[1]);
        mma16816<T>(o[mt][2 * dp + 1], pa[mt], vb[2], vb[3]);
      }
    }
  }
}

}  // namespace cubridge
