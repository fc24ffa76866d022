// Dev instantiations mirroring the generated translation units.
#include "variants.cuh"

#define CB_KERNEL(NAME, VAR, CFG, T)                                                          \
  extern "C" __global__ void __launch_bounds__(CFG::kThreads, 1)                               \
      NAME(cubridge::FwdArgs a, VAR::Params p) {                                               \
    cubridge::attention_fwd<CFG, VAR, T>(a, p);                                                \
  }                                                                                            \
  extern "C" __constant__ int NAME##_cfg[4] = {CFG::kThreads, CFG::kSmemBytes, CFG::kBlockM,   \
                                               CFG::kHeadDim};

#ifndef CB_DIMS
#define CB_DIMS(X) X(64) X(96) X(128) X(256)
#endif
using bf16 = __nv_bfloat16;
using f16 = __half;
template <int D> using CfgB = cubridge::FwdConfig<D, bf16>;
template <int D> using CfgH = cubridge::FwdConfig<D, f16>;
#define CB_ALL(D)                                                                              \
  CB_KERNEL(fwd_full_##D##_bf16, cubridge::DefaultVariant, CfgB<D>, bf16) \
  CB_KERNEL(fwd_full_##D##_f16, cubridge::DefaultVariant, CfgH<D>, f16)    \
  CB_KERNEL(fwd_causal_##D##_bf16, dev::Causal, CfgB<D>, bf16)            \
  CB_KERNEL(fwd_causal_##D##_f16, dev::Causal, CfgH<D>, f16)               \
  CB_KERNEL(fwd_meanv_##D##_bf16, dev::CausalMeanV, CfgB<D>, bf16)        \
  CB_KERNEL(fwd_softcap_##D##_bf16, dev::Softcap, CfgB<D>, bf16)          \
  CB_KERNEL(fwd_sink_##D##_f16, dev::CausalSink, CfgH<D>, f16)
CB_DIMS(CB_ALL)

// Tuning candidates (full + causal bf16), named fwd_<tag>_{full,causal}.
#define CB_TUNE(TAG, ...)                                                                      \
  using Cfg_##TAG = cubridge::FwdTile<__VA_ARGS__>;                                           \
  CB_KERNEL(fwd_##TAG##_full, cubridge::DefaultVariant, Cfg_##TAG, bf16)                       \
  CB_KERNEL(fwd_##TAG##_causal, dev::Causal, Cfg_##TAG, bf16)
#if __has_include("tuning.inc")
#include "tuning.inc"  // written by build.sh
#endif
