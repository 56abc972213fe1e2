#pragma once
/// \file kernels/arch/avx2_quant.hpp
/// AVX2 tiles of the block formats (kernels/quant_types.hpp,
/// kernels/quant_k_types.hpp): each type's `Tiles<T, Isa::avx2>` entry of
/// the weight-type table holds the integer block product of its entry's
/// `dot_block`, 8 lanes a vector, and the pieces of its column unpacker
/// (kernels/arch/avx2_unpack_columns.hpp). This file has the pass orders, the
/// 32-weight formats' tiles and the tile loop; kernels/arch/avx2_quant_k.hpp
/// the K-quants', kernels/arch/avx2_quant_blocks.hpp the loads, products and
/// prefetch they are built from.
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
///
/// No tile branches on a type: the shared bodies (Nibble32Avx2) take what
/// differs from the type's own entry, so a type without tiles here does not
/// compile for this path (weight_types.hpp: TilesOn) instead of running
/// another type's code.

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "../quant_layout.hpp"
#include "../weight_types.hpp"
#include "avx2_quant_blocks.hpp"

#if APEX_PACKED_X86
namespace apex::packed::detail {

/// int32 sum vectors a row of an AVX2 entry keeps through a block: its
/// kSumsPerRow, 1 without one.
template <class Entry, class = void>
inline constexpr int sums_per_row_v = 1;
template <class Entry>
inline constexpr int sums_per_row_v<Entry, std::void_t<decltype(Entry::kSumsPerRow)>> = Entry::kSumsPerRow;

/// The two pass orders of an AVX2 entry whose block is Steps steps
/// (Entry::step<R, Ahead>: step s of quarter v into the rows' sums; Q8_0's
/// 4-weight groups, Q4_K's sub-blocks, Q6_K's groups, the 4-bit blocks'
/// octs) finished per quarter (Entry::finish<R>). A quarter's sums are
/// R · sums_per_row_v<Entry> vectors. Per quarter both orders form the same
/// integer sums and float steps, so the same bits.
template <class Entry, int Steps>
struct QuarterPasses {
  /// Lanes 8v … 8v + 7 of block b (every row count).
  template <int R>
  APEX_TARGET_AVX2 APEX_KERNEL_INLINE static void block(const std::byte* slab, const std::byte* area, Index b,
                                                        const QuantRows& x, int v, float (*acc)[32]) {
    constexpr int kSums = R * sums_per_row_v<Entry>;
    __m256i sumi[kSums];
    for (int r = 0; r < kSums; ++r) sumi[r] = _mm256_setzero_si256();
    for (int s = 0; s < Steps; ++s) Entry::template step<R, false>(slab, area, b, x, v, s, sumi);
    Entry::template finish<R>(area, b, x, v, sumi, acc);
  }
  /// All 32 lanes of block b step by step (R ≤ Entry::kAllQuartersRows), so
  /// a decode pass reads the slab's lines in order and prefetches one a line.
  template <int R>
  APEX_TARGET_AVX2 APEX_KERNEL_INLINE static void all_quarters(const std::byte* slab, const std::byte* area, Index b,
                                                               const QuantRows& x, float (*acc)[32]) {
    constexpr int kSums = R * sums_per_row_v<Entry>;
    __m256i sumi[4][kSums];
    for (auto& q : sumi)
      for (int r = 0; r < kSums; ++r) q[r] = _mm256_setzero_si256();
    for (int s = 0; s < Steps; ++s)
      for (int v = 0; v < 4; ++v) Entry::template step<R, true>(slab, area, b, x, v, s, sumi[v]);
    for (int v = 0; v < 4; ++v) Entry::template finish<R>(area, b, x, v, sumi[v], acc);
  }
};

/// Blocks of 32 4-bit codes (Q4_0, MXFP4): the block product, R rows × 8
/// lanes of block b, and the unpacker's pieces. What differs between the
/// types comes from the type's entry C = Tiles<T, Isa::avx2>:
///   C::offset_codes(q)  the unsigned u = v(q) + C::kOffset `vpmaddubsw` takes;
///   C::kRun             octs an int16 run holds before `vpmaddwd` (< 2^15);
///   C::values(q)        the signed value v(q) of each code byte (unpacking);
///   C::scale(area, v)   the block scale of lanes 8v … 8v + 7 as float.
template <Dtype T>
struct Nibble32Avx2 : QuarterPasses<Tiles<T, Isa::avx2>, 4> {
  using W = WeightType<T>;
  static constexpr bool kChunkMin = false;  ///< no min term (Q4_K has one)
  /// A row's sums through a block: its int32 sum, then its open int16 run.
  static constexpr int kSumsPerRow = 2;

