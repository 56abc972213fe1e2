#pragma once
/// \file quant/quantize_q4_0.hpp
/// Q4_0: blocks of 32 weights, value d·(q − 8) with q ∈ [0, 15]. The
/// element of largest magnitude, with its sign, maps to q = 0: d = max/−8,
/// so that element is exactly −8·d and the opposite side reaches only +7·d.
/// Bit-identical to ggml's quantize_row_q4_0_ref / dequantize_row_q4_0:
/// q = min(15, int(x/d + 8.5)) (truncation, so ties round up), 1/d from the
/// float d. An all-zero block stores d = 0/−8 = −0 (half 0x8000) and codes 8.

#include <cmath>
#include <cstdint>

#include "blocks.hpp"
#include "half.hpp"

namespace apex::quant {

APEX_QUANT_FP_STRICT_BEGIN

/// Quantizes k floats (a multiple of kQK) into k/32 blocks.
inline void quantize_row_q4_0(const float* x, BlockQ4_0* y, Index k) {
  APEX_QUANT_FP_STRICT_SCOPE
  const Index nb = detail::blocks_in_row("apex::quant::quantize_row_q4_0", k, kQK, "q4_0 block");
  constexpr int half = kQK / 2;
  for (Index i = 0; i < nb; ++i, x += kQK) {
    float amax = 0.0f, max = 0.0f;  // first element of largest |x| wins
    for (int j = 0; j < kQK; ++j) {
      if (amax < std::fabs(x[j])) {
        amax = std::fabs(x[j]);
        max = x[j];
      }
    }
    const float d = max / -8;
    const float id = d ? 1.0f / d : 0.0f;
    y[i].d = fp32_to_fp16(d);
    const auto code = [id](float v) {
      const int q = static_cast<std::int8_t>(static_cast<int>(v * id + 8.5f));
      return static_cast<std::uint8_t>(q < 15 ? q : 15);
    };
    for (int j = 0; j < half; ++j) y[i].qs[j] = static_cast<std::uint8_t>(code(x[j]) | (code(x[j + half]) << 4));
  }
}

/// y = d·(q − 8) for each of the k/32 blocks.
inline void dequantize_row_q4_0(const BlockQ4_0* x, float* y, Index k) {
  APEX_QUANT_FP_STRICT_SCOPE
  const Index nb = detail::blocks_in_row("apex::quant::dequantize_row_q4_0", k, kQK, "q4_0 block");
  constexpr int half = kQK / 2;
  for (Index i = 0; i < nb; ++i, y += kQK) {
    const float d = fp16_to_fp32(x[i].d);
    for (int j = 0; j < half; ++j) {
      y[j] = ((x[i].qs[j] & 0x0F) - 8) * d;
      y[j + half] = ((x[i].qs[j] >> 4) - 8) * d;
    }
  }
}

APEX_QUANT_FP_STRICT_END

}  // namespace apex::quant
