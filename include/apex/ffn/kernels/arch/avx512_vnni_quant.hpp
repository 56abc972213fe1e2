#pragma once
/// \file kernels/arch/avx512_vnni_quant.hpp
/// AVX-512 VNNI tiles of the block formats: `vpdpbusd` adds four u8 × s8
/// products of each 32-bit lane to an int32 accumulator in one instruction,
/// without the int16 step of `vpmaddubsw` (so no runs to keep below 2^15
/// and no saturation to design around). The integer block sums are the
/// scalar path's exactly, and the float step is the same, so the bits are.
///
/// Unsigned operand per format:
/// - Q8_0: u = w + 128 (the sign bit flipped), then Σ w·x = Σ u·x − 128·Σ x
///   with the activation block sum: one xor a weight vector instead of a
///   per-row sign fix;
/// - Q4_0, MXFP4, Q4_K, Q6_K: the offset codes of the AVX2 tiles
///   (kernels/arch/avx2_quant.hpp), the offset taken off with Σ x.
/// Loads, scales and the tile's shape are the AVX-512BW tiles'
/// (kernels/arch/avx512_quant.hpp). The 32-weight formats' `Tiles<T,
/// Isa::avx512_vnni>` entries and the tile loop are here, the K-quants'
/// in kernels/arch/avx512_vnni_quant_k.hpp.
///
/// The 32-weight formats (Q8_0, Q4_0, MXFP4) multiply both 16-lane halves of
/// a block in one pass (`both_halves`): each activation quad is broadcast
/// once for 32 lanes instead of once per half. Broadcasts were half the
/// tile's instructions; at many rows (Zen 4 EPYC, one Qwen3-30B-A3B expert,
/// hot weights) Q8_0 went from 189 to 297 GFLOP/s and Q4_0 from 208 to 318,
/// decode unchanged. (The K-quants take both halves at decode row counts
/// only: kernels/arch/avx512_vnni_quant_k.hpp.)

