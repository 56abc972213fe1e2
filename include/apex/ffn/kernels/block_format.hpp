#pragma once
/// \file kernels/block_format.hpp
/// What every block-format entry of the weight-type table shares
/// (kernels/quant_types.hpp, kernels/quant_k_types.hpp): `BlockFormat`, the
/// sizes, slab and scale-area addresses, the row conversions through the
/// entry's ggml quantizer and dequantizer, the scale-range rule on float
/// rows and on file blocks, and the column unpacker's default for a block
/// of 32 weights; and the helpers of the fp16 scales and 4-bit codes.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "../core/errors.hpp"
#include "../core/scalar_range.hpp"
#include "../quant/formats.hpp"
#include "dtype.hpp"
#include "quant_layout.hpp"

namespace apex::packed::detail {

/// What every block format's entry shares: sizes, slab and scale-area
/// addresses, and the row conversions through ggml's block quantizer and
/// dequantizer (`F::quantize`, `F::dequantize`, F the entry).
template <class F, class BlockT, Index B, Index BlockBytes, Index ScaleBytes, ActivationFormat A>
struct BlockFormat {
  using Element = std::byte;
  using Block = BlockT;
  static constexpr const char* kFileDtype = nullptr;  // safetensors holds blocks as U8 bytes
  static constexpr Index kGroup = 1;
  static constexpr Index kBlockWeights = B;
  static constexpr Index kBlockBytes = BlockBytes;
  static constexpr Index kScaleBytes = ScaleBytes;
  static constexpr Index kCodeBytes = BlockBytes - ScaleBytes;  ///< per lane and block
  static constexpr bool kQuantized = true;
  static constexpr ActivationFormat kActivation = A;
  static_assert(sizeof(BlockT) == std::size_t(BlockBytes), "a panel block holds exactly the file block's bytes");

  static std::byte* slab(Element* codes, Index b) { return codes + b * kPanelLanes * kCodeBytes; }
  static const std::byte* slab(const Element* codes, Index b) { return codes + b * kPanelLanes * kCodeBytes; }
  static std::byte* area(std::byte* scales, Index b) { return scales + b * kPanelLanes * kScaleBytes; }
  static const std::byte* area(const std::byte* scales, Index b) { return scales + b * kPanelLanes * kScaleBytes; }

