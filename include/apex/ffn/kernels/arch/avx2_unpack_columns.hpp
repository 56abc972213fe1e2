#pragma once
/// \file kernels/arch/avx2_unpack_columns.hpp
/// kernels/unpack_columns.hpp on AVX2: 32 columns of a panel, lane by lane,
/// the same bytes as the portable unpacker.
///
/// Block formats. A slab row holds, for each lane, one 32-bit word of 4
/// consecutive k (kernels/quant_layout.hpp), so one vector load gives 8
/// lanes' words. They become words of 4 signed code bytes q, "code rows"
/// r = 0 … 7 with k = 4r … 4r + 3 of the chunk: Q8_0's bytes as stored; a
/// 4-bit row's low and high nibbles (rows 2i, 2i + 1), minus 8 for Q4_0,
/// through the E2M1 table for MXFP4; Q6_K's low nibble joined with its two
/// high bits, minus 32. An 8 × 8 transpose of 32-bit words gives each lane
/// its 32 codes in k order; they are widened exactly (vpmovsxbd, vcvtdq2ps)
/// and multiplied by the lane's factor (Q4_K: minus its min), the factors
/// computed 8 lanes at a time by the scalar path's operations.
///
/// Float types. Each k's 32 lanes widened to fp32 (f32 as stored, bf16 by a
/// shift or mask, f16 by F16C: all exact), then 8 × 8 transposes.
///
/// What differs between types is the type's AVX2 tile entry
/// (`Tiles<T, Isa::avx2>`, kernels/arch/avx2.hpp, avx2_quant.hpp,
/// avx2_quant_k.hpp): `code_rows` and `factors8` of a block format,
/// `lanes` of a float type; this file only moves and multiplies.
///
/// Everything but the factor products and Q4_K's difference is data
/// movement or an exact conversion; those are the scalar path's IEEE
/// operations on the same operands (fp-contract off: no fma may join
/// Q4_K's product and difference), so the bytes are the same.
///
/// The AVX-512 paths run this unpacker too: the same steps on 16-lane zmm
/// vectors measured 0-13 % slower on the Zen 4 CPU here (interleaved,
/// warm). A chunk is bound by its shuffles and its 4 KiB of float stores,
/// which 512-bit vectors do not make fewer on a core that executes them as
/// two 256-bit halves.

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "../unpack_columns.hpp"
#include "avx2.hpp"
#include "avx2_quant_k.hpp"

