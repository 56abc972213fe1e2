#pragma once
/// \file quant/quantize_q6_k.hpp
/// Q6_K: super-blocks of 256 weights in 16 sub-blocks of 16, value
/// d·s_j·(q − 32) with q ∈ [0, 63] and a signed 8-bit s_j (6.5625 bits per
/// weight). Bit-identical to ggml's quantize_row_q6_K_ref /
/// dequantize_row_q6_K:
/// 1. each sub-block gets a signed scale from make_qx_quants (nmax 32,
///    weights x², 18 trial scales around −32/max);
/// 2. the scale of largest magnitude, with its sign, maps to −128:
///    d = half(max_scale/−128), s_j = min(127, nearest_int(−128·scale_j/max_scale));
///    a super-block whose scales are all below 1e-15 is stored as zeros;
/// 3. codes are recomputed against the stored d·s_j:
///    q = clamp(nearest_int(x/(d·s_j)), −32, 31) + 32; a sub-block whose
///    d·s_j is 0 keeps the codes of step 1.

#include <cmath>
#include <cstdint>
#include <cstring>

#include "blocks.hpp"
#include "half.hpp"
#include "k_quant_search.hpp"

namespace apex::quant {

APEX_QUANT_FP_STRICT_BEGIN

namespace detail {

/// The 256 codes L (0..63) into ql/qh (layout in BlockQ6_K).
inline void q6_k_pack(const std::int8_t* L, BlockQ6_K& y) {
  std::uint8_t* ql = y.ql;
  std::uint8_t* qh = y.qh;
  for (int j = 0; j < 256; j += 128, ql += 64, qh += 32) {
    for (int l = 0; l < 32; ++l) {
      const int q1 = L[j + l], q2 = L[j + l + 32], q3 = L[j + l + 64], q4 = L[j + l + 96];
      ql[l] = static_cast<std::uint8_t>((q1 & 0xF) | ((q3 & 0xF) << 4));
      ql[l + 32] = static_cast<std::uint8_t>((q2 & 0xF) | ((q4 & 0xF) << 4));
      qh[l] = static_cast<std::uint8_t>((q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6));
    }
  }
}

/// One super-block (steps 1–3 above) of 256 floats into `y`.
inline void quantize_q6_k_block(const float* x, BlockQ6_K& y) {
  APEX_QUANT_FP_STRICT_SCOPE
  std::int8_t L[256];
  float scales[16];
  float max_scale = 0, max_abs_scale = 0;
  for (int ib = 0; ib < 16; ++ib) {
    scales[ib] = make_qx_quants(16, 32, x + 16 * ib, L + 16 * ib, 1, nullptr);
    const float abs_scale = std::fabs(scales[ib]);
    if (abs_scale > max_abs_scale) {
      max_abs_scale = abs_scale;
      max_scale = scales[ib];
    }
  }
  if (max_abs_scale < kGroupMaxEps) {
    std::memset(&y, 0, sizeof y);
    y.d = fp32_to_fp16(0.f);
    return;
  }
  const float iscale = -128.f / max_scale;
  y.d = fp32_to_fp16(1 / iscale);
  for (int ib = 0; ib < 16; ++ib) {
    const int s = nearest_int(iscale * scales[ib]);
    y.scales[ib] = static_cast<std::int8_t>(s < 127 ? s : 127);
  }
  for (int j = 0; j < 16; ++j) {
    const float d = fp16_to_fp32(y.d) * y.scales[j];
    if (!d) continue;
    for (int l = 0; l < 16; ++l) {
      const int q = nearest_int(x[16 * j + l] / d);
      L[16 * j + l] = static_cast<std::int8_t>((q < -32 ? -32 : (q > 31 ? 31 : q)) + 32);
    }
  }
  q6_k_pack(L, y);
}

}  // namespace detail

/// Quantizes k floats (a multiple of kQKK) into k/256 super-blocks.
inline void quantize_row_q6_k(const float* x, BlockQ6_K* y, Index k) {
  const Index nb = detail::blocks_in_row("apex::quant::quantize_row_q6_k", k, kQKK, "q6_k super-block");
  for (Index i = 0; i < nb; ++i) detail::quantize_q6_k_block(x + i * kQKK, y[i]);
}

/// y = d·s_j·(q − 32) for each of the k/256 super-blocks.
inline void dequantize_row_q6_k(const BlockQ6_K* x, float* y, Index k) {
  APEX_QUANT_FP_STRICT_SCOPE
  const Index nb = detail::blocks_in_row("apex::quant::dequantize_row_q6_k", k, kQKK, "q6_k super-block");
  for (Index i = 0; i < nb; ++i) {
    const float d = fp16_to_fp32(x[i].d);
    const std::uint8_t* ql = x[i].ql;
    const std::uint8_t* qh = x[i].qh;
    const std::int8_t* sc = x[i].scales;
    for (int n = 0; n < 256; n += 128, y += 128, ql += 64, qh += 32, sc += 8) {
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        y[l] = d * sc[is] * q1;
        y[l + 32] = d * sc[is + 2] * q2;
        y[l + 64] = d * sc[is + 4] * q3;
        y[l + 96] = d * sc[is + 6] * q4;
      }
    }
  }
}

APEX_QUANT_FP_STRICT_END

}  // namespace apex::quant
