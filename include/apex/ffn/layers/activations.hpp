#pragma once
/// \file layers/activations.hpp
/// Numerically stable logistic sigmoid, SiLU and the sharpness-scaled SiLU_κ,
/// with their derivatives, for scalars and Eigen arrays, and a vectorised tanh.
///
/// Stability: σ is evaluated through e = exp(−|z|) ∈ (0, 1], so no exponential
/// overflows; 1 − σ(z) is taken as σ(−z) rather than by cancellation. All
/// functions are finite for |z| up to the largest finite value whose square
/// does not overflow (|z| ≤ 1e4 is exercised in the tests for float and double).

#include <cmath>
#include <type_traits>

#include "../core/types.hpp"

namespace apex {

/// σ(z) = 1 / (1 + e^{−z}).
template <class T>
T sigmoid(T z) {
  const T e = std::exp(-std::abs(z));
  return z >= T(0) ? T(1) / (T(1) + e) : e / (T(1) + e);
}

/// SiLU(z) = z·σ(z).
template <class T>
T silu(T z) {
  return z * sigmoid(z);
}

/// SiLU'(z) = σ(z)·(1 + z·σ(−z)).
template <class T>
T silu_grad(T z) {
  return sigmoid(z) * (T(1) + z * sigmoid(-z));
}

/// SiLU_κ(z) = z·σ(κz); κ = 1 is SiLU.
template <class T>
T silu_kappa(T z, T kappa) {
  return z * sigmoid(kappa * z);
}

/// ∂SiLU_κ/∂z = σ(κz) + κz·σ(κz)·σ(−κz).
template <class T>
T silu_kappa_grad_z(T z, T kappa) {
  const T kz = kappa * z;
  return sigmoid(kz) * (T(1) + kz * sigmoid(-kz));
}

/// ∂SiLU_κ/∂κ = z²·σ(κz)·σ(−κz), computed as (z·σ(κz))·(z·σ(−κz)) so the
/// square never forms on its own.
template <class T>
T silu_kappa_grad_kappa(T z, T kappa) {
  const T kz = kappa * z;
  return (z * sigmoid(kz)) * (z * sigmoid(-kz));
}

/// Array forms, returned as Eigen expressions (no temporaries) and
/// vectorised by Eigen's packet exp. Here σ(z) = 1/(1 + e^{−z}) directly: for
/// z ≪ 0 the exponential overflows to +inf and 1/inf = 0, the correct limit,
/// so no branch is needed and no NaN can form.
namespace array {

/// σ(z) elementwise.
template <class Derived>
auto sigmoid(const Eigen::ArrayBase<Derived>& z) {
  using T = typename Derived::Scalar;
  return (T(1) + (-z.derived()).exp()).inverse();
}

/// tanh(u) elementwise, vectorised for float and double. Eigen 3.4 vectorises
/// `tanh` for float only; for double, tanh(u) = 1 − 2/(1 + e^{2u}), whose
/// limits are exact (e^{2u} = inf gives 1, e^{2u} = 0 gives −1) and which is 0
/// at u = 0 exactly. Near 0 its error is absolute (≈ ε), which is all κ-SwiGLU's
/// κ = exp(ln U·τ) sees. Both forms give ±1 at u = ±∞.
template <class Derived>
auto tanh(const Eigen::ArrayBase<Derived>& u) {
  using T = typename Derived::Scalar;
  if constexpr (std::is_same_v<T, float>) {
    return u.derived().tanh();
  } else {
    return T(1) - T(2) * (T(1) + (T(2) * u.derived()).exp()).inverse();
  }
}

/// A row buffer for sigmoid_pair.
template <class T>
using Row = Eigen::Array<T, 1, Eigen::Dynamic>;

/// s = σ(z) and sm = σ(−z) of a row with one exponential per entry (a
/// backward needs both; two `sigmoid` calls cost two). With e = exp(−|z|) ∈
/// (0, 1] and r = 1/(1 + e), the pair is (r, e·r) for z ≥ 0 and (e·r, r)
/// otherwise: nothing overflows, and σ(−z) never forms as 1 − σ(z). `e` is
/// scratch. z must not alias an output.
template <class Derived>
void sigmoid_pair(const Eigen::ArrayBase<Derived>& z, Row<typename Derived::Scalar>& s,
                  Row<typename Derived::Scalar>& sm, Row<typename Derived::Scalar>& e) {
  using T = typename Derived::Scalar;
  e = (-z.derived().abs()).exp();
  sm = (T(1) + e).inverse();  // r, for now
  s = (z.derived() >= T(0)).select(sm, e * sm);
  sm = (z.derived() >= T(0)).select(e * sm, sm);
}

}  // namespace array
}  // namespace apex
