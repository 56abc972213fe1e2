#pragma once
/// \file kernels/arch/avx2_quant.hpp
/// AVX2 tiles of the block formats (kernels/quant_types.hpp,
/// kernels/quant_k_types.hpp): the integer block products of each entry's
/// `dot_block`, 8 lanes a vector.
///
/// One 32-bit lane of a code vector holds 4 consecutive weights of one row
/// (kernels/quant_layout.hpp), so `vpmaddubsw` against a broadcast word of 4
/// activation codes, then `vpmaddwd` with ones, gives 8 rows' 4-term dot
/// products in int32 at once, with no horizontal sum. `vpmaddubsw` wants
/// one unsigned operand:
/// - Q8_0 codes are signed: the sign trick, |w| · sign(x, w) (|−128| is 128
///   as unsigned, and Q8_0 activations never hold −128);
/// - the 4-bit and 6-bit codes are unsigned offsets u = q + o (Q4_0: o = 8,
///   MXFP4 through a 16-byte table with o = 12, Q6_K: o = 32), and
///   Σ q·x = Σ u·x − o·Σ x with the activation block sums.
/// int16 partial sums stay below 2^15: at most two pairs of 4-bit codes
/// (2·2·24·128) or one pair of 6-bit codes (2·63·128 each) before `vpmaddwd`.
/// The float step, fma(float(Σ), d_w·d_x, acc), is the entry's, in its order.
/// The AVX-512 paths run these tiles for the block formats.

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
APEX_TARGET_AVX2 inline __m256i bcast4(const std::int8_t* q) {
  std::int32_t v;
  std::memcpy(&v, q, 4);
  return _mm256_set1_epi32(v);
}
/// 8 × Σ of 4 products u·s (u unsigned bytes, s signed) in int32.
APEX_TARGET_AVX2 inline __m256i dot4(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
/// As dot4 for two 4-byte groups at once (a byte of 4-bit codes: low and high nibble).
APEX_TARGET_AVX2 inline __m256i dot8(__m256i u0, __m256i s0, __m256i u1, __m256i s1) {
  return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(u0, s0), _mm256_maddubs_epi16(u1, s1)),
                           _mm256_set1_epi16(1));
}
/// acc = fma(float(isum), scale, acc) on 8 lanes (the entries' float step).
APEX_TARGET_AVX2 inline void accumulate8(float* acc, __m256i isum, __m256 scale) {
  _mm256_store_ps(acc, _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, _mm256_load_ps(acc)));
}
APEX_TARGET_AVX2 inline __m256i load32(const std::byte* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
/// 8 fp16 fields of a plane as float.
APEX_TARGET_AVX2 inline __m256 load_fp16x8(const std::byte* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
/// 8 bytes of a plane widened to int32 (unsigned or signed).
APEX_TARGET_AVX2 inline __m256i load_u8x8(const std::byte* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
APEX_TARGET_AVX2 inline __m256i load_i8x8(const std::byte* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
/// The low and high nibbles of 32 bytes.
APEX_TARGET_AVX2 inline __m256i low_nibbles(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
APEX_TARGET_AVX2 inline __m256i high_nibbles(__m256i v) {
  return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F));
}
/// 2^(e−128) for 8 E8M0 bytes: ggml's e8m0 "half" (subnormal below e = 2).
APEX_TARGET_AVX2 inline __m256 e8m0_half8(const std::byte* p) {
  const __m256i e = load_u8x8(p);
  const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
  const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
  return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
}
/// Software prefetch of a slab's bytes, kPrefetchBytes ahead (kernels/isa.hpp).
inline void prefetch_bytes(const std::byte* p, Index bytes) {
  for (Index o = 0; o < bytes; o += 128) prefetch_slab(p + o);
}
/// The 32 accumulators of row r through the epilogue.
template <class Epi>
APEX_TARGET_AVX2 inline void store_acc_avx2(const float* acc, float* out, Index ncols) {
  __m256 v[4];
  for (int i = 0; i < 4; ++i) v[i] = _mm256_load_ps(acc + 8 * i);
  store_row_avx2<Epi>(v, out, ncols);
}

/// Block formats of 32 weights (Q8_0, Q4_0, MXFP4): isum of R rows × 8
/// lanes of block b; then the float step.
template <Dtype T>
struct Block32Avx2 {
  using W = WeightType<T>;
  template <int R>
  APEX_TARGET_AVX2 static void block(const std::byte* slab, const std::byte* area, Index b, const QuantRows& x,
                                     int v, float (*acc)[32]) {
    __m256i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
    if constexpr (T == Dtype::q8_0) {
      for (int q = 0; q < 8; ++q) {
        const __m256i w = load32(slab + (q * kPanelLanes + 8 * v) * 4);
        const __m256i aw = _mm256_sign_epi8(w, w);
        for (int r = 0; r < R; ++r)
          isum[r] = _mm256_add_epi32(isum[r], dot4(aw, _mm256_sign_epi8(bcast4(x.q + r * x.ldq + 32 * b + 4 * q), w)));
      }
    } else {
      // int16 partial sums over `run` octs before vpmaddwd: each oct adds at
      // most 2·2·15·127 (Q4_0, 4 octs < 2^15) or 2·2·24·127 (MXFP4, 2 octs)
      constexpr int run = T == Dtype::mxfp4 ? 2 : 4;
      __m256i p16[R];
      for (int r = 0; r < R; ++r) p16[r] = _mm256_setzero_si256();
      for (int o = 0; o < 4; ++o) {
        const __m256i raw = load32(slab + (o * kPanelLanes + 8 * v) * 4);
        __m256i lo = low_nibbles(raw), hi = high_nibbles(raw);
        if constexpr (T == Dtype::mxfp4) {  // u = v2[q] + 12 ∈ [0, 24]
          const __m256i lut = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0, 12, 13, 14,
                                               15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
          lo = _mm256_shuffle_epi8(lut, lo);
          hi = _mm256_shuffle_epi8(lut, hi);
        }
        for (int r = 0; r < R; ++r) {
          const std::int8_t* xq = x.q + r * x.ldq + 32 * b + 8 * o;
          const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(xq)), _mm256_maddubs_epi16(hi, bcast4(xq + 4)));
          p16[r] = _mm256_add_epi16(p16[r], p);
          if (o % run == run - 1) {
            isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(p16[r], _mm256_set1_epi16(1)));
            p16[r] = _mm256_setzero_si256();
          }
        }
      }
      constexpr std::int32_t offset = T == Dtype::mxfp4 ? 12 : 8;
      for (int r = 0; r < R; ++r)
        isum[r] = _mm256_sub_epi32(isum[r], _mm256_set1_epi32(offset * x.row(r).sum32(b)));
    }
    const __m256 dw = T == Dtype::mxfp4 ? e8m0_half8(area + 8 * v) : load_fp16x8(area + 16 * v);
    for (int r = 0; r < R; ++r)
      accumulate8(acc[r] + 8 * v, isum[r], _mm256_mul_ps(dw, _mm256_set1_ps(x.d[r * x.ldd + b])));
  }
};

