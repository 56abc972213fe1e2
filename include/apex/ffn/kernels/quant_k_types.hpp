#pragma once
/// \file kernels/quant_k_types.hpp
/// The K-quant entries of the weight-type table: ggml's Q4_K and Q6_K,
/// 256-weight super-blocks with sub-block scales, multiplied with Q8_K
/// activations (kernels/quant_types.hpp says what an entry holds).
///
///   Q4_K: 8 sub-blocks of 32, 4-bit q, 6-bit scale sc_j and min m_j packed
///         in 12 bytes; value d·sc_j·q − dmin·m_j.
///         Product: d·d_x·Σ_j sc_j·Σ q·x − dmin·d_x·Σ_j m_j·Σ x.
///   Q6_K: 16 groups of 16, 6-bit q (4 low bits + 2 high), int8 scale sc_g;
///         value d·sc_g·(q − 32). Product: d·d_x·Σ_g sc_g·Σ (q − 32)·x.
///
/// Both integer sums are exact in int32 (|Σ| < 2^25), then two (Q4_K) or
/// one (Q6_K) fp32 fma per super-block and lane, in that order.

#include <cstddef>
#include <cstdint>

#include "quant_types.hpp"

namespace apex::packed {

/// Q4_K. Scale area of a super-block: d (fp16 plane), dmin (fp16 plane),
/// then the 12 packed scale bytes as 12 byte planes.
template <>
struct WeightType<Dtype::q4_k>
    : detail::BlockFormat<WeightType<Dtype::q4_k>, quant::BlockQ4_K, 256, 144, 16, ActivationFormat::q8_k> {
  using Storage = packed::q4_k;
  static constexpr const char* kName = "q4_k";
  static constexpr std::uint32_t kGgmlType = 12;
  static constexpr const char* kGgmlName = "q4_K";
  static constexpr Index kDminPlane = 2 * kPanelLanes, kScalePlanes = 4 * kPanelLanes;
  static void quantize(const float* w, Block* y, Index k) { quant::quantize_row_q4_k(w, y, k); }
  static void dequantize(const Block* x, float* w, Index k) { quant::dequantize_row_q4_k(x, w, k); }
  static std::string scale_problem(const Block& blk) {
    const std::string d = detail::half_scale_problem("d", blk.d);
    return d.empty() ? detail::half_scale_problem("dmin", blk.dmin) : d;
  }
  /// No finite Q4_K value reaches 2^32 (|d·sc·q| + |dmin·m| ≤ 65504·63·16 < 2^27), and above about 1e13
  /// the search's float sums overflow and return NaN scales, not Inf.
  static constexpr float kSearchBound = 4294967296.0f;

  /// ggml's order of the 256 codes: 64 weights per 32 bytes, low nibbles first.
  static unsigned file_code(const Block& blk, Index k) {
    const Index c = k / 64, r = k % 64;
    return r < 32 ? blk.qs[32 * c + r] & 0xFu : unsigned(blk.qs[32 * c + r - 32]) >> 4;
  }
  static void set_file_code(Block& blk, Index k, unsigned v) {
    const Index c = k / 64, r = k % 64;
    std::uint8_t& q = blk.qs[32 * c + (r < 32 ? r : r - 32)];
    q = r < 32 ? std::uint8_t((q & 0xF0u) | v) : std::uint8_t((q & 0x0Fu) | (v << 4));
  }
  static void put_block(const Block& blk, Index b, Index lane, Element* codes, std::byte* scales) {
    for (Index k = 0; k < 256; ++k) detail::set_nibble(slab(codes, b), k, lane, file_code(blk, k));
    std::byte* a = area(scales, b);
    detail::set_u16(a, lane, blk.d);
    detail::set_u16(a + kDminPlane, lane, blk.dmin);
    for (Index j = 0; j < 12; ++j) a[kScalePlanes + j * kPanelLanes + lane] = std::byte(blk.scales[j]);
  }
  static Block get_block(const Element* codes, const std::byte* scales, Index b, Index lane) {
    Block blk{};
    for (Index k = 0; k < 256; ++k) set_file_code(blk, k, detail::get_nibble(slab(codes, b), k, lane));
    const std::byte* a = area(scales, b);
    blk.d = detail::get_u16(a, lane);
    blk.dmin = detail::get_u16(a + kDminPlane, lane);
    for (Index j = 0; j < 12; ++j) blk.scales[j] = detail::byte_at(a, kScalePlanes + j * kPanelLanes + lane);
    return blk;
  }
  static float dot_block(const Element* codes, const std::byte* scales, Index b, Index lane, const detail::QuantRow& x,
                         float acc) {
    const std::byte* a = area(scales, b);
    std::uint8_t packed_scales[12];
    for (Index j = 0; j < 12; ++j) packed_scales[j] = detail::byte_at(a, kScalePlanes + j * kPanelLanes + lane);
    std::int32_t sumi = 0, mins = 0;
    for (int j = 0; j < 8; ++j) {
      std::uint8_t sc, m;
      quant::q4_k_scale_min(j, packed_scales, sc, m);
      std::int32_t s = 0;
      for (Index k = 32 * j; k < 32 * j + 32; ++k)
        s += std::int32_t(detail::get_nibble(slab(codes, b), k, lane)) * std::int32_t(x.q[256 * b + k]);
      sumi += std::int32_t(sc) * s;
      mins += std::int32_t(m) * x.sum32(8 * b + j);
    }
    const float d = quant::fp16_to_fp32(detail::get_u16(a, lane));
    const float dmin = quant::fp16_to_fp32(detail::get_u16(a + kDminPlane, lane));
    acc = std::fma(float(sumi), d * x.d[b], acc);
    return std::fma(float(mins), -(dmin * x.d[b]), acc);
  }
  /// Chunk c of a lane is sub-block j = c mod 8 of super-block c / 8: codes
  /// q, factor d·sc_j, minus dmin·m_j (dequantize_row_q4_k's operations).
  static constexpr bool kChunkMin = true;
  static void chunk_codes(const Element* codes, Index chunk, Index lane, std::int8_t* q) {
    for (Index c = 0; c < 32; ++c)
      q[c] = std::int8_t(detail::get_nibble(slab(codes, chunk / 8), 32 * (chunk % 8) + c, lane));
  }
  static void chunk_factors(const std::byte* scales, Index chunk, Index lane, float& lo, float& hi, float& min) {
    const std::byte* a = area(scales, chunk / 8);
    std::uint8_t packed_scales[12], sc, m;
    for (Index i = 0; i < 12; ++i) packed_scales[i] = detail::byte_at(a, kScalePlanes + i * kPanelLanes + lane);
    quant::q4_k_scale_min(int(chunk % 8), packed_scales, sc, m);
    lo = hi = quant::fp16_to_fp32(detail::get_u16(a, lane)) * float(sc);
    min = quant::fp16_to_fp32(detail::get_u16(a + kDminPlane, lane)) * float(m);
  }
  template <class Fn>
  static void chunk_bytes(const Element* codes, const std::byte* scales, Index chunk, Fn&& f) {
    f(slab(codes, chunk / 8) + chunk % 8 * 16 * kPanelLanes, 16 * kPanelLanes);
    f(area(scales, chunk / 8), kPanelLanes * kScaleBytes);
  }
};

/// Q6_K. Codes by group of 16 weights (384 bytes a group, 6144 a
/// super-block): group g's low 4 bits as 4-bit codes (its two octs, 256
/// bytes), then its high 2 bits as 2-bit parts (128 bytes), each in the
/// layout of kernels/quant_layout.hpp with k counted from the group's start.
/// Scale area: d (fp16 plane), then the 16 int8 scales as 16 byte planes.
///
/// Why by group: a group's product needs both parts, and with all low codes
/// of a super-block first and the high parts after them a pass reads two
/// streams in lockstep 4 KiB apart, which the hardware prefetcher follows at
/// half the speed of one (cold, no arithmetic, Zen 4: 10.8 against 20.2
/// GB/s); grouped, a decode pass reads the slab front to back
/// (docs/performance.md, "Q6_K codes by group"). Pack-once files name the
/// layout (`kPanelLayout`), so a file of the former one is refused.
template <>
struct WeightType<Dtype::q6_k>
    : detail::BlockFormat<WeightType<Dtype::q6_k>, quant::BlockQ6_K, 256, 210, 18, ActivationFormat::q8_k> {
  using Storage = packed::q6_k;
  static constexpr const char* kName = "q6_k";
  static constexpr std::uint32_t kGgmlType = 14;
  static constexpr const char* kGgmlName = "q6_K";
  static constexpr Index kScalePlanes = 2 * kPanelLanes;
  static constexpr Index kGroupBytes = 12 * kPanelLanes;  ///< 16 weights × 32 lanes × 6 bits
  static constexpr Index kGroupHighBits = 8 * kPanelLanes;  ///< offset of the 2-bit parts in a group
  static constexpr const char* kPanelLayout = "codes by group of 16";
  /// Group g's low codes (octs 2g, 2g + 1 as octs 0, 1) and its 2-bit parts (row 0).
  static const std::byte* group_low(const std::byte* slab, Index g) { return slab + g * kGroupBytes; }
  static const std::byte* group_high(const std::byte* slab, Index g) { return slab + g * kGroupBytes + kGroupHighBits; }
  static void quantize(const float* w, Block* y, Index k) { quant::quantize_row_q6_k(w, y, k); }
  static void dequantize(const Block* x, float* w, Index k) { quant::dequantize_row_q6_k(x, w, k); }
  static std::string scale_problem(const Block& blk) { return detail::half_scale_problem("d", blk.d); }
  /// No finite Q6_K value reaches 2^32 (|d·sc·(q − 32)| ≤ 65504·128·32 < 2^28), and above about 1e13
  /// the search's float sums overflow: a NaN scale is dropped and the block stored as zeros.
  static constexpr float kSearchBound = 4294967296.0f;

  /// ggml's order: per half of 128, weight 32·part + l (l < 32) has low bits
  /// in ql[l] (parts 0, 2) or ql[l + 32] (parts 1, 3), low or high nibble
  /// (parts 0, 1 or 2, 3), and high bits at qh[l] >> 2·part.
  static unsigned file_code(const Block& blk, Index k) {
    const Index h = k / 128, part = (k % 128) / 32, l = k % 32;
    const std::uint8_t lo = blk.ql[64 * h + l + (part & 1) * 32];
    const unsigned low = part < 2 ? lo & 0xFu : unsigned(lo) >> 4;
    return low | (((unsigned(blk.qh[32 * h + l]) >> (2 * part)) & 3u) << 4);
  }
  static void set_file_code(Block& blk, Index k, unsigned v) {
    const Index h = k / 128, part = (k % 128) / 32, l = k % 32;
    std::uint8_t& lo = blk.ql[64 * h + l + (part & 1) * 32];
    lo = part < 2 ? std::uint8_t((lo & 0xF0u) | (v & 0xFu)) : std::uint8_t((lo & 0x0Fu) | ((v & 0xFu) << 4));
    std::uint8_t& hi = blk.qh[32 * h + l];
    hi = std::uint8_t((hi & ~(3u << (2 * part))) | ((v >> 4) << (2 * part)));
  }
  static unsigned code(const Element* codes, Index b, Index k, Index lane) {
    const std::byte* g = slab(codes, b) + k / 16 * kGroupBytes;
    return detail::get_nibble(g, k % 16, lane) | (unsigned(detail::get_crumb(g + kGroupHighBits, k % 16, lane)) << 4);
  }
  static void put_block(const Block& blk, Index b, Index lane, Element* codes, std::byte* scales) {
    for (Index k = 0; k < 256; ++k) {
      const unsigned v = file_code(blk, k);
      std::byte* g = slab(codes, b) + k / 16 * kGroupBytes;
      detail::set_nibble(g, k % 16, lane, v & 0xFu);
      detail::set_crumb(g + kGroupHighBits, k % 16, lane, v >> 4);
    }
    std::byte* a = area(scales, b);
    detail::set_u16(a, lane, blk.d);
    for (Index g = 0; g < 16; ++g) a[kScalePlanes + g * kPanelLanes + lane] = std::byte(std::uint8_t(blk.scales[g]));
  }
  static Block get_block(const Element* codes, const std::byte* scales, Index b, Index lane) {
    Block blk{};
    for (Index k = 0; k < 256; ++k) set_file_code(blk, k, code(codes, b, k, lane));
    const std::byte* a = area(scales, b);
    blk.d = detail::get_u16(a, lane);
    for (Index g = 0; g < 16; ++g) blk.scales[g] = std::int8_t(detail::byte_at(a, kScalePlanes + g * kPanelLanes + lane));
    return blk;
  }
  static float dot_block(const Element* codes, const std::byte* scales, Index b, Index lane, const detail::QuantRow& x,
                         float acc) {
    const std::byte* a = area(scales, b);
    std::int32_t sumi = 0;
    for (Index g = 0; g < 16; ++g) {
      std::int32_t s = 0;
      for (Index k = 16 * g; k < 16 * g + 16; ++k)
        s += (std::int32_t(code(codes, b, k, lane)) - 32) * std::int32_t(x.q[256 * b + k]);
      sumi += std::int32_t(std::int8_t(detail::byte_at(a, kScalePlanes + g * kPanelLanes + lane))) * s;
    }
    const float d = quant::fp16_to_fp32(detail::get_u16(a, lane));
    return std::fma(float(sumi), d * x.d[b], acc);
  }
  /// Chunk c of a lane is groups 2h, 2h + 1 (h = c mod 8) of super-block
  /// c / 8: codes q − 32, factors d·sc_2h and d·sc_2h+1.
  static void chunk_codes(const Element* codes, Index chunk, Index lane, std::int8_t* q) {
    for (Index c = 0; c < 32; ++c) q[c] = std::int8_t(int(code(codes, chunk / 8, 32 * (chunk % 8) + c, lane)) - 32);
  }
  static void chunk_factors(const std::byte* scales, Index chunk, Index lane, float& lo, float& hi, float&) {
    const std::byte* a = area(scales, chunk / 8);
    const float d = quant::fp16_to_fp32(detail::get_u16(a, lane));
    const auto group = [&](Index g) { return float(std::int8_t(detail::byte_at(a, kScalePlanes + g * kPanelLanes + lane))); };
    lo = d * group(2 * (chunk % 8));
    hi = d * group(2 * (chunk % 8) + 1);
  }
  template <class Fn>
  static void chunk_bytes(const Element* codes, const std::byte* scales, Index chunk, Fn&& f) {
    f(slab(codes, chunk / 8) + 2 * (chunk % 8) * kGroupBytes, 2 * kGroupBytes);  // groups 2h, 2h + 1
    f(area(scales, chunk / 8), kPanelLanes * kScaleBytes);
  }
};

}  // namespace apex::packed
