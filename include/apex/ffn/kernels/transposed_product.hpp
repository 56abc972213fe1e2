#pragma once
/// \file kernels/transposed_product.hpp
/// The transposed product of a packed matrix: the backward through frozen
/// packed weights (LoRA training on packed experts),
///
///     dx (rows × K) = dy (rows × O) · M,   O = 32·panels,
///
/// M the matrix whose row 32p + l is lane l of panel p (the forward is
/// y = x·Mᵀ: kernels/fused_expert.hpp, run_matrix). Which logical output a
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

#include <algorithm>
#include <string>

#include "../core/errors.hpp"
#include "arch/avx2_unpack_columns.hpp"
#include "arch/avx512_unpack_columns.hpp"
#include "fused_expert.hpp"
#include "unpack_columns.hpp"

namespace apex::packed {

namespace detail {

/// Per-thread buffer of one unpacked chunk (grows, never shrinks).
inline AlignedArray<float>& transposed_scratch() {
  thread_local AlignedArray<float> s;
  return s;
}

/// Chunk `chunk` of one panel on path `isa` (the same bytes on every path).
template <Dtype T>
void unpack_columns(Isa isa, const typename WeightType<T>::Element* codes, const std::byte* scales, Index K,
                    Index chunk, float* dst) {
#if APEX_PACKED_X86
  if (is_avx512(isa)) return unpack_columns512<T>(codes, scales, K, chunk, dst);
  if (isa == Isa::avx2) return unpack_columns_avx2<T>(codes, scales, K, chunk, dst);
#endif
  (void)isa;
  unpack_columns_scalar<T>(codes, scales, K, chunk, dst);
}

/// dx = dy · M for a matrix of type T (arguments checked by the caller).
template <Dtype T>
void transposed_product(Isa isa, const PanelMatrix& pm, const float* dy, Index lddy, Index rows, float* dx,
                        Index lddx) {
  constexpr Index L = kPanelLanes, C = kChunkColumns;
  const Index K = pm.k(), O = L * pm.panels();
  float* buf = grow(transposed_scratch(),
                    apex::detail::checked_product("packed::transposed_product", "unpacked columns", {O, C}));
  const Index block = rows <= kSmallRows ? rows : kRowBlock;
  for (Index j = 0; j < column_chunks(K); ++j) {
    for (Index p = 0; p < pm.panels(); ++p) unpack_columns<T>(isa, pm.panel<T>(p), pm.scales(p), K, j, buf + p * L * C);
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
  apex::detail::require_config(rows >= 0, where, "row count rows = " + std::to_string(rows) + " is negative");
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
