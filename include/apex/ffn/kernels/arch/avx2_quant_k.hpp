#pragma once
/// \file kernels/arch/avx2_quant_k.hpp
/// AVX2 tiles of the K-quants Q4_K and Q6_K (kernels/quant_k_types.hpp):
/// each type's `Tiles<T, Isa::avx2>` entry, its block product and its
/// column unpacker's pieces (kernels/arch/avx2_quant.hpp has the helpers,
/// the 32-weight formats and the tile loop; the arithmetic is explained
/// there).
///
/// The unpacker's factors are single products, stored before the unpacker
/// (compiled with fp-contract off) subtracts Q4_K's min: nothing here for a
/// contraction to join.

#include <cstddef>
#include <cstdint>

#include "avx2_quant.hpp"

#if APEX_PACKED_X86
namespace apex::packed::detail {

/// Q4_K's sc_j and m_j of 8 lanes (quant::q4_k_scale_min); planes: the 12
/// byte planes of a super-block, offset to the first lane.
APEX_TARGET_AVX2 APEX_KERNEL_INLINE inline void q4_k_scale_min8(const std::byte* planes, int j, __m256i& sc,
                                                                __m256i& m) {
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

/// Q4_K. Block product of one super-block: Σ_j sc_j·Σ q·x and Σ_j m_j·Σ x
/// per lane, then two fmas. Unpacking: chunk j of a super-block is its
/// sub-block j (4-bit codes as they are), factors d·sc_j and dmin·m_j.
template <>
struct Tiles<Dtype::q4_k, Isa::avx2> : QuarterPasses<Tiles<Dtype::q4_k, Isa::avx2>, 8> {
  using W = WeightType<Dtype::q4_k>;
  static constexpr bool kChunkMin = true;  ///< w = float(q)·(d·sc_j) − dmin·m_j

  /// Rows up to which the tile loop takes all four 8-lane quarters of a
  /// block sub-block by sub-block (all_quarters), so a decode pass reads the
  /// slab's lines in order and prefetches one a line: one Qwen3-30B-A3B
  /// step, cold, against one quarter a pass, 1.31–1.48× at N = 1 and 4, one
  /// and two threads (docs/performance.md, "Q4_K in order on AVX-512BW and
  /// AVX2"). The minima are summed in finish, from the scale planes alone,
  /// so the code loop keeps only the sums of Σ q·x live.
  static constexpr int kAllQuartersRows = 2;

  /// Step j: sumi += sc_j·Σ q·x of sub-block j, lanes 8v … 8v + 7; Ahead:
  /// prefetch each line's successor when a quarter pair starts it
  /// (all_quarters).
  template <int R, bool Ahead>
  APEX_TARGET_AVX2 APEX_KERNEL_INLINE static void step(const std::byte* slab, const std::byte* area, Index b,
                                                            const QuantRows& x, int v, int j, __m256i* sumi) {
    __m256i sc, m;
    q4_k_scale_min8(area + W::kScalePlanes + 8 * v, j, sc, m);
    __m256i p16[R];  // ≤ 4 octs · 2 · 2 · 15 · 128 < 2^15
    for (int r = 0; r < R; ++r) p16[r] = _mm256_setzero_si256();
    for (int o = 4 * j; o < 4 * j + 4; ++o) {
      const std::byte* line = slab + (o * kPanelLanes + 8 * v) * 4;
      if (Ahead && v % 2 == 0) prefetch_line(line);  // quarters 2i and 2i + 1 share a line
      const __m256i raw = load32(line);
      const __m256i lo = low_nibbles(raw), hi = high_nibbles(raw);
      for (int r = 0; r < R; ++r) {
        const std::int8_t* xq = x.q + r * x.ldq + 256 * b + 8 * o;
        p16[r] = _mm256_add_epi16(p16[r], _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(xq)),
                                                           _mm256_maddubs_epi16(hi, bcast4(xq + 4))));
      }
    }
    // sc_j in both int16 halves of each lane: vpmaddwd gives sc_j·Σ q·x at once
    // (|Σ| ≤ 2·63·2^15 fits int32), the same integer as the scalar path's
    const __m256i sc2 = _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16));
    for (int r = 0; r < R; ++r) sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(p16[r], sc2));
  }
  /// acc += d·d_x·sumi − dmin·d_x·Σ_j m_j·Σ x_j for lanes 8v … 8v + 7 (the
  /// minima from the scale planes alone, after the codes).
  template <int R>
  APEX_TARGET_AVX2 APEX_KERNEL_INLINE static void finish(const std::byte* area, Index b, const QuantRows& x, int v,
                                                         const __m256i* sumi, float (*acc)[32]) {
    __m256i mins[R];
    for (int r = 0; r < R; ++r) mins[r] = _mm256_setzero_si256();
    for (int j = 1; j < 8; j += 2) {
      __m256i sc, m_even, m_odd;
      q4_k_scale_min8(area + W::kScalePlanes + 8 * v, j - 1, sc, m_even);
      q4_k_scale_min8(area + W::kScalePlanes + 8 * v, j, sc, m_odd);
      // m_{j−1}·Σx_{j−1} + m_j·Σx_j as one vpmaddwd of int16 pairs (|Σx| ≤ 32·128)
      const __m256i m2 = _mm256_or_si256(m_even, _mm256_slli_epi32(m_odd, 16));
      for (int r = 0; r < R; ++r) {
        const std::uint32_t lo16 = std::uint16_t(x.row(r).sum32(8 * b + j - 1));
        const std::uint32_t pair = lo16 | (std::uint32_t(std::uint16_t(x.row(r).sum32(8 * b + j))) << 16);
        mins[r] = _mm256_add_epi32(mins[r], _mm256_madd_epi16(m2, _mm256_set1_epi32(std::int32_t(pair))));
      }
    }
    const __m256 d = load_fp16x8(area + 16 * v), dmin = load_fp16x8(area + W::kDminPlane + 16 * v);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int r = 0; r < R; ++r) {
      const __m256 xd = _mm256_set1_ps(x.d[r * x.ldd + b]);
      accumulate8(acc[r] + 8 * v, sumi[r], _mm256_mul_ps(d, xd));
      accumulate8(acc[r] + 8 * v, mins[r], _mm256_xor_ps(_mm256_mul_ps(dmin, xd), sign));
    }
  }
  /// Code rows 0 … 7 of chunk `chunk` (sub-block chunk mod 8 of super-block chunk / 8), lanes l0 … l0 + 7.
  APEX_TARGET_AVX2 static void code_rows(const std::byte* codes, Index chunk, Index l0, __m256i* rows) {
    const std::byte* slab = W::slab(codes, chunk / 8);
    const Index o0 = 4 * (chunk % 8);
    for (int i = 0; i < 4; ++i) {
      const __m256i raw = slab_words8(slab, o0 + i, l0);
      for (int half = 0; half < 2; ++half) rows[2 * i + half] = half ? high_nibbles(raw) : low_nibbles(raw);
    }
  }
  APEX_TARGET_AVX2 APEX_KERNEL_INLINE static void factors8(const std::byte* scales, Index chunk, int v, __m256& lo,
                                                           __m256& hi,
                                        __m256& min) {
    const std::byte* a = W::area(scales, chunk / 8);
    __m256i sc, m;
    q4_k_scale_min8(a + W::kScalePlanes + 8 * v, int(chunk % 8), sc, m);
    lo = hi = _mm256_mul_ps(load_fp16x8(a + 16 * v), _mm256_cvtepi32_ps(sc));
    min = _mm256_mul_ps(load_fp16x8(a + W::kDminPlane + 16 * v), _mm256_cvtepi32_ps(m));
  }
};

