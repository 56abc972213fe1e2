#pragma once
/// \file kernels/arch/avx2_quant_activations.hpp
/// The activation quantizers of the block-format products (Q8_0 blocks of
/// 32, Q8_K super-blocks of 256) on 8 lanes, bit for bit ggml's reference
/// quantizers (quant/quantize_q8_0.hpp, quant/quantize_q8_k.hpp), which the
/// scalar path runs. Every SIMD path uses them (AVX-512 CPUs have AVX2).
///
/// Why vectors: a product quantizes each row of its activations once per
/// matrix, and at the widths of real layers the reference quantizer (a
/// libm `roundf` per element) took a third as long as the VNNI tiles
/// themselves in batch (perf, `coarse`, N = 2048).
///
/// Why the bits are the reference's: every float step is the reference's
/// own operation on the same operands (a max, x·id or iscale·x, one IEEE
/// multiply), and the two roundings are written out exactly:
/// - Q8_0: `roundf`, ties away from zero: t = trunc(v), then t ± 1 where
///   |v − t| ≥ 0.5 (v − t is exact for |v| < 2^23; the codes are ≤ 127);
/// - Q8_K: ggml's `nearest_int` (v + 1.5·2^23, the low mantissa bits) is
///   v rounded to nearest, ties to even, for |v| < 2^22: `vroundps` with
///   that mode named in the instruction (not MXCSR's).
/// No multiply may fuse with the step after it (an fma would skip the
/// product's rounding): the file is compiled with fp-contract off, as the
/// reference is.
/// The per-block scalars (d, 1/d, the fp16 scale, −127/max) are computed
/// by the same scalar expressions. A block the vector step cannot take —
/// a NaN or Inf, or a largest |x| so small that 1/d or −127/max overflows
/// (below ≈ 3.7e-37) — goes through the reference quantizer itself.

#include <cmath>
#include <cstdint>
#include <limits>

#include "../../quant/quantize_q8_0.hpp"
#include "../../quant/quantize_q8_k.hpp"
#include "avx2.hpp"

#if APEX_PACKED_X86
namespace apex::packed::detail {

APEX_QUANT_FP_STRICT_BEGIN

/// |v| on 8 lanes.
APEX_TARGET_AVX2 APEX_KERNEL_INLINE inline __m256 abs8(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v); }

/// Largest |x| of n floats (n a multiple of 8), and whether all are finite.
APEX_TARGET_AVX2 inline float abs_max8(const float* x, int n, bool& finite) {
  __m256 m = _mm256_setzero_ps();
  __m256 bad = _mm256_setzero_ps();  // lanes that held a NaN or ±Inf
  const __m256 big = _mm256_set1_ps(std::numeric_limits<float>::max());
  for (int i = 0; i < n; i += 8) {
    const __m256 a = abs8(_mm256_loadu_ps(x + i));
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, big, _CMP_NLE_UQ));  // NaN or > FLT_MAX
    m = _mm256_max_ps(m, a);
  }
  finite = _mm256_movemask_ps(bad) == 0;
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
  return _mm_cvtss_f32(h);
}

/// Four vectors of 8 int32 codes (each in [−128, 127]) as 32 int8, in order.
APEX_TARGET_AVX2 APEX_KERNEL_INLINE inline void store_codes32(__m256i a, __m256i b, __m256i c, __m256i d,
                                                              std::int8_t* q) {
  const __m256i ab = _mm256_packs_epi32(a, b), cd = _mm256_packs_epi32(c, d);  // lane-interleaved int16
  const __m256i bytes = _mm256_packs_epi16(ab, cd);                            // lane-interleaved int8
  // packs work per 128-bit lane: dwords come out as a0 b0 c0 d0 a1 b1 c1 d1
  const __m256i order = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), order);
}

/// roundf(x·id) on 8 lanes (ties away from zero), as int32.
APEX_TARGET_AVX2 APEX_KERNEL_INLINE inline __m256i round_away8(const float* x, __m256 id) {
  APEX_QUANT_FP_STRICT_SCOPE
  const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x), id);
  const __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
  const __m256 tie_or_more = _mm256_cmp_ps(abs8(_mm256_sub_ps(v, t)), _mm256_set1_ps(0.5f), _CMP_GE_OQ);
  const __m256 one = _mm256_or_ps(_mm256_set1_ps(1.0f), _mm256_and_ps(v, _mm256_set1_ps(-0.0f)));  // ±1 as v
  return _mm256_cvttps_epi32(_mm256_add_ps(t, _mm256_and_ps(tie_or_more, one)));
}

/// ggml's nearest_int(iscale·x) on 8 lanes, capped at 127 (Q8_K's codes).
APEX_TARGET_AVX2 APEX_KERNEL_INLINE inline __m256i q8_k_codes8(const float* x, __m256 iscale) {
  APEX_QUANT_FP_STRICT_SCOPE
  const __m256 v = _mm256_mul_ps(iscale, _mm256_loadu_ps(x));  // |v| ≤ 127
  const __m256i n = _mm256_cvttps_epi32(_mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  return _mm256_min_epi32(n, _mm256_set1_epi32(127));
}

/// One Q8_0 block (32 activations) to codes q and the scale d as stored
/// (the fp16 scale widened); false (nothing written) when the block must go
/// through the reference.
APEX_TARGET_AVX2 inline bool quantize_q8_0_block_avx2(const float* x, std::int8_t* q, float* d) {
  bool finite = false;
  const float amax = abs_max8(x, 32, finite);
  if (!finite) return false;
  const float dd = amax / 127;
  const float id = dd ? 1.0f / dd : 0.0f;
  if (!std::isfinite(id)) return false;
  const __m256 vid = _mm256_set1_ps(id);
  store_codes32(round_away8(x, vid), round_away8(x + 8, vid), round_away8(x + 16, vid), round_away8(x + 24, vid), q);
  *d = quant::fp16_to_fp32(quant::fp32_to_fp16(dd));
  return true;
}

/// One Q8_K super-block (256 activations) to codes q and the scale d; false
/// (nothing written) when the block must go through the reference.
APEX_TARGET_AVX2 inline bool quantize_q8_k_block_avx2(const float* x, std::int8_t* q, float* d) {
  bool finite = false;
  const float amax = abs_max8(x, 256, finite);
  if (!finite) return false;
  if (!amax) {
    for (int j = 0; j < 256; j += 32) _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + j), _mm256_setzero_si256());
    *d = 0;
    return true;
  }
  int first = 0;  // the first element of largest magnitude gives max its sign
  for (int i = 0;; i += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(abs8(_mm256_loadu_ps(x + i)), _mm256_set1_ps(amax), _CMP_EQ_OQ));
    if (hit) {
      first = i + __builtin_ctz(unsigned(hit));
      break;
    }
  }
  const float iscale = -127.f / x[first];
  if (!std::isfinite(iscale)) return false;
  const __m256 vs = _mm256_set1_ps(iscale);
  for (int j = 0; j < 256; j += 32)
    store_codes32(q8_k_codes8(x + j, vs), q8_k_codes8(x + j + 8, vs), q8_k_codes8(x + j + 16, vs),
                  q8_k_codes8(x + j + 24, vs), q + j);
  *d = 1 / iscale;
  return true;
}

APEX_QUANT_FP_STRICT_END

}  // namespace apex::packed::detail
#endif