#if APEX_PACKED_X86
namespace apex::packed::detail {

APEX_QUANT_FP_STRICT_BEGIN

/// An 8 × 8 transpose of 32-bit elements: r[i] holds row i (8 lanes) in,
/// column i out.
APEX_TARGET_AVX2 APEX_KERNEL_INLINE inline void transpose8x8_epi32(__m256i* r) {
  __m256i t[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {  // r[i + j]: elements i … i + 3 of columns j (low half) and j + 4 (high)
    r[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    t[j] = _mm256_permute2x128_si256(r[j], r[j + 4], 0x20);
    t[j + 4] = _mm256_permute2x128_si256(r[j], r[j + 4], 0x31);
  }
  for (int i = 0; i < 8; ++i) r[i] = t[i];
}

/// The factors of chunk `chunk` of a block-format panel, 8 lanes a step
/// (the type's `factors8`; `kChunkMin`: minus a min). Always inlined, as are
/// the entries: GCC 12 (-O1 and -O2) dropped the call to an out-of-line
/// copy for Q6_K as if it wrote nothing, leaving the caller's factors unset.
template <Dtype T>
APEX_TARGET_AVX2 APEX_KERNEL_INLINE inline void chunk_factors_avx2(const std::byte* scales, Index chunk,
                                                                   ChunkFactors& f) {
  for (int v = 0; v < 4; ++v) {  // lanes 8v … 8v + 7
    __m256 lo, hi, min = _mm256_setzero_ps();
    Tiles<T, Isa::avx2>::factors8(scales, chunk, v, lo, hi, min);
    _mm256_store_ps(f.lo + 8 * v, lo);
    _mm256_store_ps(f.hi + 8 * v, hi);
    _mm256_store_ps(f.min + 8 * v, min);
  }
}

/// Code rows 0 … 7 of chunk `chunk`, lanes l0 … l0 + 7: row r holds k = 4r …
/// 4r + 3 of each lane, a signed byte each (the type's `code_rows`).
template <Dtype T>
APEX_TARGET_AVX2 APEX_KERNEL_INLINE inline void code_rows_avx2(const std::byte* codes, Index chunk, Index l0,
                                                               __m256i* rows) {
  Tiles<T, Isa::avx2>::code_rows(codes, chunk, l0, rows);
}

/// A block-format chunk: codes per lane in k order, then the factors.
template <Dtype T>
APEX_TARGET_AVX2 void unpack_block_avx2(const std::byte* codes, const std::byte* scales, Index chunk, float* dst) {
  APEX_QUANT_FP_STRICT_SCOPE
  using Tl = Tiles<T, Isa::avx2>;
  alignas(32) std::int8_t q[kPanelLanes][kChunkColumns];  // lane × k
  for (Index l0 = 0; l0 < kPanelLanes; l0 += 8) {
    __m256i rows[8];
    code_rows_avx2<T>(codes, chunk, l0, rows);
    transpose8x8_epi32(rows);
    for (int i = 0; i < 8; ++i) _mm256_store_si256(reinterpret_cast<__m256i*>(q[l0 + i]), rows[i]);
  }
  ChunkFactors f;
  chunk_factors_avx2<T>(scales, chunk, f);
  for (Index l = 0; l < kPanelLanes; ++l) {
    const __m256 lo = _mm256_broadcast_ss(f.lo + l), hi = _mm256_broadcast_ss(f.hi + l);
    const __m256 min = _mm256_broadcast_ss(f.min + l);
    for (int v = 0; v < 4; ++v) {
      const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q[l] + 8 * v));
      __m256 w = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)), v < 2 ? lo : hi);
      if constexpr (Tl::kChunkMin) w = _mm256_sub_ps(w, min);
      _mm256_store_ps(dst + l * kChunkColumns + 8 * v, w);
    }
  }
}

/// A float-type chunk: 8 × 8 blocks of (column, lane) widened straight
/// from the panel, zero past K, transposed into dst.
template <Dtype T>
APEX_TARGET_AVX2 void unpack_float_avx2(const typename WeightType<T>::Element* w, Index K, Index chunk, float* dst) {
  constexpr Index C = kChunkColumns;
  const Index k0 = chunk * C, n = std::min(C, K - k0);
  for (Index c0 = 0; c0 < C; c0 += 8)
    for (int v = 0; v < 4; ++v) {  // lanes 8v … 8v + 7
      __m256i r[8];
      for (int i = 0; i < 8; ++i)
        r[i] = _mm256_castps_si256(c0 + i < n ? Tiles<T, Isa::avx2>::lanes(w, k0 + c0 + i, v) : _mm256_setzero_ps());
      transpose8x8_epi32(r);
      for (int i = 0; i < 8; ++i) _mm256_store_ps(dst + (8 * v + i) * C + c0, _mm256_castsi256_ps(r[i]));
    }
}

/// Chunk `chunk` of one panel of type T into dst: unpack_columns_scalar's
/// bytes; a compile error naming T for a type without AVX2 tiles.
template <Dtype T>
APEX_TARGET_AVX2 void unpack_columns_avx2(const typename WeightType<T>::Element* codes, const std::byte* scales,
                                          Index K, Index chunk, float* dst) {
  static_assert(TilesOn<T, Isa::avx2>::check());
  if constexpr (WeightType<T>::kQuantized) unpack_block_avx2<T>(codes, scales, chunk, dst);
  else unpack_float_avx2<T>(codes, K, chunk, dst);
}

APEX_QUANT_FP_STRICT_END

}  // namespace apex::packed::detail
#endif
