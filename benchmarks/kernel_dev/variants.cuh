// Hand-written variants standing in for generated code (dev harness only).
#pragma once
#include "cubridge/fwd_kernel.cuh"

namespace dev {
using cubridge::FwdArgs;

// Bottom-right aligned causal mask: keep kv <= q + Skv - Sq.
struct Causal : cubridge::DefaultVariant {
  static constexpr bool kHasMask = true;
  __device__ __forceinline__ static bool mask(const FwdArgs& a, const Params&, int, int, int q,
                                              int kv) {
    return kv <= q + (int)(a.Skv - a.Sq);
  }
  __device__ __forceinline__ static int block_class(const FwdArgs& a, const Params&, int, int,
                                                    int q_lo, int q_hi, int kv_lo, int kv_hi) {
    const int off = (int)(a.Skv - a.Sq);
    if (kv_lo > q_hi - 1 + off) return cubridge::kEmpty;
    if (kv_hi - 1 <= q_lo + off) return cubridge::kFull;
    return cubridge::kPartial;
  }
};

// Causal, but empty rows output mean(V) (finite-fill semantics).
struct CausalMeanV : Causal {
  static constexpr bool kEmptyRowMeanV = true;
};

// tanh soft-capping of the logits: cap * tanh(s * scale / cap).
struct Softcap : cubridge::DefaultVariant {
  struct Params { double cap; };
  __device__ __forceinline__ static float score(const FwdArgs& a, const Params& p, float s, int,
                                                int, int, int) {
    const float c = (float)p.cap;
    return c * tanhf(s * (float)a.scale / c);
  }
};

// Causal + per-head sink logit (sinks: float[Hq]).
struct CausalSink : Causal {
  struct Params { const float* sinks; };
  static constexpr bool kHasSink = true;
  __device__ __forceinline__ static float sink(const FwdArgs&, const Params& p, int, int h) {
    return p.sinks[h];
  }
};
}  // namespace dev
