#pragma once
/// \file kernels/quant_types.hpp
/// The block-format entries of the weight-type table (kernels/weight_types.hpp):
/// ggml's 32-weight formats Q8_0, Q4_0 and MXFP4 (the K-quants are
/// kernels/quant_k_types.hpp), held in panels as
/// kernels/quant_layout.hpp places them. Each entry says
///
/// - how a ggml block (quant/blocks.hpp) goes into a panel lane and comes
///   back (`put_block`, `get_block`: the same bits, only moved);
/// - how a float row becomes blocks (`pack_row`: ggml's reference quantizer)
///   and blocks become floats (`unpack_row`: ggml's dequantizer);
/// - the product of one block with quantized activations (`dot_block`):
///   integer sums of code × code, exact, then fp32 `fma(float(sum), scale,
///   acc)` in a fixed order. The scalar path runs it as written; every SIMD
///   path computes the same integers and the same float operations in the
///   same order, so every path gives the same bits.
///
/// Scale planes (bytes per lane in parentheses) inside block b's scale area:
///   Q8_0, Q4_0:  d fp16 (2)                      value d·q,  d·(q − 8)
///   MXFP4:       e E8M0 (1)                      value 2^(e−128)·v2[q]  (v2: doubled E2M1)
///   Q4_K:        d, dmin fp16, scales[12] (16)   value d·sc_j·q − dmin·m_j
///   Q6_K:        d fp16, scales[16] int8 (18)    value d·sc_g·(q − 32)

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

