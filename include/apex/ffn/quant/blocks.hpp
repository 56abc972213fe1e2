#pragma once
/// \file quant/blocks.hpp
/// The quantized block layouts of ggml (ggml/src/ggml-common.h), byte for
/// byte, so a row of blocks written here is a row of a GGUF tensor of that
/// type and the other way round. Scales are stored as raw bits (quant/half.hpp
/// converts them); nothing here has padding, which the size asserts pin.
///
/// | block      | weights | bytes | bits/weight | value of weight i                         |
/// |------------|---------|-------|-------------|-------------------------------------------|
/// | BlockQ8_0  | 32      | 34    | 8.5         | d·qs[i]                                   |
/// | BlockQ4_0  | 32      | 18    | 4.5         | d·(q_i − 8)                               |
/// | BlockMXFP4 | 32      | 17    | 4.25        | 2^(e−128)·kMxfp4Values[q_i]               |
/// | BlockQ4_K  | 256     | 144   | 4.5         | d·sc_j·q_i − dmin·m_j, j = i/32           |
/// | BlockQ6_K  | 256     | 210   | 6.5625      | d·scales[j]·(q_i − 32), j = i/16          |
/// | BlockQ8_K  | 256     | 292   | 9.125       | d·qs[i] (d is a float)                    |

#include <cstdint>
#include <string>
#include <type_traits>

#include "../core/errors.hpp"
#include "../core/types.hpp"

/// ggml's reference quantizers round every product and sum separately (its
/// base library is built without FMA). A compiler allowed to fuse a·b + c
/// into one FMA (GCC's default in GNU modes, Clang's within an expression)
/// would change low bits of the search sums and so of the chosen codes: the
/// quantizer headers switch contraction off for their own functions.
/// APEX_QUANT_FP_STRICT_BEGIN/END bracket those definitions (GCC);
/// APEX_QUANT_FP_STRICT_SCOPE opens each function body (Clang).
#if defined(__clang__)
#define APEX_QUANT_FP_STRICT_BEGIN
#define APEX_QUANT_FP_STRICT_END
#define APEX_QUANT_FP_STRICT_SCOPE _Pragma("clang fp contract(off)")
#elif defined(__GNUC__)
#define APEX_QUANT_FP_STRICT_BEGIN _Pragma("GCC push_options") _Pragma("GCC optimize(\"fp-contract=off\")")
#define APEX_QUANT_FP_STRICT_END _Pragma("GCC pop_options")
#define APEX_QUANT_FP_STRICT_SCOPE
#else
#define APEX_QUANT_FP_STRICT_BEGIN
#define APEX_QUANT_FP_STRICT_END
#define APEX_QUANT_FP_STRICT_SCOPE
#endif

