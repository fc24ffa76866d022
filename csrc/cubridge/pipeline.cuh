// The barrier ring of a warp-specialised kernel (Hopper): a producer fills a ring of shared-memory stages with
// bulk copies, consumers drain them, and mbarriers hand each stage back and forth; plus the named barriers by
// which consumer warpgroups take turns at the tensor cores. Written once for every kernel that streams K and V
// past resident query rows (the forward today; a backward streams the same way).
#pragma once
#include "tma.cuh"

namespace cubridge {

// The barriers, 8 bytes each from shared address `bars`: Q full, Q empty, then per stage K full, V full, K empty,
// V empty. A full barrier completes when the copy engine has written the bytes the producer announced
// (expect_tx); an empty one when every consumer warp has arrived (release). K and V of a stage are released
// separately: K once its Q K^T is done, V once its P V is, a block later.
template <int ST>
struct KVRing {
  static constexpr int kBarriers = 2 + 4 * ST;
  unsigned bars;

  __device__ __forceinline__ unsigned q_full() const { return bars; }
  __device__ __forceinline__ unsigned q_empty() const { return bars + 8u; }
  __device__ __forceinline__ unsigned k_full(int s) const { return bars + 8u * (2 + s); }
  __device__ __forceinline__ unsigned v_full(int s) const { return bars + 8u * (2 + ST + s); }
  __device__ __forceinline__ unsigned k_empty(int s) const { return bars + 8u * (2 + 2 * ST + s); }
  __device__ __forceinline__ unsigned v_empty(int s) const { return bars + 8u * (2 + 3 * ST + s); }

  // By one thread, before the CTA's first barrier: the full barriers wait for the one producer thread's
  // announcement, the empty ones for one arrival per consumer warp.
  __device__ __forceinline__ void init(int consumer_warps) const {
    mbar_init(q_full(), 1);
    mbar_init(q_empty(), consumer_warps);
    for (int s = 0; s < ST; ++s) {
      mbar_init(k_full(s), 1);
      mbar_init(v_full(s), 1);
      mbar_init(k_empty(s), consumer_warps);
      mbar_init(v_empty(s), consumer_warps);
    }
    mbar_init_fence();
  }

  // The i-th block through the ring (counted on across tiles): its stage, the parity of the phase that marks
  // it full, and the parity a producer waits on for the stage to be free (a fresh barrier passes parity 1).
  __device__ __forceinline__ static int stage(int i) { return i % ST; }
  __device__ __forceinline__ static unsigned full_phase(int i) { return (i / ST) & 1; }
  __device__ __forceinline__ static unsigned free_phase(int i) { return ((i / ST) & 1) ^ 1; }
};

// The backward's barriers (bwd_kernel_sm90.cuh), 8 bytes each from shared address `bars`: K and V full (the
// CTA's resident keys, loaded once), then per stage a full one (the copy engine wrote a query block's Q, dO,
// LSE and delta) and an empty one (every consumer warp is done with them). Positions and phases as KVRing's.
template <int ST>
struct QueryRing {
  static constexpr int kBarriers = 1 + 2 * ST;
  unsigned bars;

  __device__ __forceinline__ unsigned kv_full() const { return bars; }
  __device__ __forceinline__ unsigned full(int s) const { return bars + 8u * (1 + s); }
  __device__ __forceinline__ unsigned empty(int s) const { return bars + 8u * (1 + ST + s); }

  __device__ __forceinline__ void init(int consumer_warps) const {
    mbar_init(kv_full(), 1);
    for (int s = 0; s < ST; ++s) {
      mbar_init(full(s), 1);
      mbar_init(empty(s), consumer_warps);
    }
    mbar_init_fence();
  }
  __device__ __forceinline__ static int stage(int i) { return i % ST; }
  __device__ __forceinline__ static unsigned full_phase(int i) { return (i / ST) & 1; }
  __device__ __forceinline__ static unsigned free_phase(int i) { return ((i / ST) & 1) ^ 1; }
};

// A consumer warp is done with the buffer behind barrier `bar`: one arrival for the warp.
__device__ __forceinline__ void release_warp(unsigned bar, int lane) {
  __syncwarp();
  if (lane == 0) mbar_arrive(bar);
}

// Pingpong: the consumer warpgroups take turns issuing their GEMMs, in a ring, so one's softmax runs while
// another's GEMMs hold the tensor cores. Barrier kTurn + w opens warpgroup w's turn; its predecessor in the
// ring opens it after issuing. Warpgroup 0 goes first: the last one opens its first turn (open_first) and
// skips its own last hand-over, so every barrier phase completes. Barriers 1..NC are left to the
// warpgroups' epilogues.
template <int NC>
struct Pingpong {
  static constexpr int kTurn = 1 + NC;
  int cw;  // this consumer warpgroup

  __device__ __forceinline__ bool last() const { return cw == NC - 1; }
  __device__ __forceinline__ void open_first() const { named_arrive(kTurn, 256); }
  __device__ __forceinline__ void wait() const { named_sync(kTurn + cw, 256); }
  __device__ __forceinline__ void pass() const { named_arrive(kTurn + (cw + 1) % NC, 256); }
};

}  // namespace cubridge
