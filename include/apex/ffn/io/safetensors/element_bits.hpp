#pragma once
/// \file io/safetensors/element_bits.hpp
/// Scalar conversions behind every tensor the format stores: little-endian
/// loads and stores, float/double bit casts, double → float and float or
/// double → bfloat16 rounding (to nearest, ties to even, NaN → 0x7FC0, as
/// PyTorch rounds; the float rules are core/bfloat16.hpp's).
///
/// Exists on its own because the rounding rules are the subtle part of the
/// format (a double must be rounded to bf16 once, not twice) and are tested
/// bit by bit; the codec only loops over them.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "../../core/bfloat16.hpp"

namespace apex {
namespace safetensors {
namespace detail {

// Little-endian loads and stores written byte by byte: correct on any host,
// and compiled to single moves on little-endian ones.
inline std::uint64_t load_le(const unsigned char* p, int bytes) {
  std::uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
inline void store_le(unsigned char* p, std::uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i, v >>= 8) p[i] = static_cast<unsigned char>(v & 0xFF);
}

inline float bits_to_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline std::uint32_t float_to_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline double bits_to_double(std::uint64_t u) {
  double d;
  std::memcpy(&d, &u, 8);
  return d;
}
inline std::uint64_t double_to_bits(double d) {
  std::uint64_t u;
  std::memcpy(&u, &d, 8);
  return u;
}

/// double → float, round to nearest even, ±inf beyond the range. (A plain
/// cast of an out-of-range double is undefined behaviour in C++.)
inline float to_float(double d) {
  constexpr double kMax = double(std::numeric_limits<float>::max());
  // Halfway between FLT_MAX and 2^128: from here on, RNE gives infinity.
  constexpr double kOverflow = kMax + 0x1.0p103;
  if (std::isnan(d) || std::fabs(d) <= kMax) return static_cast<float>(d);
  const float big = std::fabs(d) >= kOverflow ? std::numeric_limits<float>::infinity() : std::numeric_limits<float>::max();
  return std::signbit(d) ? -big : big;
}

/// float → bfloat16 bits, round to nearest, ties to even; NaN → 0x7FC0
/// (core/bfloat16.hpp, PyTorch's rules).
inline std::uint16_t float_to_bf16(float f) { return bfloat16::from_float(f); }

/// double → bfloat16 bits, rounded once (to nearest even) from the double.
/// Going through a round-to-nearest float would round twice and can land on
/// the wrong side of a bf16 tie (1 + 2⁻⁸ + 2⁻³⁰ → 1 instead of 1 + 2⁻⁷).
/// Rounding to float by round-to-odd first (sticky last bit) keeps enough
/// information for the second rounding to be exact.
inline std::uint16_t double_to_bf16(double d) {
  if (std::isnan(d)) return bfloat16::kNaN;
  float f = to_float(d);
  if (double(f) != d) {
    std::uint32_t u = float_to_bits(f);
    // f is one of the two floats around d; round-to-odd picks the odd one.
    if ((u & 1u) == 0) u = std::fabs(double(f)) > std::fabs(d) ? u - 1 : u + 1;
    f = bits_to_float(u);
  }
  return float_to_bf16(f);
}

inline float bf16_to_float(std::uint16_t b) { return bfloat16::to_float(b); }

}  // namespace detail
}  // namespace safetensors
}  // namespace apex
