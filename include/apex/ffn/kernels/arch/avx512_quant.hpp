#pragma once
/// \file kernels/arch/avx512_quant.hpp
/// AVX-512 (F + BW) tiles of the block formats: the AVX2 tiles'
/// arithmetic (kernels/arch/avx2_quant.hpp) on 16 lanes a vector, so a
/// panel's 32 lanes are two halves v = 0, 1. The same integer block sums
/// (`vpmaddubsw`, int16 runs below 2^15, `vpmaddwd`), the same float step,
/// so the same bits as the scalar path. AVX-512BW has no `vpsignb`: Q8_0's
/// sign trick negates the activation bytes under the mask of the negative
/// weights instead (`vpmovb2m`, a masked `vpsubb`).
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
APEX_TARGET_AVX512 inline __m512i bcast4_512(const std::int8_t* q) {
  std::int32_t v;
  std::memcpy(&v, q, 4);
  return _mm512_set1_epi32(v);
}
/// 16 lanes (64 bytes) of codes: half v of slab row `group` (a quad, oct or
/// 16-k group of 32 lanes × 4 bytes).
APEX_TARGET_AVX512 inline __m512i load_half512(const std::byte* slab, Index group, int v) {
  return _mm512_loadu_si512(slab + (group * kPanelLanes + 16 * v) * 4);
}
APEX_TARGET_AVX512 inline __m512i low_nibbles512(__m512i v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
APEX_TARGET_AVX512 inline __m512i high_nibbles512(__m512i v) {
  return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
}
/// MXFP4 codes to u = v2[q] + 12 ∈ [0, 24] (the AVX2 tile's table, per 128-bit lane).
APEX_TARGET_AVX512 inline __m512i mxfp4_offsets512(__m512i q) {
  const __m512i lut = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
  return _mm512_shuffle_epi8(lut, q);
}
/// 16 fp16 fields of a plane as float.
APEX_TARGET_AVX512 inline __m512 load_fp16x16(const std::byte* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
/// 16 bytes of a plane widened to int32 (unsigned or signed).
APEX_TARGET_AVX512 inline __m512i load_u8x16(const std::byte* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
APEX_TARGET_AVX512 inline __m512i load_i8x16(const std::byte* p) {
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
/// 2^(e−128) for 16 E8M0 bytes (as e8m0_half8).
APEX_TARGET_AVX512 inline __m512 e8m0_half16(const std::byte* p) {
  const __m512i e = load_u8x16(p);
  const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
  const __m512i tiny = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
  return _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask(e, _mm512_set1_epi32(2)), normal, tiny));
}
/// The scale of half v of a 32-weight block: fp16 d or E8M0.
template <Dtype T>
APEX_TARGET_AVX512 inline __m512 block32_scale512(const std::byte* area, int v) {
  if constexpr (T == Dtype::mxfp4) return e8m0_half16(area + 16 * v);
  else return load_fp16x16(area + 32 * v);
}
/// Σ over pairs of int16 lanes into int32 (`vpmaddwd` with ones).
APEX_TARGET_AVX512 inline __m512i widen_pairs512(__m512i p16) {
  return _mm512_madd_epi16(p16, _mm512_set1_epi16(1));
}
/// acc = fma(float(isum), scale, acc) (the entries' float step).
APEX_TARGET_AVX512 inline __m512 accumulate16(__m512 acc, __m512i isum, __m512 scale) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc);
}
/// Q4_K's sub-block scale sc_j and min m_j of 16 lanes (quant::q4_k_scale_min).
APEX_TARGET_AVX512 inline void q4_k_scale_min16(const std::byte* planes, int j, __m512i& sc, __m512i& m) {
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
APEX_TARGET_AVX512 inline __m512i q4_k_min_pair16(__m512i m_even, __m512i m_odd, const QuantRow& x, Index sub) {
  const __m512i m2 = _mm512_or_si512(m_even, _mm512_slli_epi32(m_odd, 16));
  const std::uint32_t pair =
      std::uint32_t(std::uint16_t(x.sum32(sub - 1))) | (std::uint32_t(std::uint16_t(x.sum32(sub))) << 16);
  return _mm512_madd_epi16(m2, _mm512_set1_epi32(std::int32_t(pair)));
}
/// Q6_K's 6-bit codes u ∈ [0, 63] of oct o = 2g + half: the low nibbles of
/// the oct and two high bits each from the group's 2-bit plane.
APEX_TARGET_AVX512 inline void q6_k_codes16(__m512i raw, __m512i hraw, int half, __m512i& u0, __m512i& u1) {
  const __m512i three = _mm512_set1_epi8(3);
  const __m512i h0 = _mm512_and_si512(_mm512_srli_epi16(hraw, 4 * half), three);
  const __m512i h1 = _mm512_and_si512(_mm512_srli_epi16(hraw, 4 * half + 2), three);
  u0 = _mm512_or_si512(low_nibbles512(raw), _mm512_slli_epi16(h0, 4));
  u1 = _mm512_or_si512(high_nibbles512(raw), _mm512_slli_epi16(h1, 4));
}

/// Row r of a tile's activations.
inline QuantRows quant_rows_from(const QuantRows& x, Index r) {
  return QuantRows{x.q + r * x.ldq, x.ldq, x.d + r * x.ldd, x.ldd, x.s16 + r * x.lds, x.lds};
}

/// Blocks of 32 weights (Q8_0, Q4_0, MXFP4), half v of block b, R rows:
/// acc[r] += isum · d_w·d_x.
template <Dtype T>
struct Block32Avx512 {
  template <int R>
  APEX_TARGET_AVX512 APEX_KERNEL_INLINE static void block(const std::byte* slab, const std::byte* area, Index b,
                                                          const QuantRows& x, int v, __m512* acc) {
    __m512i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    if constexpr (T == Dtype::q8_0) {
      for (int q = 0; q < 8; ++q) {  // |w| · (x negated where w < 0): |Σ pair| ≤ 2·128·127
        const __m512i w = load_half512(slab, q, v);
        const __m512i aw = _mm512_abs_epi8(w);
        const __mmask64 neg = _mm512_movepi8_mask(w);
        for (int r = 0; r < R; ++r) {
          const __m512i xv = bcast4_512(x.q + r * x.ldq + 32 * b + 4 * q);
          const __m512i sx = _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv);
          isum[r] = _mm512_add_epi32(isum[r], widen_pairs512(_mm512_maddubs_epi16(aw, sx)));
        }
      }
    } else {
      constexpr int run = T == Dtype::mxfp4 ? 2 : 4;  // octs per int16 run, as on AVX2
      __m512i p16[R];
      for (int r = 0; r < R; ++r) p16[r] = _mm512_setzero_si512();
      for (int o = 0; o < 4; ++o) {
        const __m512i raw = load_half512(slab, o, v);
        __m512i lo = low_nibbles512(raw), hi = high_nibbles512(raw);
        if constexpr (T == Dtype::mxfp4) lo = mxfp4_offsets512(lo), hi = mxfp4_offsets512(hi);
        for (int r = 0; r < R; ++r) {
          const std::int8_t* xq = x.q + r * x.ldq + 32 * b + 8 * o;
          p16[r] = _mm512_add_epi16(p16[r], _mm512_add_epi16(_mm512_maddubs_epi16(lo, bcast4_512(xq)),
                                                             _mm512_maddubs_epi16(hi, bcast4_512(xq + 4))));
          if (o % run == run - 1) {
            isum[r] = _mm512_add_epi32(isum[r], widen_pairs512(p16[r]));
            p16[r] = _mm512_setzero_si512();
          }
        }
      }
      constexpr std::int32_t offset = T == Dtype::mxfp4 ? 12 : 8;
      for (int r = 0; r < R; ++r)
        isum[r] = _mm512_sub_epi32(isum[r], _mm512_set1_epi32(offset * x.row(r).sum32(b)));
    }
    const __m512 dw = block32_scale512<T>(area, v);
    for (int r = 0; r < R; ++r)
      acc[r] = accumulate16(acc[r], isum[r], _mm512_mul_ps(dw, _mm512_set1_ps(x.d[r * x.ldd + b])));
  }
};

