#pragma once
/// \file kernels/arch/amx_bf16.hpp
/// Paired bf16 products on AMX-BF16 tiles (path `amx_bf16`). One
/// `tdpbf16ps` multiplies a 16 × 32 bf16 tile of activations by a 32 × 16
/// tile of weights into 16 × 16 fp32 sums: 8192 multiply-adds, where a
/// `vdpbf16ps` does 32. The products are the paired path's (activations and
/// weights in bf16, sums in fp32, kernels/arch/avx512.hpp's tile_dot_avx512),
/// at the tile unit's rate instead of the vector unit's.
///
/// Layout. A bf16 panel stores, per pair of k, 32 lanes × (w_2j, w_2j+1):
/// 128 bytes. That is AMX's weight-tile layout already ("VNNI pairs": a tile
/// row holds 16 columns' pairs), so a weight tile is 16 consecutive pairs of
/// one half of the lanes, read with a 128-byte stride: no repacking. Lanes
/// 0–15 go to one accumulator, 16–31 to another; on a gate/up panel they are
/// the gate and the up of 16 hidden units, which the epilogue pairs as the
/// vector tiles do.
///
/// Activations. X and A are converted to bf16 as activation tiles, each
/// tile's 16 rows × 32 values one contiguous KiB (rows_to_bf16_tiles), so a
/// tile load reads 16 consecutive lines whatever d is (rows of a row-major
/// copy lie d·2 bytes apart, for the usual widths a multiple of 4 KiB: one
/// cache set for all 16). On the Xeon measured both layouts ran alike; the
/// tiled one also needs no row stride. Values are padded to a multiple of
/// 32 with zeros; rows to a multiple of 16 with whatever the scratch held
/// (row i of a tile product reads only row i of the activations).
///
/// Weights cannot be padded in place (the next panel, or the end of the
/// buffer, follows a panel's last pair), so the last, partial chunk of 16
/// pairs is copied into a zeroed 2 KiB buffer: the padding's zero
/// activations meet zero weights, never the next panel's (0 · Inf = NaN).
///
/// Speed (one Qwen3-30B-A3B-shaped expert, d 2048, f 768, 512 rows, one
/// thread, Sapphire Rapids-class Xeon): ≈ 700–780 GFLOP/s against 60–75 for
/// packed float and widened bf16 and 45–60 for `vdpbf16ps` (which issues at
/// half the FMA rate there). The tile unit alone peaks near 2.8 TFLOP/s on
/// that CPU and ≈ 1.9 with its operands in L2; streaming the weights from
/// memory (≈ 8 GB/s a core there) bounds the rest, hence kAmxRowBlock.