  /// Oct o (codes 8o … 8o + 7 of each lane) of lanes 8v … 8v + 7 into the
  /// rows' int16 runs p16, a run added to isum as it closes. Ahead: prefetch
  /// each line's successor when a quarter pair starts it (all_quarters).
  template <int R, bool Ahead>
  APEX_TARGET_AVX2 APEX_KERNEL_INLINE static void oct(const std::byte* slab, Index b, const QuantRows& x, int v, int o,
                                                      __m256i* p16, __m256i* isum) {
    using C = Tiles<T, Isa::avx2>;
    const std::byte* line = slab + (o * kPanelLanes + 8 * v) * 4;
    if (Ahead && v % 2 == 0) prefetch_line(line);  // quarters 2i and 2i + 1 share a line
    const __m256i raw = load32(line);
    const __m256i lo = C::offset_codes(low_nibbles(raw)), hi = C::offset_codes(high_nibbles(raw));
    for (int r = 0; r < R; ++r) {
      const std::int8_t* xq = x.q + r * x.ldq + 32 * b + 8 * o;
      const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(xq)), _mm256_maddubs_epi16(hi, bcast4(xq + 4)));
      p16[r] = _mm256_add_epi16(p16[r], p);
      if (o % C::kRun == C::kRun - 1) {
        isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(p16[r], _mm256_set1_epi16(1)));
        p16[r] = _mm256_setzero_si256();
      }
    }
  }
  /// Step o of QuarterPasses: oct o, sums = the rows' int32 sums, then
  /// their int16 runs. An entry that sets kAllQuartersRows (MXFP4) takes a
  /// block's 512 bytes in order with one prefetch a line and no burst, as
  /// the AVX2 Q8_0 tile does.
  template <int R, bool Ahead>
  APEX_TARGET_AVX2 APEX_KERNEL_INLINE static void step(const std::byte* slab, const std::byte*, Index b,
                                                       const QuantRows& x, int v, int o, __m256i* sums) {
    oct<R, Ahead>(slab, b, x, v, o, sums + R, sums);
  }
  /// acc += the block's float step of lanes 8v … 8v + 7 (the offset taken off with Σ x).
  template <int R>
  APEX_TARGET_AVX2 APEX_KERNEL_INLINE static void finish(const std::byte* area, Index b, const QuantRows& x, int v,
                                                         const __m256i* sums, float (*acc)[32]) {
    using C = Tiles<T, Isa::avx2>;
    const __m256 dw = C::scale(area, v);
    for (int r = 0; r < R; ++r) {
      const __m256i isum = _mm256_sub_epi32(sums[r], _mm256_set1_epi32(C::kOffset * x.row(r).sum32(b)));
      accumulate8(acc[r] + 8 * v, isum, _mm256_mul_ps(dw, _mm256_set1_ps(x.d[r * x.ldd + b])));
    }
  }
  /// Code rows 0 … 7 of block `chunk`, lanes l0 … l0 + 7: the low and high
  /// nibbles of slab row i as rows 2i, 2i + 1, each code its signed value.
  APEX_TARGET_AVX2 static void code_rows(const std::byte* codes, Index chunk, Index l0, __m256i* rows) {
    const std::byte* slab = W::slab(codes, chunk);
    for (int i = 0; i < 4; ++i) {
      const __m256i raw = slab_words8(slab, i, l0);
      for (int half = 0; half < 2; ++half)
        rows[2 * i + half] = Tiles<T, Isa::avx2>::values(half ? high_nibbles(raw) : low_nibbles(raw));
    }
  }
  /// Lanes 8v … 8v + 7's factor of block `chunk`: its scale, for all 32 columns.
  APEX_TARGET_AVX2 APEX_KERNEL_INLINE static void factors8(const std::byte* scales, Index chunk, int v, __m256& lo,
                                                           __m256& hi, __m256&) {
    lo = hi = Tiles<T, Isa::avx2>::scale(W::area(scales, chunk), v);
  }
};

