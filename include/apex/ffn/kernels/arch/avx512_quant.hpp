#pragma once
/// \file kernels/arch/avx512_quant.hpp
/// AVX-512 (F + BW) tiles of the block formats: each type's
/// `Tiles<T, Isa::avx512>` entry of the weight-type table, the AVX2 tiles'
/// arithmetic (kernels/arch/avx2_quant.hpp) on 16 lanes a vector, so a
/// panel's 32 lanes are two halves v = 0, 1. The same integer block sums
/// (`vpmaddubsw`, int16 runs below 2^15, `vpmaddwd`), the same float step,
/// so the same bits as the scalar path. AVX-512BW has no `vpsignb`: Q8_0's
/// sign trick negates the activation bytes under the mask of the negative
/// weights instead (`vpmovb2m`, a masked `vpsubb`). This file has the
/// helpers, the 32-weight formats' tiles and the tile loop;
/// kernels/arch/avx512_quant_k.hpp the K-quants'.
///
/// The accumulators of a tile stay in registers across the blocks of K
/// (2R zmm), where the AVX2 tiles keep them in memory; with 32 registers a
/// tile of kAvx512QuantRows = 6 rows leaves room for a block's int16 and
/// int32 partial sums. The helpers here serve the VNNI tiles as well
/// (kernels/arch/avx512_vnni_quant.hpp).

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../epilogue.hpp"
#include "../quant_layout.hpp"
#include "../weight_types.hpp"
#include "avx2_quant.hpp"
#include "avx512.hpp"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#if APEX_PACKED_X86
namespace apex::packed::detail {

inline constexpr int kAvx512QuantRows = 6;

/// 4 activation codes (one 32-bit word) in all 16 lanes.
APEX_TARGET_AVX512 APEX_KERNEL_INLINE inline __m512i bcast4_512(const std::int8_t* q) {
  std::int32_t v;
  std::memcpy(&v, q, 4);
  return _mm512_set1_epi32(v);
}
/// 16 lanes (64 bytes) of codes: half v of slab row `group` (a quad, oct or
/// 16-k group of 32 lanes × 4 bytes).
APEX_TARGET_AVX512 APEX_KERNEL_INLINE inline __m512i load_half512(const std::byte* slab, Index group, int v) {
  return _mm512_loadu_si512(slab + (group * kPanelLanes + 16 * v) * 4);
}
/// load_half512, and if Ahead the line kPrefetchBytes ahead of it prefetched
/// (prefetch_line): for the K-quant tiles that read a slab front to back;
/// one pass per half reads every other line, where the prefetch lost.
template <bool Ahead>
APEX_TARGET_AVX512 APEX_KERNEL_INLINE inline __m512i load_half512_ahead(const std::byte* slab, Index group, int v) {
  if constexpr (Ahead) prefetch_line(slab + (group * kPanelLanes + 16 * v) * 4);
  return load_half512(slab, group, v);
}
APEX_TARGET_AVX512 APEX_KERNEL_INLINE inline __m512i low_nibbles512(__m512i v) { return _mm512_and_si512(v,
                                                                    _mm512_set1_epi8(0x0F)); }
APEX_TARGET_AVX512 APEX_KERNEL_INLINE inline __m512i high_nibbles512(__m512i v) {
  return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
}
/// MXFP4 codes to u = v2[q] + 12 ∈ [0, 24] (the AVX2 tile's table, per 128-bit lane).
APEX_TARGET_AVX512 APEX_KERNEL_INLINE inline __m512i mxfp4_offsets512(__m512i q) {
  const __m512i lut = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
  return _mm512_shuffle_epi8(lut, q);
}
/// 16 fp16 fields of a plane as float.
APEX_TARGET_AVX512 APEX_KERNEL_INLINE inline __m512 load_fp16x16(const std::byte* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
/// 16 bytes of a plane widened to int32 (unsigned or signed).
APEX_TARGET_AVX512 APEX_KERNEL_INLINE inline __m512i load_u8x16(const std::byte* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
APEX_TARGET_AVX512 APEX_KERNEL_INLINE inline __m512i load_i8x16(const std::byte* p) {
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
/// 2^(e−128) for 16 E8M0 bytes (as e8m0_half8).
APEX_TARGET_AVX512 APEX_KERNEL_INLINE inline __m512 e8m0_half16(const std::byte* p) {
  const __m512i e = load_u8x16(p);
  const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
  const __m512i tiny = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
  return _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask(e, _mm512_set1_epi32(2)), normal, tiny));
}
/// Σ over pairs of int16 lanes into int32 (`vpmaddwd` with ones).
APEX_TARGET_AVX512 APEX_KERNEL_INLINE inline __m512i widen_pairs512(__m512i p16) {
  return _mm512_madd_epi16(p16, _mm512_set1_epi16(1));
}
/// acc = fma(float(isum), scale, acc) (the entries' float step).
APEX_TARGET_AVX512 APEX_KERNEL_INLINE inline __m512 accumulate16(__m512 acc, __m512i isum, __m512 scale) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc);
}
/// Q4_K's sub-block scale sc_j and min m_j of 16 lanes (quant::q4_k_scale_min).
APEX_TARGET_AVX512 APEX_KERNEL_INLINE inline void q4_k_scale_min16(const std::byte* planes, int j, __m512i& sc,
                                                                   __m512i& m) {
  const __m512i m6 = _mm512_set1_epi32(63), m4 = _mm512_set1_epi32(15);
  if (j < 4) {
    sc = _mm512_and_si512(load_u8x16(planes + 32 * j), m6);
    m = _mm512_and_si512(load_u8x16(planes + 32 * (j + 4)), m6);
    return;
  }
  const __m512i hi = load_u8x16(planes + 32 * (j + 4));
  sc = _mm512_or_si512(_mm512_and_si512(hi, m4), _mm512_slli_epi32(_mm512_srli_epi32(load_u8x16(planes + 32 * (j - 4)), 6), 4));
  m = _mm512_or_si512(_mm512_srli_epi32(hi, 4), _mm512_slli_epi32(_mm512_srli_epi32(load_u8x16(planes + 32 * j), 6), 4));
}
/// Q4_K's Σ_j m_j·Σ x_j for the pair of sub-blocks (j − 1, j) of row x:
/// one `vpmaddwd` of int16 pairs (|Σx| ≤ 32·128).
APEX_TARGET_AVX512 APEX_KERNEL_INLINE inline __m512i q4_k_min_pair16(__m512i m_even, __m512i m_odd, const QuantRow& x,
                                                                     Index sub) {
  const __m512i m2 = _mm512_or_si512(m_even, _mm512_slli_epi32(m_odd, 16));
  const std::uint32_t pair =
      std::uint32_t(std::uint16_t(x.sum32(sub - 1))) | (std::uint32_t(std::uint16_t(x.sum32(sub))) << 16);
  return _mm512_madd_epi16(m2, _mm512_set1_epi32(std::int32_t(pair)));
}
/// Q6_K's 6-bit codes u ∈ [0, 63] of oct o = 2g + half: the low nibbles of
/// the oct and two high bits each from the group's 2-bit plane. The two bits
/// reach bits 4–5 by one 16-bit shift of the plane (what crosses a byte is
/// outside 0x30) and join the nibble in one `vpternlogd` ((a & 0x0F) | b).
APEX_TARGET_AVX512 APEX_KERNEL_INLINE inline void q6_k_codes16(__m512i raw, __m512i hraw, int half, __m512i& u0,
                                                               __m512i& u1) {
  const __m512i nibble = _mm512_set1_epi8(0x0F), bits45 = _mm512_set1_epi8(0x30);
  // the plane's bits 4·half + (0, 1) to bits 4–5, and 4·half + (2, 3)
  const __m512i h0 = half == 0 ? _mm512_slli_epi16(hraw, 4) : hraw;
  const __m512i h1 = half == 0 ? _mm512_slli_epi16(hraw, 2) : _mm512_srli_epi16(hraw, 2);
  constexpr int kLowOr = 0xEC;  // (A & C) | B with A = 0xF0, B = 0xCC, C = 0xAA
  u0 = _mm512_ternarylogic_epi32(raw, _mm512_and_si512(h0, bits45), nibble, kLowOr);
  u1 = _mm512_ternarylogic_epi32(_mm512_srli_epi16(raw, 4), _mm512_and_si512(h1, bits45), nibble, kLowOr);
}

