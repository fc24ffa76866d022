// Interval arithmetic for block classification of index masks.
//
// The lowering turns a mask predicate into nested calls on intervals over the
// tile's query and key ranges; a result of [1,1] is a full tile, [0,0] empty.
// Booleans are intervals over {0, 1}. Mirrors torch_cubridge/ir/interval.py.
#pragma once

namespace cubridge {

// fp32 bounds: exact for indices below 2^24, and full-rate arithmetic. The
// hook runs for every key block of every CTA, so float precision (1/64 rate
// on H100) cost up to half the runtime of long sliding-window sequences.
struct Iv {
  float lo, hi;
};

__device__ __forceinline__ Iv iv(float x) { return {x, x}; }
__device__ __forceinline__ Iv iv(float lo, float hi) { return {lo, hi}; }
__device__ __forceinline__ Iv iv_unknown() { return {-3.0e38f, 3.0e38f}; }
// A value read from memory (one per tile: a sequence's length) as a point, where fp32 holds it exactly and
// below 2^24, so arithmetic with key indices stays exact; otherwise unknown (an int64 length of 2^24 + 1
// read as 2^24 would class a block wrongly).
__device__ __forceinline__ Iv iv_exact(double x) {
  const float f = static_cast<float>(x);
  return static_cast<double>(f) == x && f > -16777216.f && f < 16777216.f ? Iv{f, f} : iv_unknown();
}
__device__ __forceinline__ Iv iv_bool_unknown() { return {0.0, 1.0}; }
__device__ __forceinline__ float dmin(float x, float y) { return x < y ? x : y; }
__device__ __forceinline__ float dmax(float x, float y) { return x > y ? x : y; }

__device__ __forceinline__ Iv iv_add(Iv x, Iv y) { return {x.lo + y.lo, x.hi + y.hi}; }
__device__ __forceinline__ Iv iv_sub(Iv x, Iv y) { return {x.lo - y.hi, x.hi - y.lo}; }
__device__ __forceinline__ Iv iv_neg(Iv x) { return {-x.hi, -x.lo}; }
__device__ __forceinline__ Iv iv_mul(Iv x, Iv y) {
  const float a = x.lo * y.lo, b = x.lo * y.hi, c = x.hi * y.lo, d = x.hi * y.hi;
  return {dmin(dmin(a, b), dmin(c, d)), dmax(dmax(a, b), dmax(c, d))};
}
__device__ __forceinline__ Iv iv_max(Iv x, Iv y) { return {dmax(x.lo, y.lo), dmax(x.hi, y.hi)}; }
__device__ __forceinline__ Iv iv_min(Iv x, Iv y) { return {dmin(x.lo, y.lo), dmin(x.hi, y.hi)}; }
__device__ __forceinline__ Iv iv_abs(Iv x) {
  if (x.lo >= 0) return x;
  if (x.hi <= 0) return iv_neg(x);
  return {0.0, dmax(-x.lo, x.hi)};
}
// Floor division and Python modulo by a positive constant.
__device__ __forceinline__ Iv iv_floordiv(Iv x, float d) { return {floorf(x.lo / d), floorf(x.hi / d)}; }
__device__ __forceinline__ Iv iv_mod(Iv x, float d) {
  if (floorf(x.lo / d) == floorf(x.hi / d)) {
    const float base = floorf(x.lo / d) * d;
    return {x.lo - base, x.hi - base};
  }
  return {0.0, d - 1};
}
__device__ __forceinline__ Iv iv_lt(Iv x, Iv y) {
  if (x.hi < y.lo) return {1, 1};
  if (x.lo >= y.hi) return {0, 0};
  return {0, 1};
}
__device__ __forceinline__ Iv iv_le(Iv x, Iv y) {
  if (x.hi <= y.lo) return {1, 1};
  if (x.lo > y.hi) return {0, 0};
  return {0, 1};
}
__device__ __forceinline__ Iv iv_gt(Iv x, Iv y) { return iv_lt(y, x); }
__device__ __forceinline__ Iv iv_ge(Iv x, Iv y) { return iv_le(y, x); }
__device__ __forceinline__ Iv iv_eq(Iv x, Iv y) {
  if (x.lo == x.hi && y.lo == y.hi && x.lo == y.lo) return {1, 1};
  if (x.hi < y.lo || y.hi < x.lo) return {0, 0};
  return {0, 1};
}
__device__ __forceinline__ Iv iv_ne(Iv x, Iv y) {
  const Iv e = iv_eq(x, y);
  return {1 - e.hi, 1 - e.lo};
}
__device__ __forceinline__ Iv iv_and(Iv x, Iv y) { return {dmin(x.lo, y.lo), dmin(x.hi, y.hi)}; }
__device__ __forceinline__ Iv iv_or(Iv x, Iv y) { return {dmax(x.lo, y.lo), dmax(x.hi, y.hi)}; }
__device__ __forceinline__ Iv iv_not(Iv x) { return {1 - x.hi, 1 - x.lo}; }
__device__ __forceinline__ Iv iv_where(Iv c, Iv x, Iv y) {
  if (c.lo >= 1) return x;
  if (c.hi <= 0) return y;
  return {dmin(x.lo, y.lo), dmax(x.hi, y.hi)};
}
__device__ __forceinline__ int iv_class(Iv keep) {
  return keep.hi <= 0 ? 0 : (keep.lo >= 1 ? 2 : 1);
}

// Python semantics for integer floor division and modulo (the spec's semantics).
template <class I> __device__ __forceinline__ I py_floordiv(I x, I d) {
  I q = x / d;
  return (x % d != 0 && ((x < 0) != (d < 0))) ? q - 1 : q;
}
template <class I> __device__ __forceinline__ I py_mod(I x, I d) {
  I r = x % d;
  return (r != 0 && ((r < 0) != (d < 0))) ? r + d : r;
}

// An index read from data (bias[ids[q], ids[kv]]): negative counts from the end, as torch indexing
// does, and the result is clamped into [0, n) so a read is never wild (ir/bounds.py).
__device__ __forceinline__ long long cb_index(long long i, long long n) {
  if (i < 0) i += n;
  return i < 0 ? 0 : (i >= n ? n - 1 : i);
}

}  // namespace cubridge
