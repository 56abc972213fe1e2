#pragma once
/// \file kernels/dequantized_product.hpp
/// The forward product of a PanelMatrix with exact float activations,
///
///     y (rows × 32·panels) = x (rows × K) · Mᵀ,   M's row 32p + l = lane l of panel p,
///
/// for the layers that train through frozen packed weights. The inference
/// products of the block formats quantize the activations to Q8_0 / Q8_K
/// (ggml's `vec_dot_type`, kernels/quant_activations.hpp): right for
/// inference, but then the backward's exact dequantized weights would
/// differentiate a function the forward did not compute.
///
/// How. A block format's panel is dequantized 32 k at a time
/// (kernels/dequantize_panel.hpp; the AVX2 and AVX-512 forms in
/// kernels/arch/) into one float panel in the thread's scratch, K × 32
/// floats in the f32 panel order (256 KiB at K = 2048: it stays in L2), and
/// the f32 tiles run every row over it. While panel p is dequantized, the
/// bytes of panel p + 1 are prefetched into L2, so memory works through the
/// tiles of panel p. f32, bf16 and f16 panels already multiply exact
/// activations: they run their own tiles (kernels/fused_expert.hpp). Rows a
/// multiple of 4 KiB apart are copied apart first (kernels/spread_rows.hpp),
/// in blocks of kSpreadRowBlock rows, each block dequantizing the panels
/// again (so the copy stays bounded).
///
/// Why a whole panel, not 32 k at a time in L1 with the tiles run over
/// that k-range: that needs tiles that continue an accumulation, and the
/// panel in L2 does not slow the tiles (32 rows, K = 2048, warm: the tiles
/// over the dequantized panels 1.94 ms, the same tiles streaming an f32
/// matrix 2.02 ms). The dequantization's own time (3-5 µs for a panel of
/// K = 2048) is what a fused form could hide behind the FMAs, at most the
/// 1-15 % it adds at 32 rows (below); the tiles stay the engine's.
///
/// Measured (bench_packed, BM_dequantized: one thread, cold weights, the
/// thread's CPU time per call, medians of 3 runs of interleaved calls; path
/// avx512_bf16, i.e. the AVX-512 dequantizer and the AVX-512 f32 tiles; an
/// AMD Zen 4 core shared with other jobs), gate_up (1536 × 2048) / down
/// (2048 × 768) of a Qwen3-30B-A3B expert:
///
///     cmake --preset bench && cmake --build --preset bench --target bench_packed
///     build/bench/benchmarks/bench_packed --benchmark_filter=BM_dequantized --benchmark_repetitions=3
///
///   time over the forward of an f32 matrix of the same shape (the tiles it runs)
///   rows  Q8_0       Q4_0       MXFP4      Q4_K       Q6_K
///   1     1.03 1.05  0.84 0.73  0.82 0.75  0.95 0.99  0.89 0.80
///   32    1.07 1.15  1.04 1.10  1.01 1.10  1.04 1.12  1.10 1.11
///   512   0.91 1.00  0.90 0.99  0.90 0.99  0.91 0.99  0.91 0.99
///   time over the inference forward of the same matrix (quantized activations)
///   1     2.27 2.18  3.23 4.24  4.54 4.54  2.63 2.87  1.86 1.94
///   32    1.99 1.91  2.10 2.04  1.80 1.81  2.30 2.34  1.94 1.83
///   512   1.78 1.71  1.84 1.75  1.63 1.56  2.30 2.21  1.85 1.83
///
/// At 512 rows the product runs at the f32 tiles' rate (107-112 GFLOP/s);
/// on gate_up faster than the f32 forward, whose 8 KiB-apart rows thrash L1
/// (the rows copied apart here). At 32 rows the dequantization, not
/// overlapped with the tiles, adds 1-15 %. At one row the product is bound
/// by the dequantization (about 18 floats a ns), not by memory: about as
/// fast as the f32 forward, 1.9-4.5× the time of the block formats' own
/// forward, which reads their 2-7× fewer bytes at the memory's rate.
/// Against the get_block dequantizer it replaces
/// (Q8_0, Q4_K, Q6_K, gate_up): 11×, 19×, 58× faster at one row; 2.9×,
/// 4.4×, 11× at 32; 1.25×, 1.4×, 1.8× at 512.
///
/// Bits. y[r][o] is the fp32 chain acc ← fma(x[r][k], W(o, k), acc) over
/// k = 0 … K − 1 ascending, from acc = 0, W(o, k) the stored weight as
/// PanelMatrix::unpack_row gives it (ggml's dequantizer for a block
/// format). Every path's dequantizer writes the same floats and the f32
/// tiles compute that chain on every path (bf16 and f16 tiles on the
/// exactly widened values), so the bits do not depend on the path, the row
/// count, the row blocking or a split of the rows between calls or threads;
/// a plain std::fma loop over unpack_row's values is the exact reference
/// (tests/test_dequantized_product.cpp).