/// Row r of a tile's activations.
inline QuantRows quant_rows_from(const QuantRows& x, Index r) {
  return QuantRows{x.q + r * x.ldq, x.ldq, x.d + r * x.ldd, x.ldd, x.s16 + r * x.lds, x.lds};
}

/// Blocks of 32 4-bit codes (Q4_0, MXFP4), half v of block b, R rows:
/// acc[r] += isum · d_w·d_x. What differs between the types comes from the
/// type's entry C = Tiles<T, Isa::avx512> (as Nibble32Avx2's:
/// `offset_codes`, `kOffset`, `kRun`, `scale` of 16 lanes); the VNNI tiles
/// read the same entry.
template <Dtype T>
struct Nibble32Avx512 {
  template <int R>
  APEX_TARGET_AVX512 APEX_KERNEL_INLINE static void block(const std::byte* slab, const std::byte* area, Index b,
                                                          const QuantRows& x, int v, __m512* acc) {
    using C = Tiles<T, Isa::avx512>;
    __m512i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    __m512i p16[R];
    for (int r = 0; r < R; ++r) p16[r] = _mm512_setzero_si512();
    for (int o = 0; o < 4; ++o) {
      const __m512i raw = load_half512(slab, o, v);
      const __m512i lo = C::offset_codes(low_nibbles512(raw)), hi = C::offset_codes(high_nibbles512(raw));
      for (int r = 0; r < R; ++r) {
        const std::int8_t* xq = x.q + r * x.ldq + 32 * b + 8 * o;
        p16[r] = _mm512_add_epi16(p16[r], _mm512_add_epi16(_mm512_maddubs_epi16(lo, bcast4_512(xq)),
                                                           _mm512_maddubs_epi16(hi, bcast4_512(xq + 4))));
        if (o % C::kRun == C::kRun - 1) {
          isum[r] = _mm512_add_epi32(isum[r], widen_pairs512(p16[r]));
          p16[r] = _mm512_setzero_si512();
        }
      }
    }
    for (int r = 0; r < R; ++r)
      isum[r] = _mm512_sub_epi32(isum[r], _mm512_set1_epi32(C::kOffset * x.row(r).sum32(b)));
    const __m512 dw = C::scale(area, v);
    for (int r = 0; r < R; ++r)
      acc[r] = accumulate16(acc[r], isum[r], _mm512_mul_ps(dw, _mm512_set1_ps(x.d[r * x.ldd + b])));
  }
};

