#pragma once
/// \file kernels/transposed_product.hpp
/// The transposed product of a packed matrix: the backward through frozen
/// packed weights (LoRA training on packed experts),
///
///     dx (rows × K) = dy (rows × O) · M,   O = 32·panels,
///
/// M the matrix whose row 32p + l is lane l of panel p (the forward is
/// y = x·Mᵀ: kernels/matrix_runs.hpp, run_matrix). Which logical output a
/// lane is (a gate, an up or a down row) is the owner's business: dy's
/// columns are in lane order, and those of padding lanes must be finite
/// (their weights are zero).
///
/// How. A panel stores each lane's weights along K, the order x·Mᵀ reads;
/// dy·M reduces over the lanes instead. So M is turned around 32 columns at
/// a time: chunk j (columns k0 = 32j … k0 + 31) of every panel is unpacked
/// (kernels/unpack_columns.hpp) into a per-thread buffer that is one f32
/// panel of reduction length O, buf[o·32 + c] = W(o, k0 + c), and the f32
/// tiles compute dx[:, k0 … k0 + 31] = dy · buf for every row, as for any
/// f32 panel. The buffer (O × 128 bytes: 192 KiB at O = 1536) stays in L2
/// while the rows stream past it, so a chunk is unpacked once for all rows.
///
/// Bits. dx[r][k] is the fp32 chain acc ← fma(dy[r][o], W(o, k), acc) over
/// o = 0 … O − 1 ascending, from acc = 0, W(o, k) the stored weight as
/// PanelMatrix::unpack_row gives it (ggml's dequantizer for a block
/// format). The f32 tiles compute that chain on every path, and every
/// path's unpacker writes the same floats, so the bits do not depend on the
/// path, the row count, the row blocking or a split of the rows between
/// calls or threads; a plain std::fma loop over unpack_row's values is the
/// exact reference (tests/test_transposed_product.cpp).
///
/// Measured (bench_packed, BM_transposed: one thread, cold weights, the
/// thread's CPU time per call, medians of 3 runs of interleaved calls; path
/// avx512_bf16, i.e. the AVX2 unpacker and the AVX-512 f32 tiles; an AMD
/// Zen 4 core shared with other jobs). Time of dx = dy·M over the forward
/// x·Mᵀ of an f32 matrix of the same shape (the tiles both run), gate_up
/// (1536 × 2048) / down (2048 × 768) of a Qwen3-30B-A3B expert:
///
///   rows  f32        bf16       f16        Q8_0       Q4_0       MXFP4      Q4_K       Q6_K
///   1     1.39 1.31  1.49 1.65  1.17 1.14  1.06 1.10  0.95 0.90  0.91 0.91  0.99 0.99  1.01 1.12
///   32    1.22 1.24  1.18 1.26  1.19 1.21  1.21 1.31  1.19 1.26  1.08 1.14  1.08 1.14  1.30 1.19
///   512   0.96 1.04  0.94 1.02  0.95 1.02  0.94 1.01  0.93 1.00  0.94 1.00  0.94 1.01  0.96 1.02
///
/// At 512 rows the product runs at the f32 tiles' rate. At 32 rows what is
/// left is the unpacking's memory traffic, which is not overlapped with the
/// tiles. Against the forward of the same matrix (another copy, cold too) a
/// block format takes 1.6–2.5× at 32 and 512 rows (its forward multiplies
/// int8 codes, about twice the f32 tiles' rate) and 2.3–5.7× at one row
/// (the whole matrix is unpacked for that row).

#include <algorithm>
#include <cstdint>
#include <string>

#include "../core/errors.hpp"
#include "arch/avx2_unpack_columns.hpp"
#include "matrix_runs.hpp"
#include "spread_rows.hpp"
#include "unpack_columns.hpp"