/// Q4_K, one super-block: Σ_j sc_j·Σ q·x and Σ_j m_j·Σ x per lane, then two fmas.
struct Q4KAvx512 {
  using W = WeightType<Dtype::q4_k>;
  template <int R>
  APEX_TARGET_AVX512 APEX_KERNEL_INLINE static void block(const std::byte* slab, const std::byte* area, Index b,
                                                          const QuantRows& x, int v, __m512* acc) {
    const std::byte* planes = area + W::kScalePlanes + 16 * v;
    __m512i sumi[R], mins[R], m_even = _mm512_setzero_si512();
    for (int r = 0; r < R; ++r) sumi[r] = mins[r] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      __m512i sc, m;
      q4_k_scale_min16(planes, j, sc, m);
      __m512i p16[R];  // ≤ 4 octs · 2 · 2 · 15 · 128 < 2^15
      for (int r = 0; r < R; ++r) p16[r] = _mm512_setzero_si512();
      for (int o = 4 * j; o < 4 * j + 4; ++o) {
        const __m512i raw = load_half512(slab, o, v);
        const __m512i lo = low_nibbles512(raw), hi = high_nibbles512(raw);
        for (int r = 0; r < R; ++r) {
          const std::int8_t* xq = x.q + r * x.ldq + 256 * b + 8 * o;
          p16[r] = _mm512_add_epi16(p16[r], _mm512_add_epi16(_mm512_maddubs_epi16(lo, bcast4_512(xq)),
                                                             _mm512_maddubs_epi16(hi, bcast4_512(xq + 4))));
        }
      }
      const __m512i sc2 = _mm512_or_si512(sc, _mm512_slli_epi32(sc, 16));  // sc_j in both int16 halves
      for (int r = 0; r < R; ++r) sumi[r] = _mm512_add_epi32(sumi[r], _mm512_madd_epi16(p16[r], sc2));
      if (j % 2 == 0) {
        m_even = m;
        continue;
      }
      for (int r = 0; r < R; ++r) mins[r] = _mm512_add_epi32(mins[r], q4_k_min_pair16(m_even, m, x.row(r), 8 * b + j));
    }
    const __m512 d = load_fp16x16(area + 32 * v), dmin = load_fp16x16(area + W::kDminPlane + 32 * v);
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int r = 0; r < R; ++r) {
      const __m512 xd = _mm512_set1_ps(x.d[r * x.ldd + b]);
      acc[r] = accumulate16(acc[r], sumi[r], _mm512_mul_ps(d, xd));
      acc[r] = accumulate16(acc[r], mins[r], _mm512_castsi512_ps(_mm512_xor_si512(
                                                 _mm512_castps_si512(_mm512_mul_ps(dmin, xd)), _mm512_castps_si512(sign))));
    }
  }
};

