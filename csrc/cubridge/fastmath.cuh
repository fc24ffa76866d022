// Fast special functions the lowering may choose when GPU verification shows
// they are exact enough (tanh.approx: about 2^-11 relative error).
#pragma once

namespace cubridge {

__device__ __forceinline__ float tanh_fast(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace cubridge
