#pragma once
/// \file kernels/quant_activations.hpp
/// The activations of a block-format product, quantized per block as ggml's
/// `vec_dot_type` does: Q8_0 (32 codes, fp16 scale; for Q8_0, Q4_0, MXFP4
/// weights) or Q8_K (256 codes, float scale; for Q4_K, Q6_K), bit for bit
/// ggml's reference quantizers (quant/: the scalar path runs them, the SIMD
/// paths their vector form, kernels/arch/avx2_quant_activations.hpp), once
/// per matrix and row, into a per-thread scratch the panels of that matrix
/// then read (kernels/quant_layout.hpp: QuantRows).
///
/// The rounding of the activations is part of the product's error (docs/
/// quantized_formats.md): ≈ 2⁻⁸ of a block's largest |x| per element. A
/// Q8_0 block whose largest |x| exceeds 127·65504 ≈ 8.3e6 overflows its
/// fp16 scale (ggml's format), and its products become ±Inf or NaN.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "../core/checked_size.hpp"
#include "../quant/formats.hpp"
#include "aligned_array.hpp"
#include "arch/avx2_quant_activations.hpp"
#include "isa.hpp"
#include "quant_layout.hpp"

namespace apex::packed::detail {

struct QuantScratch {
  AlignedArray<std::int8_t> q;    // rows × K
  AlignedArray<float> d;          // rows × K / block
  AlignedArray<std::int32_t> s16; // rows × K / 16
};
inline QuantScratch& quant_scratch() {
  thread_local QuantScratch s;
  return s;
}

/// Whether x[0..n) holds only finite values.
inline bool all_finite(const float* x, Index n) {
  for (Index i = 0; i < n; ++i)
    if (!std::isfinite(x[i])) return false;
  return true;
}

/// One block of B activations: ggml's reference quantizer, except that a
/// block holding NaN or Inf gets codes 0 and a NaN scale (the quantizer
/// would convert NaN to an integer, which is undefined), so the products
/// it enters are NaN, as float products would be.
template <class Block, Index B, class Quantize, class Scale>
void quantize_block(const float* x, std::int8_t* q, float* d, Quantize quantize, Scale scale) {
  if (!all_finite(x, B)) {
    for (Index k = 0; k < B; ++k) q[k] = 0;
    *d = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  Block blk;
  quantize(x, &blk, B);
  *d = scale(blk);
  for (Index k = 0; k < B; ++k) q[k] = blk.qs[k];
}

/// One row: codes, scales and sums of 16 of x[0..K) in format `fmt`, on
/// path `isa` (every path gives the same bytes).
inline void quantize_row(Isa isa, ActivationFormat fmt, const float* x, Index K, std::int8_t* q, float* d,
                         std::int32_t* s16) {
  const bool vector = APEX_PACKED_X86 && isa != Isa::scalar;
  if (fmt == ActivationFormat::q8_0) {
    for (Index b = 0; b < K / 32; ++b) {
#if APEX_PACKED_X86
      if (vector && quantize_q8_0_block_avx2(x + 32 * b, q + 32 * b, d + b)) continue;
#endif
      quantize_block<quant::BlockQ8_0, 32>(x + 32 * b, q + 32 * b, d + b, quant::quantize_row_q8_0,
                                            [](const quant::BlockQ8_0& blk) { return quant::fp16_to_fp32(blk.d); });
    }
  } else {
    for (Index b = 0; b < K / 256; ++b) {
#if APEX_PACKED_X86
      if (vector && quantize_q8_k_block_avx2(x + 256 * b, q + 256 * b, d + b)) continue;
#endif
      quantize_block<quant::BlockQ8_K, 256>(x + 256 * b, q + 256 * b, d + b, quant::quantize_row_q8_k,
                                             [](const quant::BlockQ8_K& blk) { return blk.d; });
    }
  }
  (void)vector;
  for (Index g = 0; g < K / 16; ++g) {  // Q8_K's bsums, and the same sums for Q8_0
    std::int32_t s = 0;
    for (Index k = 16 * g; k < 16 * g + 16; ++k) s += q[k];
    s16[g] = s;
  }
}

/// The reference row: ggml's scalar quantizers.
inline void quantize_row(ActivationFormat fmt, const float* x, Index K, std::int8_t* q, float* d, std::int32_t* s16) {
  quantize_row(Isa::scalar, fmt, x, K, q, d, s16);
}

/// rows × K activations (row stride ldx; K whole blocks of `fmt`) quantized
/// into the thread's scratch, on path `isa`; codes and scales followed by
/// zero rows up to a multiple of `row_multiple` (16 for the AMX-INT8 tiles,
/// which read whole 16-row tiles: kernels/arch/amx_int8_quant.hpp).
inline QuantRows quantize_rows(Isa isa, ActivationFormat fmt, const float* x, Index ldx, Index rows, Index K,
                               Index row_multiple = 1) {
  constexpr const char* where = "packed::quantize_rows";
  const Index block = fmt == ActivationFormat::q8_0 ? 32 : 256;
  QuantScratch& s = quant_scratch();
  const Index padded = (rows + row_multiple - 1) / row_multiple * row_multiple;
  std::int8_t* q = grow(s.q, apex::detail::checked_product(where, "rows x K", {padded, K}));
  float* d = grow(s.d, apex::detail::checked_product(where, "rows x blocks", {padded, K / block}));
  std::int32_t* s16 = grow(s.s16, apex::detail::checked_product(where, "rows x K/16", {rows, K / 16}));
  for (Index r = 0; r < rows; ++r)
    quantize_row(isa, fmt, x + r * ldx, K, q + r * K, d + r * (K / block), s16 + r * (K / 16));
  std::fill(q + rows * K, q + padded * K, std::int8_t{0});
  std::fill(d + rows * (K / block), d + padded * (K / block), 0.0f);
  return {q, K, d, K / block, s16, K / 16};
}

}  // namespace apex::packed::detail
