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
#include "avx2_quant.hpp"

#if APEX_PACKED_X86
namespace apex::packed::detail {

APEX_QUANT_FP_STRICT_BEGIN

/// An 8 × 8 transpose of 32-bit elements: r[i] holds row i (8 lanes) in,
/// column i out.
APEX_TARGET_AVX2 inline void transpose8x8_epi32(__m256i* r) {
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

/// Q4_K's sc_j and m_j of 8 lanes (quant::q4_k_scale_min); planes: the 12
/// byte planes of a super-block, offset to the first lane.
APEX_TARGET_AVX2 inline void q4_k_scale_min8(const std::byte* planes, int j, __m256i& sc, __m256i& m) {
  const __m256i m6 = _mm256_set1_epi32(63), m4 = _mm256_set1_epi32(15);
  if (j < 4) {
    sc = _mm256_and_si256(load_u8x8(planes + 32 * j), m6);
    m = _mm256_and_si256(load_u8x8(planes + 32 * (j + 4)), m6);
    return;
  }
  const __m256i hi = load_u8x8(planes + 32 * (j + 4));
  const __m256i sc_top = _mm256_srli_epi32(load_u8x8(planes + 32 * (j - 4)), 6);  // bits 4, 5 of sc_j
  const __m256i m_top = _mm256_srli_epi32(load_u8x8(planes + 32 * j), 6);         // bits 4, 5 of m_j
  sc = _mm256_or_si256(_mm256_and_si256(hi, m4), _mm256_slli_epi32(sc_top, 4));
  m = _mm256_or_si256(_mm256_srli_epi32(hi, 4), _mm256_slli_epi32(m_top, 4));
}

/// The factors of chunk `chunk` of a block-format panel, 8 lanes a step.
/// Always inlined: GCC 12 (-O1 and -O2) dropped the call to an out-of-line
/// copy for Q6_K as if it wrote nothing, leaving the caller's factors unset.
template <Dtype T>
APEX_TARGET_AVX2 APEX_KERNEL_INLINE inline void chunk_factors_avx2(const std::byte* scales, Index chunk,
                                                                   ChunkFactors& f) {
  using W = WeightType<T>;
  for (int v = 0; v < 4; ++v) {  // lanes 8v … 8v + 7
    __m256 lo, hi, min = _mm256_setzero_ps();
    if constexpr (T == Dtype::q4_k) {
      const std::byte* a = W::area(scales, chunk / 8);
      __m256i sc, m;
      q4_k_scale_min8(a + W::kScalePlanes + 8 * v, int(chunk % 8), sc, m);
      lo = hi = _mm256_mul_ps(load_fp16x8(a + 16 * v), _mm256_cvtepi32_ps(sc));
      min = _mm256_mul_ps(load_fp16x8(a + W::kDminPlane + 16 * v), _mm256_cvtepi32_ps(m));
    } else if constexpr (T == Dtype::q6_k) {
      const std::byte* a = W::area(scales, chunk / 8);
      const std::byte* group = a + W::kScalePlanes + 2 * (chunk % 8) * kPanelLanes + 8 * v;
      const __m256 d = load_fp16x8(a + 16 * v);
      lo = _mm256_mul_ps(d, _mm256_cvtepi32_ps(load_i8x8(group)));
      hi = _mm256_mul_ps(d, _mm256_cvtepi32_ps(load_i8x8(group + kPanelLanes)));
    } else if constexpr (T == Dtype::mxfp4) {
      lo = hi = e8m0_half8(W::area(scales, chunk) + 8 * v);
    } else {
      lo = hi = load_fp16x8(W::area(scales, chunk) + 16 * v);
    }
    _mm256_store_ps(f.lo + 8 * v, lo);
    _mm256_store_ps(f.hi + 8 * v, hi);
    _mm256_store_ps(f.min + 8 * v, min);
  }
}

/// The 32-bit words of lanes l0 … l0 + 7 in row `row` of a slab.
APEX_TARGET_AVX2 inline __m256i slab_words8(const std::byte* slab, Index row, Index l0) {
  return load32(slab + (row * kPanelLanes + l0) * 4);
}

/// Code rows 0 … 7 of chunk `chunk`, lanes l0 … l0 + 7 (see the file comment).
template <Dtype T>
APEX_TARGET_AVX2 void code_rows_avx2(const std::byte* codes, Index chunk, Index l0, __m256i* rows) {
  using W = WeightType<T>;
  if constexpr (T == Dtype::q8_0) {
    for (int r = 0; r < 8; ++r) rows[r] = slab_words8(W::slab(codes, chunk), r, l0);
  } else if constexpr (T == Dtype::q6_k) {
    const std::byte* slab = W::slab(codes, chunk / 8);
    const Index h = chunk % 8;  // octs 4h … 4h + 3, 2-bit rows 2h, 2h + 1
    for (int r = 0; r < 8; ++r) {
      const __m256i raw = slab_words8(slab, 4 * h + r / 2, l0);
      const __m256i low = r % 2 ? high_nibbles(raw) : low_nibbles(raw);
      const __m256i high = slab_words8(slab + W::kHighBits, 2 * h + r / 4, l0);
      const __m256i two = _mm256_and_si256(_mm256_srli_epi16(high, 2 * (r % 4)), _mm256_set1_epi8(3));
      rows[r] = _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(two, 4)), _mm256_set1_epi8(32));
    }
  } else {  // 4-bit codes: Q4_0, MXFP4 (block = chunk), Q4_K (sub-block chunk mod 8)
    const std::byte* slab = W::slab(codes, T == Dtype::q4_k ? chunk / 8 : chunk);
    const Index o0 = T == Dtype::q4_k ? 4 * (chunk % 8) : 0;
    const __m256i v2 = _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12, 0, 1, 2, 3, 4, 6, 8,
                                        12, 0, -1, -2, -3, -4, -6, -8, -12);  // quant::kMxfp4Values
    for (int i = 0; i < 4; ++i) {
      const __m256i raw = slab_words8(slab, o0 + i, l0);
      for (int half = 0; half < 2; ++half) {
        const __m256i q = half ? high_nibbles(raw) : low_nibbles(raw);
        if constexpr (T == Dtype::q4_0) rows[2 * i + half] = _mm256_sub_epi8(q, _mm256_set1_epi8(8));
        else if constexpr (T == Dtype::mxfp4) rows[2 * i + half] = _mm256_shuffle_epi8(v2, q);
        else rows[2 * i + half] = q;
      }
    }
  }
}

