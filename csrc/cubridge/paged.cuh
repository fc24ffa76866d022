// K and V read in place from pages through a block table (vLLM-style paged caches), shared by the
// decode kernel (cp.async copies) and the Hopper prefill kernel (one TMA box per page piece).
#pragma once

namespace cubridge {

// K and V kept in pages (vLLM-style), read in place where the kernel is built paged: key s of
// sequence b is row s % page of page table[b, s / page]. FwdArgs' k/v then point at the pages, with
// k_sh/v_sh the pages' head stride and k_ss/v_ss the row stride within a page (k_sb/v_sb unused).
struct PagedKV {
  static constexpr bool kSegmented = false;
  const void* k_table;  // [B, pages per sequence], int32 or int64
  const void* v_table;
  long long kt_sb, kt_sp, vt_sb, vt_sp;  // table strides: sequence, page
  long long k_sp, v_sp;                  // elements from one page to the next
  long long k_pages, v_pages;            // pages in each buffer
  long long page;                        // keys per page
  long long page_div;                    // PageDiv's multiplier (low 32 bits) and shift (above), made on the host
  long long table64;                     // 1: the tables are int64
};

// A table entry as loaded: its low 32 bits, read as signed, for int32 and int64 tables alike (little-endian). Every
// entry torch indexing accepts fits (|entry| < pages < 2^31); one that does not is rejected by the spec, and
// entry_index still keeps it inside the buffer. One register an entry, so a block's entries held a block ahead of
// their use (decode_kernel.cuh) fit beside D 256's accumulators (and against two words an entry: pages of 16 and
// 256, B 8, D 128, 4k and 32k: -0.3% to +1.6%, H100).
using Entry = int;
__device__ __forceinline__ Entry load_entry(const void* table, bool t64, long long off) {
  return __ldg(static_cast<const int*>(table) + (t64 ? 2 * off : off));
}

// A table entry as torch indexing reads it (a negative entry counts from the end), kept inside the
// buffer: an entry the spec itself would reject must not become a wild read. In 32 bits: a pool holds fewer than
// 2^31 pages (ops/runner.py _pages and the C Decoder refuse more). In 64 bits the clamp cost pages of 16 at 4k keys
// 3% (D 128) and 24% (D 256, 16 rows a thread), H100.
__device__ __forceinline__ long long entry_index(Entry r, long long n) {
  const int m = static_cast<int>(n);
  const int e = r < 0 ? r + m : r;
  return static_cast<unsigned>(min(max(e, 0), m - 1));
}

__device__ __forceinline__ long long page_entry(const void* table, bool t64, long long off, long long n) {
  return entry_index(load_entry(table, t64, off), n);
}

// Division by the page size with no divide instruction (Granlund-Montgomery): for 0 <= n < 2^31,
// n / page = (umulhi(n, m) + n) >> l, with l = ceil(log2(page)) and m = 2^32 (2^l - page) / page + 1. One short
// form for every page size, power of two or not, in every paged walk (decode, FA2-class, Hopper): the per-row
// walk's shift and divide branches were most of the paged decode kernel's extra code, and cold code
// is fetched from DRAM on a call's first pass. m and l come with the call (PagedKV::page_div, packed by
// ops/pack.py page_div_word and the C Decoder), so a CTA's first table read waits on no 64-bit division.
struct PageDiv {
  unsigned m = 1;
  int l = 0, page = 1;
  PageDiv() = default;  // division by one: unpaged kernels' placeholder
  __device__ explicit PageDiv(const PagedKV& pg)
      : m(static_cast<unsigned>(pg.page_div)), l(static_cast<int>(pg.page_div >> 32)), page(static_cast<int>(pg.page)) {}
  __device__ __forceinline__ int div(int n) const {
    return static_cast<int>((__umulhi(static_cast<unsigned>(n), m) + static_cast<unsigned>(n)) >> l);
  }
};

// One sequence's pages of K and V: its block tables' entries (load_block_paged's page_of) and the division by
// the page size. Unpaged kernels make one that is never read.
struct SeqPages {
  const PagedKV& pg;
  bool t64;
  int b;
  PageDiv pd;
  template <bool kPaged>
  __device__ __forceinline__ static SeqPages of(const PagedKV& pg, int b) {
    SeqPages s{pg, pg.table64 != 0, b, PageDiv()};
    if constexpr (kPaged) s.pd = PageDiv(pg);
    return s;
  }
  __device__ __forceinline__ long long k_page(int i) const {
    return page_entry(pg.k_table, t64, b * pg.kt_sb + i * pg.kt_sp, pg.k_pages);
  }
  __device__ __forceinline__ long long v_page(int i) const {
    return page_entry(pg.v_table, t64, b * pg.vt_sb + i * pg.vt_sp, pg.v_pages);
  }
};

// Rows of one TMA box of a paged K/V block: the largest piece that divides both the block and the page,
// so a box never crosses a page. The host builds the tensor maps with the same rule, and gathers pages
// whose boxes would be smaller than lower/tiles.py's PAGED_TMA_ROWS (ops/runner.py, pipeline.kernel_choice).
__host__ __device__ __forceinline__ int page_box_rows(int page, int block) {
  while (block) {
    const int r = page % block;
    page = block;
    block = r;
  }
  return page;
}

}  // namespace cubridge