  /// One lane's K weights from float: ggml's reference quantizer, block by
  /// block. Checked in the order of docs/error_model.md#order-of-checks, all
  /// before a byte is written: K whole blocks (ConfigError: a shape), then
  /// the values — ValueError for NaN or Inf (ggml's quantizers would convert
  /// them to integers, which is undefined), then for a block the format
  /// cannot hold (check_range), naming the block.
  static void pack_row(const float* w, Index K, Index lane, Element* codes, std::byte* scales) {
    apex::detail::require_config(K % B == 0, "packing weights",
                                 "reduction length " + std::to_string(K) + " is not a multiple of " +
                                     std::to_string(B) + ", the " + F::kName +
                                     " block: quantized weights hold whole blocks");
    for (Index k = 0; k < K; ++k)
      if (!std::isfinite(w[k]))
        throw ValueError(std::string("packing weights as ") + F::kName + ": weight " + std::to_string(k) +
                         " of a row is " + std::to_string(w[k]) + "; block formats hold finite values only");
    std::vector<Block> blocks(std::size_t(K / B));
    if (F::kSearchBound < std::numeric_limits<float>::infinity())  // before the K-quants' search
      for (Index b = 0; b < K / B; ++b) check_range(w + b * B, b, nullptr);
    F::quantize(w, blocks.data(), K);
    for (Index b = 0; b < K / B; ++b) check_range(w + b * B, b, &blocks[std::size_t(b)]);
    for (Index b = 0; b < K / B; ++b) F::put_block(blocks[std::size_t(b)], b, lane, codes, scales);
  }
  /// The scale-range rule (docs/quantized_formats.md#scale-range): a block is
  /// refused when a value it would dequantize to is not a finite float —
  /// for the fp16-scaled types exactly when a stored scale (d, dmin) is ±Inf
  /// or NaN, for MXFP4 when 2^(e−128) times its largest code reaches 2^128
  /// (F::scale_problem; no finite float row makes one). ValueError naming block b and its largest |w|;
  /// `blk` null: the check before ggml's search, |w| ≥ F::kSearchBound.
  static void check_range(const float* w, Index b, const Block* blk) {
    float amax = 0;
    const auto largest = [&] {
      for (Index i = 0; i < B; ++i) amax = std::fabs(w[i]) > amax ? std::fabs(w[i]) : amax;
      return amax;
    };
    std::string problem = blk ? F::scale_problem(*blk) : std::string();
    if (!blk && F::kSearchBound < std::numeric_limits<float>::infinity() && largest() >= F::kSearchBound)
      problem = "no finite scale of the format reaches it";
    if (problem.empty()) return;
    throw ValueError(std::string("packing weights as ") + F::kName + ": block " + std::to_string(b) + " (weights " +
                     std::to_string(b * B) + ".." + std::to_string(b * B + B - 1) + ") of a row has largest |w| = " +
                     apex::detail::number(blk ? largest() : amax) + ", beyond the format's range: " + problem +
                     ", so its values would not be finite (store this matrix as f32 or bf16)");
  }
  /// ValueError unless block b of a file row (moved in as it is: GGUF,
  /// quantized checkpoints, gpt-oss's MXFP4) dequantizes to finite floats.
  static void check_file_block(const Block& blk, Index b) {
    const std::string problem = F::scale_problem(blk);
    if (!problem.empty())
      throw ValueError(std::string("block ") + std::to_string(b) + " of a " + F::kName + " row: " + problem +
                       ", so its values would not be finite (the library holds finite weights only)");
  }
  /// Weights at or above this bound are refused before ggml's search runs.
  static constexpr float kSearchBound = std::numeric_limits<float>::infinity();
  /// The column unpacker (kernels/unpack_columns.hpp) reads chunk `chunk`
  /// (32 columns k) of a lane as signed codes q (`chunk_codes`) times a
  /// factor, `lo` below column 16 and `hi` from it, minus `min` where
  /// kChunkMin (`chunk_factors`). A 32-weight block is one chunk: its
  /// slab and scale area are the bytes the chunk reads (`chunk_bytes`, for
  /// prefetching); other block sizes name their own.
  static constexpr bool kChunkMin = false;
  template <class Fn>
  static void chunk_bytes(const Element* codes, const std::byte* scales, Index chunk, Fn&& f) {
    static_assert(B == kChunkColumns, "a format whose blocks are not one chunk names the bytes a chunk reads");
    f(slab(codes, chunk), kPanelLanes * kCodeBytes);
    f(area(scales, chunk), kPanelLanes * kScaleBytes);
  }
  /// One lane's K weights as float: ggml's dequantizer on the lane's blocks.
  static void unpack_row(const Element* codes, const std::byte* scales, Index K, Index lane, float* w) {
    for (Index b = 0; b < K / B; ++b) {
      const Block blk = F::get_block(codes, scales, b, lane);
      F::dequantize(&blk, w + b * B, B);
    }
  }
  /// Weight (k, lane) as float (a whole block dequantized: for single reads).
  static float weight(const Element* codes, const std::byte* scales, Index k, Index lane) {
    const Block blk = F::get_block(codes, scales, k / B, lane);
    float w[B];
    F::dequantize(&blk, w, B);
    return w[k % B];
  }
};

/// Whether the fp16 value `bits` is finite (its exponent not all ones).
inline bool half_finite(std::uint16_t bits) { return (bits & 0x7C00u) != 0x7C00u; }
/// "" if the fp16 scale `bits` is finite, else "its scale <name> = inf in fp16".
inline std::string half_scale_problem(const char* name, std::uint16_t bits) {
  if (half_finite(bits)) return {};
  return std::string("its scale ") + name + " = " + apex::detail::number(quant::fp16_to_fp32(bits)) + " in fp16";
}

/// The 32 4-bit codes of a Q4_0 or MXFP4 block (`qs` in ggml's order) into
/// and out of lane `lane` of a slab, and their integer product with 32
/// activation codes, `value(q)` the code's integer.
inline void put_nibbles32(const std::uint8_t* qs, std::byte* slab, Index lane) {
  for (Index k = 0; k < 32; ++k) set_nibble(slab, k, lane, block32_nibble(qs, k));
}
inline void get_nibbles32(const std::byte* slab, Index lane, std::uint8_t* qs) {
  for (Index k = 0; k < 32; ++k) set_block32_nibble(qs, k, get_nibble(slab, k, lane));
}
template <class Value>
std::int32_t nibble_dot32(const std::byte* slab, Index lane, const std::int8_t* x, Value value) {
  std::int32_t s = 0;
  for (Index k = 0; k < 32; ++k) s += std::int32_t(value(get_nibble(slab, k, lane))) * std::int32_t(x[k]);
  return s;
}

}  // namespace apex::packed::detail
