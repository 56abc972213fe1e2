#pragma once
/// \file kernels/arch/avx512_vnni_quant_k.hpp
/// AVX-512 VNNI tiles of the K-quants (Q4_K, Q6_K): `vpdpbusd` on the AVX2
/// tiles' offset codes (kernels/arch/avx2_quant_k.hpp), the offset taken off
/// with Σ x, with the AVX-512BW entries' loads, scales and per-half sums
/// (kernels/arch/avx512_quant_k.hpp). The integer sums and the float step are
/// the scalar path's, so the bits are. The tile loop that runs them is
/// QuantTilesVnni (kernels/arch/avx512_vnni_quant.hpp).
///
/// At many rows a pass takes one 16-lane half: the per-half sums and minima
/// already fill the registers at six rows. At decode row counts both halves,
/// so a pass reads the slab's lines in order (Q6_K up to four rows, Q4_K up
/// to two; each entry says what it gave).

#include "avx512_quant_k.hpp"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#if APEX_PACKED_X86
namespace apex::packed::detail {

/// Q4_K, one super-block: Σ_j sc_j·Σ q·x and Σ_j m_j·Σ x per lane, then two
/// fmas (the per-half sums and float step: Q4kHalfSums). At one and two
/// rows both halves sub-block by sub-block, so the slab's lines are read in
/// order: one-thread decode 1.05–1.10× in three A/Bs
/// (docs/performance.md, "Q6_K codes by group"); at three and four rows
/// the tile lost from cache and gained nothing at N = 16.
template <>
struct Tiles<Dtype::q4_k, Isa::avx512_vnni> {
  using W = WeightType<Dtype::q4_k>;
  static constexpr int kBothHalvesRows = 2;
  /// Sub-block j (32 weights) of half v into h; Ahead: prefetch each line's
  /// successor (both_halves, which reads the slab in order).
  template <int R, bool Ahead>
  APEX_TARGET_AVX512VNNI APEX_KERNEL_INLINE static void sub_block(const std::byte* slab, const std::byte* area, Index b,
                                                                  const QuantRows& x, int v, int j, Q4kHalfSums<R>& h) {
    __m512i sc, m;
    q4_k_scale_min16(area + W::kScalePlanes + 16 * v, j, sc, m);
    __m512i s[R];  // Σ q·x of sub-block j, |s| ≤ 32·15·128
    for (int r = 0; r < R; ++r) s[r] = _mm512_setzero_si512();
    for (int o = 4 * j; o < 4 * j + 4; ++o) {
      const __m512i raw = load_half512_ahead<Ahead>(slab, o, v);
      const __m512i lo = low_nibbles512(raw), hi = high_nibbles512(raw);
      for (int r = 0; r < R; ++r) {
        const std::int8_t* xq = x.q + r * x.ldq + 256 * b + 8 * o;
        s[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s[r], lo, bcast4_512(xq)), hi, bcast4_512(xq + 4));
      }
    }
    for (int r = 0; r < R; ++r) h.sumi[r] = _mm512_add_epi32(h.sumi[r], _mm512_mullo_epi32(sc, s[r]));
    h.add_min(m, x, b, j);
  }
  /// Half v of block b (every row count).
  template <int R>
  APEX_TARGET_AVX512VNNI APEX_KERNEL_INLINE static void block(const std::byte* slab, const std::byte* area, Index b,
                                                              const QuantRows& x, int v, __m512* acc) {
    Q4kHalfSums<R> h;
    h.zero();
    for (int j = 0; j < 8; ++j) sub_block<R, false>(slab, area, b, x, v, j, h);
    h.finish(area, b, x, v, acc);
  }
  /// Both halves of block b sub-block by sub-block (R ≤ kBothHalvesRows):
  /// the same integer sums and float steps per half as block<R>.
  template <int R>
  APEX_TARGET_AVX512VNNI APEX_KERNEL_INLINE static void both_halves(const std::byte* slab, const std::byte* area,
                                                                    Index b, const QuantRows& x, __m512* acc0,
                                                                    __m512* acc1) {
    Q4kHalfSums<R> h0, h1;
    h0.zero();
    h1.zero();
    for (int j = 0; j < 8; ++j) {
      sub_block<R, true>(slab, area, b, x, 0, j, h0);
      sub_block<R, true>(slab, area, b, x, 1, j, h1);
    }
    h0.finish(area, b, x, 0, acc0);
    h1.finish(area, b, x, 1, acc1);
  }
};

