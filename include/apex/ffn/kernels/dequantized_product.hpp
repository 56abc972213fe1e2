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
/// differentiate a function the forward did not compute. Here a block
/// format's panel is dequantized (ggml's values, PanelMatrix::unpack_row's
/// bits) into a float panel in the thread's scratch, K × 32 floats that stay
/// in L2, and the f32 tiles run on it: each output is the fp32 FMA chain over
/// k ascending of x·w, the same bits on every kernel path, and the same bits
/// as the float weights holding the dequantized values. f32, bf16 and f16
/// panels already multiply exact activations: they run their own tiles
/// (kernels/fused_expert.hpp), whose bits are the f32 tiles' on the widened
/// values.

#include <algorithm>

#include "../core/checked_size.hpp"
#include "../core/types.hpp"
#include "fused_expert.hpp"
#include "panel_matrix.hpp"

namespace apex::packed {

namespace detail {
/// Per-thread scratch: one dequantized panel (K × 32 floats).
inline AlignedArray<float>& dequantized_panel_scratch() {
  thread_local AlignedArray<float> s;
  return s;
}

/// Panel p of pm as floats in the f32 panel order, buf[k·32 + lane], K = pm.k().
inline void dequantize_panel(const PanelMatrix& pm, Index p, float* buf) {
  const Index K = pm.k();
  float row[256];  // one block of one lane (the largest block: 256 weights)
  visit_dtype(pm.dtype(), [&](auto tag) {
    constexpr Dtype T = decltype(tag)::value;
    using W = WeightType<T>;
    if constexpr (W::kQuantized) {
      const auto* codes = pm.panel<T>(p);
      for (Index lane = 0; lane < kPanelLanes; ++lane)
        for (Index b = 0; b < K / W::kBlockWeights; ++b) {
          const typename W::Block blk = W::get_block(codes, pm.scales(p), b, lane);
          W::dequantize(&blk, row, W::kBlockWeights);
          for (Index i = 0; i < W::kBlockWeights; ++i) buf[(b * W::kBlockWeights + i) * kPanelLanes + lane] = row[i];
        }
    } else {
      for (Index k = 0; k < K; ++k)
        for (Index lane = 0; lane < kPanelLanes; ++lane) buf[k * kPanelLanes + lane] = pm.get(p, k, lane);
    }
  });
}
}  // namespace detail

/// y (rows × n, row stride ldy) = x (rows × K, row stride ldx) · Mᵀ with
/// float activations, panel p writing columns [32p, 32p + min(32, n − 32p)).
/// Single-threaded; the caller parallelises over experts and row tiles.
inline void dequantized_product(Isa isa, const PanelMatrix& pm, const float* x, Index ldx, Index rows, float* y,
                                Index ldy, Index n) {
  if (rows == 0) return;
  constexpr Index L = kPanelLanes;
  const bool quantized = visit_dtype(pm.dtype(), [](auto tag) { return WeightType<decltype(tag)::value>::kQuantized; });
  if (!quantized) return detail::run_matrix<PlainEpilogue>(isa, pm, x, ldx, rows, y, ldy, L, n);
  const Index K = pm.k();
  float* buf = detail::grow(detail::dequantized_panel_scratch(),
                            apex::detail::checked_product("dequantized_product", "panel floats", {K, L}));
  const Index block = rows <= kSmallRows ? rows : kRowBlock;
  for (Index p = 0; p < pm.panels(); ++p) {
    detail::dequantize_panel(pm, p, buf);
    for (Index r0 = 0; r0 < rows; r0 += block)
      detail::run_panel<Dtype::f32, PlainEpilogue>(isa, buf, nullptr, K, x + r0 * ldx, ldx, std::min(block, rows - r0),
                                                   y + r0 * ldy + p * L, ldy, std::min(L, n - p * L));
  }
}

}  // namespace apex::packed
