#pragma once
/// \file kernels/vec_math.hpp
/// SiLU(g)·u for the kernels' epilogues, one formula written for each path.
///
///     e = exp(−|g|) ∈ (0, 1]         (no overflow for any g)
///     σ(g) = 1/(1 + e) for g ≥ 0,  e/(1 + e) otherwise
///     a = (g·σ(g))·u
///
/// exp is Cephes' `expf` for x ≤ 0: x = n·ln2 + r with n = rint(x·log₂e),
/// r by a two-constant Cody–Waite reduction, e^r by a degree-7 polynomial
/// (≈ 1 ulp), times 2ⁿ applied as two normal factors 2^⌊n/2⌋·2^(n−⌊n/2⌋), so
/// e^x is rounded once into the subnormal range exactly as a multiplication
/// would (x down to −104, where e^x < 2⁻¹⁵⁰). Below that e is set to 0, so
/// σ(g) = 0 exactly and SiLU(−huge) = −0 as its limit says.
///
/// The scalar, AVX2 and AVX-512 forms perform the same IEEE operations in the
/// same order (every multiply-add is a fused `fma`, every rounding
/// round-to-nearest-even), so they return identical bits; the kernel paths
/// therefore agree bit for bit wherever their products do. NaN in g or u
/// gives NaN.

#include <cmath>
#include <cstdint>
#include <cstring>

#include "isa.hpp"

namespace apex::packed::detail {

struct ExpConst {
  static constexpr float lo = -104.0f;  // e^x < 2⁻¹⁵⁰ below: rounds to 0
  static constexpr float log2e = 1.44269504088896341f;
  static constexpr float ln2_hi = 0.693359375f;     // exact in 9 bits, so n·ln2_hi is exact
  static constexpr float ln2_lo = -2.12194440e-4f;  // ln2 − ln2_hi
  static constexpr float p0 = 1.9875691500e-4f, p1 = 1.3981999507e-3f, p2 = 8.3334519073e-3f,
                         p3 = 4.1665795894e-2f, p4 = 1.6666665459e-1f, p5 = 5.0000001201e-1f;
};

/// SiLU(g)·u, scalar.
inline float silu_mul_scalar(float g, float u) {
  using C = ExpConst;
  float x = -std::fabs(g);
  const bool under = x < C::lo;
  x = x > C::lo ? x : C::lo;  // as max_ps(x, lo)
  const float n = std::nearbyint(x * C::log2e);
  float r = std::fma(n, -C::ln2_hi, x);
  r = std::fma(n, -C::ln2_lo, r);
  float p = std::fma(C::p0, r, C::p1);
  p = std::fma(p, r, C::p2);
  p = std::fma(p, r, C::p3);
  p = std::fma(p, r, C::p4);
  p = std::fma(p, r, C::p5);
  p = std::fma(p, r * r, r) + 1.0f;
  const std::int32_t ni = static_cast<std::int32_t>(n), n1 = -((1 - ni) / 2), n2 = ni - n1;  // n1 = ⌊n/2⌋
  float s1, s2;  // 2^n1, 2^n2: n ∈ [−150, 0], so both lie in [2⁻⁷⁵, 1]
  const std::uint32_t b1 = std::uint32_t(n1 + 127) << 23, b2 = std::uint32_t(n2 + 127) << 23;
  std::memcpy(&s1, &b1, sizeof s1);
  std::memcpy(&s2, &b2, sizeof s2);
  float e = (p * s1) * s2;
  if (under) e = 0.0f;
  const float num = g >= 0.0f ? 1.0f : e;
  const float sigma = num / (1.0f + e);
  return (g * sigma) * u;
}

// GCC 12 reports its own `_mm512_undefined_*` placeholders (`__Y = __Y`) as
// maybe-uninitialized once they are inlined (GCC PR 105593, fixed in 13).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#if APEX_PACKED_X86
APEX_TARGET_AVX2 inline __m256 silu_mul_avx2(__m256 g, __m256 u) {
  using C = ExpConst;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 x = _mm256_or_ps(g, sign);  // −|g|
  const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(C::lo), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(C::lo));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(C::log2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-C::ln2_hi), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(-C::ln2_lo), r);
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(C::p0), r, _mm256_set1_ps(C::p1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(C::p2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(C::p3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(C::p4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(C::p5));
  p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i ni = _mm256_cvtps_epi32(n), n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  const __m256 e = _mm256_andnot_ps(under, _mm256_mul_ps(_mm256_mul_ps(p, s1), s2));
  const __m256 ge0 = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_GE_OQ);
  const __m256 num = _mm256_blendv_ps(e, _mm256_set1_ps(1.0f), ge0);
  const __m256 sigma = _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
  return _mm256_mul_ps(_mm256_mul_ps(g, sigma), u);
}

APEX_TARGET_AVX512 inline __m512 silu_mul_avx512(__m512 g, __m512 u) {
  using C = ExpConst;
  __m512 x = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(g), _mm512_set1_epi32(INT32_MIN)));
  const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(C::lo), _CMP_LT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(C::lo));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(C::log2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-C::ln2_hi), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-C::ln2_lo), r);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(C::p0), r, _mm512_set1_ps(C::p1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(C::p2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(C::p3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(C::p4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(C::p5));
  p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  const __m512i ni = _mm512_cvtps_epi32(n), n1 = _mm512_srai_epi32(ni, 1), n2 = _mm512_sub_epi32(ni, n1);
  const __m512i bias = _mm512_set1_epi32(127);
  const __m512 s1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n1, bias), 23));
  const __m512 s2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n2, bias), 23));
  const __m512 e = _mm512_maskz_mov_ps(static_cast<__mmask16>(~under), _mm512_mul_ps(_mm512_mul_ps(p, s1), s2));
  const __mmask16 ge0 = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_GE_OQ);
  const __m512 num = _mm512_mask_blend_ps(ge0, e, _mm512_set1_ps(1.0f));
  const __m512 sigma = _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
  return _mm512_mul_ps(_mm512_mul_ps(g, sigma), u);
}
#endif
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

}  // namespace apex::packed::detail