/// Q4_K, one super-block: Σ_j sc_j·Σ q·x and Σ_j m_j·Σ x per lane, then two fmas.
struct Q4KAvx2 {
  using W = WeightType<Dtype::q4_k>;
  template <int R>
  APEX_TARGET_AVX2 static void block(const std::byte* slab, const std::byte* area, Index b, const QuantRows& x,
                                     int v, float (*acc)[32]) {
    const std::byte* planes = area + W::kScalePlanes + 8 * v;  // byte plane j at planes + 32·j
    __m256i sumi[R], mins[R];
    for (int r = 0; r < R; ++r) sumi[r] = mins[r] = _mm256_setzero_si256();
    const __m256i m6 = _mm256_set1_epi32(63), m4 = _mm256_set1_epi32(15);
    __m256i m_even = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      __m256i sc, m;  // quant::q4_k_scale_min, 8 lanes
      if (j < 4) {
        sc = _mm256_and_si256(load_u8x8(planes + 32 * j), m6);
        m = _mm256_and_si256(load_u8x8(planes + 32 * (j + 4)), m6);
      } else {
        const __m256i hi = load_u8x8(planes + 32 * (j + 4));
        sc = _mm256_or_si256(_mm256_and_si256(hi, m4), _mm256_slli_epi32(_mm256_srli_epi32(load_u8x8(planes + 32 * (j - 4)), 6), 4));
        m = _mm256_or_si256(_mm256_srli_epi32(hi, 4), _mm256_slli_epi32(_mm256_srli_epi32(load_u8x8(planes + 32 * j), 6), 4));
      }
      __m256i p16[R];  // ≤ 4 octs · 2 · 2 · 15 · 128 < 2^15
      for (int r = 0; r < R; ++r) p16[r] = _mm256_setzero_si256();
      for (int o = 4 * j; o < 4 * j + 4; ++o) {
        const __m256i raw = load32(slab + (o * kPanelLanes + 8 * v) * 4);
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
      if (j % 2 == 0) {
        m_even = m;
        continue;
      }
      // m_{j−1}·Σx_{j−1} + m_j·Σx_j as one vpmaddwd of int16 pairs (|Σx| ≤ 32·128)
      const __m256i m2 = _mm256_or_si256(m_even, _mm256_slli_epi32(m, 16));
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
};

/// Q6_K, one super-block: Σ_g sc_g·(Σ u·x − 32·Σ x) per lane, then one fma.
struct Q6KAvx2 {
  using W = WeightType<Dtype::q6_k>;
  template <int R>
  APEX_TARGET_AVX2 static void block(const std::byte* slab, const std::byte* area, Index b, const QuantRows& x,
                                     int v, float (*acc)[32]) {
    const std::byte* high = slab + W::kHighBits;
    const __m256i three = _mm256_set1_epi8(3);
    __m256i sumi[R];
    for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
    for (int g = 0; g < 16; ++g) {
      const __m256i hraw = load32(high + (g * kPanelLanes + 8 * v) * 4);
      __m256i isum[R];
      for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
      for (int half = 0; half < 2; ++half) {  // octs 2g, 2g + 1: quads 4g + 2·half, +1
        const int o = 2 * g + half;
        const __m256i raw = load32(slab + (o * kPanelLanes + 8 * v) * 4);
        const __m256i h0 = _mm256_and_si256(_mm256_srli_epi16(hraw, 4 * half), three);
        const __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(hraw, 4 * half + 2), three);
        const __m256i u0 = _mm256_or_si256(low_nibbles(raw), _mm256_slli_epi16(h0, 4));
        const __m256i u1 = _mm256_or_si256(high_nibbles(raw), _mm256_slli_epi16(h1, 4));
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
    const __m256 d = load_fp16x8(area + 16 * v);
    for (int r = 0; r < R; ++r)
      accumulate8(acc[r] + 8 * v, sumi[r], _mm256_mul_ps(d, _mm256_set1_ps(x.d[r * x.ldd + b])));
  }
};

template <Dtype T>
struct QuantBlockAvx2 : Block32Avx2<T> {};
template <>
struct QuantBlockAvx2<Dtype::q4_k> : Q4KAvx2 {};
template <>
struct QuantBlockAvx2<Dtype::q6_k> : Q6KAvx2 {};

/// R rows (x already offset to the first) against one panel of type T.
template <Dtype T, int R, class Epi>
APEX_TARGET_AVX2 void quant_tile_avx2(const std::byte* codes, const std::byte* scales, Index K, const QuantRows& x,
                                      float* out, Index ldo, Index ncols) {
  using W = WeightType<T>;
  alignas(32) float acc[R][32] = {};
  constexpr Index slab_bytes = kPanelLanes * W::kCodeBytes, area_bytes = kPanelLanes * W::kScaleBytes;
  for (Index b = 0; b < K / W::kBlockWeights; ++b) {
    const std::byte* slab = codes + b * slab_bytes;
    const std::byte* area = scales + b * area_bytes;
    prefetch_bytes(slab, slab_bytes);
    prefetch_bytes(area, area_bytes);
    for (int v = 0; v < 4; ++v) QuantBlockAvx2<T>::template block<R>(slab, area, b, x, v, acc);
  }
  for (int r = 0; r < R; ++r) store_acc_avx2<Epi>(acc[r], out + r * ldo, ncols);
}

/// out (rows × ncols) = epilogue(x · panel) for a block format, tiles of 4 rows.
template <Dtype T, class Epi>
APEX_TARGET_AVX2 void quant_panel_avx2(const std::byte* codes, const std::byte* scales, Index K, const QuantRows& x,
                                       Index rows, float* out, Index ldo, Index ncols) {
  const auto at = [&](Index r) {
    return QuantRows{x.q + r * x.ldq, x.ldq, x.d + r * x.ldd, x.ldd, x.s16 + r * x.lds, x.lds};
  };
  Index r = 0;
  for (; r + kAvx2QuantRows <= rows; r += kAvx2QuantRows)
    quant_tile_avx2<T, kAvx2QuantRows, Epi>(codes, scales, K, at(r), out + r * ldo, ldo, ncols);
  switch (rows - r) {
    case 3: quant_tile_avx2<T, 3, Epi>(codes, scales, K, at(r), out + r * ldo, ldo, ncols); break;
    case 2: quant_tile_avx2<T, 2, Epi>(codes, scales, K, at(r), out + r * ldo, ldo, ncols); break;
    case 1: quant_tile_avx2<T, 1, Epi>(codes, scales, K, at(r), out + r * ldo, ldo, ncols); break;
    default: break;
  }
}

}  // namespace apex::packed::detail
#endif
