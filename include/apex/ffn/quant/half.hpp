#pragma once
/// \file quant/half.hpp
/// The scalar conversions the quantized block formats store their scales in:
/// IEEE binary16 (the `d`/`dmin` of Q8_0, Q4_0, Q4_K, Q6_K) and E8M0 (the
/// shared power-of-two exponent of an MXFP4 block).
///
/// Both follow ggml (ggml/src/ggml-impl.h) bit for bit, because a block is
/// only interchangeable with ggml's when its scale bits are:
/// - float → half rounds to nearest, ties to even; finite values at or above
///   65520 (halfway past the largest half, 65504) become ±Inf; values below
///   2^-14 become subnormal halves (m·2^-24), rounded the same way. This is
///   what F16C `_cvtss_sh(x, 0)` gives for every non-NaN input.
/// - Every NaN becomes sign | 0x7E00 (ggml's `GGML_FP32_TO_FP16`; F16C keeps
///   the payload's top bits instead).
/// - half → float is exact; a NaN keeps its payload and comes back quiet
///   (bit 22 set), as ggml's multiply-based conversion returns it.
///
/// Written with integer operations only, so the result does not depend on
/// the floating-point environment (flush-to-zero, excess precision).

#include <cstdint>
#include <cstring>

namespace apex::quant {

namespace detail {

inline std::uint32_t float_bits(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

inline float bits_float(std::uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

/// `value >> shift` rounded to nearest, ties to even (1 ≤ shift ≤ 31).
inline std::uint32_t shift_round_even(std::uint32_t value, int shift) {
  const std::uint32_t kept = value >> shift;
  const std::uint32_t rest = value & ((std::uint32_t{1} << shift) - 1);
  const std::uint32_t half = std::uint32_t{1} << (shift - 1);
  return kept + ((rest > half || (rest == half && (kept & 1))) ? 1 : 0);
}

}  // namespace detail

/// The binary16 bits nearest `x` (ties to even; NaN → sign | 0x7E00).
inline std::uint16_t fp32_to_fp16(float x) {
  const std::uint32_t u = detail::float_bits(x);
  const auto sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<std::uint16_t>(sign | 0x7E00u);
  if (a >= 0x477FF000u) return static_cast<std::uint16_t>(sign | 0x7C00u);  // ≥ 65520 and ±Inf
  if (a >= 0x38800000u) {
    // Normal half: rebias the exponent (127 → 15) and round the 23-bit
    // mantissa to 10 bits; a carry out of the mantissa correctly bumps the
    // exponent (and 65504 + ulp/2 was handled above).
    return static_cast<std::uint16_t>(sign | detail::shift_round_even(a - (112u << 23), 13));
  }
  // Subnormal half m·2^-24: m = round(1.f·2^(e-127) / 2^-24) = round(mant24 >> (126 - e)).
  const int e = static_cast<int>(a >> 23);
  if (e < 102) return sign;  // below 2^-25, i.e. under half the smallest subnormal
  const std::uint32_t mant = (a & 0x7FFFFFu) | 0x800000u;
  return static_cast<std::uint16_t>(sign | detail::shift_round_even(mant, 126 - e));
}

/// The float equal to the binary16 `h` (exact).
inline float fp16_to_fp32(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1Fu;
  std::uint32_t mant = h & 0x3FFu;
  if (exp == 0x1F) return detail::bits_float(sign | 0x7F800000u | (mant << 13) | (mant ? 0x400000u : 0u));
  if (exp != 0) return detail::bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return detail::bits_float(sign);
  // Subnormal m·2^-24: normalise m to 1.f·2^(10-shift) · 2^-24.
  std::uint32_t shift = 0;
  while ((mant & 0x400u) == 0) {
    mant <<= 1;
    ++shift;
  }
  return detail::bits_float(sign | ((113u - shift) << 23) | ((mant & 0x3FFu) << 13));
}

/// 2^(e − 127), the E8M0 scale (ggml_e8m0_to_fp32). Code 0 is the float
/// subnormal 2^-127; code 255 gives +Inf (ggml does not map it to NaN).
inline float e8m0_to_fp32(std::uint8_t e) {
  return detail::bits_float(e == 0 ? 0x00400000u : static_cast<std::uint32_t>(e) << 23);
}

/// 2^(e − 128), half the E8M0 scale (ggml_e8m0_to_fp32_half): MXFP4 stores
/// its E2M1 values doubled (kMxfp4Values), so this is the factor they take.
/// Codes 0 and 1 are the float subnormals 2^-128 and 2^-127.
inline float e8m0_to_fp32_half(std::uint8_t e) {
  return detail::bits_float(e < 2 ? (0x00200000u << e) : static_cast<std::uint32_t>(e - 1) << 23);
}

}  // namespace apex::quant
