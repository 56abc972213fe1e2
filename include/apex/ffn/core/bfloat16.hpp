#pragma once
/// \file core/bfloat16.hpp
/// The scalar float ↔ bfloat16 conversions, written once for every part of
/// the library that stores bf16: the checkpoint codec (safetensors/) and the
/// packed expert engine (kernels/bf16_vectors.hpp, whose vector paths must give these
/// bits).
///
/// bfloat16 is the upper 16 bits of an IEEE binary32 (1 sign, 8 exponent,
/// 7 mantissa bits). Conversions follow PyTorch
/// (`c10::detail::round_to_nearest_even`) bit for bit, so a value rounded here
/// equals the value `tensor.bfloat16()` holds:
/// - float → bf16 rounds to nearest, ties to even, by adding 0x7FFF plus the
///   lowest kept bit and truncating; finite values at or above the halfway
///   point past the largest bf16 become ±Inf; subnormals round like any value.
/// - NaN becomes 0x7FC0 (a positive quiet NaN; sign and payload dropped, as
///   PyTorch does), so a NaN never turns into an Inf by rounding.
/// - bf16 → float is exact: the 16 bits shifted into the top of a float.

#include <cmath>
#include <cstdint>
#include <cstring>

namespace apex::bfloat16 {

/// The canonical NaN every NaN rounds to.
inline constexpr std::uint16_t kNaN = 0x7FC0;

/// The bf16 bits of `x` (round to nearest even; NaN → kNaN).
inline std::uint16_t from_float(float x) {
  if (std::isnan(x)) return kNaN;
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  // No overflow: the largest non-NaN pattern is 0xFF800000 (−Inf).
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

/// The float whose upper half is `bits` (exact).
inline float to_float(std::uint16_t bits) {
  const std::uint32_t u = std::uint32_t(bits) << 16;
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

}  // namespace apex::bfloat16
