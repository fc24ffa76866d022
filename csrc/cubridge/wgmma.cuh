// Hopper warpgroup MMA (wgmma, sm_90a): shared-memory matrix descriptors for
// 128-byte-swizzled tiles and the m64nNk16 instructions the sm_90 kernel uses.
//
// Tile layout (what a TMA copy with CU_TENSOR_MAP_SWIZZLE_128B writes): a
// [rows][D] bf16/fp16 tile is stored as D/64 column chunks, each [rows][64]
// with a 128-byte row; inside every 8-row, 1024-byte group the 16-byte pieces
// of row r sit at piece ^ (r % 8). Chunks and stages start 1024-byte aligned.
//
// Accumulators: thread t of the warpgroup holds d[4j + e] = C[row][col] with
// row = 16 (t / 32) + (t % 32) / 4 + 8 (e / 2), col = 8 j + 2 (t % 4) + e % 2:
// per 16-row warp slice the mma.sync m16n8 layout, so softmax.cuh applies as is.
#pragma once
#include "mma.cuh"

namespace cubridge {

// Descriptor of a 128B-swizzled tile at shared address `addr`. lbo: bytes
// between 64-element column chunks along the MN mode (MN-major operands);
// sbo: bytes between 8-row groups (1024 for 128-byte rows).
__device__ __forceinline__ unsigned long long sw128_desc(unsigned addr, unsigned lbo, unsigned sbo) {
  return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)(lbo >> 4) << 16) |
         ((unsigned long long)(sbo >> 4) << 32) | (1ull << 62);
}

// The descriptor of the same tile `bytes` further on (bytes a multiple of 16, inside shared memory).
__device__ __forceinline__ unsigned long long desc_plus(unsigned long long d, unsigned bytes) { return d + (bytes >> 4); }
// d, opaque to the compiler: descriptors derived from it by desc_plus with constant offsets are made where they
// are used, not hoisted out of a loop as loop-invariant values that then take registers (or spill) across it.
__device__ __forceinline__ unsigned long long desc_here(unsigned long long d) {
  asm volatile("" : "+l"(d));
  return d;
}

// Byte offset of element (r, c) of a 128B-swizzled [ROWS][D] 2-byte tile in this layout.
template <int ROWS>
__device__ __forceinline__ unsigned sw128_offset(int r, int c) {
  return (c / 64) * (ROWS * 128) + r * 128 + ((((c % 64) / 8) ^ (r % 8)) * 16) + (c % 8) * 2;
}

// Four 8 x 8 b16 matrices to shared memory, transposed: a thread's word i holds row lane / 4, columns
// 2 (lane % 4) and +1 of matrix i (an m16n8 accumulator's packing); lanes 8 i .. 8 i + 7 give the addresses of
// matrix i's eight rows as stored (its columns).
__device__ __forceinline__ void stsm_x4_t(unsigned addr, const unsigned (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1,%2,%3,%4};\n"
               :: "r"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Tie accumulator registers to the asynchronous MMA so the compiler neither
// reads nor moves them while it is in flight.
template <int R>
__device__ __forceinline__ void wgmma_hold(float* d) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The same for A operand registers of an RS wgmma: kept unchanged (and unreused) until the wait.
template <int R>
__device__ __forceinline__ void wgmma_hold_a(unsigned* a) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+r"(a[i])::"memory");
}

// PTX names every accumulator register; the lists below are written out once.
#define CB_REGS32 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}"
#define CB_REGS40 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39}"
#define CB_REGS64 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}"
#define CB_REGS96 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95}"
#define CB_REGS128 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}"
#define CB_D4(i) "+f"(d[i]), "+f"(d[(i) + 1]), "+f"(d[(i) + 2]), "+f"(d[(i) + 3])
#define CB_D8(i) CB_D4(i), CB_D4((i) + 4)
#define CB_D32(i) CB_D8(i), CB_D8((i) + 8), CB_D8((i) + 16), CB_D8((i) + 24)
#define CB_ACC32 CB_D32(0)
#define CB_ACC40 CB_D32(0), CB_D8(32)
#define CB_ACC64 CB_D32(0), CB_D32(32)
#define CB_ACC96 CB_D32(0), CB_D32(32), CB_D32(64)
#define CB_ACC128 CB_D32(0), CB_D32(32), CB_D32(64), CB_D32(96)

// d (+)= A B with A [64 x 16] K-major and B [16 x N] in shared memory: K-major (TB 0) or MN-major (TB 1,
// transposed).
#define CB_WGMMA_SS(N, R, TY, TB, I0, I1, I2)                                             \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #I2 ", 0;\n"                          \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " CB_REGS##R \
               ", %" #I0 ", %" #I1 ", p, 1, 1, 0, " #TB ";\n}\n"                          \
               : CB_ACC##R                                                                \
               : "l"(da), "l"(db), "r"(acc))
// d += A B with A in registers and B [16 x N] MN-major (transposed) in shared memory.
#define CB_WGMMA_RS(N, R, TY, I0, I1, I2, I3, I4)                                          \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                                  \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " CB_REGS##R  \
               ", {%" #I0 ",%" #I1 ",%" #I2 ",%" #I3 "}, %" #I4 ", p, 1, 1, 1;\n}\n"        \
               : CB_ACC##R                                                                 \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db))

template <int N, class T> struct Wgmma;
#define CB_WGMMA_N(N, R, I0, I1, I2, I3, I4)                                                    \
  template <class T> struct Wgmma<N, T> {                                                       \
    __device__ __forceinline__ static void ss(float* d, unsigned long long da,                  \
                                              unsigned long long db, int acc) {                 \
      if constexpr (IsSame<T, __nv_bfloat16>::value) CB_WGMMA_SS(N, R, "bf16", 0, I0, I1, I2);  \
      else CB_WGMMA_SS(N, R, "f16", 0, I0, I1, I2);                                             \
    }                                                                                           \
    __device__ __forceinline__ static void ss_t(float* d, unsigned long long da,                \
                                                unsigned long long db, int acc) {               \
      if constexpr (IsSame<T, __nv_bfloat16>::value) CB_WGMMA_SS(N, R, "bf16", 1, I0, I1, I2);  \
      else CB_WGMMA_SS(N, R, "f16", 1, I0, I1, I2);                                             \
    }                                                                                           \
    __device__ __forceinline__ static void rs(float* d, const unsigned* a, unsigned long long db) { \
      if constexpr (IsSame<T, __nv_bfloat16>::value) CB_WGMMA_RS(N, R, "bf16", I0, I1, I2, I3, I4); \
      else CB_WGMMA_RS(N, R, "f16", I0, I1, I2, I3, I4);                                        \
    }                                                                                           \
  };
CB_WGMMA_N(64, 32, 32, 33, 34, 35, 36)
CB_WGMMA_N(80, 40, 40, 41, 42, 43, 44)
CB_WGMMA_N(128, 64, 64, 65, 66, 67, 68)
CB_WGMMA_N(192, 96, 96, 97, 98, 99, 100)
CB_WGMMA_N(256, 128, 128, 129, 130, 131, 132)

}  // namespace cubridge
