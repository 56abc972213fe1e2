#pragma once
/// \file kernels/arch/avx512_unpack_columns.hpp
/// kernels/unpack_columns.hpp on AVX-512 (F + BW): the AVX2 unpacker's
/// steps (kernels/arch/avx2_unpack_columns.hpp) on 16 lanes a vector, so a
/// panel's code rows are two loads per row instead of four, and each lane's
/// 32 codes are widened as two 16-float vectors. The same codes, the same
/// factors (computed by the same operations), the same IEEE products and
/// differences: the same bytes as the portable unpacker.
///
/// Float types run the AVX2 unpacker (every AVX-512 CPU has AVX2): their
/// chunk is a widening and a transpose, which 8 × 8 blocks do as well.

#include <cstddef>
#include <cstdint>

#include "../unpack_columns.hpp"
#include "avx2_unpack_columns.hpp"
#include "avx512_quant.hpp"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#if APEX_PACKED_X86
namespace apex::packed::detail {

APEX_QUANT_FP_STRICT_BEGIN

/// r[0 … 7]: code rows of 16 lanes; writes lane i's 8 words (32 codes in k
/// order) to q[i]. An 8 × 16 transpose of 32-bit words: the AVX2 steps in
/// each 128-bit part, then the two halves of a lane joined across parts.
APEX_TARGET_AVX512 inline void store_lane_codes512(__m512i* r, std::int8_t (*q)[kChunkColumns]) {
  __m512i t[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {  // r[i + j], part p: words i … i + 3 of lane 4p + j
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  const __m512i parts01 = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), parts23 = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
  for (int j = 0; j < 4; ++j) {
    const __m512i a = _mm512_permutex2var_epi64(r[j], parts01, r[j + 4]);  // lane j | lane 4 + j
    const __m512i b = _mm512_permutex2var_epi64(r[j], parts23, r[j + 4]);  // lane 8 + j | lane 12 + j
    _mm256_store_si256(reinterpret_cast<__m256i*>(q[j]), _mm512_castsi512_si256(a));
    _mm256_store_si256(reinterpret_cast<__m256i*>(q[j + 4]), _mm512_extracti64x4_epi64(a, 1));
    _mm256_store_si256(reinterpret_cast<__m256i*>(q[j + 8]), _mm512_castsi512_si256(b));
    _mm256_store_si256(reinterpret_cast<__m256i*>(q[j + 12]), _mm512_extracti64x4_epi64(b, 1));
  }
}

/// The factors of chunk `chunk` of a block-format panel, 16 lanes a step.
template <Dtype T>
APEX_TARGET_AVX512 void chunk_factors512(const std::byte* scales, Index chunk, ChunkFactors& f) {
  using W = WeightType<T>;
  for (int v = 0; v < 2; ++v) {  // lanes 16v … 16v + 15
    __m512 lo, hi, min = _mm512_setzero_ps();
    if constexpr (T == Dtype::q4_k) {
      const std::byte* a = W::area(scales, chunk / 8);
      __m512i sc, m;
      q4_k_scale_min16(a + W::kScalePlanes + 16 * v, int(chunk % 8), sc, m);
      lo = hi = _mm512_mul_ps(load_fp16x16(a + 32 * v), _mm512_cvtepi32_ps(sc));
      min = _mm512_mul_ps(load_fp16x16(a + W::kDminPlane + 32 * v), _mm512_cvtepi32_ps(m));
    } else if constexpr (T == Dtype::q6_k) {
      const std::byte* a = W::area(scales, chunk / 8);
      const std::byte* group = a + W::kScalePlanes + 2 * (chunk % 8) * kPanelLanes + 16 * v;
      const __m512 d = load_fp16x16(a + 32 * v);
      lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(load_i8x16(group)));
      hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(load_i8x16(group + kPanelLanes)));
    } else {
      lo = hi = block32_scale512<T>(W::area(scales, chunk), v);
    }
    _mm512_store_ps(f.lo + 16 * v, lo);
    _mm512_store_ps(f.hi + 16 * v, hi);
    _mm512_store_ps(f.min + 16 * v, min);
  }
}

