#pragma once
/// \file kernels/arch/avx2_dequantize_panel.hpp
/// kernels/dequantize_panel.hpp on AVX2: 32 reduction steps of a
/// block-format panel as floats in the f32 panel order, the same bytes as
/// the portable dequantizer.
///
/// A slab row holds one 32-bit word of 4 consecutive k per lane
/// (kernels/quant_layout.hpp), so one vector holds those 4 k of 8 lanes.
/// The code rows of kernels/arch/avx2_unpack_columns.hpp turn them into
/// words of 4 signed code bytes (Q4_0's q − 8, MXFP4's v2[q], Q6_K's
/// q − 32 …); byte j of every word, sign-extended by two shifts, is code
/// k = 4r + j of the 8 lanes, already in the order the f32 panel stores
/// them: no transpose. Widened exactly (vcvtdq2ps), it is multiplied by the
/// lanes' factors (Q4_K: minus their min), computed 8 lanes at a time by the
/// scalar path's operations (chunk_factors_avx2), so the bytes are the same.
///
/// The AVX-512 paths run the same steps on zmm vectors
/// (kernels/arch/avx512_dequantize_panel.hpp).

#include <cstddef>

#include "../dequantize_panel.hpp"
#include "avx2_unpack_columns.hpp"

#if APEX_PACKED_X86
namespace apex::packed::detail {

APEX_QUANT_FP_STRICT_BEGIN

/// Column k = 4r + j of 8 lanes times their factor (minus their min: Q4_K),
/// q: the 8 codes sign-extended to int32.
template <Dtype T>
APEX_TARGET_AVX2 APEX_KERNEL_INLINE inline void store_column8(float* dst, __m256i q, __m256 factor, __m256 min) {
  __m256 w = _mm256_mul_ps(_mm256_cvtepi32_ps(q), factor);
  if constexpr (WeightType<T>::kChunkMin) w = _mm256_sub_ps(w, min);
  _mm256_store_ps(dst, w);
}

/// Chunk `chunk` of one block-format panel of type T into dst (32 k × 32
/// lanes, 64-byte aligned): dequantize_chunk_scalar's bytes.
template <Dtype T>
APEX_TARGET_AVX2 void dequantize_chunk_avx2(const std::byte* codes, const std::byte* scales, Index chunk,
                                            float* dst) {
  static_assert(TilesOn<T, Isa::avx2>::check());
  APEX_QUANT_FP_STRICT_SCOPE
  constexpr Index L = kPanelLanes;
  ChunkFactors f;
  chunk_factors_avx2<T>(scales, chunk, f);
  for (Index l0 = 0; l0 < L; l0 += 8) {
    __m256i rows[8];  // row r: k = 4r … 4r + 3 of lanes l0 … l0 + 7, a byte each
    code_rows_avx2<T>(codes, chunk, l0, rows);
    const __m256 lo = _mm256_load_ps(f.lo + l0), hi = _mm256_load_ps(f.hi + l0), min = _mm256_load_ps(f.min + l0);
    for (int r = 0; r < 8; ++r) {
      const __m256 s = r < 4 ? lo : hi;  // k < 16: the first factor
      float* d = dst + 4 * r * L + l0;
      store_column8<T>(d, _mm256_srai_epi32(_mm256_slli_epi32(rows[r], 24), 24), s, min);
      store_column8<T>(d + L, _mm256_srai_epi32(_mm256_slli_epi32(rows[r], 16), 24), s, min);
      store_column8<T>(d + 2 * L, _mm256_srai_epi32(_mm256_slli_epi32(rows[r], 8), 24), s, min);
      store_column8<T>(d + 3 * L, _mm256_srai_epi32(rows[r], 24), s, min);
    }
  }
}

APEX_QUANT_FP_STRICT_END

}  // namespace apex::packed::detail
#endif
