// The backward's two small kernels around the main one (bwd_kernel.cuh):
//   preprocess:  delta[b, h, q] = sum_d dO[b, h, q, d] * O[b, h, q, d] (float32), the LSE copied into the
//                same padded rows (the Hopper kernel bulk-copies whole blocks of both), and dQ's float32
//                accumulator zeroed where it is read (the main kernel adds every key block's share into it);
//   postprocess: dQ = the accumulator, converted to the input dtype.
// Both are memory-bound: L lanes take a query row, 8 columns a lane at a time in 16-byte accesses (L: pieces of
// 8 columns of the wider head dim, to a power of two; lower/backward.py prepost_lanes chooses it and the grid),
// blockDim.x / L rows a CTA. Launch the preprocess with grid (ceil(sq_pad / rows), query heads, batches) of the
// share (BwdArgs' b0, h0), the postprocess with (ceil(Sq / rows), ...).
#pragma once
#include "bwd_config.cuh"
#include "mma.cuh"

namespace cubridge {

// Where the Hopper kernel's dQ accumulator holds element (q, c) of head h: per (b, h) and 64-row block, CH
// chunks of 64 columns, each 64 x 64 floats in the order a warpgroup stages them (bwd_consumer_sm90.cuh add_dq:
// a warp's 16 rows, n8 tile j, half hf, then lane and element).
template <int CH>
__device__ __forceinline__ long long dq_tiled_at(const BwdArgs& a, int b, int h, int q, int c) {
  const int r = q % 64, cc = c % 64;
  const int warp = r / 16, hf = (r % 16) / 8, lane = (r % 8) * 4 + (cc % 8) / 2, j = cc / 8;
  const long long blk = (bwd_slot(a, b, h) * (a.sq_pad / 64) + q / 64) * CH + c / 64;
  return blk * 4096 + ((warp * 8 + j) * 2 + hf) * 64 + lane * 2 + cc % 2;
}

// Each 8 consecutive columns of a row of the tiled accumulator lie together (dq_tiled_at: (q % 8) * 8 + c % 8
// within a 64-float run), 32-byte aligned: a lane takes such a piece with two 16-byte accesses.
template <int CH>
__device__ __forceinline__ float4* dq_piece(const BwdArgs& a, int b, int h, int q, int c8) {
  return reinterpret_cast<float4*>(a.dq_acc + dq_tiled_at<CH>(a, b, h, q, 8 * c8));
}

// Columns [8 c8, 8 c8 + 8) of a row of T as floats: one 16-byte load where the row allows it, else eight.
template <class T>
__device__ __forceinline__ void load8(const T* row, int c8, float (&x)[8]) {
  const T* at = row + 8 * c8;
  if (reinterpret_cast<unsigned long long>(at) % 16 == 0) {
    const uint4 pack = *reinterpret_cast<const uint4*>(at);
    const T* e8 = reinterpret_cast<const T*>(&pack);
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] = to_f32(e8[e]);
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] = to_f32(at[e]);
  }
}

// The row this thread helps with, and its lane within the row's L (a row's lanes lie together in one warp).
template <int L>
__device__ __forceinline__ int prepost_row(int& sub) {
  sub = threadIdx.x % L;
  return blockIdx.x * (blockDim.x / L) + threadIdx.x / L;
}