/// Q8_0: signed byte codes (the sign trick), fp16 scale d.
template <>
struct Tiles<Dtype::q8_0, Isa::avx2> : QuarterPasses<Tiles<Dtype::q8_0, Isa::avx2>, 8> {
  using W = WeightType<Dtype::q8_0>;
  static constexpr bool kChunkMin = false;
  /// Rows up to which the tile loop takes all four 8-lane quarters of a
  /// block group by group (all_quarters): the pass reads the block's 1 KiB
  /// in order with one prefetch a line and no burst, where one quarter a
  /// pass after the block's burst read every other 32 bytes four times
  /// over. One Qwen3-30B-A3B step, cold, N = 1 and 4, one and two threads:
  /// 1.16–1.89× (docs/performance.md, "Q8_0 in order on AVX2").
  static constexpr int kAllQuartersRows = 2;

  /// Step q: isum += Σ w·x of weights 4q … 4q + 3, lanes 8v … 8v + 7;
  /// Ahead: prefetch each line's successor when a quarter pair starts it
  /// (all_quarters).
  template <int R, bool Ahead>
  APEX_TARGET_AVX2 APEX_KERNEL_INLINE static void step(const std::byte* slab, const std::byte*, Index b,
                                                       const QuantRows& x, int v, int q, __m256i* isum) {
    const std::byte* line = slab + (q * kPanelLanes + 8 * v) * 4;
    if (Ahead && v % 2 == 0) prefetch_line(line);  // quarters 2i and 2i + 1 share a line
    const __m256i w = load32(line);
    const __m256i aw = _mm256_sign_epi8(w, w);
    for (int r = 0; r < R; ++r)
      isum[r] = _mm256_add_epi32(isum[r], dot4(aw, _mm256_sign_epi8(bcast4(x.q + r * x.ldq + 32 * b + 4 * q), w)));
  }
  template <int R>
  APEX_TARGET_AVX2 APEX_KERNEL_INLINE static void finish(const std::byte* area, Index b, const QuantRows& x, int v,
                                                         const __m256i* isum, float (*acc)[32]) {
    const __m256 dw = load_fp16x8(area + 16 * v);
    for (int r = 0; r < R; ++r)
      accumulate8(acc[r] + 8 * v, isum[r], _mm256_mul_ps(dw, _mm256_set1_ps(x.d[r * x.ldd + b])));
  }
  /// Code rows 0 … 7 of block `chunk`: the slab rows as stored.
  APEX_TARGET_AVX2 static void code_rows(const std::byte* codes, Index chunk, Index l0, __m256i* rows) {
    for (int r = 0; r < 8; ++r) rows[r] = slab_words8(W::slab(codes, chunk), r, l0);
  }
  APEX_TARGET_AVX2 APEX_KERNEL_INLINE static void factors8(const std::byte* scales, Index chunk, int v, __m256& lo,
                                                           __m256& hi, __m256&) {
    lo = hi = load_fp16x8(W::area(scales, chunk) + 16 * v);
  }
};

