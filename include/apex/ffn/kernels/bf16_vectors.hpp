#pragma once
/// \file kernels/bf16_vectors.hpp
/// bfloat16 storage: the upper 16 bits of an IEEE binary32 (1 sign, 8 exponent,
/// 7 mantissa bits). Same range as float, relative spacing 2⁻⁷, so
/// round-to-nearest has a relative error of at most 2⁻⁸ ≈ 3.9e-3.
///
/// The scalar conversions and their rounding rules (PyTorch's, bit for bit)
/// are core/bfloat16.hpp's; the vector paths here give the same bits.
///
/// Hardware `vcvtneps2bf16` is not used: it treats subnormal inputs as zero and
/// keeps NaN payloads, which would differ from PyTorch.

#include <cmath>
#include <cstdint>
#include <cstring>

#include "../core/bfloat16.hpp"
#include "../core/types.hpp"
#include "isa.hpp"

namespace apex::packed {

/// One bfloat16 value, stored as its bit pattern.
struct bf16 {
  std::uint16_t bits;
};
static_assert(sizeof(bf16) == 2, "bf16 must be two bytes so arrays of it are raw bf16 tensors");

/// The bf16 bits of `x` (round to nearest even; NaN → 0x7FC0): core/bfloat16.hpp.
inline std::uint16_t bf16_bits(float x) { return bfloat16::from_float(x); }

/// The float whose upper half is `bits` (exact).
inline float bf16_bits_to_float(std::uint16_t bits) { return bfloat16::to_float(bits); }

inline bf16 to_bf16(float x) { return bf16{bf16_bits(x)}; }
inline float to_float(bf16 x) { return bf16_bits_to_float(x.bits); }

/// x rounded to bf16 and widened back: the value a bf16 tensor holds.
inline float round_to_bf16(float x) { return bf16_bits_to_float(bf16_bits(x)); }

namespace detail {

inline void to_bf16_scalar(const float* src, bf16* dst, Index n) {
  for (Index i = 0; i < n; ++i) dst[i].bits = bf16_bits(src[i]);
}
inline void to_float_scalar(const bf16* src, float* dst, Index n) {
  for (Index i = 0; i < n; ++i) dst[i] = bf16_bits_to_float(src[i].bits);
}

// GCC 12 reports its own `_mm512_undefined_*` placeholders (`__Y = __Y`) as
// maybe-uninitialized once they are inlined (GCC PR 105593, fixed in 13).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#if APEX_PACKED_X86
APEX_TARGET_AVX2 inline __m256i bf16_round8_avx2(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);  // 8 × u32, each < 2¹⁶
}

APEX_TARGET_AVX2 inline void to_bf16_avx2(const float* src, bf16* dst, Index n) {
  Index i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i lo = bf16_round8_avx2(_mm256_loadu_ps(src + i));
    const __m256i hi = bf16_round8_avx2(_mm256_loadu_ps(src + i + 8));
    // packus works per 128-bit lane: [lo0-3 hi0-3 lo4-7 hi4-7] → reorder the 64-bit quarters.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), packed);
  }
  to_bf16_scalar(src + i, dst + i, n - i);
}

APEX_TARGET_AVX2 inline void to_float_avx2(const bf16* src, float* dst, Index n) {
  Index i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
  }
  to_float_scalar(src + i, dst + i, n - i);
}

APEX_TARGET_AVX512 inline void to_bf16_avx512(const float* src, bf16* dst, Index n) {
  Index i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(src + i);
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm512_cvtepi32_epi16(r));
  }
  to_bf16_scalar(src + i, dst + i, n - i);
}

APEX_TARGET_AVX512 inline void to_float_avx512(const bf16* src, float* dst, Index n) {
  Index i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
  }
  to_float_scalar(src + i, dst + i, n - i);
}
#endif

/// dst[i] = bf16(src[i]), i < n, on path `isa` (all paths give the same bits).
inline void to_bf16_n(const float* src, bf16* dst, Index n, Isa isa) {
#if APEX_PACKED_X86
  if (is_avx512(isa)) return to_bf16_avx512(src, dst, n);
  if (isa == Isa::avx2) return to_bf16_avx2(src, dst, n);
#endif
  (void)isa;
  to_bf16_scalar(src, dst, n);
}

inline void to_float_n(const bf16* src, float* dst, Index n, Isa isa) {
#if APEX_PACKED_X86
  if (is_avx512(isa)) return to_float_avx512(src, dst, n);
  if (isa == Isa::avx2) return to_float_avx2(src, dst, n);
#endif
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
  (void)isa;
  to_float_scalar(src, dst, n);
}

}  // namespace detail

/// dst[0..n) = bf16(src[0..n)). `isa` must be supported by the CPU (ConfigError otherwise).
inline void to_bf16(const float* src, bf16* dst, Index n, Isa isa = kDefaultIsa) {
  detail::require_isa("packed::to_bf16", isa);
  detail::to_bf16_n(src, dst, n, isa);
}

/// dst[0..n) = float(src[0..n)) (exact).
inline void to_float(const bf16* src, float* dst, Index n, Isa isa = kDefaultIsa) {
  detail::require_isa("packed::to_float", isa);
  detail::to_float_n(src, dst, n, isa);
}

}  // namespace apex::packed
