#pragma once
/// \file quant/quantize_q4_k.hpp
/// Q4_K: super-blocks of 256 weights in 8 sub-blocks of 32, value
/// d·sc_j·q − dmin·m_j with q ∈ [0, 15] and 6-bit sc_j, m_j (4.5 bits per
/// weight). Bit-identical to ggml's quantize_row_q4_K_ref /
/// dequantize_row_q4_K:
/// 1. each sub-block gets a scale and min from make_qkx2_quants (nmax 15,
///    weights av + |x| with av the sub-block's RMS, 21 trial scales from
///    (14 + 0.1·is)/range);
/// 2. scales and mins are coded in 6 bits against their maxima:
///    sc_j = min(63, nearest_int(63·scale_j/max_scale)), d = half(max_scale/63),
///    likewise m_j and dmin;
/// 3. codes are recomputed against the stored (rounded) d·sc_j and
///    dmin·m_j: q = clamp(nearest_int((x + dmin·m_j)/(d·sc_j)), 0, 15);
///    a sub-block whose d·sc_j is 0 keeps the codes of step 1.

#include <cmath>
#include <cstdint>

#include "blocks.hpp"
#include "half.hpp"
#include "k_quant_search.hpp"

namespace apex::quant {

APEX_QUANT_FP_STRICT_BEGIN

namespace detail {

/// Writes sub-block j's 6-bit scale and min into the 12 packed bytes
/// (the inverse of q4_k_scale_min; j in ascending order, as bytes j − 4
/// and j gain their top bits after sub-blocks 0..3 wrote them).
inline void q4_k_pack_scale_min(int j, std::uint8_t ls, std::uint8_t lm, std::uint8_t* scales) {
  if (j < 4) {
    scales[j] = ls;
    scales[j + 4] = lm;
  } else {
    scales[j + 4] = static_cast<std::uint8_t>((ls & 0xF) | ((lm & 0xF) << 4));
    scales[j - 4] = static_cast<std::uint8_t>(scales[j - 4] | ((ls >> 4) << 6));
    scales[j] = static_cast<std::uint8_t>(scales[j] | ((lm >> 4) << 6));
  }
}

/// One super-block (steps 1–3 above) of 256 floats into `y`.
inline void quantize_q4_k_block(const float* x, BlockQ4_K& y) {
  APEX_QUANT_FP_STRICT_SCOPE
  std::uint8_t L[256], Laux[32];
  float weights[32], mins[8], scales[8];
  float max_scale = 0, max_min = 0;  // scales and mins are ≥ 0 once the min is subtracted
  for (int j = 0; j < 8; ++j) {
    const float* xs = x + 32 * j;
    float sum_x2 = 0;
    for (int l = 0; l < 32; ++l) sum_x2 += xs[l] * xs[l];
    const float av_x = std::sqrt(sum_x2 / 32);
    for (int l = 0; l < 32; ++l) weights[l] = av_x + std::fabs(xs[l]);
    scales[j] = make_qkx2_quants(32, 15, xs, weights, L + 32 * j, &mins[j], Laux, -1.f, 0.1f, 20, false);
    if (scales[j] > max_scale) max_scale = scales[j];
    if (mins[j] > max_min) max_min = mins[j];
  }
  const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
  const float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
  for (int j = 0; j < 8; ++j) {
    // nearest_int's int narrowed to uint8_t before the clamp, as in ggml.
    const auto ls = static_cast<std::uint8_t>(nearest_int(inv_scale * scales[j]));
    const auto lm = static_cast<std::uint8_t>(nearest_int(inv_min * mins[j]));
    q4_k_pack_scale_min(j, ls < 63 ? ls : 63, lm < 63 ? lm : 63, y.scales);
  }
  y.d = fp32_to_fp16(max_scale / 63.f);
  y.dmin = fp32_to_fp16(max_min / 63.f);
  for (int j = 0; j < 8; ++j) {
    std::uint8_t sc, m;
    q4_k_scale_min(j, y.scales, sc, m);
    const float d = fp16_to_fp32(y.d) * sc;
    if (!d) continue;
    const float dm = fp16_to_fp32(y.dmin) * m;
    for (int l = 0; l < 32; ++l) {
      const int q = nearest_int((x[32 * j + l] + dm) / d);
      L[32 * j + l] = static_cast<std::uint8_t>(q < 0 ? 0 : (q > 15 ? 15 : q));
    }
  }
  for (int g = 0; g < 4; ++g) {
    for (int l = 0; l < 32; ++l) y.qs[32 * g + l] = static_cast<std::uint8_t>(L[64 * g + l] | (L[64 * g + 32 + l] << 4));
  }
}

}  // namespace detail

/// Quantizes k floats (a multiple of kQKK) into k/256 super-blocks.
inline void quantize_row_q4_k(const float* x, BlockQ4_K* y, Index k) {
  const Index nb = detail::blocks_in_row("apex::quant::quantize_row_q4_k", k, kQKK, "q4_k super-block");
  for (Index i = 0; i < nb; ++i) detail::quantize_q4_k_block(x + i * kQKK, y[i]);
}

/// y = d·sc_j·q − dmin·m_j for each of the k/256 super-blocks.
inline void dequantize_row_q4_k(const BlockQ4_K* x, float* y, Index k) {
  APEX_QUANT_FP_STRICT_SCOPE
  const Index nb = detail::blocks_in_row("apex::quant::dequantize_row_q4_k", k, kQKK, "q4_k super-block");
  for (Index i = 0; i < nb; ++i) {
    const float d = fp16_to_fp32(x[i].d);
    const float dmin = fp16_to_fp32(x[i].dmin);
    const std::uint8_t* q = x[i].qs;
    for (int g = 0; g < 4; ++g, q += 32) {
      std::uint8_t sc, m;
      q4_k_scale_min(2 * g, x[i].scales, sc, m);
      const float d1 = d * sc, m1 = dmin * m;
      q4_k_scale_min(2 * g + 1, x[i].scales, sc, m);
      const float d2 = d * sc, m2 = dmin * m;
      for (int l = 0; l < 32; ++l) *y++ = d1 * (q[l] & 0xF) - m1;
      for (int l = 0; l < 32; ++l) *y++ = d2 * (q[l] >> 4) - m2;
    }
  }
}

APEX_QUANT_FP_STRICT_END

}  // namespace apex::quant
