// A decode step's new keys and values written into their pages (the flash API's block-table call,
// integrations/flash_api.py): one CTA per sequence copies its token's [Hkv, D] row of K and of V in 16-byte
// pieces to row pos % P of page table[b, pos / P]. A sequence whose position is negative (padding) or past its
// table writes nothing, so padding needs no slot of its own and no two writes meet. One launch for K and V:
// the same step as PyTorch ops took ~20 launches a cache (H100: 70-80 us a step in a CUDA graph).
#pragma once

namespace cubridge {

template <typename Entry>
__device__ __forceinline__ void paged_append(uint4* __restrict__ k_rows, uint4* __restrict__ v_rows,
                                             const char* __restrict__ k_new, const char* __restrict__ v_new,
                                             const Entry* __restrict__ table, const int* __restrict__ pos,
                                             long long table_stride, long long width, long long n_pages,
                                             long long page, long long heads, long long chunks_per_head,
                                             long long kb, long long kh, long long vb, long long vh) {
  const long long b = blockIdx.x;
  const long long p = pos[b];
  if (p < 0 || p / page >= width) return;
  long long e = static_cast<long long>(table[b * table_stride + p / page]) % n_pages;
  if (e < 0) e += n_pages;  // negative entries wrap, as torch's indexing does
  const long long row_chunks = heads * chunks_per_head;
  const long long dst = (e * page + p % page) * row_chunks;
  for (long long c = threadIdx.x; c < row_chunks; c += blockDim.x) {
    const long long h = c / chunks_per_head, d = c % chunks_per_head;
    // strides are in bytes; rows of the new tensors are 16-byte aligned (ops/append.py checks)
    k_rows[dst + c] = *reinterpret_cast<const uint4*>(k_new + b * kb + h * kh + d * 16);
    v_rows[dst + c] = *reinterpret_cast<const uint4*>(v_new + b * vb + h * vh + d * 16);
  }
}

}  // namespace cubridge

#define CUBRIDGE_APPEND_ENTRY(NAME, ENTRY)                                                                   \
  extern "C" __global__ void NAME(uint4* k_rows, uint4* v_rows, const char* k_new, const char* v_new,        \
                                  const ENTRY* table, const int* pos, long long table_stride,               \
                                  long long width, long long n_pages, long long page, long long heads,      \
                                  long long chunks_per_head, long long kb, long long kh, long long vb,      \
                                  long long vh) {                                                           \
    cubridge::paged_append<ENTRY>(k_rows, v_rows, k_new, v_new, table, pos, table_stride, width, n_pages,   \
                                  page, heads, chunks_per_head, kb, kh, vb, vh);                           \
  }

CUBRIDGE_APPEND_ENTRY(cubridge_paged_append_i32, int)
CUBRIDGE_APPEND_ENTRY(cubridge_paged_append_i64, long long)
