#pragma once
/// \file quant/quantize_q8_k.hpp
/// Q8_K: super-blocks of 256 weights, value d·q with a float d and
/// q ∈ [−127, 127]; bsums[g] = Σ q over weights 16g..16g+15, which the
/// K-quant dot products use for their min terms. The element of largest
/// magnitude, with its sign, maps to −127 (d = max/−127). Bit-identical to
/// ggml's quantize_row_q8_K_ref / dequantize_row_q8_K: q = min(127,
/// nearest_int(x·(−127/max))) (ties to even), d = 1/iscale. An all-zero
/// super-block gets d = 0 and q = 0; its bsums are written as 0 (ggml leaves
/// them untouched; 0 is their sum).

#include <cmath>
#include <cstdint>
#include <cstring>

#include "blocks.hpp"
#include "k_quant_search.hpp"

namespace apex::quant {

APEX_QUANT_FP_STRICT_BEGIN

/// Quantizes k floats (a multiple of kQKK) into k/256 super-blocks.
inline void quantize_row_q8_k(const float* x, BlockQ8_K* y, Index k) {
  APEX_QUANT_FP_STRICT_SCOPE
  const Index nb = detail::blocks_in_row("apex::quant::quantize_row_q8_k", k, kQKK, "q8_k super-block");
  for (Index i = 0; i < nb; ++i, x += kQKK) {
    float max = 0, amax = 0;
    for (int j = 0; j < kQKK; ++j) {
      const float ax = std::fabs(x[j]);
      if (ax > amax) {
        amax = ax;
        max = x[j];
      }
    }
    if (!amax) {
      std::memset(&y[i], 0, sizeof y[i]);
      continue;
    }
    const float iscale = -127.f / max;
    for (int j = 0; j < kQKK; ++j) {
      const int v = nearest_int(iscale * x[j]);
      y[i].qs[j] = static_cast<std::int8_t>(v < 127 ? v : 127);
    }
    for (int g = 0; g < kQKK / 16; ++g) {
      int sum = 0;
      for (int l = 0; l < 16; ++l) sum += y[i].qs[16 * g + l];
      y[i].bsums[g] = static_cast<std::int16_t>(sum);
    }
    y[i].d = 1 / iscale;
  }
}

/// y = d·q for each of the k/256 super-blocks.
inline void dequantize_row_q8_k(const BlockQ8_K* x, float* y, Index k) {
  APEX_QUANT_FP_STRICT_SCOPE
  const Index nb = detail::blocks_in_row("apex::quant::dequantize_row_q8_k", k, kQKK, "q8_k super-block");
  for (Index i = 0; i < nb; ++i) {
    for (int j = 0; j < kQKK; ++j) *y++ = x[i].d * x[i].qs[j];
  }
}

APEX_QUANT_FP_STRICT_END

}  // namespace apex::quant