namespace apex::packed {
namespace detail {

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

/// "" if the fp16 scale `bits` is finite, else "its scale <name> = inf in fp16".
inline std::string half_scale_problem(const char* name, std::uint16_t bits) {
  if ((bits & 0x7C00u) != 0x7C00u) return {};
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

}  // namespace detail

/// Q8_0: 32 int8 codes and an fp16 scale; value d·q.
template <>
struct WeightType<Dtype::q8_0>
    : detail::BlockFormat<WeightType<Dtype::q8_0>, quant::BlockQ8_0, 32, 34, 2, ActivationFormat::q8_0> {
  using Storage = packed::q8_0;
  static constexpr const char* kName = "q8_0";
  static void quantize(const float* w, Block* y, Index k) { quant::quantize_row_q8_0(w, y, k); }
  static void dequantize(const Block* x, float* w, Index k) { quant::dequantize_row_q8_0(x, w, k); }
  static std::string scale_problem(const Block& blk) { return detail::half_scale_problem("d", blk.d); }

  static void put_block(const Block& blk, Index b, Index lane, Element* codes, std::byte* scales) {
    for (Index k = 0; k < 32; ++k) slab(codes, b)[detail::q8_byte(k, lane)] = std::byte(std::uint8_t(blk.qs[k]));
    detail::set_u16(area(scales, b), lane, blk.d);
  }
  static Block get_block(const Element* codes, const std::byte* scales, Index b, Index lane) {
    Block blk{};
    for (Index k = 0; k < 32; ++k) blk.qs[k] = std::int8_t(detail::byte_at(slab(codes, b), detail::q8_byte(k, lane)));
    blk.d = detail::get_u16(area(scales, b), lane);
    return blk;
  }
  /// acc + d_w·d_x·Σ q_w·q_x over block b.
  static float dot_block(const Element* codes, const std::byte* scales, Index b, Index lane, const detail::QuantRow& x,
                         float acc) {
    std::int32_t s = 0;
    for (Index k = 0; k < 32; ++k)
      s += std::int8_t(detail::byte_at(slab(codes, b), detail::q8_byte(k, lane))) * std::int32_t(x.q[32 * b + k]);
    const float dw = quant::fp16_to_fp32(detail::get_u16(area(scales, b), lane));
    return std::fma(float(s), dw * x.d[b], acc);
  }
  /// Block `chunk` of a lane: codes q, factor d.
  static void chunk_codes(const Element* codes, Index chunk, Index lane, std::int8_t* q) {
    for (Index k = 0; k < 32; ++k) q[k] = std::int8_t(detail::byte_at(slab(codes, chunk), detail::q8_byte(k, lane)));
  }
  static void chunk_factors(const std::byte* scales, Index chunk, Index lane, float& lo, float& hi, float&) {
    lo = hi = quant::fp16_to_fp32(detail::get_u16(area(scales, chunk), lane));
  }
};

/// Q4_0: 32 4-bit codes and an fp16 scale; value d·(q − 8).
template <>
struct WeightType<Dtype::q4_0>
    : detail::BlockFormat<WeightType<Dtype::q4_0>, quant::BlockQ4_0, 32, 18, 2, ActivationFormat::q8_0> {
  using Storage = packed::q4_0;
  static constexpr const char* kName = "q4_0";
  static void quantize(const float* w, Block* y, Index k) { quant::quantize_row_q4_0(w, y, k); }
  static void dequantize(const Block* x, float* w, Index k) { quant::dequantize_row_q4_0(x, w, k); }
  static std::string scale_problem(const Block& blk) { return detail::half_scale_problem("d", blk.d); }

  static void put_block(const Block& blk, Index b, Index lane, Element* codes, std::byte* scales) {
    detail::put_nibbles32(blk.qs, slab(codes, b), lane);
    detail::set_u16(area(scales, b), lane, blk.d);
  }
  static Block get_block(const Element* codes, const std::byte* scales, Index b, Index lane) {
    Block blk{};
    detail::get_nibbles32(slab(codes, b), lane, blk.qs);
    blk.d = detail::get_u16(area(scales, b), lane);
    return blk;
  }
  /// acc + d_w·d_x·Σ (q_w − 8)·q_x over block b.
  static float dot_block(const Element* codes, const std::byte* scales, Index b, Index lane, const detail::QuantRow& x,
                         float acc) {
    const auto value = [](unsigned q) { return std::int32_t(q) - 8; };
    const std::int32_t s = detail::nibble_dot32(slab(codes, b), lane, x.q + 32 * b, value);
    const float dw = quant::fp16_to_fp32(detail::get_u16(area(scales, b), lane));
    return std::fma(float(s), dw * x.d[b], acc);
  }
  /// Block `chunk` of a lane: codes q − 8, factor d.
  static void chunk_codes(const Element* codes, Index chunk, Index lane, std::int8_t* q) {
    for (Index k = 0; k < 32; ++k) q[k] = std::int8_t(int(detail::get_nibble(slab(codes, chunk), k, lane)) - 8);
  }
  static void chunk_factors(const std::byte* scales, Index chunk, Index lane, float& lo, float& hi, float&) {
    lo = hi = quant::fp16_to_fp32(detail::get_u16(area(scales, chunk), lane));
  }
};

/// MXFP4: 32 E2M1 codes and an E8M0 exponent; value 2^(e−128)·v2[q], v2
/// the doubled E2M1 values (quant::kMxfp4Values), so the codes are integers.
template <>
struct WeightType<Dtype::mxfp4>
    : detail::BlockFormat<WeightType<Dtype::mxfp4>, quant::BlockMXFP4, 32, 17, 1, ActivationFormat::q8_0> {
  using Storage = packed::mxfp4;
  static constexpr const char* kName = "mxfp4";
  static void quantize(const float* w, Block* y, Index k) { quant::quantize_row_mxfp4(w, y, k); }
  static void dequantize(const Block* x, float* w, Index k) { quant::dequantize_row_mxfp4(x, w, k); }
  static std::string scale_problem(const Block& blk) {
    if (quant::mxfp4_block_finite(blk)) return {};
    return "its E8M0 exponent e = " + std::to_string(blk.e) + ": 2^(e-128) times its largest code overflows float";
  }

  static void put_block(const Block& blk, Index b, Index lane, Element* codes, std::byte* scales) {
    detail::put_nibbles32(blk.qs, slab(codes, b), lane);
    area(scales, b)[lane] = std::byte(blk.e);
  }
  static Block get_block(const Element* codes, const std::byte* scales, Index b, Index lane) {
    Block blk{};
    detail::get_nibbles32(slab(codes, b), lane, blk.qs);
    blk.e = detail::byte_at(area(scales, b), lane);
    return blk;
  }
  /// acc + 2^(e−128)·d_x·Σ v2[q_w]·q_x over block b.
  static float dot_block(const Element* codes, const std::byte* scales, Index b, Index lane, const detail::QuantRow& x,
                         float acc) {
    const auto value = [](unsigned q) { return quant::kMxfp4Values[q]; };
    const std::int32_t s = detail::nibble_dot32(slab(codes, b), lane, x.q + 32 * b, value);
    const float dw = quant::e8m0_to_fp32_half(detail::byte_at(area(scales, b), lane));
    return std::fma(float(s), dw * x.d[b], acc);
  }
  /// Block `chunk` of a lane: codes v2[q], factor 2^(e−128).
  static void chunk_codes(const Element* codes, Index chunk, Index lane, std::int8_t* q) {
    for (Index k = 0; k < 32; ++k) q[k] = std::int8_t(quant::kMxfp4Values[detail::get_nibble(slab(codes, chunk), k, lane)]);
  }
  static void chunk_factors(const std::byte* scales, Index chunk, Index lane, float& lo, float& hi, float&) {
    lo = hi = quant::e8m0_to_fp32_half(detail::byte_at(area(scales, chunk), lane));
  }
};

}  // namespace apex::packed