#include <algorithm>
#include <cstdint>
#include <string>

#include "../core/checked_size.hpp"
#include "../core/errors.hpp"
#include "../core/types.hpp"
#include "arch/avx2_dequantize_panel.hpp"
#include "arch/avx512_dequantize_panel.hpp"
#include "dequantize_panel.hpp"
#include "matrix_runs.hpp"
#include "panel_matrix.hpp"
#include "spread_rows.hpp"

namespace apex::packed {

/// Rows per block of the dequantized product when the rows are copied apart
/// (kernels/spread_rows.hpp): bounds the copy (4 MiB at K = 2048); a block
/// dequantizes every panel once, about 0.5 % of the time of 512 rows' tiles.
inline constexpr Index kSpreadRowBlock = 512;

namespace detail {

/// Per-thread buffers (grow, never shrink).
struct DequantizedScratch {
  AlignedArray<float> panel;  // K × 32: one dequantized panel
  AlignedArray<float> x;      // kSpreadRowBlock × (K + 16): x's rows copied apart
};
inline DequantizedScratch& dequantized_scratch() {
  thread_local DequantizedScratch s;
  return s;
}

/// Chunk `chunk` of one block-format panel on path `isa` (the same bytes
/// on every path).
template <Dtype T>
void dequantize_chunk(Isa isa, const std::byte* codes, const std::byte* scales, Index chunk, float* dst) {
#if APEX_PACKED_X86
  if (is_avx512(isa)) return dequantize_chunk_avx512<T>(codes, scales, chunk, dst);
  if (isa == Isa::avx2) return dequantize_chunk_avx2<T>(codes, scales, chunk, dst);
#endif
  (void)isa;
  dequantize_chunk_scalar<T>(codes, scales, chunk, dst);
}

/// Prefetches bytes [from, from + n) of an array of `size` bytes into L2,
/// nothing past its end. Never faults: the address is formed as an integer.
inline void prefetch_l2(const std::byte* base, Index size, Index from, Index n) {
#if APEX_PACKED_X86
  const std::uintptr_t a = reinterpret_cast<std::uintptr_t>(base);
  for (Index o = from; o < std::min(size, from + n); o += 64)
    _mm_prefetch(reinterpret_cast<const char*>(a + std::uintptr_t(o)), _MM_HINT_T1);
#else
  (void)base, (void)size, (void)from, (void)n;
#endif
}

/// Panel p of pm (type T) as floats in the f32 panel order, buf[k·32 + lane].
/// Chunk j also prefetches the j-th share of panel p + 1's codes and scales
/// (the panels are contiguous), so the next panel arrives while this one's
/// tiles run. Measured with one row, cold weights, K = 2048: Q8_0 20 %
/// faster than with a prefetch 4 KiB ahead and 45 % than with none; Q4_K
/// (half the bytes) as fast as 4 KiB ahead, 12 % faster than none.
template <Dtype T>
void dequantize_panel(Isa isa, const PanelMatrix& pm, Index p, float* buf) {
  const Index chunks = pm.k() / kChunkColumns;
  if (chunks == 0) return;
  const Index cb = pm.panel_code_bytes() / chunks, sb = pm.panel_scale_bytes() / chunks;  // a chunk's share
  for (Index j = 0; j < chunks; ++j) {
    prefetch_l2(pm.codes_data(), pm.codes_bytes(), (p + 1) * pm.panel_code_bytes() + j * cb, cb);
    prefetch_l2(pm.scales_data(), pm.scales_bytes(), (p + 1) * pm.panel_scale_bytes() + j * sb, sb);
    dequantize_chunk<T>(isa, pm.panel<T>(p), pm.scales(p), j, buf + j * kChunkColumns * kPanelLanes);
  }
}

/// y = x · Mᵀ for one block of rows (arguments checked by the caller).
template <Dtype T>
void dequantized_rows(Isa isa, const PanelMatrix& pm, const float* x, Index ldx, Index rows, float* y, Index ldy,
                      Index n, float* panel) {
  constexpr Index L = kPanelLanes;
  if constexpr (!WeightType<T>::kQuantized) {
    (void)panel;
    run_matrix<PlainEpilogue>(isa, pm, x, ldx, rows, y, ldy, L, n);
  } else {
    for (Index p = 0; p < pm.panels(); ++p) {
      dequantize_panel<T>(isa, pm, p, panel);
      run_panel<Dtype::f32, PlainEpilogue>(isa, panel, nullptr, pm.k(), x, ldx, rows, y + p * L, ldy,
                                           std::min(L, n - p * L));
    }
  }
}

/// y = x · Mᵀ for a matrix of type T (arguments checked by the caller).
template <Dtype T>
void dequantized_product(Isa isa, const PanelMatrix& pm, const float* x, Index ldx, Index rows, float* y, Index ldy,
                         Index n) {
  constexpr const char* where = "packed::dequantized_product";
  const Index K = pm.k();
  DequantizedScratch& s = dequantized_scratch();
  float* panel = nullptr;
  if constexpr (WeightType<T>::kQuantized)
    panel = grow(s.panel, apex::detail::checked_product(where, "dequantized panel", {K, kPanelLanes}));
  const Index block = ldx % 1024 == 0 ? kSpreadRowBlock : rows;  // the copy is bounded, not the rows
  for (Index r0 = 0; r0 < rows; r0 += block) {
    const Index m = std::min(block, rows - r0);
    Index ld = ldx;
    const float* xr = spread_rows(x + r0 * ldx, ld, m, K, s.x, where);
    dequantized_rows<T>(isa, pm, xr, ld, m, y + r0 * ldy, ldy, n, panel);
  }
}

}  // namespace detail

/// y (rows × n, row stride ldy) = x (rows × K, row stride ldx) · Mᵀ with
/// float activations, panel p writing columns [32p, 32p + min(32, n − 32p))
/// (see the file comment for the bits). y is overwritten and must not
/// overlap x. n must leave no panel without a column: 32·(panels − 1) < n
/// ≤ 32·panels (n = 0 for no panels). Single-threaded; the caller
/// parallelises over experts and row tiles. ConfigError for rows < 0, a
/// column count n the panels do not match or a path the CPU lacks;
/// ShapeError for a row stride below the row length.
inline void dequantized_product(Isa isa, const PanelMatrix& pm, const float* x, Index ldx, Index rows, float* y,
                                Index ldy, Index n) {
  constexpr const char* where = "packed::dequantized_product";
  const Index panels = pm.panels();
  detail::require_isa(where, isa);
  apex::detail::require_config(rows >= 0, where,
                               [&] { return "row count rows = " + std::to_string(rows) + " is negative"; });
  apex::detail::require_config(n <= kPanelLanes * panels && n > kPanelLanes * (panels - 1) && n >= 0, where, [&] {
    return "column count n = " + std::to_string(n) + " does not match the " + std::to_string(panels) +
           " panels of 32 lanes (needs " + std::to_string(std::max<Index>(0, kPanelLanes * (panels - 1) + 1)) +
           " to " + std::to_string(kPanelLanes * panels) + ")";
  });
  if (ldx < pm.k()) apex::detail::check_shape(where, "x (row stride)", rows, ldx, rows, pm.k());
  if (ldy < n) apex::detail::check_shape(where, "y (row stride)", rows, ldy, rows, n);
  if (rows == 0 || n == 0) return;
  visit_dtype(pm.dtype(), [&](auto tag) {
    detail::dequantized_product<decltype(tag)::value>(isa, pm, x, ldx, rows, y, ldy, n);
  });
}

/// y = x · Mᵀ for x: N × K (ShapeError otherwise) → N × 32·panels.
inline Matrix<float> dequantized_product(const PanelMatrix& pm, const ConstMatrixRef<float>& x,
                                         Isa isa = kDefaultIsa) {
  apex::detail::check_shape("packed::dequantized_product", "x", x, apex::detail::kAny, pm.k());
  Matrix<float> y(x.rows(), kPanelLanes * pm.panels());  // N × 32·panels
  dequantized_product(isa, pm, x.data(), x.outerStride(), x.rows(), y.data(), y.outerStride(), y.cols());
  return y;
}

}  // namespace apex::packed