/// Q4_0: value q − 8, so u = q; fp16 scale d. Runs of 4 octs: each adds at
/// most 2·2·15·127, 4 of them < 2^15.
template <>
struct Tiles<Dtype::q4_0, Isa::avx2> : Nibble32Avx2<Dtype::q4_0> {
  static constexpr int kRun = 4;
  static constexpr std::int32_t kOffset = 8;
  APEX_TARGET_AVX2 APEX_KERNEL_INLINE static __m256i offset_codes(__m256i q) { return q; }
  APEX_TARGET_AVX2 APEX_KERNEL_INLINE static __m256i values(__m256i q) { return _mm256_sub_epi8(q,
                                                            _mm256_set1_epi8(8)); }
  APEX_TARGET_AVX2 APEX_KERNEL_INLINE static __m256 scale(const std::byte* area, int v) {
    return load_fp16x8(area + 16 * v);
  }
};

/// MXFP4: value v2[q] (the doubled E2M1 values, quant::kMxfp4Values), so
/// u = v2[q] + 12 ∈ [0, 24] through a 16-byte table; E8M0 scale 2^(e−128).
/// Runs of 2 octs: each adds at most 2·2·24·127.
template <>
struct Tiles<Dtype::mxfp4, Isa::avx2> : Nibble32Avx2<Dtype::mxfp4> {
  /// Rows up to which the tile loop takes a block's four quarters oct by
  /// oct (all_quarters; at two rows four quarters' sums and runs would not
  /// fit the 16 registers). One Qwen3-30B-A3B step, cold, separate builds
  /// alternated: 1.06–1.31× at N = 1 and 4, one and two threads; Q4_0, the
  /// same pass, 1.05–1.13× on one thread but 0.90–1.07× on two, so it keeps
  /// one quarter a pass (docs/performance.md, "Q8_0 in order on AVX2").
  static constexpr int kAllQuartersRows = 1;
  static constexpr int kRun = 2;
  static constexpr std::int32_t kOffset = 12;
  APEX_TARGET_AVX2 APEX_KERNEL_INLINE static __m256i offset_codes(__m256i q) {
    const __m256i lut = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0, 12, 13, 14, 15, 16,
                                         18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
    return _mm256_shuffle_epi8(lut, q);
  }
  APEX_TARGET_AVX2 APEX_KERNEL_INLINE static __m256i values(__m256i q) {
    const __m256i v2 = _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12, 0, 1, 2, 3, 4, 6, 8,
                                        12, 0, -1, -2, -3, -4, -6, -8, -12);  // quant::kMxfp4Values
    return _mm256_shuffle_epi8(v2, q);
  }
  APEX_TARGET_AVX2 APEX_KERNEL_INLINE static __m256 scale(const std::byte* area, int v) {
    return e8m0_half8(area + 8 * v);
  }
};

/// Rows up to which an AVX2 entry takes the four quarters of a block in one
/// pass (`all_quarters`): its kAllQuartersRows, none without one.
template <class Entry, class = void>
inline constexpr int all_quarters_rows_v = 0;
template <class Entry>
inline constexpr int all_quarters_rows_v<Entry, std::void_t<decltype(Entry::kAllQuartersRows)>> =
    Entry::kAllQuartersRows;

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
    using Entry = Tiles<T, Isa::avx2>;
    if constexpr (R <= all_quarters_rows_v<Entry>) {
      Entry::template all_quarters<R>(slab, area, b, x, acc);  // prefetches its own lines
    } else {
      prefetch_block<T>(slab, area);
      for (int v = 0; v < 4; ++v) Entry::template block<R>(slab, area, b, x, v, acc);
    }
  }
  for (int r = 0; r < R; ++r) store_acc_avx2<Epi>(acc[r], out + r * ldo, ncols);
}

/// out (rows × ncols) = epilogue(x · panel) for a block format, tiles of 4
/// rows; a compile error naming T for a type without AVX2 tiles.
template <Dtype T, class Epi>
APEX_TARGET_AVX2 void quant_panel_avx2(const std::byte* codes, const std::byte* scales, Index K, const QuantRows& x,
                                       Index rows, float* out, Index ldo, Index ncols) {
  static_assert(TilesOn<T, Isa::avx2>::check());
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
