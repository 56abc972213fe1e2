#pragma once
/// \file kernels/arch/scalar.hpp
/// The portable path: the micro-kernel of kernels/arch/avx512.hpp written one lane
/// at a time. Each output lane is accumulated as acc ← fma(x_k, w_k, acc) for
/// k = 0, 1, … — the same fused operations in the same order as the SIMD
/// paths, so for float weights and for shift-widened bf16 weights all paths
/// return identical bits (the tests check this).
///
/// Panel and epilogue conventions (shared by every path):
/// - `w`: one panel (kernels/packed_weights.hpp), K reduction steps × 32 lanes;
/// - `x`: `rows` activation rows of length K, row stride `ldx`;
/// - silu = true:  out[r][c] = SiLU(acc[r][c])·acc[r][16 + c], c < ncols ≤ 16;
///   silu = false: out[r][c] = acc[r][c], c < ncols ≤ 32.

#include <cmath>

#include "../bf16_vectors.hpp"
#include "../vec_math.hpp"

namespace apex::packed::detail {

inline float panel_weight(const float* w, Index k, Index lane) { return w[k * 32 + lane]; }
inline float panel_weight(const bf16* w, Index k, Index lane) {
  return to_float(w[(k >> 1) * 64 + lane * 2 + (k & 1)]);
}

/// Writes one row's 32 accumulators through the epilogue.
inline void store_row_scalar(const float* acc, float* out, Index ncols, bool silu) {
  if (silu)
    for (Index c = 0; c < ncols; ++c) out[c] = silu_mul_scalar(acc[c], acc[16 + c]);
  else
    for (Index c = 0; c < ncols; ++c) out[c] = acc[c];
}

/// out (rows × ncols, stride ldo) = epilogue(x (rows × K) · panel).
template <class W>
void panel_scalar(const W* w, Index K, const float* x, Index ldx, Index rows, float* out, Index ldo, Index ncols,
                  bool silu) {
  for (Index r = 0; r < rows; ++r) {
    float acc[32] = {};  // 32 lanes of one row
    for (Index k = 0; k < K; ++k) {
      const float xv = x[r * ldx + k];
      for (Index lane = 0; lane < 32; ++lane) acc[lane] = std::fma(xv, panel_weight(w, k, lane), acc[lane]);
    }
    store_row_scalar(acc, out + r * ldo, ncols, silu);
  }
}

}  // namespace apex::packed::detail