namespace apex::quant {

/// Weights per block of Q8_0, Q4_0 and MXFP4 (ggml's QK8_0, QK4_0, QK_MXFP4).
inline constexpr Index kQK = 32;
/// Weights per K-quant super-block (ggml's QK_K).
inline constexpr Index kQKK = 256;

/// 8-bit symmetric: d (half) · qs[i].
struct BlockQ8_0 {
  std::uint16_t d;
  std::int8_t qs[32];
};

/// 4-bit symmetric with offset 8: qs[j] low nibble is weight j, high nibble
/// weight j + 16; value d (half) · (q − 8).
struct BlockQ4_0 {
  std::uint16_t d;
  std::uint8_t qs[16];
};

/// OCP MX FP4: E2M1 elements sharing one E8M0 exponent `e`; nibbles packed
/// as in Q4_0 (low = weight j, high = weight j + 16).
struct BlockMXFP4 {
  std::uint8_t e;
  std::uint8_t qs[16];
};

/// 4-bit asymmetric super-block: 8 sub-blocks of 32 with a 6-bit scale sc_j
/// and 6-bit min m_j each (packed in `scales`, see q4_k_scale_min); value
/// d·sc_j·q − dmin·m_j. qs holds 4 groups of 64 weights: byte l of group g
/// has weight 64g + l in its low nibble and 64g + 32 + l in its high nibble.
struct BlockQ4_K {
  std::uint16_t d;
  std::uint16_t dmin;
  std::uint8_t scales[12];
  std::uint8_t qs[128];
};

/// 6-bit symmetric super-block: 16 sub-blocks of 16 with a signed 8-bit
/// scale each; value d·scales[j]·(q − 32). The 6-bit q is split into 4 low
/// bits (ql) and 2 high bits (qh), in two halves of 128 weights: within a
/// half, ql[l] holds weights l (low nibble) and l + 64 (high), ql[l + 32]
/// weights l + 32 and l + 96, and qh[l] the high bits of l, l + 32, l + 64,
/// l + 96 at bit offsets 0, 2, 4, 6.
struct BlockQ6_K {
  std::uint8_t ql[128];
  std::uint8_t qh[64];
  std::int8_t scales[16];
  std::uint16_t d;
};

/// 8-bit intermediate of the K-quant dot products: float scale, and the sum
/// of each group of 16 quants (bsums) precomputed for the min terms.
struct BlockQ8_K {
  float d;
  std::int8_t qs[256];
  std::int16_t bsums[16];
};

static_assert(sizeof(BlockQ8_0) == 34 && std::is_standard_layout_v<BlockQ8_0>, "BlockQ8_0 must match block_q8_0");
static_assert(sizeof(BlockQ4_0) == 18 && std::is_standard_layout_v<BlockQ4_0>, "BlockQ4_0 must match block_q4_0");
static_assert(sizeof(BlockMXFP4) == 17 && std::is_standard_layout_v<BlockMXFP4>,
              "BlockMXFP4 must match block_mxfp4");
static_assert(sizeof(BlockQ4_K) == 144 && std::is_standard_layout_v<BlockQ4_K>, "BlockQ4_K must match block_q4_K");
static_assert(sizeof(BlockQ6_K) == 210 && std::is_standard_layout_v<BlockQ6_K>, "BlockQ6_K must match block_q6_K");
static_assert(sizeof(BlockQ8_K) == 292 && std::is_standard_layout_v<BlockQ8_K>, "BlockQ8_K must match block_q8_K");

/// The E2M1 values {0, 0.5, 1, 1.5, 2, 3, 4, 6} and their negatives, doubled
/// so they are integers (ggml's kvalues_mxfp4); codes 8..15 are the sign-set
/// codes 0..7 (code 8 is −0, stored as 0).
inline constexpr std::int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/// The 6-bit scale `sc` and min `m` of sub-block j (0..7) of a Q4_K block
/// (ggml's get_scale_min_k4). Bytes 0..3 hold sc_0..3, bytes 4..7 m_0..3
/// (low 6 bits); sub-blocks 4..7 keep their low 4 bits in bytes 8..11 (sc
/// low nibble, m high nibble) and their top 2 bits in the spare top bits of
/// bytes j − 4 (sc) and j (m).
inline void q4_k_scale_min(int j, const std::uint8_t* scales, std::uint8_t& sc, std::uint8_t& m) {
  if (j < 4) {
    sc = static_cast<std::uint8_t>(scales[j] & 63);
    m = static_cast<std::uint8_t>(scales[j + 4] & 63);
  } else {
    sc = static_cast<std::uint8_t>((scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4));
    m = static_cast<std::uint8_t>((scales[j + 4] >> 4) | ((scales[j] >> 6) << 4));
  }
}

namespace detail {

/// Throws ConfigError unless `k` is a non-negative multiple of `block`;
/// returns the number of blocks. `what` names the block in the message.
/// The message is built only on failure: the quantizers call this once per
/// block where a product quantizes its activations.
inline Index blocks_in_row(const char* where, Index k, Index block, const char* what) {
  if (k < 0) apex::detail::require_config(false, where, "row length " + std::to_string(k) + " is negative");
  if (k % block != 0)
    apex::detail::require_config(false, where,
                                 "row length " + std::to_string(k) + " is not a multiple of " +
                                     std::to_string(block) + " (" + what + ")");
  return k / block;
}

}  // namespace detail
}  // namespace apex::quant
