#pragma once
/// \file kernels/arch/amx_int8_quant.hpp
/// The 32-weight block formats (Q8_0, Q4_0, MXFP4) on AMX-INT8 tiles, path
/// `amx_bf16` from 8 rows (Q8_0) or 16 (kernels/matrix_runs.hpp:
/// amx_int8_rows). One `tdpbssd` multiplies a 16 × 32 tile of quantized
/// activations (s8) by a 32 × 16 tile of one block's weights (s8) into the
/// 16 × 16 exact int32 block sums: 8192 multiply-adds, where a `vpdpbusd`
/// does 64.
///
/// The same bits as the VNNI tiles (kernels/arch/avx512_vnni_quant.hpp).
/// Those sum u·x with unsigned offset codes u = w + c and take c·Σx off;
/// the tiles sum the signed values w·x directly. Both are the same exact
/// integer Σ w·x (|Σ| ≤ 32 · 128 · 128 < 2^24: no overflow, exact in
/// float), and the float step after it is the VNNI tile's, block by block
/// in the same order: acc = fma(float(Σ), d_w · d_x, acc). So every row's
/// output is the VNNI path's to the bit, which the tests check on odd
/// shapes.
///
/// Layout. A Q8_0 slab stores, per quad of k, 32 lanes × 4 bytes (128
/// bytes): AMX's weight-tile layout (a tile row holds 16 columns' quads), so
/// a block's weight tile is one half of the lanes read in place with a
/// 128-byte stride. Q4_0 and MXFP4 keep two codes a byte (slab row o: the
/// low nibbles are quad 2o, the high ones quad 2o + 1); a panel's blocks are
/// unpacked once per call into that layout as signed bytes (1 KiB a block,
/// in L2) and reused by every row group. Activations are read in place: a
/// row group's 16 rows of block b lie ldq bytes apart; quantize_rows pads
/// the rows to a multiple of 16 with zeros for these tiles.
///
/// Loop. For each 16-row group and each lane half, 16 fp32 accumulators
/// stay in registers over all blocks; a block's int32 tile goes through a
/// 1 KiB buffer, four blocks in flight (four sums tiles: with two, a
/// block's product waited on the store of the block before last). The next panel is
/// prefetched into L2 meanwhile, as on the bf16 tiles.
///
/// Where the time goes (one Q8_0 expert, d 1024, f 3584, 512 rows, warm,
/// Sapphire Rapids-class Xeon): ≈ 480 GFLOP/s, against ≈ 150 for the VNNI
/// tiles; the tile steps alone ran at ≈ 785 and the float step alone at
/// ≈ 1190, and they do not overlap (issuing the next four blocks' tiles
/// before this four's float step changed nothing). The per-block store and
/// the half-depth product (32 of the tile's 64 bytes of k: a block is 32
/// weights) are the price of the formats' per-block scales. Accumulating
/// both row groups' sums in memory instead of registers, to load each
/// weight tile once for two groups, ran at the same speed.

#include <algorithm>
#include <cstdint>

#include "../aligned_array.hpp"
#include "../epilogue.hpp"
#include "../quant_layout.hpp"
#include "../weight_types.hpp"
#include "amx_tiles.hpp"
#include "avx512_quant.hpp"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
namespace apex::packed::detail {
/// Rows of an activation tile; the caller quantizes the rows padded to a
/// multiple (quantize_rows' row_multiple).
inline constexpr Index kAmxQuantRows = 16;
}  // namespace apex::packed::detail

