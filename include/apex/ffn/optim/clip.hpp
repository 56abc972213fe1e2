#pragma once
/// \file optim/clip.hpp
/// Global-norm gradient clipping, as PyTorch's `torch.nn.utils.clip_grad_norm_`
/// (norm_type 2) computes it:
///
///     ‖g‖ = sqrt(Σ_params Σ_elements g²)        every gradient as one vector
///     c   = max_norm / (‖g‖ + 1e-6)
///     g  ← g · c            only where c < 1 (PyTorch multiplies by min(c, 1))
///
/// The 1e-6 keeps c finite for a zero gradient and is why a norm a hair
/// below max_norm (within 1e-6) is still scaled, by a factor just under 1:
/// the condition is c < 1, not ‖g‖ > max_norm, exactly as in PyTorch.
///
/// A non-finite norm is an error here (PyTorch's `error_if_nonfinite=True`;
/// its default, False, scales every gradient by NaN or 0). A NaN or Inf in
/// one gradient would otherwise spread through c into every other gradient,
/// and the optimiser step would reject the result anyway, without saying
/// where it came from; the ValueError names the parameter and the element.

#include <cmath>
#include <string>

#include "../core/errors.hpp"
#include "../core/param.hpp"
#include "../core/scalar_range.hpp"
#include "../core/types.hpp"
#include "non_finite.hpp"

namespace apex {

/// Global L2 norm of every gradient in `params`, accumulated in double.
/// ValueError naming the parameter and element if a gradient holds NaN or
/// Inf; a sum of squares beyond double's range (only double gradients of
/// magnitude ≳ 1e154 get there) is recomputed as a norm of per-parameter
/// norms, each scaled against overflow (Eigen's stableNorm), so finite
/// gradients always have a norm up to double's maximum. A norm beyond even
/// that is a ValueError too.
template <class T>
double grad_norm(const ParamList<T>& params) {
  double sum = 0;
  for (const auto& p : params) sum += p.grad().template cast<double>().squaredNorm();
  if (std::isfinite(sum)) return std::sqrt(sum);
  detail::require_finite_gradients("grad_norm", params);
  Eigen::VectorXd norms(Index(params.size()));  // ‖g_i‖ per parameter
  for (std::size_t i = 0; i < params.size(); ++i)
    norms(Index(i)) = params[i].grad().template cast<double>().stableNorm();
  const double norm = norms.stableNorm();  // ‖g‖ = ‖(‖g_1‖, …, ‖g_n‖)‖
  if (!std::isfinite(norm))
    throw ValueError("grad_norm: the gradients are finite but their global norm exceeds the range of double");
  return norm;
}

/// Scales every gradient in `params` by min(1, max_norm / (‖g‖ + 1e-6)) and
/// returns ‖g‖ before clipping (PyTorch's `clip_grad_norm_`). ConfigError
/// unless max_norm is finite and > 0; ValueError, before any gradient is
/// changed, if the norm is not finite (see grad_norm).
template <class T>
double clip_grad_norm(const ParamList<T>& params, double max_norm) {
  detail::require_config(std::isfinite(max_norm) && max_norm > 0, "clip_grad_norm",
                         "max_norm must be finite and > 0, got " + detail::number(max_norm));
  const double norm = grad_norm(params);
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) {
    const T c = T(coef);
    for (const auto& p : params) p.grad() *= c;
  }
  return norm;
}

}  // namespace apex
