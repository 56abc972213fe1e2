#pragma once
/// \file kernels/quant_layout.hpp
/// Where a block format's codes and scales sit inside a panel
/// (kernels/packed_weights.hpp), and the quantized activations its products
/// read. The formats themselves are ggml's (quant/blocks.hpp); a panel holds
/// their bits unchanged, only in another order.
///
/// A panel is 32 lanes (weight rows) × K. Along K a lane's weights form
/// blocks of B = 32 (Q8_0, Q4_0, MXFP4) or 256 (Q4_K, Q6_K) weights. Block b
/// of all 32 lanes is one contiguous *slab* of codes, so a kernel reads the
/// slabs front to back, and the block's scales sit in the panel's scale
/// array, one plane per scale field, lane-contiguous (a vector load gives
/// the field of 8 or 16 lanes).
///
/// Inside a slab the codes of one lane are grouped by 4 consecutive k, so a
/// 32-bit lane of a vector holds 4 weights of one row and one broadcast
/// activation word meets all of them (`vpmaddubsw`/`vpdpbusd` multiply 4
/// byte pairs per 32-bit lane):
///
///   8-bit codes:  byte ((k/4)·32 + lane)·4 + k mod 4
///   4-bit codes:  byte ((k/8)·32 + lane)·4 + k mod 4, low nibble for
///                 k mod 8 < 4, high nibble otherwise (one mask or shift
///                 gives 4 k of every lane)
///   2-bit parts:  byte ((k/16)·32 + lane)·4 + k mod 4, bits 2·((k/4) mod 4)
///                 (Q6_K's high bits: one shift and mask per 4 k)
///
/// A type may order its parts inside the slab: Q6_K keeps each group of 16
/// k's 4-bit codes and then its 2-bit parts together, k counted from the
/// group (kernels/quant_k_types.hpp).

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "../core/types.hpp"
#include "dtype.hpp"

namespace apex::packed {

/// How a weight type quantizes the activations its products read (ggml's
/// `vec_dot_type`): Q8_0 blocks of 32 (fp16 scale) or Q8_K blocks of 256
/// (float scale).
enum class ActivationFormat { q8_0, q8_k };

namespace detail {

/// One row of quantized activations: K int8 codes, the float scale of each
/// block of the activation format, and the sum of each 16 consecutive codes
/// (what the offset-coded formats subtract: Σ (u − o)·x = Σ u·x − o·Σ x).
struct QuantRow {
  const std::int8_t* q;     ///< K codes
  const float* d;           ///< K / block scales
  const std::int32_t* s16;  ///< K / 16 sums of codes
  std::int32_t sum32(Index j) const { return s16[2 * j] + s16[2 * j + 1]; }  ///< codes 32j…32j+31
};

/// Rows of quantized activations (rows × K), row r at offsets r·ld*.
struct QuantRows {
  const std::int8_t* q;
  Index ldq;
  const float* d;
  Index ldd;
  const std::int32_t* s16;
  Index lds;
  QuantRow row(Index r) const { return {q + r * ldq, d + r * ldd, s16 + r * lds}; }
};

constexpr Index q8_byte(Index k, Index lane) { return ((k >> 2) * kPanelLanes + lane) * 4 + (k & 3); }
constexpr Index q4_byte(Index k, Index lane) { return ((k >> 3) * kPanelLanes + lane) * 4 + (k & 3); }
constexpr int q4_shift(Index k) { return int(k & 4); }
constexpr Index q2_byte(Index k, Index lane) { return ((k >> 4) * kPanelLanes + lane) * 4 + (k & 3); }
constexpr int q2_shift(Index k) { return int((k >> 2) & 3) * 2; }

inline std::uint8_t byte_at(const std::byte* p, Index i) { return std::uint8_t(p[i]); }

inline std::uint8_t get_nibble(const std::byte* slab, Index k, Index lane) {
  return std::uint8_t((byte_at(slab, q4_byte(k, lane)) >> q4_shift(k)) & 0xF);
}
inline void set_nibble(std::byte* slab, Index k, Index lane, unsigned v) {
  std::byte& b = slab[q4_byte(k, lane)];
  const unsigned keep = std::uint8_t(b) & ~(0xFu << q4_shift(k));
  b = std::byte(std::uint8_t(keep | ((v & 0xFu) << q4_shift(k))));
}
inline std::uint8_t get_crumb(const std::byte* slab, Index k, Index lane) {
  return std::uint8_t((byte_at(slab, q2_byte(k, lane)) >> q2_shift(k)) & 0x3);
}
inline void set_crumb(std::byte* slab, Index k, Index lane, unsigned v) {
  std::byte& b = slab[q2_byte(k, lane)];
  const unsigned keep = std::uint8_t(b) & ~(0x3u << q2_shift(k));
  b = std::byte(std::uint8_t(keep | ((v & 0x3u) << q2_shift(k))));
}

/// Lane `lane` of a lane-contiguous plane of 16-bit fields.
inline std::uint16_t get_u16(const std::byte* plane, Index lane) {
  std::uint16_t v;
  std::memcpy(&v, plane + 2 * lane, 2);
  return v;
}
inline void set_u16(std::byte* plane, Index lane, std::uint16_t v) { std::memcpy(plane + 2 * lane, &v, 2); }

/// A 4-bit code of a 32-weight ggml block (Q4_0, MXFP4): byte j holds
/// weights j (low nibble) and j + 16 (high nibble).
inline unsigned block32_nibble(const std::uint8_t* qs, Index k) {
  return k < 16 ? qs[k] & 0xFu : unsigned(qs[k - 16]) >> 4;
}
inline void set_block32_nibble(std::uint8_t* qs, Index k, unsigned v) {
  if (k < 16) qs[k] = std::uint8_t((qs[k] & 0xF0u) | v);
  else qs[k - 16] = std::uint8_t((qs[k - 16] & 0x0Fu) | (v << 4));
}

}  // namespace detail
}  // namespace apex::packed
