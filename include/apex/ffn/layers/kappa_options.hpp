#pragma once
/// \file layers/kappa_options.hpp
/// κ-SwiGLU's hyper-parameters, their validation, and the U ramp trainers
/// use (docs/math.md#kappa-swiglu). Separate from the layer so a trainer's
/// schedule and configuration code need not include the layer.

#include <cmath>
#include <string>

#include "../core/errors.hpp"
#include "../core/scalar_range.hpp"

namespace apex {

/// Hyper-parameters of κ-SwiGLU (defaults of docs/math.md#kappa-swiglu).
struct KappaOptions {
  double U = 4.0;            ///< sharpness ceiling: κ ∈ [1/U, U]; U ≥ 1 (U = 1 gives κ ≡ 1)
  double c = 0.3;            ///< logit scale: s = c·ℓ; finite
  double rho = 0.1;          ///< factor on ∂L/∂ℓ through κ; ≥ 0 (0 detaches the router)
  double reg_weight = 1e-2;  ///< w of the regulariser w·(mean(b²) + mean(α²)); ≥ 0

  /// Throws ConfigError naming the first field out of range.
  void validate(const char* where = "KappaOptions") const {
    detail::require_config(std::isfinite(U) && U >= 1.0, where, "U must be finite and >= 1, got " + std::to_string(U));
    detail::require_config(std::isfinite(c), where, "c must be finite, got " + std::to_string(c));
    detail::require_config(std::isfinite(rho) && rho >= 0.0, where,
                           "rho must be finite and >= 0, got " + std::to_string(rho));
    detail::require_config(std::isfinite(reg_weight) && reg_weight >= 0.0, where,
                           "reg_weight must be finite and >= 0, got " + std::to_string(reg_weight));
  }

  /// As validate(), for a layer that computes in T: the layer converts U, c,
  /// ρ·c and w to T, and a value finite as a double can be infinite as a
  /// float (c = 1e39 would be infinite). A finite c whose product c·ℓ
  /// overflows is the layer's to handle: it saturates s = c·ℓ (KappaSwiGLU).
  template <class T>
  void validate_for(const char* where) const {
    validate(where);
    detail::require_fits<T>(where, "U", U);
    detail::require_fits<T>(where, "c", c);
    detail::require_fits<T>(where, "rho*c", rho * c);
    detail::require_fits<T>(where, "reg_weight", reg_weight);
  }
};

/// The U ramp trainers use: 1 at `progress` ≤ 0 (κ ≡ 1, plain SwiGLU), rising
/// linearly to `U_max` at `progress` ≥ 1. `progress` is e.g. (step − warmup) / ramp_steps.
inline double kappa_ramp(double progress, double U_max = 4.0) {
  const double p = progress < 0.0 ? 0.0 : (progress > 1.0 ? 1.0 : progress);
  return 1.0 + (U_max - 1.0) * p;
}

}  // namespace apex