#include "avx512_quant.hpp"
#include "avx512_vnni_quant_k.hpp"  // the K-quant entries

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#if APEX_PACKED_X86
namespace apex::packed::detail {

/// acc + Σ of the 4 products u·s in each 32-bit lane.
APEX_TARGET_AVX512VNNI APEX_KERNEL_INLINE inline __m512i dpbusd(__m512i acc, __m512i u, __m512i s) {
  return _mm512_dpbusd_epi32(acc, u, s);
}

/// Blocks of 32 4-bit codes (Q4_0, MXFP4), R rows: the
/// codes, offset and scale of the type's AVX-512BW entry (Tiles<T,
/// Isa::avx512>), the offset taken off with Σ x.
template <Dtype T>
struct Nibble32Vnni {
  /// Block b, R rows, both 16-lane halves (acc0: lanes 0–15, acc1: 16–31):
  /// per half the integer sums and float step of the AVX-512BW entry (the
  /// same bits), each activation quad broadcast once for the 32 lanes.
  static constexpr int kBothHalvesRows = kAvx512QuantRows;  // every tile
  /// A pass reads the block's lines in order and prefetches each one's
  /// successor 4 KiB ahead (prefetch_line) instead of the tile loop's burst
  /// at each block: one Qwen3-30B-A3B step, cold, Q4_0 1.00–1.16× and MXFP4
  /// 1.01–1.24× at N = 1 to 64, 1.02 at N = 512 (docs/performance.md,
  /// "Q4_0 and MXFP4: one prefetch a line on VNNI"). Q8_0 lost with it.
  static constexpr bool kSkipsBurst = true;
  template <int R>
  APEX_TARGET_AVX512VNNI APEX_KERNEL_INLINE static void both_halves(const std::byte* slab, const std::byte* area,
                                                                    Index b, const QuantRows& x, __m512* acc0,
                                                                    __m512* acc1) {
    using C = Tiles<T, Isa::avx512>;
    __m512i is0[R], is1[R];
    for (int r = 0; r < R; ++r) is0[r] = is1[r] = _mm512_setzero_si512();
    for (int o = 0; o < 4; ++o) {
      const __m512i raw0 = load_half512_ahead<true>(slab, o, 0), raw1 = load_half512_ahead<true>(slab, o, 1);
      const __m512i lo0 = C::offset_codes(low_nibbles512(raw0)), hi0 = C::offset_codes(high_nibbles512(raw0));
      const __m512i lo1 = C::offset_codes(low_nibbles512(raw1)), hi1 = C::offset_codes(high_nibbles512(raw1));
      for (int r = 0; r < R; ++r) {
        const std::int8_t* xq = x.q + r * x.ldq + 32 * b + 8 * o;
        const __m512i xlo = bcast4_512(xq), xhi = bcast4_512(xq + 4);
        is0[r] = dpbusd(dpbusd(is0[r], lo0, xlo), hi0, xhi);
        is1[r] = dpbusd(dpbusd(is1[r], lo1, xlo), hi1, xhi);
      }
    }
    const __m512 dw0 = C::scale(area, 0), dw1 = C::scale(area, 1);
    for (int r = 0; r < R; ++r) {
      const __m512i corr = _mm512_set1_epi32(C::kOffset * x.row(r).sum32(b));
      const __m512 xd = _mm512_set1_ps(x.d[r * x.ldd + b]);
      acc0[r] = accumulate16(acc0[r], _mm512_sub_epi32(is0[r], corr), _mm512_mul_ps(dw0, xd));
      acc1[r] = accumulate16(acc1[r], _mm512_sub_epi32(is1[r], corr), _mm512_mul_ps(dw1, xd));
    }
  }
};

/// Q8_0: u = w + 128 (the sign bit flipped), Σ w·x = Σ u·x − 128·Σ x; fp16 scale d.
template <>
struct Tiles<Dtype::q8_0, Isa::avx512_vnni> {
  /// Block b, R rows, both 16-lane halves (acc0: lanes 0–15, acc1: 16–31):
  /// per half the integer sums and float step of the AVX-512BW entry (the
  /// same bits), each activation quad broadcast once for the 32 lanes.
  static constexpr int kBothHalvesRows = kAvx512QuantRows;  // every tile
  /// No prefetch of Q8_0's blocks: the tile loop's burst (a block's 17
  /// lines 4 KiB ahead) cost more than it gave on Zen 4, and one prefetch a
  /// line more again; the hardware prefetcher alone streams Q8_0's in-order
  /// 1 KiB blocks fastest. One Qwen3-30B-A3B step, cold, burst against
  /// none: 1.09–1.13× at N = 1 and 4, 1.25× at N = 16, 1.06× at N = 512
  /// (docs/performance.md, "Q8_0 decode on 8-lane quarters").
  static constexpr bool kSkipsBurst = true;
  template <int R>
  APEX_TARGET_AVX512VNNI APEX_KERNEL_INLINE static void both_halves(const std::byte* slab, const std::byte* area,
                                                                    Index b, const QuantRows& x, __m512* acc0,
                                                                    __m512* acc1) {
    __m512i is0[R], is1[R];
    if constexpr (R == 1) {
      one_row_sums(slab, x.q + 32 * b, is0[0], is1[0]);
    } else {
      for (int r = 0; r < R; ++r) is0[r] = is1[r] = _mm512_setzero_si512();
      zmm_sums<R>(slab, b, x, is0, is1);
    }
    const __m512 dw0 = load_fp16x16(area), dw1 = load_fp16x16(area + 32);
    for (int r = 0; r < R; ++r) {
      const __m512i corr = _mm512_set1_epi32(128 * x.row(r).sum32(b));
      const __m512 xd = _mm512_set1_ps(x.d[r * x.ldd + b]);
      acc0[r] = accumulate16(acc0[r], _mm512_sub_epi32(is0[r], corr), _mm512_mul_ps(dw0, xd));
      acc1[r] = accumulate16(acc1[r], _mm512_sub_epi32(is1[r], corr), _mm512_mul_ps(dw1, xd));
    }
  }

