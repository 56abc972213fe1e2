#pragma once
/// \file kernels/arch/scalar.hpp
/// The portable path: the micro-kernel of kernels/arch/avx512.hpp written one lane
/// at a time, for every type of the weight-type table (it reads single
/// weights through `WeightType<T>::weight`, so a new type runs here before
/// it has SIMD tiles). Each output lane is accumulated as
/// acc ← fma(x_k, w_k, acc) for k = 0, 1, … — the same fused operations in the
/// same order as the SIMD paths, so for float weights and for shift-widened
/// bf16 weights all paths return identical bits (the tests check this).
///
/// Panel and epilogue conventions (shared by every path):
/// - `w`, `scales`: one panel's codes and per-block scales
///   (kernels/packed_weights.hpp), K reduction steps × 32 lanes;
/// - `x`: `rows` activation rows of length K, row stride `ldx`;
/// - `Epi`: the epilogue policy (kernels/epilogue.hpp): plain, out[r][c] =
///   acc[r][c] for c < ncols ≤ 32, or gated, out[r][c] = Act(acc[r][c],
///   acc[r][16 + c]) for c < ncols ≤ 16.

#include <cmath>
#include <cstddef>

#include "../epilogue.hpp"
#include "../quant_layout.hpp"
#include "../weight_types.hpp"

namespace apex::packed::detail {

/// out (rows × ncols, stride ldo) = epilogue(x (rows × K) · panel).
template <Dtype T, class Epi>
void panel_scalar(const typename WeightType<T>::Element* w, const std::byte* scales, Index K, const float* x,
                  Index ldx, Index rows, float* out, Index ldo, Index ncols) {
  using W = WeightType<T>;
  for (Index r = 0; r < rows; ++r) {
    float acc[32] = {};  // 32 lanes of one row
    for (Index k = 0; k < K; ++k) {
      const float xv = x[r * ldx + k];
      for (Index lane = 0; lane < 32; ++lane) acc[lane] = std::fma(xv, W::weight(w, scales, k, lane), acc[lane]);
    }
    store_row_lanes<Epi>(acc, out + r * ldo, ncols);
  }
}

/// The same for a block format against quantized rows: each lane's blocks
/// through the entry's integer `dot_block`, block order ascending (what the
/// SIMD tiles reproduce).
template <Dtype T, class Epi>
void quant_panel_scalar(const std::byte* codes, const std::byte* scales, Index K, const QuantRows& x, Index rows,
                        float* out, Index ldo, Index ncols) {
  using W = WeightType<T>;
  for (Index r = 0; r < rows; ++r) {
    const QuantRow xr = x.row(r);
    float acc[32];
    for (Index lane = 0; lane < 32; ++lane) {
      float a = 0.0f;
      for (Index b = 0; b < K / W::kBlockWeights; ++b) a = W::dot_block(codes, scales, b, lane, xr, a);
      acc[lane] = a;
    }
    store_row_lanes<Epi>(acc, out + r * ldo, ncols);
  }
}

}  // namespace apex::packed::detail