#if APEX_PACKED_X86
namespace apex::packed::detail {

/// Whether block format T has AMX-INT8 tiles (the 32-weight formats; the
/// K-quants' sub-block scales would need a vector step per 32 weights).
template <Dtype T>
inline constexpr bool has_amx_int8_tiles_v = T == Dtype::q8_0 || T == Dtype::q4_0 || T == Dtype::mxfp4;

/// Tile registers: 0–3 the block sums of four blocks in flight (16 × 16
/// int32), 4, 5 activations (16 rows × 32 s8), 6, 7 weights (8 quads × 16
/// lanes × 4 s8); block slot j uses sums j, activations 4 + j % 2 and
/// weights 6 + j % 2.
inline const AmxConfig& amx_int8_block_tiles() {
  static const AmxConfig config = [] {
    AmxConfig c;
    for (int t = 0; t < 4; ++t) c.shape(t, 16, 64);
    c.shape(4, 16, 32).shape(5, 16, 32).shape(6, 8, 64).shape(7, 8, 64);
    return c;
  }();
  return config;
}

/// One block's 32 lanes of signed weights in the weight-tile layout (row
/// q: 32 lanes × the 4 values of quad q, 128 bytes) from a 4-bit slab:
/// the offset codes of the AVX-512BW entry minus its offset.
template <Dtype T>
APEX_TARGET_AVX512 APEX_KERNEL_INLINE inline void signed_block_codes(const std::byte* slab, std::int8_t* dst) {
  using C = Tiles<T, Isa::avx512>;
  const __m512i offset = _mm512_set1_epi8(static_cast<char>(C::kOffset));
  for (int o = 0; o < 4; ++o)
    for (int v = 0; v < 2; ++v) {
      const __m512i raw = load_half512(slab, o, v);
      _mm512_store_si512(dst + 2 * o * 128 + 64 * v, _mm512_sub_epi8(C::offset_codes(low_nibbles512(raw)), offset));
      _mm512_store_si512(dst + (2 * o + 1) * 128 + 64 * v,
                         _mm512_sub_epi8(C::offset_codes(high_nibbles512(raw)), offset));
    }
}

/// The weight scales d_w of block area `area`, lane half v (the VNNI entry's).
template <Dtype T>
APEX_TARGET_AVX512 APEX_KERNEL_INLINE inline __m512 block_scale16(const std::byte* area, int v) {
  if constexpr (T == Dtype::q8_0)
    return load_fp16x16(area + 32 * v);
  else
    return Tiles<T, Isa::avx512>::scale(area, v);
}

/// sums (16 × 16 int32, 64-byte rows) = activations xq (16 rows, stride
/// ldq, 32 s8) · one lane half of a block's weights w (8 quads, stride 128),
/// in block slot J. Four slots in flight keep the tile unit busy: a slot's
/// sums tile is free again only once its store has read it.
template <int J>
APEX_TARGET_AMX_INT8 APEX_KERNEL_INLINE inline void block_sums_amx(const std::int8_t* w, const std::int8_t* xq,
                                                                   Index ldq, std::int32_t* sums) {
  // GCC pastes the tile numbers into the instruction's text: literals only.
  if constexpr (J == 0) {
    _tile_zero(0);
    _tile_loadd(4, xq, ldq);
    _tile_loadd(6, w, 128);
    _tile_dpbssd(0, 4, 6);
    _tile_stored(0, sums, 64);
  } else if constexpr (J == 1) {
    _tile_zero(1);
    _tile_loadd(5, xq, ldq);
    _tile_loadd(7, w, 128);
    _tile_dpbssd(1, 5, 7);
    _tile_stored(1, sums, 64);
  } else if constexpr (J == 2) {
    _tile_zero(2);
    _tile_loadd(4, xq, ldq);
    _tile_loadd(6, w, 128);
    _tile_dpbssd(2, 4, 6);
    _tile_stored(2, sums, 64);
  } else {
    _tile_zero(3);
    _tile_loadd(5, xq, ldq);
    _tile_loadd(7, w, 128);
    _tile_dpbssd(3, 5, 7);
    _tile_stored(3, sums, 64);
  }
}

/// acc[r] += float(sums row r) · (d_w · d_x(row r)) for the 16 rows of a
/// group: the VNNI tile's float step.
APEX_TARGET_AVX512 APEX_KERNEL_INLINE inline void scale_block_sums(const std::int32_t* sums, __m512 dw,
                                                                   const float* xd, Index ldd, __m512* acc) {
#pragma GCC unroll 16
  for (int r = 0; r < kAmxQuantRows; ++r)
    acc[r] = accumulate16(acc[r], _mm512_load_si512(sums + 16 * r), _mm512_mul_ps(dw, _mm512_set1_ps(xd[r * ldd])));
}

/// Thread scratch for a panel's unpacked 4-bit blocks.
inline AlignedArray<std::int8_t>& amx_unpacked_codes() {
  thread_local AlignedArray<std::int8_t> codes;
  return codes;
}

/// out (rows × ncols) = epilogue(x · panel) for block format T on AMX-INT8
/// tiles; x's rows padded with zeros to a multiple of 16 (quantize_rows).
/// Prefetches `next_bytes` at `next` (the next panel's codes; none for a
/// null `next`) into L2 meanwhile. Needs AmxTiles(amx_int8_block_tiles())
/// on this thread.
template <Dtype T, class Epi>
APEX_TARGET_AMX_INT8 void quant_panel_amx(const std::byte* codes, const std::byte* scales, Index K,
                                          const QuantRows& x, Index rows, float* out, Index ldo, Index ncols,
                                          const void* next, Index next_bytes) {
  static_assert(has_amx_int8_tiles_v<T>);
  using W = WeightType<T>;
  constexpr Index slab_bytes = kPanelLanes * W::kCodeBytes, area_bytes = kPanelLanes * W::kScaleBytes;
  constexpr Index kBlockBytes = 32 * kPanelLanes;  // a block's signed weights in the tile layout
  const Index blocks = K / 32;
  const std::int8_t* w = reinterpret_cast<const std::int8_t*>(codes);  // Q8_0: in place
  if constexpr (T != Dtype::q8_0) {
    std::int8_t* u = grow(amx_unpacked_codes(), blocks * kBlockBytes);
    for (Index b = 0; b < blocks; ++b) signed_block_codes<T>(codes + b * slab_bytes, u + b * kBlockBytes);
    w = u;
  }
  const Index full = blocks / 4 * 4, groups = (rows + kAmxQuantRows - 1) / kAmxQuantRows;
  AmxNextPanel ahead;
  ahead.spread(next, next_bytes, groups * 2 * (full / 4 + blocks - full));
  alignas(64) std::int32_t sums[4][16 * 16];           // the four slots' block sums
  alignas(64) float half0[kAmxQuantRows][16];  // lanes 0–15 of the group's rows
  for (Index r0 = 0; r0 < rows; r0 += kAmxQuantRows) {
    const std::int8_t* xq = x.q + r0 * x.ldq;
    const float* xd = x.d + r0 * x.ldd;
    for (int v = 0; v < 2; ++v) {
      __m512 acc[kAmxQuantRows];
      for (auto& a : acc) a = _mm512_setzero_ps();
      const std::int8_t* wv = w + 64 * v;
      Index b = 0;
      for (; b < full; b += 4) {
        ahead.step();
        block_sums_amx<0>(wv + b * kBlockBytes, xq + 32 * b, x.ldq, sums[0]);
        block_sums_amx<1>(wv + (b + 1) * kBlockBytes, xq + 32 * (b + 1), x.ldq, sums[1]);
        block_sums_amx<2>(wv + (b + 2) * kBlockBytes, xq + 32 * (b + 2), x.ldq, sums[2]);
        block_sums_amx<3>(wv + (b + 3) * kBlockBytes, xq + 32 * (b + 3), x.ldq, sums[3]);
        for (int j = 0; j < 4; ++j)
          scale_block_sums(sums[j], block_scale16<T>(scales + (b + j) * area_bytes, v), xd + b + j, x.ldd, acc);
      }
      for (; b < blocks; ++b) {
        ahead.step();
        block_sums_amx<0>(wv + b * kBlockBytes, xq + 32 * b, x.ldq, sums[0]);
        scale_block_sums(sums[0], block_scale16<T>(scales + b * area_bytes, v), xd + b, x.ldd, acc);
      }
      const Index n = std::min(kAmxQuantRows, rows - r0);
      if (v == 0) {
        for (int r = 0; r < kAmxQuantRows; ++r) _mm512_store_ps(half0[r], acc[r]);
      } else {
        for (Index r = 0; r < n; ++r) store_row_avx512<Epi>(_mm512_load_ps(half0[r]), acc[r], out + (r0 + r) * ldo, ncols);
      }
    }
  }
}

}  // namespace apex::packed::detail
#endif
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
