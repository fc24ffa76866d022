// Global -> shared tile copies with cp.async (16-byte chunks, L2 only).
// Rows past the end are zero-filled (src-size 0), so padded keys and values
// are exact zeros and never inject NaN into P.V.
#pragma once
#include "mma.cuh"
#include "paged.cuh"

namespace cubridge {

// CUBRIDGE_L2_PREFETCH (0, 128 or 256): the L2 prefetch hint of each copy, the bytes L2 fetches around it.
// 128: decode +1.5-2% at 32k keys and +1-2% at 4k against none, 256 the same (H100, two A/B runs of
// benchmarks/bench_decode.py --ab "l2=...").
#ifndef CUBRIDGE_L2_PREFETCH
#define CUBRIDGE_L2_PREFETCH 128
#endif
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, bool valid) {
#if CUBRIDGE_L2_PREFETCH == 256
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0));
#elif CUBRIDGE_L2_PREFETCH == 128
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0));
#else
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0));
#endif
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Wait until at most N of this thread's groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Where 16-byte chunk c of row r of a shared tile goes: at c of a row LDS elements on, or with SWZ (rows of
// whole 128-byte groups, LDS = D) at c ^ (r & 7) within its group. The XOR keeps the 8 rows of an ldmatrix in
// distinct banks with no pad, and a copy's 128-byte line lands in one 128-byte group: the decode kernel's
// copies into padded rows cost 2.6x the L2 requests and 1.5x the sectors of these (H100).
template <int LDS, bool SWZ>
__device__ __forceinline__ int tile_chunk(int r, int c) {
  return r * LDS + (SWZ ? (c ^ (r & 7)) : c) * 8;
}
// A thread that copies one column of rows STEP apart finds it in this many places, from row to row, before they
// repeat (swizzled: the XOR repeats every 8 rows; one place where STEP is a multiple of 8 or unswizzled).
template <int STEP, bool SWZ>
__host__ __device__ constexpr int walk_places() {
  return !SWZ || STEP % 8 == 0 ? 1 : STEP % 4 == 0 ? 2 : STEP % 2 == 0 ? 4 : 8;
}

// Copy rows [row0, row0 + ROWS) of a row-major [nrows, D] matrix (row stride
// `ld` elements, last dim contiguous) into a shared tile with row pitch LDS (tile_chunk's layout).
template <int ROWS, int D, int LDS, int NTHREADS, class T, bool SWZ = false>
__device__ __forceinline__ void load_tile(T* s, const T* g, long long ld, int row0, int nrows,
                                          int tid) {
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  constexpr int kAll = ROWS * kChunks;  // a head dim of 5 or 9 chunks does not split evenly: the last pass guards
  static_assert(!SWZ || (kChunks % 8 == 0 && LDS == D), "a swizzled tile has rows of whole 128-byte groups");
  const unsigned s0 = smem_u32(s);
  if constexpr (NTHREADS % kChunks == 0 && ROWS % (NTHREADS / kChunks) == 0) {
    // Each thread keeps one column and walks rows kStep apart: one running
    // pointer instead of a hoisted 64-bit offset per chunk (saves registers), and its column's walk_places
    // places in shared memory.
    constexpr int kStep = NTHREADS / kChunks;
    const int r = tid / kChunks, c = tid % kChunks;
    const int left = nrows - row0 - r;  // rows this thread may still read
    const T* src = g + (long long)(row0 + r) * ld + c * 8;
    const long long step = kStep * ld;
    constexpr int kP = walk_places<kStep, SWZ>();
    const unsigned dst = s0 + tile_chunk<LDS, SWZ>(r, c) * 2;
#pragma unroll
    for (int i = 0; i < ROWS / kStep; ++i) {
      const bool ok = i * kStep < left;
      const int j = i % kP, rep = (i / kP) * kP * kStep * LDS * 2;  // its place, and the repeats before it
      cp_async16(j == 0 ? dst + rep : s0 + tile_chunk<LDS, SWZ>(r + j * kStep, c) * 2 + rep, ok ? src : g, ok);
      src += step;
    }
  } else {
#pragma unroll
    for (int i = 0; i < (kAll + NTHREADS - 1) / NTHREADS; ++i) {
      const int idx = tid + i * NTHREADS;
      if (kAll % NTHREADS != 0 && idx >= kAll) break;
      const int r = idx / kChunks, c = idx % kChunks;
      const bool ok = row0 + r < nrows;
      const T* src = g + (ok ? (long long)(row0 + r) * ld : 0) + c * 8;
      cp_async16(s0 + tile_chunk<LDS, SWZ>(r, c) * 2, src, ok);
    }
  }
}