/// Code rows 0 … 7 of chunk `chunk`, lanes 16v … 16v + 15 (the AVX2
/// unpacker's rows, kernels/arch/avx2_unpack_columns.hpp).
template <Dtype T>
APEX_TARGET_AVX512 void code_rows512(const std::byte* codes, Index chunk, int v, __m512i* rows) {
  using W = WeightType<T>;
  if constexpr (T == Dtype::q8_0) {
    for (int r = 0; r < 8; ++r) rows[r] = load_half512(W::slab(codes, chunk), r, v);
  } else if constexpr (T == Dtype::q6_k) {
    const std::byte* slab = W::slab(codes, chunk / 8);
    const Index h = chunk % 8;  // octs 4h … 4h + 3, 2-bit rows 2h, 2h + 1
    for (int r = 0; r < 8; ++r) {
      const __m512i raw = load_half512(slab, 4 * h + r / 2, v);
      const __m512i low = r % 2 ? high_nibbles512(raw) : low_nibbles512(raw);
      const __m512i two = _mm512_and_si512(_mm512_srli_epi16(load_half512(slab + W::kHighBits, 2 * h + r / 4, v), 2 * (r % 4)),
                                           _mm512_set1_epi8(3));
      rows[r] = _mm512_sub_epi8(_mm512_or_si512(low, _mm512_slli_epi16(two, 4)), _mm512_set1_epi8(32));
    }
  } else {  // 4-bit codes: Q4_0, MXFP4 (block = chunk), Q4_K (sub-block chunk mod 8)
    const std::byte* slab = W::slab(codes, T == Dtype::q4_k ? chunk / 8 : chunk);
    const Index o0 = T == Dtype::q4_k ? 4 * (chunk % 8) : 0;
    const __m512i v2 = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12));
    for (int i = 0; i < 4; ++i) {
      const __m512i raw = load_half512(slab, o0 + i, v);
      for (int half = 0; half < 2; ++half) {
        const __m512i q = half ? high_nibbles512(raw) : low_nibbles512(raw);
        if constexpr (T == Dtype::q4_0) rows[2 * i + half] = _mm512_sub_epi8(q, _mm512_set1_epi8(8));
        else if constexpr (T == Dtype::mxfp4) rows[2 * i + half] = _mm512_shuffle_epi8(v2, q);
        else rows[2 * i + half] = q;
      }
    }
  }
}

/// A block-format chunk: codes per lane in k order, then the factors.
template <Dtype T>
APEX_TARGET_AVX512 void unpack_block512(const std::byte* codes, const std::byte* scales, Index chunk, float* dst) {
  APEX_QUANT_FP_STRICT_SCOPE
  alignas(64) std::int8_t q[kPanelLanes][kChunkColumns];  // lane × k
  for (int v = 0; v < 2; ++v) {
    __m512i rows[8];
    code_rows512<T>(codes, chunk, v, rows);
    store_lane_codes512(rows, q + 16 * v);
  }
  ChunkFactors f;
  chunk_factors512<T>(scales, chunk, f);
  for (Index l = 0; l < kPanelLanes; ++l) {
    for (int v = 0; v < 2; ++v) {  // columns 16v … 16v + 15
      const __m128i q16 = _mm_load_si128(reinterpret_cast<const __m128i*>(q[l] + 16 * v));
      __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q16)), _mm512_set1_ps(v ? f.hi[l] : f.lo[l]));
      if constexpr (T == Dtype::q4_k) w = _mm512_sub_ps(w, _mm512_set1_ps(f.min[l]));
      _mm512_store_ps(dst + l * kChunkColumns + 16 * v, w);
    }
  }
}

/// Chunk `chunk` of one panel of type T into dst: unpack_columns_scalar's bytes.
template <Dtype T>
APEX_TARGET_AVX512 void unpack_columns512(const typename WeightType<T>::Element* codes, const std::byte* scales,
                                          Index K, Index chunk, float* dst) {
  if constexpr (WeightType<T>::kQuantized) unpack_block512<T>(codes, scales, chunk, dst);
  else unpack_float_avx2<T>(codes, K, chunk, dst);
}

APEX_QUANT_FP_STRICT_END

}  // namespace apex::packed::detail
#endif
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
