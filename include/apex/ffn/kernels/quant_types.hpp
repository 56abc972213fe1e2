#pragma once
/// \file kernels/quant_types.hpp
/// The block-format entries of the weight-type table (kernels/weight_types.hpp):
/// ggml's 32-weight formats Q8_0, Q4_0 and MXFP4 (the K-quants are
/// kernels/quant_k_types.hpp), held in panels as
/// kernels/quant_layout.hpp places them. What every entry shares (sizes,
/// addresses, the row conversions and the scale-range rule) is
/// kernels/block_format.hpp. Each entry says
///
/// - its name, its GGUF spelling (ggml's type id and name) and its ggml
///   block (quant/blocks.hpp), how that block goes into a panel lane and
///   comes back (`put_block`, `get_block`: the same bits, only moved), and
///   ggml's quantizer and dequantizer (`quantize`, `dequantize`);
/// - when a block's values would not be finite (`scale_problem`);
/// - the product of one block with quantized activations (`dot_block`):
///   integer sums of code × code, exact, then fp32 `fma(float(sum), scale,
///   acc)` in a fixed order. The scalar path runs it as written; every SIMD
///   path (the type's `Tiles<T, Isa>`, kernels/arch/) computes the same
///   integers and the same float operations in the same order, so every
///   path gives the same bits;
/// - a chunk of 32 columns of a lane as codes and factors (`chunk_codes`,
///   `chunk_factors`: the portable column unpacker, kernels/unpack_columns.hpp).
///
/// Scale planes (bytes per lane in parentheses) inside block b's scale area:
///   Q8_0, Q4_0:  d fp16 (2)                      value d·q,  d·(q − 8)
///   MXFP4:       e E8M0 (1)                      value 2^(e−128)·v2[q]  (v2: doubled E2M1)
///   Q4_K:        d, dmin fp16, scales[12] (16)   value d·sc_j·q − dmin·m_j
///   Q6_K:        d fp16, scales[16] int8 (18)    value d·sc_g·(q − 32)

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "../quant/formats.hpp"
#include "block_format.hpp"
#include "dtype.hpp"
#include "quant_layout.hpp"

namespace apex::packed {

/// Q8_0: 32 int8 codes and an fp16 scale; value d·q.
template <>
struct WeightType<Dtype::q8_0>
    : detail::BlockFormat<WeightType<Dtype::q8_0>, quant::BlockQ8_0, 32, 34, 2, ActivationFormat::q8_0> {
  using Storage = packed::q8_0;
  static constexpr const char* kName = "q8_0";
  static constexpr std::uint32_t kGgmlType = 8;
  static constexpr const char* kGgmlName = "q8_0";
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
  static constexpr std::uint32_t kGgmlType = 2;
  static constexpr const char* kGgmlName = "q4_0";
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
  static constexpr std::uint32_t kGgmlType = 39;
  static constexpr const char* kGgmlName = "mxfp4";
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