  /// One row (decode): Σ u·x of the block's four 8-lane quarters on ymm
  /// (32-byte loads, the AVX2 entry's order), joined into the halves'
  /// lanes 0–15 (is0) and 16–31 (is1). The same integer sums as zmm_sums;
  /// on Zen 4 a cold block streams faster this way than in 64-byte loads:
  /// one Qwen3-30B-A3B step, cold, 1.08–1.12× at N = 1 to 16 over zmm
  /// without prefetch (docs/performance.md, "Q8_0 decode on 8-lane quarters").
  APEX_TARGET_AVX512VNNI APEX_KERNEL_INLINE static void one_row_sums(const std::byte* slab, const std::int8_t* xq,
                                                                     __m512i& is0, __m512i& is1) {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    __m256i s[4];
    for (auto& v : s) v = _mm256_setzero_si256();
    for (int q = 0; q < 8; ++q) {
      const __m256i xv = bcast4(xq + 4 * q);
      for (int v = 0; v < 4; ++v) {
        const auto* line = reinterpret_cast<const __m256i*>(slab + (q * kPanelLanes + 8 * v) * 4);
        s[v] = _mm256_dpbusd_epi32(s[v], _mm256_xor_si256(_mm256_loadu_si256(line), flip), xv);  // w + 128
      }
    }
    is0 = _mm512_inserti64x4(_mm512_castsi256_si512(s[0]), s[1], 1);
    is1 = _mm512_inserti64x4(_mm512_castsi256_si512(s[2]), s[3], 1);
  }

  /// R rows: Σ u·x of both 16-lane halves, each activation quad broadcast
  /// once for the 32 lanes.
  template <int R>
  APEX_TARGET_AVX512VNNI APEX_KERNEL_INLINE static void zmm_sums(const std::byte* slab, Index b, const QuantRows& x,
                                                                 __m512i* is0, __m512i* is1) {
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int q = 0; q < 8; ++q) {
      const __m512i u0 = _mm512_xor_si512(load_half512(slab, q, 0), flip);  // w + 128 ∈ [0, 255]
      const __m512i u1 = _mm512_xor_si512(load_half512(slab, q, 1), flip);
      for (int r = 0; r < R; ++r) {
        const __m512i xv = bcast4_512(x.q + r * x.ldq + 32 * b + 4 * q);
        is0[r] = dpbusd(is0[r], u0, xv);
        is1[r] = dpbusd(is1[r], u1, xv);
      }
    }
  }
};

/// Q4_0 and MXFP4: their AVX-512BW entries' codes and scales.
template <>
struct Tiles<Dtype::q4_0, Isa::avx512_vnni> : Nibble32Vnni<Dtype::q4_0> {};
template <>
struct Tiles<Dtype::mxfp4, Isa::avx512_vnni> : Nibble32Vnni<Dtype::mxfp4> {};

/// Whether the tile loop leaves a VNNI entry's blocks without a burst
/// (kSkipsBurst): the entry prefetches its lines itself (Q4_0, MXFP4) or
/// leaves them to the hardware (Q8_0).
template <class Entry, class = void>
inline constexpr bool skips_burst_v = false;
template <class Entry>
inline constexpr bool skips_burst_v<Entry, std::void_t<decltype(Entry::kSkipsBurst)>> = Entry::kSkipsBurst;

/// The VNNI tile loop: QuantTilesAvx512's on the VNNI block products.
struct QuantTilesVnni {
  template <Dtype T, int R, class Epi>
  APEX_TARGET_AVX512VNNI static void tile(const std::byte* codes, const std::byte* scales, Index K, const QuantRows& x,
                                          float* out, Index ldo, Index ncols) {
    static_assert(TilesOn<T, Isa::avx512_vnni>::check());
    using W = WeightType<T>;
    __m512 acc[2][R];  // half v of row r: acc[v][r]
    for (int r = 0; r < R; ++r) acc[0][r] = acc[1][r] = _mm512_setzero_ps();
    constexpr Index slab_bytes = kPanelLanes * W::kCodeBytes, area_bytes = kPanelLanes * W::kScaleBytes;
    for (Index b = 0; b < K / W::kBlockWeights; ++b) {
      const std::byte* slab = codes + b * slab_bytes;
      const std::byte* area = scales + b * area_bytes;
      using Entry = Tiles<T, Isa::avx512_vnni>;
      if constexpr (!skips_burst_v<Entry>) prefetch_block<T>(slab, area);
      if constexpr (R <= both_halves_rows_v<Entry>)
        Entry::template both_halves<R>(slab, area, b, x, acc[0], acc[1]);
      else
        for (int v = 0; v < 2; ++v) Entry::template block<R>(slab, area, b, x, v, acc[v]);
    }
    for (int r = 0; r < R; ++r) store_row_avx512<Epi>(acc[0][r], acc[1][r], out + r * ldo, ncols);
  }
};

}  // namespace apex::packed::detail
#endif
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