/// Q6_K, one super-block: Σ_g sc_g·(Σ u·x − 32·Σ x) per lane, then one fma.
struct Q6KAvx512 {
  using W = WeightType<Dtype::q6_k>;
  template <int R>
  APEX_TARGET_AVX512 APEX_KERNEL_INLINE static void block(const std::byte* slab, const std::byte* area, Index b,
                                                          const QuantRows& x, int v, __m512* acc) {
    __m512i sumi[R];
    for (int r = 0; r < R; ++r) sumi[r] = _mm512_setzero_si512();
    for (int g = 0; g < 16; ++g) {
      const __m512i hraw = load_half512(slab + W::kHighBits, g, v);
      __m512i isum[R];
      for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
      for (int half = 0; half < 2; ++half) {
        const int o = 2 * g + half;
        __m512i u0, u1;
        q6_k_codes16(load_half512(slab, o, v), hraw, half, u0, u1);
        for (int r = 0; r < R; ++r) {  // two pairs of 6-bit codes: ≤ 2·2·63·128 < 2^15
          const std::int8_t* xq = x.q + r * x.ldq + 256 * b + 8 * o;
          isum[r] = _mm512_add_epi32(isum[r], widen_pairs512(_mm512_add_epi16(_mm512_maddubs_epi16(u0, bcast4_512(xq)),
                                                                               _mm512_maddubs_epi16(u1, bcast4_512(xq + 4)))));
        }
      }
      const __m512i sc = load_i8x16(area + W::kScalePlanes + g * kPanelLanes + 16 * v);
      for (int r = 0; r < R; ++r) {
        const __m512i centred = _mm512_sub_epi32(isum[r], _mm512_set1_epi32(32 * x.s16[r * x.lds + 16 * b + g]));
        sumi[r] = _mm512_add_epi32(sumi[r], _mm512_mullo_epi32(sc, centred));
      }
    }
    const __m512 d = load_fp16x16(area + 32 * v);
    for (int r = 0; r < R; ++r) acc[r] = accumulate16(acc[r], sumi[r], _mm512_mul_ps(d, _mm512_set1_ps(x.d[r * x.ldd + b])));
  }
};

