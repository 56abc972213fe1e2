#pragma once
/// \file layers/kappa_activation.hpp
/// κ-SwiGLU's gated activation on one block of rows and its derivatives
/// (docs/math.md#kappa-swiglu): the part of the layer (layers/kappa_swiglu.hpp)
/// that differs from SwiGLU, run inside SwiGLU's gated forward and backward.
/// For a row t with router logit ℓ_t and gate unit j:
///
///     A_tj = SiLU_κ(G_tj) ⊙ U_tj,   SiLU_κ(z) = z·σ(κz),   κ_tj = κ(ℓ_t) (layers/kappa_row.hpp)
///
/// Kept apart from the layer so its weights, parameters and expert contract
/// read on their own, and the derivation sits in one place beside its code.
/// Backward recomputes κ from ℓ, α, b rather than reading it from the forward.

#include <cmath>

#include "activations.hpp"
#include "kappa_options.hpp"
#include "kappa_row.hpp"
#include "../core/types.hpp"

namespace apex::detail {

/// One row's κ (into k) and ∂κ/∂u (into dk), both 1 × f, for logit ℓ;
/// alpha, bias: 1 × f.
template <class T, class K, class DK>
void kappa_with_derivative(const KappaOptions& o, const RowVector<T>& alpha, const RowVector<T>& bias, T logit,
                           K&& k, DK&& dk) {
  if (o.U == 1.0) {  // ln U = 0: κ ≡ 1 whatever α, b
    k.setOnes();
    dk.setZero();
    return;
  }
  kappa_row(o, alpha, bias, logit, dk, k);  // dk holds τ until ∂κ/∂u replaces it
  // ∂κ/∂u = κ·ln U·(1 − tanh²u)
  dk = k * T(std::log(o.U)) * (T(1) - dk.square());
}

/// Forward: a = SiLU_κ(gate) ⊙ up. gate, up: n × f arrays, a: n × f
/// (written), logit: n (one per row), alpha, bias: 1 × f.
template <class T, class Gate, class Up, class A>
void kappa_activation_forward(const KappaOptions& o, const RowVector<T>& alpha, const RowVector<T>& bias,
                              const ConstVectorRef<T>& logit, Gate&& gate, Up&& up, A&& a) {
  if (o.U == 1.0) {
    a = gate * array::sigmoid(gate) * up;  // κ ≡ 1: SiLU
    return;
  }
  // A = SiLU_κ(G) ⊙ U = G·σ(κG) ⊙ U, a row at a time (s_t is per row);
  // κ lives in a row buffer that stays in L1. Three short passes (τ, κ,
  // A) run faster than one fused expression, whose tanh, two exps and
  // division in one loop body spill registers.
  const Index f = alpha.size();
  Eigen::Array<T, 1, Eigen::Dynamic> tau(f), k(f);  // 1 × f each
  for (Index t = 0; t < gate.rows(); ++t) {
    kappa_row(o, alpha, bias, logit(t), tau, k);
    const auto g = gate.row(t);
    a.row(t) = g * array::sigmoid(k * g) * up.row(t);
  }
}

/// Backward of kappa_activation_forward, SwiGLU's gated backward with the
/// gate derivative of SiLU_κ. work: n × 3f as the forward left it
/// ([G | U | A]), dh: n × 2f holding dA in its right half, turned into
/// [dG | dU]; logit: n, dlogit: n (written, ρ·∂L/∂ℓ); alpha_row, bias:
/// 1 × f; adds ∂L/∂α and ∂L/∂b (1 × f) into alpha_grad and bias_grad.
template <class T, class DH, class DL>
void kappa_activation_backward(const KappaOptions& o, const RowVector<T>& alpha_row, const RowVector<T>& bias,
                               const ConstVectorRef<T>& logit, const ConstMatrixRef<T>& work, DH& dh,
                               RowVector<T>& alpha_grad, RowVector<T>& bias_grad, DL& dlogit) {
  const Index f = alpha_row.size();
  const T rho_c = T(o.rho * o.c);
  const auto alpha = alpha_row.array();
  // One row each, reused: κ, ∂κ/∂u, σ(κG), σ(−κG), ∂L/∂u, scratch.
  array::Row<T> k(f), dk(f), sk(f), smk(f), du(f), e(f);
  for (Index t = 0; t < dh.rows(); ++t) {
    const auto row = work.row(t);
    const auto g = row.segment(0, f).array();
    const auto up = row.segment(f, f).array();
    auto da = dh.row(t).segment(f, f).array();
    kappa_with_derivative(o, alpha_row, bias, logit(t), k, dk);
    du = k * g;  // κG, until ∂L/∂u replaces it
    // σ(κG), σ(−κG) as SwiGLU computes σ(G), σ(−G): with κ ≡ 1 the two layers agree bitwise
    array::sigmoid_pair(du, sk, smk, e);
    // ∂SiLU_κ/∂κ = z²σ(κz)σ(−κz), as (zσ(κz))·(zσ(−κz)) so z² never forms;
    // ∂L/∂u = dA ⊙ U ⊙ ∂SiLU_κ/∂κ ⊙ ∂κ/∂u
    du = da * up * (g * sk) * (g * smk) * dk;
    // dG = dA ⊙ U ⊙ ∂SiLU_κ/∂z,  ∂SiLU_κ/∂z = σ(κz)(1 + κz·σ(−κz))
    dh.row(t).segment(0, f).array() = da * up * sk * (T(1) + (k * g) * smk);
    // dU = dA ⊙ SiLU_κ(G)
    da = da * g * sk;
    // ∂u/∂b = 1, ∂u/∂α = s = c·ℓ, ∂u/∂ℓ = α·c (0 where s saturates)
    const T s = kappa_scaled_logit(o, logit(t));
    bias_grad.array() += du;
    alpha_grad.array() += s * du;
    dlogit(t) = rho_c == T(0) || kappa_saturated(s) ? T(0) : rho_c * (du * alpha).sum();
  }
}

}  // namespace apex::detail