/// Q8_0: |w| · (x negated where w < 0), |Σ pair| ≤ 2·128·127; fp16 scale d.
template <>
struct Tiles<Dtype::q8_0, Isa::avx512> {
  template <int R>
  APEX_TARGET_AVX512 APEX_KERNEL_INLINE static void block(const std::byte* slab, const std::byte* area, Index b,
                                                          const QuantRows& x, int v, __m512* acc) {
    __m512i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    for (int q = 0; q < 8; ++q) {
      const __m512i w = load_half512(slab, q, v);
      const __m512i aw = _mm512_abs_epi8(w);
      const __mmask64 neg = _mm512_movepi8_mask(w);
      for (int r = 0; r < R; ++r) {
        const __m512i xv = bcast4_512(x.q + r * x.ldq + 32 * b + 4 * q);
        const __m512i sx = _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv);
        isum[r] = _mm512_add_epi32(isum[r], widen_pairs512(_mm512_maddubs_epi16(aw, sx)));
      }
    }
    const __m512 dw = load_fp16x16(area + 32 * v);
    for (int r = 0; r < R; ++r)
      acc[r] = accumulate16(acc[r], isum[r], _mm512_mul_ps(dw, _mm512_set1_ps(x.d[r * x.ldd + b])));
  }
};

/// Q4_0: u = q (value q − 8), runs of 4 octs, fp16 scale d.
template <>
struct Tiles<Dtype::q4_0, Isa::avx512> : Nibble32Avx512<Dtype::q4_0> {
  static constexpr int kRun = 4;
  static constexpr std::int32_t kOffset = 8;
  APEX_TARGET_AVX512 APEX_KERNEL_INLINE static __m512i offset_codes(__m512i q) { return q; }
  APEX_TARGET_AVX512 APEX_KERNEL_INLINE static __m512 scale(const std::byte* area, int v) {
    return load_fp16x16(area + 32 * v);
  }
};

/// MXFP4: u = v2[q] + 12 through the table, runs of 2 octs, E8M0 scale.
template <>
struct Tiles<Dtype::mxfp4, Isa::avx512> : Nibble32Avx512<Dtype::mxfp4> {
  static constexpr int kRun = 2;
  static constexpr std::int32_t kOffset = 12;
  APEX_TARGET_AVX512 APEX_KERNEL_INLINE static __m512i offset_codes(__m512i q) { return mxfp4_offsets512(q); }
  APEX_TARGET_AVX512 APEX_KERNEL_INLINE static __m512 scale(const std::byte* area, int v) {
    return e8m0_half16(area + 16 * v);
  }
};