// D: Q's head dim (dQ's columns); DV: V's (dO's and O's columns), both multiples of 8. CH: 0 where dQ's
// accumulator is row-major [B, Hq, Sq, D], else its chunks per block (dq_tiled_at); either is zeroed here in the
// rows and columns the postprocess reads (the Hopper kernel's reductions into the padding add to whatever it
// holds, never read). L: lanes a row (a power of two, at most 32).
template <int D, int DV, class T, int CH = 0, int L = 32>
__device__ __forceinline__ void bwd_preprocess(const BwdArgs& a) {
  static_assert(D % 8 == 0 && DV % 8 == 0 && L >= 1 && L <= 32 && (L & (L - 1)) == 0, "pieces of 8 columns");
  int sub;
  const int q = prepost_row<L>(sub);
  const int h = blockIdx.y + a.h0, b = blockIdx.z + a.b0;
  const long long prow = bwd_slot(a, b, h) * a.sq_pad + q;
  if (q >= a.f.Sq) {  // a pad row: no probabilities (the kernels drop rows past Sq); all its lanes leave
    if (q < a.sq_pad && sub == 0) a.delta[prow] = a.lse_pad[prow] = 0.f;
    return;
  }
  const T* o = static_cast<const T*>(a.f.o) + b * a.f.o_sb + h * a.f.o_sh + q * a.f.o_ss;
  const T* g = static_cast<const T*>(a.dout) + b * a.do_sb + h * a.do_sh + q * a.do_ss;
  float acc = 0.f;
  for (int c8 = sub; c8 < DV / 8; c8 += L) {
    float x[8], y[8];
    load8(o, c8, x);
    load8(g, c8, y);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc = fmaf(x[e], y[e], acc);
  }
  // the row's lanes alone: a row past Sq beside it in the warp has left
  const unsigned lanes = L == 32 ? 0xffffffffu : ((1u << L) - 1u) << (threadIdx.x % 32 / L * L);
#pragma unroll
  for (int off = L / 2; off > 0; off /= 2) acc += __shfl_xor_sync(lanes, acc, off);
  if (sub == 0) {
    a.delta[prow] = acc;
    a.lse_pad[prow] = a.f.lse[(b * a.f.Hq + h) * a.f.Sq + q];
  }
  const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int c8 = sub; c8 < D / 8; c8 += L) {
    float4* piece = CH == 0 ? reinterpret_cast<float4*>(a.dq_acc + (bwd_slot(a, b, h) * a.f.Sq + q) * D + 8 * c8)
                            : dq_piece<CH>(a, b, h, q, c8);
    piece[0] = piece[1] = zero;
  }
}

// CH: 0 where the accumulator is row-major [B, Hq, Sq, D], else its chunks per block (dq_tiled_at). kScaleDq:
// the main kernel left the scale out of dS (bwd_consumer_sm90.cuh ds_unscaled), and dQ takes it here. L: as the
// preprocess's.
template <int D, class T, int CH = 0, bool kScaleDq = false, int L = 32>
__device__ __forceinline__ void bwd_postprocess(const BwdArgs& a) {
  static_assert(D % 8 == 0 && L >= 1 && L <= 32, "the accumulator is read in pieces of 8 columns");
  static_assert(CH != 0 || !kScaleDq, "the Hopper kernel's tiled accumulator alone leaves dQ unscaled");
  int sub;
  const int q = prepost_row<L>(sub);
  const int h = blockIdx.y + a.h0, b = blockIdx.z + a.b0;
  if (q >= a.f.Sq) return;
  T* dq = static_cast<T*>(a.dq) + b * a.dq_sb + h * a.dq_sh + q * a.dq_ss;
  const float f = kScaleDq ? static_cast<float>(a.f.scale) : 1.f;
  // a lane's 8 columns: two 16-byte loads, one 16-byte store where dQ's row allows it (else 8 stores)
  for (int c8 = sub; c8 < D / 8; c8 += L) {
    const float4* piece = CH == 0
        ? reinterpret_cast<const float4*>(a.dq_acc + (bwd_slot(a, b, h) * a.f.Sq + q) * D + 8 * c8)
        : dq_piece<CH>(a, b, h, q, c8);
    const float4 x = piece[0], y = piece[1];
    const float v[8] = {x.x * f, x.y * f, x.z * f, x.w * f, y.x * f, y.y * f, y.z * f, y.w * f};
    T* out = dq + 8 * c8;
    if (reinterpret_cast<unsigned long long>(out) % 16 == 0) {
      uint4 pack;
      T* e8 = reinterpret_cast<T*>(&pack);
#pragma unroll
      for (int e = 0; e < 8; ++e) e8[e] = from_f32<T>(v[e]);
      *reinterpret_cast<uint4*>(out) = pack;
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) out[e] = from_f32<T>(v[e]);
    }
  }
}

}  // namespace cubridge