/// Tile state: kernels/arch/amx_tiles.hpp.
///
/// Determinism. A row's sums are computed from that row's activations alone
/// (zero rows and zero columns add exact zeros), so as on the other paths a
/// row's bits do not depend on m or on the other rows. They may differ from
/// `vdpbf16ps`'s (the order of the fp32 additions inside the tile unit is the
/// hardware's), as paired products may differ between CPUs anyway.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "../bf16_vectors.hpp"
#include "../epilogue.hpp"
#include "amx_tiles.hpp"
#include "avx512.hpp"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#if APEX_PACKED_X86
namespace apex::packed::detail {

/// Rows of an activation tile; the caller pads its rows to a multiple.
inline constexpr Index kAmxRows = 16;
/// bf16 values of k per tile (64 bytes); the caller pads its rows to a multiple.
inline constexpr Index kAmxDepth = 32;

/// The tile registers of one panel product: four accumulators (row group ×
/// lane half), two activation tiles, two weight tiles. Macros, not
/// constants: GCC's tile intrinsics paste the register number into the
/// instruction's text.
#define APEX_AMX_ACC00 0
#define APEX_AMX_ACC01 1
#define APEX_AMX_ACC10 2
#define APEX_AMX_ACC11 3
#define APEX_AMX_X0 4
#define APEX_AMX_X1 5
#define APEX_AMX_W0 6
#define APEX_AMX_W1 7

/// The zero-padded copy of a panel's last, partial chunk of 16 pairs:
/// `pairs` pairs (< 16) of 32 lanes from `w`, then zeros (2 KiB).
struct alignas(64) AmxTailChunk {
  bf16 w[kAmxRows * 64];
  void fill(const bf16* src, Index pairs) {
    std::memcpy(w, src, std::size_t(pairs) * 64 * sizeof(bf16));
    std::memset(w + pairs * 64, 0, std::size_t(kAmxRows - pairs) * 64 * sizeof(bf16));
  }
};

/// Rows of src (rows × n, stride lds) in bf16 as activation tiles: tile
/// (g, c) holds rows 16g… and values 32c… of the rows, 1 KiB contiguous at
/// dst + (g·chunks + c)·512. Zero from n to chunks·32. The rows that pad the
/// last group to 16 are left as they are: a row's sums read only that row,
/// and a padding row's are never stored. dst: ⌈rows⌉₁₆ · chunks · 32 elements.
inline void rows_to_bf16_tiles(const float* src, Index lds, Index rows, Index n, bf16* dst, Index chunks) {
  for (Index r = 0; r < rows; ++r) {
    bf16* row = dst + (r / kAmxRows) * chunks * kAmxRows * kAmxDepth + (r % kAmxRows) * kAmxDepth;
    const float* x = src + r * lds;
    for (Index c = 0; c < chunks; ++c) {
      bf16* piece = row + c * kAmxRows * kAmxDepth;  // values 32c… of row r
      const Index have = std::clamp<Index>(n - c * kAmxDepth, 0, kAmxDepth);
      to_bf16_n(x + c * kAmxDepth, piece, have, Isa::avx512);
      std::fill(piece + have, piece + kAmxDepth, bf16{0});
    }
  }
}

/// acc[g][h] += activation tiles xt (group g) × the lane half h of the 16
/// pairs at w (stride 64 elements between pairs); `next_group`: elements
/// from group 0's tile to group 1's.
APEX_TARGET_AMX_BF16 APEX_KERNEL_INLINE inline void amx_chunk(const bf16* w, const bf16* xt, Index next_group,
                                                              bool two_groups) {
  constexpr long kWStride = 64 * sizeof(bf16), kXStride = kAmxDepth * sizeof(bf16);
  _tile_loadd(APEX_AMX_X0, xt, kXStride);
  _tile_loadd(APEX_AMX_W0, w, kWStride);
  _tile_dpbf16ps(APEX_AMX_ACC00, APEX_AMX_X0, APEX_AMX_W0);
  _tile_loadd(APEX_AMX_W1, w + 32, kWStride);
  _tile_dpbf16ps(APEX_AMX_ACC01, APEX_AMX_X0, APEX_AMX_W1);
  if (two_groups) {
    _tile_loadd(APEX_AMX_X1, xt + next_group, kXStride);
    _tile_dpbf16ps(APEX_AMX_ACC10, APEX_AMX_X1, APEX_AMX_W0);
    _tile_dpbf16ps(APEX_AMX_ACC11, APEX_AMX_X1, APEX_AMX_W1);
  }
}

/// out (rows × ncols) = epilogue(xt (rows × K, bf16 tiles of
/// rows_to_bf16_tiles, `chunks` ≥ ⌈K/32⌉ per row group) · panel w) on AMX
/// tiles, prefetching `next_bytes` bytes at `next` into L2 meanwhile (none
/// for a null `next`). Needs an AmxTiles on this thread.
template <class Epi>
APEX_TARGET_AMX_BF16 void panel_amx(const bf16* w, Index K, const bf16* xt, Index chunks, Index rows, float* out,
                                    Index ldo, Index ncols, const void* next, Index next_bytes) {
  const Index pairs = (K + 1) / 2, full = pairs / kAmxRows, tail = pairs % kAmxRows;
  const Index group = chunks * kAmxRows * kAmxDepth;  // elements per row group
  const Index steps = (rows + 2 * kAmxRows - 1) / (2 * kAmxRows) * (full + (tail ? 1 : 0));
  AmxNextPanel ahead;
  ahead.spread(next, next_bytes, steps);
  AmxTailChunk last;
  if (tail) last.fill(w + full * kAmxRows * 64, tail);
  alignas(64) float acc[2 * kAmxRows][32];  // two row groups × 32 lanes
  for (Index r0 = 0; r0 < rows; r0 += 2 * kAmxRows) {
    const bool two = rows - r0 > kAmxRows;
    const bf16* x = xt + (r0 / kAmxRows) * group;
    _tile_zero(APEX_AMX_ACC00);
    _tile_zero(APEX_AMX_ACC01);
    _tile_zero(APEX_AMX_ACC10);
    _tile_zero(APEX_AMX_ACC11);
    for (Index c = 0; c < full; ++c) {
      ahead.step();
      amx_chunk(w + c * kAmxRows * 64, x + c * kAmxRows * kAmxDepth, group, two);
    }
    if (tail) amx_chunk(last.w, x + full * kAmxRows * kAmxDepth, group, two);
    _tile_stored(APEX_AMX_ACC00, &acc[0][0], 32 * sizeof(float));
    _tile_stored(APEX_AMX_ACC01, &acc[0][16], 32 * sizeof(float));
    _tile_stored(APEX_AMX_ACC10, &acc[kAmxRows][0], 32 * sizeof(float));
    _tile_stored(APEX_AMX_ACC11, &acc[kAmxRows][16], 32 * sizeof(float));
    const Index n = std::min<Index>(2 * kAmxRows, rows - r0);
    for (Index r = 0; r < n; ++r)
      store_row_avx512<Epi>(_mm512_load_ps(acc[r]), _mm512_load_ps(acc[r] + 16), out + (r0 + r) * ldo, ncols);
  }
}

#undef APEX_AMX_ACC00
#undef APEX_AMX_ACC01
#undef APEX_AMX_ACC10
#undef APEX_AMX_ACC11
#undef APEX_AMX_X0
#undef APEX_AMX_X1
#undef APEX_AMX_W0
#undef APEX_AMX_W1

}  // namespace apex::packed::detail
#endif
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
