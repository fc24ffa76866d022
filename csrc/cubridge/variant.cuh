// The hook interface between the expert forward kernel and a variant.
//
// A variant is a struct with a nested `Params` (extra tensor pointers and
// runtime scalars, passed by value as the second kernel argument) and static
// device hooks. Generated code (torch_cubridge/lower) fills only these hooks;
// the kernel body never changes per variant. Every hook has a default here.
#pragma once

namespace cubridge {

// Tile classes returned by Variant::block_class.
enum BlockClass : int { kEmpty = 0, kPartial = 1, kFull = 2 };

// Problem description shared by every variant. All strides are in elements.
// Every field is 8 bytes wide so the host packs it as a flat array of
// 64-bit words, in declaration order.
struct FwdArgs {
  const void* q;  // [B, Hq, Sq, D] through the strides below
  const void* k;  // [B, Hkv, Skv, D]
  const void* v;  // [B, Hkv, Skv, D]
  void* o;        // [B, Hq, Sq, D]
  float* lse;     // [B, Hq, Sq] contiguous, natural log; may be null
  long long q_sb, q_sh, q_ss;
  long long k_sb, k_sh, k_ss;
  long long v_sb, v_sh, v_ss;
  long long o_sb, o_sh, o_ss;
  long long B, Hq, Hkv, Sq, Skv;
  double scale;  // default score hook: s * scale
};

// The defaults: plain softmax(scale * q.k) attention with no mask.
struct DefaultVariant {
  struct Params {
    long long unused;
  };
  // Whether the mask hook must be called on partial tiles.
  static constexpr bool kHasMask = false;
  // Whether block_class can differ between query heads (false: the mask never reads h, so a tile of
  // several heads is classed once).
  static constexpr bool kClassByHead = true;
  // Whether the normaliser includes a per-(b, h) sink logit.
  static constexpr bool kHasSink = false;
  // Empty rows (every key masked) output zero unless this is set, in which
  // case they output the mean of V over all keys (a finite-fill mask spec).
  static constexpr bool kEmptyRowMeanV = false;
  // Learnable tensors the score reads (the backward kernel's site hooks, lower/sites.py): none here. A
  // variant with kSites > 0 declares Sites (a thread's state over one tile) and site_tile, site_add and
  // site_flush, and kSiteFloats of shared memory past the tile's, where a step's additions gather.
  static constexpr int kSites = 0, kSiteWin = 0, kSiteFloats = 0;
  struct Sites {};

  // Raw dot product s = q.k (fp32) -> logit in natural-log units.
  __device__ __forceinline__ static float score(const FwdArgs& a, const Params&, float s,
                                                int b, int h, int q, int kv) {
    return s * static_cast<float>(a.scale);
  }
  // d score / d s at the raw dot product s (the backward kernel's chain rule); a variant that overrides
  // score overrides this too (bwd_kernel.cuh refuses one that does not).
  __device__ __forceinline__ static float score_grad(const FwdArgs& a, const Params&, float s, int b, int h,
                                                     int q, int kv) {
    return static_cast<float>(a.scale);
  }
  // true keeps (q, kv).
  __device__ __forceinline__ static bool mask(const FwdArgs&, const Params&, int b, int h,
                                              int q, int kv) {
    return true;
  }
  // Classify the tile [q_lo, q_hi) x [kv_lo, kv_hi). Out-of-range keys are
  // handled by the kernel, not here. The range may span several key blocks
  // (the kernel skips a run of empty blocks with one call); such a call need
  // only tell empty from non-empty.
  __device__ __forceinline__ static int block_class(const FwdArgs&, const Params&, int b,
                                                    int h, int q_lo, int q_hi, int kv_lo,
                                                    int kv_hi) {
    return kFull;
  }
  // The key/value head query head h reads: grouped GQA/MQA (repeat_interleave,
  // expand) by default; a tiled spec (k.repeat) overrides it with h % Hkv.
  __device__ __forceinline__ static int kv_head(const FwdArgs& a, int h) {
    return h / static_cast<int>(a.Hq / a.Hkv);
  }
  // The inverse for the decode kernel's packing: the g-th query head that reads key head hk.
  __device__ __forceinline__ static int q_head(const FwdArgs& a, int hk, int g) {
    return hk * static_cast<int>(a.Hq / a.Hkv) + g;
  }
  // Sink logit for (b, h), natural-log units; only read when kHasSink.
  __device__ __forceinline__ static float sink(const FwdArgs&, const Params&, int b, int h) {
    return -__int_as_float(0x7f800000);
  }
};

}  // namespace cubridge
