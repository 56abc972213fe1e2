#pragma once
/// \file quant/k_quant_search.hpp
/// The scale searches the K-quants share, as ggml's reference quantizers
/// (ggml/src/ggml-quants.c) run them: same float (never double) arithmetic,
/// same order of accumulation, same clamps, so the codes they choose are
/// ggml's codes.

#include <cmath>
#include <cstdint>
#include <cstring>

#include "blocks.hpp"

namespace apex::quant {

APEX_QUANT_FP_STRICT_BEGIN

/// Below this group maximum a group is all zero (ggml's GROUP_MAX_EPS).
inline constexpr float kGroupMaxEps = 1e-15f;

/// round(x) to nearest, ties to even, for |x| ≤ 2^22 − 1: adding 1.5·2^23
/// puts the float's units in the low mantissa bits, the addition rounding
/// them (ggml's nearest_int; not std::lround, which rounds ties away).
inline int nearest_int(float x) {
  APEX_QUANT_FP_STRICT_SCOPE
  const float shifted = x + 12582912.f;
  std::int32_t bits;
  std::memcpy(&bits, &shifted, sizeof bits);
  return (bits & 0x007fffff) - 0x00400000;
}

namespace detail {

/// Weight of element i in the least-squares fit of make_qx_quants: the
/// caller's weights if given, else x², 1, |x| or √|x| for rmse_type 1..4.
inline float qx_weight(int rmse_type, const float* x, const float* qw, int i) {
  if (qw) return qw[i];
  if (rmse_type == 1) return x[i] * x[i];
  if (rmse_type == 2) return 1;
  if (rmse_type == 3) return std::fabs(x[i]);
  return std::sqrt(std::fabs(x[i]));
}

}  // namespace detail

/// Symmetric codes L[i] ∈ [0, 2·nmax) for n values, x ≈ scale·(L − nmax);
/// returns the scale (ggml's make_qx_quants). The first guess maps the
/// signed maximum `max` to −nmax (iscale = −nmax/max); with rmse_type ≠ 0
/// the scale is refit by weighted least squares (scale = Σwxl/Σwl²) and 18
/// nearby guesses −(nmax ± 0.1·is)/max are tried, a guess kept when its
/// Σwxl²/Σwl² is larger. rmse_type < 0 stops after the first fit and
/// returns the mean of the two scales. A group with |x| < 1e-15 gets
/// L = 0 and scale 0.
inline float make_qx_quants(int n, int nmax, const float* x, std::int8_t* L, int rmse_type, const float* qw) {
  APEX_QUANT_FP_STRICT_SCOPE
  float max = 0, amax = 0;
  for (int i = 0; i < n; ++i) {
    const float ax = std::fabs(x[i]);
    if (ax > amax) {
      amax = ax;
      max = x[i];
    }
  }
  if (amax < kGroupMaxEps) {
    for (int i = 0; i < n; ++i) L[i] = 0;
    return 0.f;
  }
  const auto code = [&](float iscale, int i) {
    const int l = nearest_int(iscale * x[i]);
    return l < -nmax ? -nmax : (l > nmax - 1 ? nmax - 1 : l);
  };
  float iscale = -nmax / max;
  if (rmse_type == 0) {
    for (int i = 0; i < n; ++i) L[i] = static_cast<std::int8_t>(nmax + code(iscale, i));
    return 1 / iscale;
  }
  const bool return_early = rmse_type < 0;
  if (rmse_type < 0) rmse_type = -rmse_type;
  float sumlx = 0, suml2 = 0;
  for (int i = 0; i < n; ++i) {
    const int l = code(iscale, i);
    L[i] = static_cast<std::int8_t>(l + nmax);
    const float w = detail::qx_weight(rmse_type, x, qw, i);
    sumlx += w * x[i] * l;
    suml2 += w * l * l;
  }
  float scale = suml2 ? sumlx / suml2 : 0.0f;
  if (return_early) return suml2 > 0 ? 0.5f * (scale + 1 / iscale) : 1 / iscale;
  float best = scale * sumlx;
  for (int is = -9; is <= 9; ++is) {
    if (is == 0) continue;
    iscale = -(nmax + 0.1f * is) / max;
    sumlx = suml2 = 0;
    for (int i = 0; i < n; ++i) {
      const int l = code(iscale, i);
      const float w = detail::qx_weight(rmse_type, x, qw, i);
      sumlx += w * x[i] * l;
      suml2 += w * l * l;
    }
    if (suml2 > 0 && sumlx * sumlx > best * suml2) {
      for (int i = 0; i < n; ++i) L[i] = static_cast<std::int8_t>(nmax + code(iscale, i));
      scale = sumlx / suml2;
      best = scale * sumlx;
    }
  }
  return scale;
}

namespace detail {

/// Weighted error Σ w·e(scale·L + min − x), e = |·| (use_mad) or (·)².
inline float qkx_error(int n, const float* x, const float* weights, const std::uint8_t* L, float scale, float min,
                       bool use_mad) {
  APEX_QUANT_FP_STRICT_SCOPE
  float error = 0;
  for (int i = 0; i < n; ++i) {
    float diff = scale * L[i] + min - x[i];
    diff = use_mad ? std::fabs(diff) : diff * diff;
    error += weights[i] * diff;
  }
  return error;
}

}  // namespace detail

/// Asymmetric codes L[i] ∈ [0, nmax], x ≈ scale·L − the_min, for n values
/// with weights (ggml's make_qkx2_quants). The range starts at [min(x, 0),
/// max(x)]; then nstep + 1 scales (rmin + rdelta·is + nmax)/(max − min) are
/// tried, each refit by weighted least squares for scale and offset (the
/// offset clamped to ≤ 0, i.e. a non-negative `the_min`), the one with the
/// smallest weighted error kept. Returns the scale; a constant group gets
/// L = 0 and scale 0. Laux is scratch for n codes.
inline float make_qkx2_quants(int n, int nmax, const float* x, const float* weights, std::uint8_t* L, float* the_min,
                              std::uint8_t* Laux, float rmin, float rdelta, int nstep, bool use_mad) {
  APEX_QUANT_FP_STRICT_SCOPE
  float min = x[0], max = x[0];
  float sum_w = weights[0], sum_x = sum_w * x[0];
  for (int i = 1; i < n; ++i) {
    if (x[i] < min) min = x[i];
    if (x[i] > max) max = x[i];
    const float w = weights[i];
    sum_w += w;
    sum_x += w * x[i];
  }
  if (min > 0) min = 0;
  if (max == min) {
    for (int i = 0; i < n; ++i) L[i] = 0;
    *the_min = -min;
    return 0.f;
  }
  const auto code = [&](float iscale, int i) {
    const int l = nearest_int(iscale * (x[i] - min));
    return static_cast<std::uint8_t>(l < 0 ? 0 : (l > nmax ? nmax : l));
  };
  float iscale = nmax / (max - min);
  float scale = 1 / iscale;
  for (int i = 0; i < n; ++i) L[i] = code(iscale, i);
  float best_error = detail::qkx_error(n, x, weights, L, scale, min, use_mad);
  if (nstep < 1) {
    *the_min = -min;
    return scale;
  }
  for (int is = 0; is <= nstep; ++is) {
    iscale = (rmin + rdelta * is + nmax) / (max - min);
    float sum_l = 0, sum_l2 = 0, sum_xl = 0;
    for (int i = 0; i < n; ++i) {
      const int l = code(iscale, i);
      Laux[i] = static_cast<std::uint8_t>(l);
      const float w = weights[i];
      sum_l += w * l;
      sum_l2 += w * l * l;
      sum_xl += w * l * x[i];
    }
    const float D = sum_w * sum_l2 - sum_l * sum_l;
    if (!(D > 0)) continue;
    float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
    float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
    if (this_min > 0) {
      this_min = 0;
      this_scale = sum_xl / sum_l2;
    }
    const float cur_error = detail::qkx_error(n, x, weights, Laux, this_scale, this_min, use_mad);
    if (cur_error < best_error) {
      for (int i = 0; i < n; ++i) L[i] = Laux[i];
      best_error = cur_error;
      scale = this_scale;
      min = this_min;
    }
  }
  *the_min = -min;
  return scale;
}

APEX_QUANT_FP_STRICT_END

}  // namespace apex::quant