/// Rows up to which a tile entry (AVX-512BW or VNNI) multiplies both 16-lane
/// halves of a block in one pass (`both_halves`): its kBothHalvesRows, none
/// without one.
template <class Entry, class = void>
inline constexpr int both_halves_rows_v = 0;
template <class Entry>
inline constexpr int both_halves_rows_v<Entry, std::void_t<decltype(Entry::kBothHalvesRows)>> = Entry::kBothHalvesRows;

/// One panel of a block format, R rows (x offset to the first): the
/// accumulators of both 16-lane halves in registers across the blocks of K.
/// The VNNI tile (kernels/arch/avx512_vnni_quant.hpp) repeats these lines
/// under its own target: a tile must carry the target of the block products
/// it inlines.
///
/// Q8_0 at one row runs the AVX2 tile (the same sums and float steps, so the
/// same bits): its 32-byte loads in order, one prefetch a line, stream a cold
/// panel faster on Zen 4 than the 64-byte loads after a burst here (one
/// Qwen3-30B-A3B step, cold, N = 1: 1.35×; docs/performance.md, "Q8_0 decode
/// on 8-lane quarters").
struct QuantTilesAvx512 {
  template <Dtype T, int R, class Epi>
  APEX_TARGET_AVX512 static void tile(const std::byte* codes, const std::byte* scales, Index K, const QuantRows& x,
                                      float* out, Index ldo, Index ncols) {
    static_assert(TilesOn<T, Isa::avx512>::check());
    if constexpr (T == Dtype::q8_0 && R == 1) {
      quant_tile_avx2<T, 1, Epi>(codes, scales, K, x, out, ldo, ncols);
      return;
    }
    using W = WeightType<T>;
    __m512 acc[2][R];  // half v of row r: acc[v][r]
    for (int r = 0; r < R; ++r) acc[0][r] = acc[1][r] = _mm512_setzero_ps();
    constexpr Index slab_bytes = kPanelLanes * W::kCodeBytes, area_bytes = kPanelLanes * W::kScaleBytes;
    for (Index b = 0; b < K / W::kBlockWeights; ++b) {
      const std::byte* slab = codes + b * slab_bytes;
      const std::byte* area = scales + b * area_bytes;
      prefetch_block<T>(slab, area);
      using Entry = Tiles<T, Isa::avx512>;
      if constexpr (R <= both_halves_rows_v<Entry>)
        Entry::template both_halves<R>(slab, area, b, x, acc[0], acc[1]);
      else
        for (int v = 0; v < 2; ++v) Entry::template block<R>(slab, area, b, x, v, acc[v]);
    }
    for (int r = 0; r < R; ++r) store_row_avx512<Epi>(acc[0][r], acc[1][r], out + r * ldo, ncols);
  }
};

/// out (rows × ncols) = epilogue(x · panel) for a block format: tiles of
/// kAvx512QuantRows rows, then one of the remainder (a row's bits do not
/// depend on its tile). `Loop` is QuantTilesAvx512 or QuantTilesVnni.
template <class Loop, Dtype T, class Epi>
void quant_panel_512(const std::byte* codes, const std::byte* scales, Index K, const QuantRows& x, Index rows,
                     float* out, Index ldo, Index ncols) {
  static_assert(kAvx512QuantRows == 6, "the remainder switch lists rows 1 to 5");
  const auto run = [&](auto rows_tag, Index r) {
    Loop::template tile<T, decltype(rows_tag)::value, Epi>(codes, scales, K, quant_rows_from(x, r), out + r * ldo,
                                                           ldo, ncols);
  };
  Index r = 0;
  for (; r + kAvx512QuantRows <= rows; r += kAvx512QuantRows) run(std::integral_constant<int, kAvx512QuantRows>{}, r);
  switch (rows - r) {
    case 5: run(std::integral_constant<int, 5>{}, r); break;
    case 4: run(std::integral_constant<int, 4>{}, r); break;
    case 3: run(std::integral_constant<int, 3>{}, r); break;
    case 2: run(std::integral_constant<int, 2>{}, r); break;
    case 1: run(std::integral_constant<int, 1>{}, r); break;
    default: break;
  }
}

}  // namespace apex::packed::detail
#endif
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
