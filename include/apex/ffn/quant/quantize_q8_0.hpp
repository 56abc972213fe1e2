#pragma once
/// \file quant/quantize_q8_0.hpp
/// Q8_0: blocks of 32 weights, value d·q with q ∈ [−127, 127] and d the
/// block's absolute maximum over 127, stored as a half. Bit-identical to
/// ggml's quantize_row_q8_0_ref / dequantize_row_q8_0: q = roundf(x/d)
/// (ties away from zero) with 1/d taken from the float d, not from the
/// stored half.

#include <cmath>
#include <cstdint>

#include "blocks.hpp"
#include "half.hpp"

namespace apex::quant {

APEX_QUANT_FP_STRICT_BEGIN

/// Quantizes k floats (a multiple of kQK) into k/32 blocks.
inline void quantize_row_q8_0(const float* x, BlockQ8_0* y, Index k) {
  APEX_QUANT_FP_STRICT_SCOPE
  const Index nb = detail::blocks_in_row("apex::quant::quantize_row_q8_0", k, kQK, "q8_0 block");
  for (Index i = 0; i < nb; ++i, x += kQK) {
    float amax = 0.0f;
    for (int j = 0; j < kQK; ++j) {
      const float a = std::fabs(x[j]);
      amax = amax > a ? amax : a;  // ggml's MAX(amax, |x|), NaN handling included
    }
    const float d = amax / 127;
    const float id = d ? 1.0f / d : 0.0f;
    y[i].d = fp32_to_fp16(d);
    for (int j = 0; j < kQK; ++j) y[i].qs[j] = static_cast<std::int8_t>(static_cast<int>(std::round(x[j] * id)));
  }
}

/// y = d·q for each of the k/32 blocks.
inline void dequantize_row_q8_0(const BlockQ8_0* x, float* y, Index k) {
  APEX_QUANT_FP_STRICT_SCOPE
  const Index nb = detail::blocks_in_row("apex::quant::dequantize_row_q8_0", k, kQK, "q8_0 block");
  for (Index i = 0; i < nb; ++i) {
    const float d = fp16_to_fp32(x[i].d);
    for (int j = 0; j < kQK; ++j) *y++ = x[i].qs[j] * d;
  }
}

APEX_QUANT_FP_STRICT_END

}  // namespace apex::quant