/// Q6_K, one super-block: Σ_g sc_g·(Σ u·x − 32·Σ x) per lane, then one fma.
/// Up to four rows both halves group by group, so a pass reads the slab's
/// grouped codes (kernels/quant_k_types.hpp) front to back; a group's
/// per-half sums are finished before the next half starts, so four rows
/// fit the registers (one matrix cold, VNNI: 3 rows 0.59 → 0.68 of the
/// probe, 4 rows 0.47 → 0.57; at 5 and 6 rows the AVX-512BW tile lost).
template <>
struct Tiles<Dtype::q6_k, Isa::avx512_vnni> {
  using W = WeightType<Dtype::q6_k>;
  static constexpr int kBothHalvesRows = 4;
  /// sumi += sc_g·(Σ u·x − 32·Σ x) of group g, half v; Ahead: prefetch each
  /// line's successor (both_halves, which reads the slab in order).
  template <int R, bool Ahead>
  APEX_TARGET_AVX512VNNI APEX_KERNEL_INLINE static void group(const std::byte* slab, const std::byte* area, Index b,
                                                              const QuantRows& x, int v, int g, __m512i* sumi) {
    const __m512i hraw = load_half512_ahead<Ahead>(W::group_high(slab, g), 0, v);
    __m512i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    for (int half = 0; half < 2; ++half) {
      const int o = 2 * g + half;
      __m512i u0, u1;
      q6_k_codes16(load_half512_ahead<Ahead>(W::group_low(slab, g), half, v), hraw, half, u0, u1);
      for (int r = 0; r < R; ++r) {
        const std::int8_t* xq = x.q + r * x.ldq + 256 * b + 8 * o;
        isum[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(isum[r], u0, bcast4_512(xq)), u1, bcast4_512(xq + 4));
      }
    }
    const __m512i sc = load_i8x16(area + W::kScalePlanes + g * kPanelLanes + 16 * v);
    for (int r = 0; r < R; ++r) {
      const __m512i centred = _mm512_sub_epi32(isum[r], _mm512_set1_epi32(32 * x.s16[r * x.lds + 16 * b + g]));
      sumi[r] = _mm512_add_epi32(sumi[r], _mm512_mullo_epi32(sc, centred));
    }
  }
  template <int R>
  APEX_TARGET_AVX512VNNI APEX_KERNEL_INLINE static void finish(const std::byte* area, Index b, const QuantRows& x,
                                                               int v, const __m512i* sumi, __m512* acc) {
    const __m512 d = load_fp16x16(area + 32 * v);
    for (int r = 0; r < R; ++r) acc[r] = accumulate16(acc[r], sumi[r], _mm512_mul_ps(d, _mm512_set1_ps(x.d[r * x.ldd + b])));
  }
  /// Half v of block b (every row count).
  template <int R>
  APEX_TARGET_AVX512VNNI APEX_KERNEL_INLINE static void block(const std::byte* slab, const std::byte* area, Index b,
                                                              const QuantRows& x, int v, __m512* acc) {
    __m512i sumi[R];
    for (int r = 0; r < R; ++r) sumi[r] = _mm512_setzero_si512();
    for (int g = 0; g < 16; ++g) group<R, false>(slab, area, b, x, v, g, sumi);
    finish<R>(area, b, x, v, sumi, acc);
  }
  /// Both halves of block b group by group (R ≤ kBothHalvesRows): the same
  /// integer sums and float step per half as block<R>, so the same bits.
  template <int R>
  APEX_TARGET_AVX512VNNI APEX_KERNEL_INLINE static void both_halves(const std::byte* slab, const std::byte* area,
                                                                    Index b, const QuantRows& x, __m512* acc0,
                                                                    __m512* acc1) {
    __m512i sumi0[R], sumi1[R];
    for (int r = 0; r < R; ++r) sumi0[r] = sumi1[r] = _mm512_setzero_si512();
    for (int g = 0; g < 16; ++g) {
      group<R, true>(slab, area, b, x, 0, g, sumi0);
      group<R, true>(slab, area, b, x, 1, g, sumi1);
    }
    finish<R>(area, b, x, 0, sumi0, acc0);
    finish<R>(area, b, x, 1, sumi1, acc1);
  }
};

}  // namespace apex::packed::detail
#endif
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