template <Dtype T>
struct QuantBlockAvx512 : Block32Avx512<T> {};
template <>
struct QuantBlockAvx512<Dtype::q4_k> : Q4KAvx512 {};
template <>
struct QuantBlockAvx512<Dtype::q6_k> : Q6KAvx512 {};

/// One panel of a block format, R rows (x offset to the first): the
/// accumulators of both 16-lane halves in registers across the blocks of K.
/// The VNNI tile (kernels/arch/avx512_vnni_quant.hpp) repeats these lines
/// under its own target: a tile must carry the target of the block products
/// it inlines.
struct QuantTilesAvx512 {
  template <Dtype T, int R, class Epi>
  APEX_TARGET_AVX512 static void tile(const std::byte* codes, const std::byte* scales, Index K, const QuantRows& x,
                                      float* out, Index ldo, Index ncols) {
    using W = WeightType<T>;
    __m512 acc[2][R];  // half v of row r: acc[v][r]
    for (int r = 0; r < R; ++r) acc[0][r] = acc[1][r] = _mm512_setzero_ps();
    constexpr Index slab_bytes = kPanelLanes * W::kCodeBytes, area_bytes = kPanelLanes * W::kScaleBytes;
    for (Index b = 0; b < K / W::kBlockWeights; ++b) {
      const std::byte* slab = codes + b * slab_bytes;
      const std::byte* area = scales + b * area_bytes;
      prefetch_bytes(slab, slab_bytes);
      prefetch_bytes(area, area_bytes);
      for (int v = 0; v < 2; ++v) QuantBlockAvx512<T>::template block<R>(slab, area, b, x, v, acc[v]);
    }
    for (int r = 0; r < R; ++r) store_row_avx512<Epi>(acc[0][r], acc[1][r], out + r * ldo, ncols);
  }
};

/// out (rows × ncols) = epilogue(x · panel) for a block format: tiles of
/// kAvx512QuantRows rows, then one of the remainder (a row's bits do not
/// depend on its tile). `Tiles` is QuantTilesAvx512 or QuantTilesVnni.
template <class Tiles, Dtype T, class Epi>
void quant_panel_512(const std::byte* codes, const std::byte* scales, Index K, const QuantRows& x, Index rows,
                     float* out, Index ldo, Index ncols) {
  static_assert(kAvx512QuantRows == 6, "the remainder switch lists rows 1 to 5");
  const auto run = [&](auto rows_tag, Index r) {
    Tiles::template tile<T, decltype(rows_tag)::value, Epi>(codes, scales, K, quant_rows_from(x, r), out + r * ldo,
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
