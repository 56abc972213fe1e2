#pragma once
/// \file layers/kappa_experts.hpp
/// Helpers over every κ-SwiGLU expert of an MoE layer
/// (`MoEFFN<T, KappaSwiGLU<T>>`, or any layer whose `experts()` are
/// KappaSwiGLU): the U schedule and the layer-wide regulariser
/// (docs/math.md#kappa-swiglu).

namespace apex {

/// Sets U on every routed expert of an MoE layer (`MoEFFN<T, KappaSwiGLU<T>>`).
template <class MoE>
void set_kappa_U(MoE& moe, double U) {
  for (auto& e : moe.experts()) e.set_U(U);
}

/// The layer-wide regulariser w·(mean(b²) + mean(α²)), means over all E×f
/// entries (the mean of the experts' regularizer()), with its gradient added
/// into every expert's α and b. Add the returned value to the loss.
template <class MoE>
auto add_kappa_regularizer_grad(MoE& moe) {
  using T = typename MoE::Scalar;
  auto& experts = moe.experts();
  const T scale = experts.empty() ? T(0) : T(1) / T(experts.size());
  T total = T(0);
  for (auto& e : experts) total += e.add_regularizer_grad(scale);
  return total;
}

}  // namespace apex