// Columns [D, PADD) of a shared tile's ROWS rows (pitch LDS) set to zero: a head dim that is not a
// multiple of 16 is computed over PADD columns, and the copies write only D of them. Plain stores, made
// before the barrier that precedes the first read.
template <int ROWS, int D, int PADD, int LDS, int NTHREADS, class T>
__device__ __forceinline__ void zero_pad_columns(T* s, int tid) {
  if constexpr (PADD > D) {
    static_assert(PADD - D == 8 && D % 8 == 0, "one 16-byte chunk past the head dim");
    for (int r = tid; r < ROWS; r += NTHREADS) *reinterpret_cast<uint4*>(s + r * LDS + D) = make_uint4(0u, 0u, 0u, 0u);
  }
}

// The same rows of an operand whose rows lie anywhere: `row_at(row)` is where row `row` starts (K/V
// kept as several pieces one after another, decode_kernel.cuh's SegKV).
template <int ROWS, int D, int LDS, int NTHREADS, bool SWZ = false, class T, class RowAt>
__device__ __forceinline__ void load_tile_at(T* s, const T* fallback, RowAt row_at, int row0, int nrows, int tid) {
  constexpr int kChunks = D / 8;
  constexpr int kAll = ROWS * kChunks;
  const unsigned s0 = smem_u32(s);
#pragma unroll
  for (int i = 0; i < (kAll + NTHREADS - 1) / NTHREADS; ++i) {
    const int idx = tid + i * NTHREADS;
    if (kAll % NTHREADS != 0 && idx >= kAll) break;
    const int r = idx / kChunks, c = idx % kChunks, row = row0 + r;
    const bool ok = row < nrows;
    cp_async16(s0 + tile_chunk<LDS, SWZ>(r, c) * 2, ok ? row_at(row) + c * 8 : fallback, ok);
  }
}

// The same rows of an operand kept in pages: row s is row s - p * page of page page_of(p), p = s / page (by
// pd), pages `page_stride` elements apart and rows `ld` apart within one (paged KV, decode_kernel.cuh).
template <int ROWS, int D, int LDS, int NTHREADS, bool SWZ = false, class T, class PageOf>
__device__ __forceinline__ void load_tile_paged(T* s, const T* g, long long ld, long long page_stride,
                                                const PageDiv& pd, PageOf page_of, int row0, int nrows, int tid) {
  auto row_at = [&](int row) {
    const int pi = pd.div(row);
    return g + page_of(pi) * page_stride + static_cast<long long>(row - pi * pd.page) * ld;
  };
  load_tile_at<ROWS, D, LDS, NTHREADS, SWZ>(s, g, row_at, row0, nrows, tid);
}

// One operand's block of BN rows inside one page (pages a multiple of BN): that page's strided copy, with
// the contiguous copy's running pointer. Returns false otherwise (the caller's per-row lookups). The per-row
// page arithmetic cost the paged kernel 7-10% against the contiguous one on the very same memory at pages of
// 256 (H100).
template <int BN, int D, int LDS, int NTH, bool SWZ = false, class T, class PageOf>
__device__ __forceinline__ bool load_block_in_page(T* s, const T* g, long long ss, long long sp, const PageDiv& pd,
                                                   PageOf page_of, int row0, int nrows, int tid) {
  constexpr int kChunks = D / 8;
  if constexpr (NTH % kChunks == 0 && BN % (NTH / kChunks) == 0) {
    if (pd.page % BN == 0) {
      const int pi = pd.div(row0);  // row0 < nrows: its page is in the table
      load_tile<BN, D, LDS, NTH, T, SWZ>(s, g + page_of(pi) * sp + static_cast<long long>(row0 - pi * pd.page) * ss, ss, 0,
                                 nrows - row0, tid);
      return true;
    }
  }
  return false;
}

// One operand's block of BN rows from its pages, the whole block by the page's strided copy where it lies in
// one page and the threads split its rows evenly, else row by row (the FA2-class kernel, whose paged programs
// have pages of whole blocks, pipeline.kernel_choice; the decode kernel walks K and V together).
template <int BN, int D, int LDS, int NTH, bool SWZ = false, class T, class PageOf>
__device__ __forceinline__ void load_block_paged(T* s, const T* g, long long ss, long long sp, const PageDiv& pd,
                                                 PageOf page_of, int row0, int nrows, int tid) {
  if (!load_block_in_page<BN, D, LDS, NTH, SWZ>(s, g, ss, sp, pd, page_of, row0, nrows, tid))
    load_tile_paged<BN, D, LDS, NTH, SWZ>(s, g, ss, sp, pd, page_of, row0, nrows, tid);
}

}  // namespace cubridge