namespace apex::packed {

namespace detail {

/// Per-thread buffers (grow, never shrink): one unpacked chunk, and dy
/// copied with a padded row stride.
struct TransposedScratch {
  AlignedArray<float> columns;  // O × 32
  AlignedArray<float> dy;       // rows × (O + 16)
};
inline TransposedScratch& transposed_scratch() {
  thread_local TransposedScratch s;
  return s;
}

/// Chunk `chunk` of one panel on path `isa` (the same bytes on every path):
/// the AVX2 unpacker on every SIMD path (kernels/arch/avx2_unpack_columns.hpp
/// says why not AVX-512).
template <Dtype T>
void unpack_columns(Isa isa, const typename WeightType<T>::Element* codes, const std::byte* scales, Index K,
                    Index chunk, float* dst) {
#if APEX_PACKED_X86
  if (isa != Isa::scalar) return unpack_columns_avx2<T>(codes, scales, K, chunk, dst);
#endif
  (void)isa;
  unpack_columns_scalar<T>(codes, scales, K, chunk, dst);
}

/// A chunk reads a few KiB from each panel, a panel's size apart: runs too
/// short for the hardware prefetchers, each on a page the TLB has not seen
/// (and a software prefetch that misses the TLB may be dropped). So while
/// panel p is unpacked, the chunk of panel p + 2·kPrefetchPanels is touched
/// (one load per range: the page walk) and that of p + kPrefetchPanels is
/// prefetched into L2 (not L1: when a panel's size is a multiple of 4 KiB
/// the chunks of all panels fall in the same L1 sets). Measured on cold
/// weights, one row: f32 1.7× and Q8_0 1.6× faster than without either.
inline constexpr Index kPrefetchPanels = 2;

/// Touches or prefetches what chunk `chunk` of panel p reads; p past the
/// last panel is the next chunk's. Never faults: a touch reads a range's
/// first byte, inside the matrix, and a prefetch's address is formed as an
/// integer.
template <Dtype T>
void prefetch_chunk(const PanelMatrix& pm, Index p, Index chunk, bool touch) {
#if APEX_PACKED_X86
  if (pm.panels() == 0) return;
  chunk += p / pm.panels();
  p %= pm.panels();
  if (chunk >= column_chunks(pm.k())) return;
  chunk_bytes<T>(pm.panel<T>(p), pm.scales(p), chunk, [touch](const std::byte* first, Index n) {
    if (n == 0) return;
    if (touch) {
      (void)*reinterpret_cast<const volatile std::byte*>(first);
      return;
    }
    const std::uintptr_t a = reinterpret_cast<std::uintptr_t>(first);
    for (Index o = 0; o < n; o += 64) _mm_prefetch(reinterpret_cast<const char*>(a + std::uintptr_t(o)), _MM_HINT_T1);
  });
#else
  (void)pm, (void)p, (void)chunk, (void)touch;
#endif
}

/// dx = dy · M for a matrix of type T (arguments checked by the caller).
template <Dtype T>
void transposed_product(Isa isa, const PanelMatrix& pm, const float* dy, Index lddy, Index rows, float* dx,
                        Index lddx) {
  constexpr Index L = kPanelLanes, C = kChunkColumns;
  const Index K = pm.k(), O = L * pm.panels();
  TransposedScratch& s = transposed_scratch();
  float* buf = grow(s.columns, apex::detail::checked_product("packed::transposed_product", "unpacked columns", {O, C}));
  dy = spread_rows(dy, lddy, rows, O, s.dy, "packed::transposed_product");  // kernels/spread_rows.hpp
  const Index block = rows <= kSmallRows ? rows : kRowBlock;
  for (Index p = 0; p < 2 * kPrefetchPanels; ++p) prefetch_chunk<T>(pm, p, 0, p >= kPrefetchPanels);
  for (Index j = 0; j < column_chunks(K); ++j) {
    for (Index p = 0; p < pm.panels(); ++p) {
      prefetch_chunk<T>(pm, p + 2 * kPrefetchPanels, j, true);
      prefetch_chunk<T>(pm, p + kPrefetchPanels, j, false);
      unpack_columns<T>(isa, pm.panel<T>(p), pm.scales(p), K, j, buf + p * L * C);
    }
    const Index ncols = std::min(C, K - j * C);
    for (Index r0 = 0; r0 < rows; r0 += block)
      run_panel<Dtype::f32, PlainEpilogue>(isa, buf, nullptr, O, dy + r0 * lddy, lddy, std::min(block, rows - r0),
                                           dx + r0 * lddx + j * C, lddx, ncols);
  }
}

}  // namespace detail

/// dx (rows × K, row stride lddx) = dy (rows × 32·panels, row stride lddy)
/// · M, M: row 32p + l = lane l of panel p of pm, exactly the stored values
/// (see the file comment for the bits). dx is overwritten and must not
/// overlap dy. ConfigError for rows < 0 or a path the CPU lacks, ShapeError
/// for a row stride below the row length.
inline void transposed_product(Isa isa, const PanelMatrix& pm, const float* dy, Index lddy, Index rows, float* dx,
                               Index lddx) {
  constexpr const char* where = "packed::transposed_product";
  const Index O = kPanelLanes * pm.panels();
  detail::require_isa(where, isa);
  apex::detail::require_config(rows >= 0, where,
                               [&] { return "row count rows = " + std::to_string(rows) + " is negative"; });
  if (lddy < O) apex::detail::check_shape(where, "dy (row stride)", rows, lddy, rows, O);
  if (lddx < pm.k()) apex::detail::check_shape(where, "dx (row stride)", rows, lddx, rows, pm.k());
  if (rows == 0) return;
  visit_dtype(pm.dtype(), [&](auto tag) {
    detail::transposed_product<decltype(tag)::value>(isa, pm, dy, lddy, rows, dx, lddx);
  });
}

/// dx = dy · M for dy: N × 32·panels (ShapeError otherwise) → N × K.
inline Matrix<float> transposed_product(const PanelMatrix& pm, const ConstMatrixRef<float>& dy, Isa isa = kDefaultIsa) {
  apex::detail::check_shape("packed::transposed_product", "dy", dy, apex::detail::kAny, kPanelLanes * pm.panels());
  Matrix<float> dx(dy.rows(), pm.k());  // N × K
  transposed_product(isa, pm, dy.data(), dy.outerStride(), dy.rows(), dx.data(), pm.k());
  return dx;
}

}  // namespace apex::packed
