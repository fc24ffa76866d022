// Hook dispatch. A variant that declares its own Params but inherits some
// hooks from DefaultVariant would not compile if those hooks were handed the
// new Params (they take DefaultVariant::Params). Each call below passes the
// variant's Params when the hook accepts them, else a default
// DefaultVariant::Params (which inherited default hooks ignore).
#pragma once
#include "variant.cuh"

namespace cubridge {

template <class V>
struct Hook {
  using P = typename V::Params;
  using DP = DefaultVariant::Params;

  template <class W = V>
  __device__ __forceinline__ static auto score_(int, const FwdArgs& a, const P& p, float s, int b,
                                                int h, int q, int kv)
      -> decltype(W::score(a, p, s, b, h, q, kv)) {
    return W::score(a, p, s, b, h, q, kv);
  }
  template <class W = V>
  __device__ __forceinline__ static float score_(long, const FwdArgs& a, const P&, float s, int b,
                                                 int h, int q, int kv) {
    return W::score(a, DP{}, s, b, h, q, kv);
  }
  __device__ __forceinline__ static float score(const FwdArgs& a, const P& p, float s, int b,
                                                int h, int q, int kv) {
    return score_(0, a, p, s, b, h, q, kv);
  }

  template <class W = V>
  __device__ __forceinline__ static auto score_grad_(int, const FwdArgs& a, const P& p, float s, int b,
                                                     int h, int q, int kv)
      -> decltype(W::score_grad(a, p, s, b, h, q, kv)) {
    return W::score_grad(a, p, s, b, h, q, kv);
  }
  template <class W = V>
  __device__ __forceinline__ static float score_grad_(long, const FwdArgs& a, const P&, float s, int b,
                                                      int h, int q, int kv) {
    return W::score_grad(a, DP{}, s, b, h, q, kv);
  }
  __device__ __forceinline__ static float score_grad(const FwdArgs& a, const P& p, float s, int b,
                                                     int h, int q, int kv) {
    return score_grad_(0, a, p, s, b, h, q, kv);
  }

  template <class W = V>
  __device__ __forceinline__ static auto mask_(int, const FwdArgs& a, const P& p, int b, int h,
                                               int q, int kv) -> decltype(W::mask(a, p, b, h, q, kv)) {
    return W::mask(a, p, b, h, q, kv);
  }
  template <class W = V>
  __device__ __forceinline__ static bool mask_(long, const FwdArgs& a, const P&, int b, int h,
                                               int q, int kv) {
    return W::mask(a, DP{}, b, h, q, kv);
  }
  __device__ __forceinline__ static bool mask(const FwdArgs& a, const P& p, int b, int h, int q,
                                              int kv) {
    return mask_(0, a, p, b, h, q, kv);
  }

  template <class W = V>
  __device__ __forceinline__ static auto cls_(int, const FwdArgs& a, const P& p, int b, int h,
                                              int ql, int qh, int kl, int kh)
      -> decltype(W::block_class(a, p, b, h, ql, qh, kl, kh)) {
    return W::block_class(a, p, b, h, ql, qh, kl, kh);
  }
  template <class W = V>
  __device__ __forceinline__ static int cls_(long, const FwdArgs& a, const P&, int b, int h,
                                             int ql, int qh, int kl, int kh) {
    return W::block_class(a, DP{}, b, h, ql, qh, kl, kh);
  }
  __device__ __forceinline__ static int block_class(const FwdArgs& a, const P& p, int b, int h,
                                                    int ql, int qh, int kl, int kh) {
    return cls_(0, a, p, b, h, ql, qh, kl, kh);
  }

  template <class W = V>
  __device__ __forceinline__ static auto sink_(int, const FwdArgs& a, const P& p, int b, int h)
      -> decltype(W::sink(a, p, b, h)) {
    return W::sink(a, p, b, h);
  }
  template <class W = V>
  __device__ __forceinline__ static float sink_(long, const FwdArgs& a, const P&, int b, int h) {
    return W::sink(a, DP{}, b, h);
  }
  __device__ __forceinline__ static float sink(const FwdArgs& a, const P& p, int b, int h) {
    return sink_(0, a, p, b, h);
  }
};

// True when the variant's score hook is DefaultVariant::score (s * scale), so
// the kernel may fold the scale into the exp2 factor.
using DefaultScoreFn = float (*)(const FwdArgs&, const DefaultVariant::Params&, float, int, int,
                                 int, int);
__host__ __device__ constexpr bool is_default_score_fn(DefaultScoreFn f) {
  return f == &DefaultVariant::score;
}
template <class F>
__host__ __device__ constexpr bool is_default_score_fn(F) { return false; }
template <class V>
__host__ __device__ constexpr auto score_is_default(int) -> decltype(is_default_score_fn(&V::score)) {
  return is_default_score_fn(&V::score);
}
template <class V>
__host__ __device__ constexpr bool score_is_default(long) { return false; }

// True when the variant's score_grad is DefaultVariant's (the scale): the backward kernel accepts that only
// with the default score.
__host__ __device__ constexpr bool is_default_score_grad_fn(DefaultScoreFn f) {
  return f == &DefaultVariant::score_grad;
}
template <class F>
__host__ __device__ constexpr bool is_default_score_grad_fn(F) { return false; }
template <class V>
__host__ __device__ constexpr auto score_grad_is_default(int)
    -> decltype(is_default_score_grad_fn(&V::score_grad)) {
  return is_default_score_grad_fn(&V::score_grad);
}
template <class V>
__host__ __device__ constexpr bool score_grad_is_default(long) { return false; }

}  // namespace cubridge