/// A block-format chunk: codes per lane in k order, then the factors.
template <Dtype T>
APEX_TARGET_AVX2 void unpack_block_avx2(const std::byte* codes, const std::byte* scales, Index chunk, float* dst) {
  APEX_QUANT_FP_STRICT_SCOPE
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
      if constexpr (T == Dtype::q4_k) w = _mm256_sub_ps(w, min);
      _mm256_store_ps(dst + l * kChunkColumns + 8 * v, w);
    }
  }
}

/// Lanes 8v … 8v + 7 of column k of a float-type panel, widened exactly.
template <Dtype T>
APEX_TARGET_AVX2 inline __m256 float_lanes_avx2(const typename WeightType<T>::Element* w, Index k, int v) {
  constexpr Index L = kPanelLanes;
  if constexpr (T == Dtype::f32) {
    return _mm256_load_ps(w + k * L + 8 * v);
  } else if constexpr (T == Dtype::f16) {
    return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(w + k * L + 8 * v)));
  } else {  // bf16: lane word (k even | k odd << 16) of pair k / 2
    const __m256i pair = _mm256_load_si256(reinterpret_cast<const __m256i*>(w + (k / 2) * 2 * L + 16 * v));
    return _mm256_castsi256_ps(k % 2 ? _mm256_and_si256(pair, _mm256_set1_epi32(int(0xFFFF0000u)))
                                     : _mm256_slli_epi32(pair, 16));
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
        r[i] = _mm256_castps_si256(c0 + i < n ? float_lanes_avx2<T>(w, k0 + c0 + i, v) : _mm256_setzero_ps());
      transpose8x8_epi32(r);
      for (int i = 0; i < 8; ++i) _mm256_store_ps(dst + (8 * v + i) * C + c0, _mm256_castsi256_ps(r[i]));
    }
}

/// Chunk `chunk` of one panel of type T into dst: unpack_columns_scalar's bytes.
template <Dtype T>
APEX_TARGET_AVX2 void unpack_columns_avx2(const typename WeightType<T>::Element* codes, const std::byte* scales,
                                          Index K, Index chunk, float* dst) {
  if constexpr (WeightType<T>::kQuantized) unpack_block_avx2<T>(codes, scales, chunk, dst);
  else unpack_float_avx2<T>(codes, K, chunk, dst);
}

APEX_QUANT_FP_STRICT_END

}  // namespace apex::packed::detail
#endif
