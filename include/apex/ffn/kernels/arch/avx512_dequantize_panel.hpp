#pragma once
/// \file kernels/arch/avx512_dequantize_panel.hpp
/// kernels/arch/avx2_dequantize_panel.hpp on 16-lane zmm vectors
/// (AVX-512F and BW): the same code rows, shifts, conversions and factor
/// products, 16 lanes at a time, so the same bytes.
///
/// A chunk costs about five vector operations per 8 or 16 floats (two
/// shifts, a conversion, a product, a store) and no shuffles, so on the
/// Zen 4 CPU here, which runs most zmm operations as two 256-bit halves,
/// zmm still pays through issuing half the instructions: a panel
/// (K = 2048, warm) dequantized 4-13 % faster than with the AVX2 form
/// (Q8_0 3.2 against 3.5 µs, Q6_K 4.5 against 5.2),
/// and the product of one row with cold weights 2-10 % faster. (The
/// transposed product's unpacker, bound by its transposes, did not gain.)
/// The per-lane factors are the AVX2 form's (chunk_factors_avx2).

#include <cstddef>

#include "../dequantize_panel.hpp"
#include "avx2_unpack_columns.hpp"

// GCC 12 reports its own `_mm512_undefined_*` placeholders (`__Y = __Y`) as
// maybe-uninitialized once they are inlined (GCC PR 105593, fixed in 13).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#if APEX_PACKED_X86
namespace apex::packed::detail {

APEX_QUANT_FP_STRICT_BEGIN

/// The 32-bit words of lanes l0 … l0 + 15 in row `row` of a slab.
APEX_TARGET_AVX512 APEX_KERNEL_INLINE inline __m512i slab_words16(const std::byte* slab, Index row, Index l0) {
  return _mm512_loadu_si512(slab + (row * kPanelLanes + l0) * 4);
}

/// Code rows 0 … 7 of chunk `chunk`, lanes l0 … l0 + 15 (code_rows_avx2 on zmm).
template <Dtype T>
APEX_TARGET_AVX512 void code_rows_avx512(const std::byte* codes, Index chunk, Index l0, __m512i* rows) {
  using W = WeightType<T>;
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  if constexpr (T == Dtype::q8_0) {
    for (int r = 0; r < 8; ++r) rows[r] = slab_words16(W::slab(codes, chunk), r, l0);
  } else if constexpr (T == Dtype::q6_k) {
    const std::byte* slab = W::slab(codes, chunk / 8);
    const Index h = chunk % 8;  // octs 4h … 4h + 3, 2-bit rows 2h, 2h + 1
    for (int r = 0; r < 8; ++r) {
      const Index g = 2 * h + r / 4;  // oct 4h + r/2 is oct (r/2) mod 2 of group g
      const __m512i raw = slab_words16(W::group_low(slab, g), r / 2 % 2, l0);
      const __m512i low = r % 2 ? _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4) : _mm512_and_si512(raw, m4);
      const __m512i high = slab_words16(W::group_high(slab, g), 0, l0);
      const __m512i two = _mm512_and_si512(_mm512_srli_epi16(high, unsigned(2 * (r % 4))), _mm512_set1_epi8(3));
      rows[r] = _mm512_sub_epi8(_mm512_or_si512(low, _mm512_slli_epi16(two, 4)), _mm512_set1_epi8(32));
    }
  } else {  // 4-bit codes: Q4_0, MXFP4 (block = chunk), Q4_K (sub-block chunk mod 8)
    static_assert(T == Dtype::q4_0 || T == Dtype::mxfp4 || T == Dtype::q4_k,
                  "code_rows_avx512: a block type without its code rows here (docs/inference.md, a new block type)");
    const std::byte* slab = W::slab(codes, T == Dtype::q4_k ? chunk / 8 : chunk);
    const Index o0 = T == Dtype::q4_k ? 4 * (chunk % 8) : 0;
    const __m512i v2 = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12));
    for (int i = 0; i < 4; ++i) {
      const __m512i raw = slab_words16(slab, o0 + i, l0);
      for (int half = 0; half < 2; ++half) {
        const __m512i q = half ? _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4) : _mm512_and_si512(raw, m4);
        if constexpr (T == Dtype::q4_0) rows[2 * i + half] = _mm512_sub_epi8(q, _mm512_set1_epi8(8));
        else if constexpr (T == Dtype::mxfp4) rows[2 * i + half] = _mm512_shuffle_epi8(v2, q);
        else rows[2 * i + half] = q;
      }
    }
  }
}

/// Column k of 16 lanes times their factor (minus their min: Q4_K).
template <Dtype T>
APEX_TARGET_AVX512 APEX_KERNEL_INLINE inline void store_column16(float* dst, __m512i q, __m512 factor, __m512 min) {
  __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(q), factor);
  if constexpr (WeightType<T>::kChunkMin) w = _mm512_sub_ps(w, min);
  _mm512_store_ps(dst, w);
}

/// Chunk `chunk` of one block-format panel of type T into dst (32 k × 32
/// lanes, 64-byte aligned): dequantize_chunk_scalar's bytes.
template <Dtype T>
APEX_TARGET_AVX512 void dequantize_chunk_avx512(const std::byte* codes, const std::byte* scales, Index chunk,
                                                float* dst) {
  APEX_QUANT_FP_STRICT_SCOPE
  constexpr Index L = kPanelLanes;
  ChunkFactors f;
  chunk_factors_avx2<T>(scales, chunk, f);
  for (Index l0 = 0; l0 < L; l0 += 16) {
    __m512i rows[8];  // row r: k = 4r … 4r + 3 of lanes l0 … l0 + 15, a byte each
    code_rows_avx512<T>(codes, chunk, l0, rows);
    const __m512 lo = _mm512_load_ps(f.lo + l0), hi = _mm512_load_ps(f.hi + l0), min = _mm512_load_ps(f.min + l0);
    for (int r = 0; r < 8; ++r) {
      const __m512 s = r < 4 ? lo : hi;  // k < 16: the first factor
      float* d = dst + 4 * r * L + l0;
      store_column16<T>(d, _mm512_srai_epi32(_mm512_slli_epi32(rows[r], 24), 24), s, min);
      store_column16<T>(d + L, _mm512_srai_epi32(_mm512_slli_epi32(rows[r], 16), 24), s, min);
      store_column16<T>(d + 2 * L, _mm512_srai_epi32(_mm512_slli_epi32(rows[r], 8), 24), s, min);
      store_column16<T>(d + 3 * L, _mm512_srai_epi32(rows[r], 24), s, min);
    }
  }
}

APEX_QUANT_FP_STRICT_END

}  // namespace apex::packed::detail
#endif
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
