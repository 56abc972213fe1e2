#pragma once
/// \file moe/shared_expert_gate.hpp
/// The sigmoid gate on the shared experts (MoEConfig::shared_expert_gate,
/// Qwen2-MoE; docs/routing.md), written once for every MoE layer — MoEFFN,
/// the packed inference layer and the expert-parallel layer — so they agree
/// bit for bit:
///
///     z_t = x_t·w_gateᵀ,  σ_t = σ(z_t),  D_s[t] ← σ_t · D_s[t]
///
/// Backward: the shared experts see σ ⊙ dy; with D_s gated,
///     ∂L/∂z_t = (1 − σ_t) ⟨dy_t, Σ_s D_s[t]⟩,
///     ∂L/∂w_gate += ∂zᵀ·X,  ∂L/∂x += ∂z·w_gate (added by the caller after its gather).

#include <vector>

#include "../core/types.hpp"

namespace apex::detail {

/// gate (N) = σ(x·w_gateᵀ) and every shared_y[s] (N × d) scaled by it row by
/// row. x: N × d, w_gate: 1 × d.
template <class T>
void shared_gate_forward(const ConstMatrixRef<T>& x, const Matrix<T>& w_gate, Vector<T>& gate,
                         std::vector<Matrix<T>>& shared_y) {
  gate = ((-(x * w_gate.transpose()).array()).exp() + T(1)).inverse().matrix();
  for (auto& ys : shared_y) ys = gate.asDiagonal() * ys;
}

/// dy_shared (N × d) = σ ⊙ dy, the shared experts' dy; dz (N × 1) = ∂L/∂z;
/// w_gate_grad (1 × d, allocated) += dzᵀ·x. gate and shared_y as the forward
/// left them (shared_y gated).
template <class T>
void shared_gate_backward(const ConstMatrixRef<T>& x, const ConstMatrixRef<T>& dy, const Vector<T>& gate,
                          const std::vector<Matrix<T>>& shared_y, Matrix<T>& w_gate_grad, Matrix<T>& dy_shared,
                          Matrix<T>& dz) {
  dy_shared = gate.asDiagonal() * dy;
  dz = Matrix<T>::Zero(x.rows(), 1);
  for (const auto& ys : shared_y) dz += (ys.cwiseProduct(dy)).rowwise().sum();
  dz.array() *= T(1) - gate.array();
  w_gate_grad.noalias() += dz.transpose() * x;
}

}  // namespace apex::detail