/// Q6_K. Block product of one super-block: Σ_g sc_g·(Σ u·x − 32·Σ x) per
/// lane, then one fma. Unpacking: chunk h of a super-block is its groups 2h
/// and 2h + 1, codes q − 32, factors d·sc_2h (columns < 16) and d·sc_2h+1.
template <>
struct Tiles<Dtype::q6_k, Isa::avx2> : QuarterPasses<Tiles<Dtype::q6_k, Isa::avx2>, 16> {
  using W = WeightType<Dtype::q6_k>;
  static constexpr bool kChunkMin = false;

  /// Rows up to which the tile loop takes all four 8-lane quarters of a
  /// block group by group (all_quarters), so a decode pass reads the grouped
  /// codes front to back (docs/performance.md, "Q6_K codes by group").
  static constexpr int kAllQuartersRows = 2;

  /// Step g: sumi += sc_g·(Σ u·x − 32·Σ x) of group g, lanes 8v … 8v + 7;
  /// Ahead: prefetch each line's successor (prefetch_line) when a quarter
  /// pair starts it (all_quarters, which reads the slab in order).
  template <int R, bool Ahead>
  APEX_TARGET_AVX2 APEX_KERNEL_INLINE static void step(const std::byte* slab, const std::byte* area, Index b,
                                                        const QuantRows& x, int v, int g, __m256i* sumi) {
    const __m256i bits45 = _mm256_set1_epi8(0x30);
    const std::byte* high = W::group_high(slab, g) + 8 * v * 4;
    if (Ahead && v % 2 == 0) prefetch_line(high);  // quarters 2i and 2i + 1 share a line
    const __m256i hraw = load32(high);
    __m256i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
    for (int half = 0; half < 2; ++half) {  // octs 2g, 2g + 1: quads 4g + 2·half, +1
      const int o = 2 * g + half;
      const std::byte* low = W::group_low(slab, g) + (half * kPanelLanes + 8 * v) * 4;
      if (Ahead && v % 2 == 0) prefetch_line(low);
      const __m256i raw = load32(low);
      // the plane's bits 4·half + (0, 1) and + (2, 3) to bits 4–5 by one
      // 16-bit shift each (what crosses a byte is outside 0x30)
      const __m256i h0 = half == 0 ? _mm256_slli_epi16(hraw, 4) : hraw;
      const __m256i h1 = half == 0 ? _mm256_slli_epi16(hraw, 2) : _mm256_srli_epi16(hraw, 2);
      const __m256i u0 = _mm256_or_si256(low_nibbles(raw), _mm256_and_si256(h0, bits45));
      const __m256i u1 = _mm256_or_si256(high_nibbles(raw), _mm256_and_si256(h1, bits45));
      for (int r = 0; r < R; ++r) {
        const std::int8_t* xq = x.q + r * x.ldq + 256 * b + 8 * o;
        isum[r] = _mm256_add_epi32(isum[r], dot8(u0, bcast4(xq), u1, bcast4(xq + 4)));
      }
    }
    const __m256i sc = load_i8x8(area + W::kScalePlanes + g * kPanelLanes + 8 * v);
    for (int r = 0; r < R; ++r) {
      const __m256i centred = _mm256_sub_epi32(isum[r], _mm256_set1_epi32(32 * x.s16[r * x.lds + 16 * b + g]));
      sumi[r] = _mm256_add_epi32(sumi[r], _mm256_mullo_epi32(sc, centred));
    }
  }
  template <int R>
  APEX_TARGET_AVX2 APEX_KERNEL_INLINE static void finish(const std::byte* area, Index b, const QuantRows& x, int v,
                                                         const __m256i* sumi, float (*acc)[32]) {
    const __m256 d = load_fp16x8(area + 16 * v);
    for (int r = 0; r < R; ++r)
      accumulate8(acc[r] + 8 * v, sumi[r], _mm256_mul_ps(d, _mm256_set1_ps(x.d[r * x.ldd + b])));
  }
  /// Code rows 0 … 7 of chunk `chunk`, lanes l0 … l0 + 7: octs 4h … 4h + 3,
  /// 2-bit rows 2h, 2h + 1 (h = chunk mod 8).
  APEX_TARGET_AVX2 static void code_rows(const std::byte* codes, Index chunk, Index l0, __m256i* rows) {
    const std::byte* slab = W::slab(codes, chunk / 8);
    const Index h = chunk % 8;
    for (int r = 0; r < 8; ++r) {
      const Index g = 2 * h + r / 4;  // oct 4h + r/2 is oct (r/2) mod 2 of group g
      const __m256i raw = slab_words8(W::group_low(slab, g), r / 2 % 2, l0);
      const __m256i low = r % 2 ? high_nibbles(raw) : low_nibbles(raw);
      const __m256i high = slab_words8(W::group_high(slab, g), 0, l0);
      const __m256i two = _mm256_and_si256(_mm256_srli_epi16(high, 2 * (r % 4)), _mm256_set1_epi8(3));
      rows[r] = _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(two, 4)), _mm256_set1_epi8(32));
    }
  }
  APEX_TARGET_AVX2 APEX_KERNEL_INLINE static void factors8(const std::byte* scales, Index chunk, int v, __m256& lo,
                                                           __m256& hi, __m256&) {
    const std::byte* a = W::area(scales, chunk / 8);
    const std::byte* scales_2h = a + W::kScalePlanes + 2 * (chunk % 8) * kPanelLanes + 8 * v;
    const __m256 d = load_fp16x8(a + 16 * v);
    lo = _mm256_mul_ps(d, _mm256_cvtepi32_ps(load_i8x8(scales_2h)));
    hi = _mm256_mul_ps(d, _mm256_cvtepi32_ps(load_i8x8(scales_2h + kPanelLanes)));
  }
};

}  // namespace apex::packed::detail
#endif
