#pragma once
/// \file quant/quantize_mxfp4.hpp
/// MXFP4 (OCP microscaling FP4): blocks of 32 E2M1 values sharing one E8M0
/// exponent e; value 2^(e−128)·kMxfp4Values[q] (the table is the E2M1 value
/// doubled, hence e − 128 rather than e − 127). Bit-identical to ggml's
/// quantize_row_mxfp4_ref / dequantize_row_mxfp4:
/// - e = floor(log2f(amax)) − 2 + 127, so amax/2^(e−128) ∈ [8, 16) and the
///   largest element lands on the codes 8 or 12 (E2M1 4 or 6); an all-zero
///   block gets e = 0;
/// - each element takes the code of least |value − x|, the lowest code on a
///   tie (so +0 over −0, and the smaller magnitude between two neighbours).
/// log2f is the C library's, as in ggml.

#include <cmath>
#include <cstdint>

#include "blocks.hpp"
#include "half.hpp"

namespace apex::quant {

APEX_QUANT_FP_STRICT_BEGIN

namespace detail {

/// The code whose value kMxfp4Values[code]·scale is nearest x (lowest code on ties).
inline std::uint8_t mxfp4_code(float x, float scale) {
  APEX_QUANT_FP_STRICT_SCOPE
  int best = 0;
  float best_err = std::fabs(kMxfp4Values[0] * scale - x);
  for (int i = 1; i < 16; ++i) {
    const float err = std::fabs(kMxfp4Values[i] * scale - x);
    if (err < best_err) {
      best = i;
      best_err = err;
    }
  }
  return static_cast<std::uint8_t>(best);
}

}  // namespace detail

/// Quantizes k floats (a multiple of kQK) into k/32 blocks.
inline void quantize_row_mxfp4(const float* x, BlockMXFP4* y, Index k) {
  APEX_QUANT_FP_STRICT_SCOPE
  const Index nb = detail::blocks_in_row("apex::quant::quantize_row_mxfp4", k, kQK, "mxfp4 block");
  constexpr int half = kQK / 2;
  for (Index i = 0; i < nb; ++i, x += kQK) {
    float amax = 0.0f;
    for (int j = 0; j < kQK; ++j) {
      if (amax < std::fabs(x[j])) amax = std::fabs(x[j]);
    }
    // Through int, as ggml's float → uint8_t conversion compiles: a block
    // below 2^-125 wraps modulo 256 rather than being undefined.
    const std::uint8_t e =
        amax > 0.0f ? static_cast<std::uint8_t>(static_cast<int>(std::floor(std::log2(amax)) - 2 + 127)) : 0;
    const float scale = e8m0_to_fp32_half(e);
    y[i].e = e;
    for (int j = 0; j < half; ++j) {
      y[i].qs[j] = static_cast<std::uint8_t>(detail::mxfp4_code(x[j], scale) |
                                             (detail::mxfp4_code(x[j + half], scale) << 4));
    }
  }
}

/// y = 2^(e−128)·kMxfp4Values[q] for each of the k/32 blocks.
inline void dequantize_row_mxfp4(const BlockMXFP4* x, float* y, Index k) {
  APEX_QUANT_FP_STRICT_SCOPE
  const Index nb = detail::blocks_in_row("apex::quant::dequantize_row_mxfp4", k, kQK, "mxfp4 block");
  constexpr int half = kQK / 2;
  for (Index i = 0; i < nb; ++i, y += kQK) {
    const float scale = e8m0_to_fp32_half(x[i].e);
    for (int j = 0; j < half; ++j) {
      y[j] = kMxfp4Values[x[i].qs[j] & 0x0F] * scale;
      y[j + half] = kMxfp4Values[x[i].qs[j] >> 4] * scale;
    }
  }
}

APEX_QUANT_FP_STRICT_END

/// Whether every value 2^(e−128)·kMxfp4Values[q] of block x (ggml's
/// decoding, e8m0_to_fp32_half) is a finite float: the products are exact,
/// so false exactly when one reaches 2^128 — e = 255 (scale 2^127) with a
/// doubled code value |v| ≥ 2, e = 254 with |v| ≥ 4, e = 253 with |v| ≥ 8
/// (E2M1 1, 2, 4); every e ≤ 252 is finite (12·2^124 < 2^128). ggml's
/// quantizer never makes such a block from finite floats (e ≤ 252 at the
/// top; the e = 255 it gives blocks of |w| ≈ 2^-126 holds codes 0), but a
/// file can hold one, and the library refuses it wherever one enters.
inline bool mxfp4_block_finite(const BlockMXFP4& x) {
  if (x.e < 253) return true;
  int top = 0;
  for (const std::uint8_t byte : x.qs)
    for (const int code : {byte & 7, (byte >> 4) & 7}) top = kMxfp4Values[code] > top ? kMxfp4Values[code] : top;
  return std::isfinite(float(top) * e8m0_to_fp32_half(x.e));
}

}  // namespace apex::quant
