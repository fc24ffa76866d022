// Online softmax on mma accumulator fragments, kept in registers.
// Scores arrive as x (natural-log logits, or raw dot products when the
// variant's score is the default s * scale); `factor` maps x to log2 units:
// p = 2^((x - m) * factor), one FADD, one FMUL and one EX2.
#pragma once

namespace cubridge {

// x in natural-log units times kLog2e is in log2 units (the hardware's ex2 and lg2); times kLn2, back.
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.69314718055994531f;

__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }

__device__ __forceinline__ float fast_exp2(float x) {  // 2^-inf = +0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float fast_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// A row lives in the 4 lanes of a quad (lanes 4r..4r+3).
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// One key block: update the running max m (x units) and the thread-partial
// row sum l, and overwrite s with unnormalised probabilities; alpha[r] is the
// factor the row's O must be multiplied by (rescale_o), 1 once the max settles.
// Thread row slot r = 2 * mt + half (half 0: row lane/4, half 1: row lane/4 + 8).
template <int MT, int NT>
__device__ __forceinline__ void softmax_rows(float (&s)[MT][NT][4], float (&m)[MT * 2],
                                             float (&l)[MT * 2], float factor,
                                             float (&alpha)[MT * 2]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int r = 2 * mt + hf;
      float mx = m[r];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * hf], s[mt][nt][2 * hf + 1]));
      mx = quad_max(mx);
      // Subtract, then scale: p = 2^((x - m) * factor). Equal scores give exactly 2^0, so
      // a row of finite fills (finfo.min, -1e9) is uniform as in the spec, and a fill
      // far below m gives -inf -> 0. The fused x * factor - m * factor is off by the
      // rounding of m * factor, up to 2^64 in p at |m| ~ 1e9, and overflows at finfo.min.
      // A row with every key masked so far keeps m = -inf: 0 is its reference.
      const float mref = (mx == neg_inf()) ? 0.f : mx;
      alpha[r] = fast_exp2((m[r] - mref) * factor);  // 0 when m was -inf
      m[r] = mx;
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        s[mt][nt][2 * hf] = fast_exp2((s[mt][nt][2 * hf] - mref) * factor);
        s[mt][nt][2 * hf + 1] = fast_exp2((s[mt][nt][2 * hf + 1] - mref) * factor);
        sum += s[mt][nt][2 * hf] + s[mt][nt][2 * hf + 1];
      }
      l[r] = fmaf(l[r], alpha[r], sum);
    }
  }
}

// O *= alpha per row. With kLazy, skipped (2 * MT * DT * 2 FMULs) unless some
// row in the warp moved its max.
template <int MT, int DT, bool kLazy = true>
__device__ __forceinline__ void rescale_o(float (&o)[MT][DT][4], const float (&alpha)[MT * 2]) {
  bool moved = false;
#pragma unroll
  for (int r = 0; r < 2 * MT; ++r) moved |= alpha[r] != 1.f;
  if (!kLazy || __any_sync(0xffffffffu, moved)) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        o[mt][dt][0] *= alpha[2 * mt];
        o[mt][dt][1] *= alpha[2 * mt];
        o[mt][dt][2] *= alpha[2 * mt + 1];
        o[mt][dt][3] *= alpha[2 * mt + 1];
      }
  }
}

template <int MT, int NT, int DT, bool kLazy = true>
__device__ __forceinline__ void softmax_update(float (&s)[MT][NT][4], float (&o)[MT][DT][4],
                                               float (&m)[MT * 2], float (&l)[MT * 2],
                                               float factor) {
  float alpha[2 * MT];
  softmax_rows<MT, NT>(s, m, l, factor, alpha);
  rescale_o<MT, DT, kLazy>(o, alpha);
}

// O = 0, and each row's running max and sum before its first key.
template <int MT, int DT>
__device__ __forceinline__ void start_rows(float (&o)[MT][DT][4], float (&m)[2 * MT], float (&l)[2 * MT]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) o[mt][dt][0] = o[mt][dt][1] = o[mt][dt][2] = o[mt][dt][3] = 0.f;
#pragma unroll
  for (int r = 0; r < 2 * MT; ++r) m[r] = neg_inf(), l[r] = 0.f;
}

}  // namespace cubridge
