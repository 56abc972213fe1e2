#pragma once
/// \file kernels/arch/avx2_quant_blocks.hpp
/// The building blocks of the AVX2 block-format tiles
/// (kernels/arch/avx2_quant.hpp, kernels/arch/avx2_quant_k.hpp) and of the
/// AVX-512 ones that reuse them: broadcasts of activation words, the 4-term
/// byte products, loads of a panel's code words and scale planes
/// (kernels/quant_layout.hpp), the tile loops' software prefetch, and a
/// row's accumulators through the epilogue.

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "../epilogue.hpp"
#include "../quant_layout.hpp"
#include "../weight_types.hpp"
#include "avx2.hpp"

#if APEX_PACKED_X86
namespace apex::packed::detail {
inline constexpr int kAvx2QuantRows = 4;

/// 4 activation codes (one 32-bit word) in all 8 lanes.
APEX_TARGET_AVX2 APEX_KERNEL_INLINE inline __m256i bcast4(const std::int8_t* q) {
  std::int32_t v;
  std::memcpy(&v, q, 4);
  return _mm256_set1_epi32(v);
}
/// 8 × Σ of 4 products u·s (u unsigned bytes, s signed) in int32.
APEX_TARGET_AVX2 APEX_KERNEL_INLINE inline __m256i dot4(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
/// As dot4 for two 4-byte groups at once (a byte of 4-bit codes: low and high nibble).
APEX_TARGET_AVX2 APEX_KERNEL_INLINE inline __m256i dot8(__m256i u0, __m256i s0, __m256i u1, __m256i s1) {
  return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(u0, s0), _mm256_maddubs_epi16(u1, s1)),
                           _mm256_set1_epi16(1));
}
/// acc = fma(float(isum), scale, acc) on 8 lanes (the entries' float step).
APEX_TARGET_AVX2 APEX_KERNEL_INLINE inline void accumulate8(float* acc, __m256i isum, __m256 scale) {
  _mm256_store_ps(acc, _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, _mm256_load_ps(acc)));
}
APEX_TARGET_AVX2 APEX_KERNEL_INLINE inline __m256i load32(const std::byte* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
/// 8 fp16 fields of a plane as float.
APEX_TARGET_AVX2 APEX_KERNEL_INLINE inline __m256 load_fp16x8(const std::byte* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
/// 8 bytes of a plane widened to int32 (unsigned or signed).
APEX_TARGET_AVX2 APEX_KERNEL_INLINE inline __m256i load_u8x8(const std::byte* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
APEX_TARGET_AVX2 APEX_KERNEL_INLINE inline __m256i load_i8x8(const std::byte* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
/// The low and high nibbles of 32 bytes.
APEX_TARGET_AVX2 APEX_KERNEL_INLINE inline __m256i low_nibbles(__m256i v) { return _mm256_and_si256(v,
                                                               _mm256_set1_epi8(0x0F)); }
APEX_TARGET_AVX2 APEX_KERNEL_INLINE inline __m256i high_nibbles(__m256i v) {
  return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F));
}
/// 2^(e−128) for 8 E8M0 bytes: ggml's e8m0 "half" (subnormal below e = 2).
APEX_TARGET_AVX2 APEX_KERNEL_INLINE inline __m256 e8m0_half8(const std::byte* p) {
  const __m256i e = load_u8x8(p);
  const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
  const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
  return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
}
/// The 32-bit words of lanes l0 … l0 + 7 in row `row` of a slab.
APEX_TARGET_AVX2 APEX_KERNEL_INLINE inline __m256i slab_words8(const std::byte* slab, Index row, Index l0) {
  return load32(slab + (row * kPanelLanes + l0) * 4);
}
/// Software prefetch of a slab's bytes, kPrefetchBytes ahead (kernels/isa.hpp).
inline void prefetch_bytes(const std::byte* p, Index bytes) {
  for (Index o = 0; o < bytes; o += 128) prefetch_slab(p + o);
}
/// A block's bytes a panel above which its tiles leave the prefetch to the
/// hardware: 2 KiB holds the 32-weight formats' blocks (Q8_0 1088 bytes, Q4_0
/// and MXFP4 576), not the K-quants' super-blocks (Q4_K 4608, Q6_K 6720).
inline constexpr Index kPrefetchBlockBytes = 2048;
/// The tile loops' prefetch of block b's slab and scale area, kPrefetchBytes
/// ahead. A K-quant super-block is 72–105 cache lines a panel: a burst of
/// that many prefetches at each block fills the core's miss buffers ahead of
/// the tile's own loads, and the hardware prefetcher alone, following the
/// codes and the scales as two sequential streams, reads them faster: on an
/// AVX-512 EPYC, decode 1.19–1.59× faster for Q4_K and 1.05–1.20× for Q6_K
/// (docs/performance.md, "K-quant decode without the prefetch burst").
template <Dtype T>
inline void prefetch_block(const std::byte* slab, const std::byte* area) {
  using W = WeightType<T>;
  constexpr Index slab_bytes = kPanelLanes * W::kCodeBytes, area_bytes = kPanelLanes * W::kScaleBytes;
  if constexpr (slab_bytes + area_bytes <= kPrefetchBlockBytes) {
    prefetch_bytes(slab, slab_bytes);
    prefetch_bytes(area, area_bytes);
  }
}
/// The 32 accumulators of row r through the epilogue.
template <class Epi>
APEX_TARGET_AVX2 APEX_KERNEL_INLINE inline void store_acc_avx2(const float* acc, float* out, Index ncols) {
  __m256 v[4];
  for (int i = 0; i < 4; ++i) v[i] = _mm256_load_ps(acc + 8 * i);
  store_row_avx2<Epi>(v, out, ncols);
}

}  // namespace apex::packed::detail
#endif
