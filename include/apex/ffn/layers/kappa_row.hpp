#pragma once
/// \file layers/kappa_row.hpp
/// κ of one token row (docs/math.md#kappa-swiglu), the one implementation
/// that κ-SwiGLU's training forward and backward (layers/kappa_swiglu.hpp)
/// and the packed inference forward (inference/engine/kinds/kappa_swiglu.hpp) both call,
/// so the two layers' κ are the same bits by construction:
///
///     s = c·ℓ (saturated),   τ = tanh(b + α·s),   κ = clamp(exp(ln U·τ), 1/U, U)      (1 × f)

#include <cmath>
#include <limits>

#include "activations.hpp"
#include "kappa_options.hpp"

namespace apex::detail {

/// s = c·ℓ, saturated to ±max of T. A product that overflows to ±∞ would
/// make u = b + α·s NaN where α = 0 (0·∞), and κ must be 1 there; with s
/// finite, α·s is 0 for α = 0 and at worst ±∞ otherwise, whose tanh is the
/// limit ±1. Every finite product is returned unchanged.
template <class T>
T kappa_scaled_logit(const KappaOptions& o, T logit) {
  constexpr T max = std::numeric_limits<T>::max();
  const T s = T(o.c) * logit;
  return s > max ? max : (s < -max ? -max : s);
}

/// Whether s = kappa_scaled_logit(ℓ) sits at the saturation bound (∂s/∂ℓ = 0 there).
template <class T>
bool kappa_saturated(T s) {
  return std::abs(s) == std::numeric_limits<T>::max();
}

/// One row's τ = tanh(u), u = b + α·s, s = c·ℓ, and κ = exp(ln U·τ) for
/// U > 1; alpha, bias: 1 × f row vectors, tau and k: 1 × f arrays (written).
/// |τ| ≤ 1; the clamp absorbs exp's last-bit rounding so κ ∈ [1/U, U]
/// exactly. τ is kept because the backward's ∂κ/∂u reads it.
template <class T, class Alpha, class Bias, class Tau, class K>
void kappa_row(const KappaOptions& o, const Alpha& alpha, const Bias& bias, T logit, Tau&& tau, K&& k) {
  const T ln_u = T(std::log(o.U)), s = kappa_scaled_logit(o, logit);
  tau = array::tanh(bias.array() + s * alpha.array());
  k = (ln_u * tau).exp().min(T(o.U)).max(T(1.0 / o.U));
}

}  // namespace apex::detail
