#pragma once
/// \file adapters/gated_activation.hpp
/// The activation of each expert kind with its frozen float parts, for the
/// layers that train adapters through frozen experts: between the gate/up
/// and the down projection,
///
///     SwiGLU:   A = SiLU(G) ⊙ U
///     κ-SwiGLU: A = G·σ(κG) ⊙ U,  κ from the row's router logit and the frozen α, b
///     clamped:  A = (clamp(Ũ, −L, L) + 1) ⊙ Ĝ·σ(αĜ),  G̃ = G + b_gate, Ũ = U + b_up,
///               Ĝ = min(G̃, L); the output gains b_down
///
/// and their backward (dA → dG, dU, and ∂L/∂ℓ for κ), each the training
/// layer's own function (layers/swiglu.hpp, kappa_activation.hpp,
/// clamped_swiglu.hpp), so the frozen layer's activation bits are the
/// training layer's. `GatedActivation<Expert>` is specialised per expert
/// type and built from a training expert or from a packed layer's float
/// parts (inference/packed_expert_kind.hpp's `Extra`).
///
/// Each policy has `SideInput` (moe/expert_contract.hpp), and
///     forward(side, g, u, a)        g, u: n × f arrays (biased in place), a: n × f (written)
///     backward(side, work, dh, ds)  work: n × ≥2f starting [G̃ | Ũ]; dh: n × 2f, ∂L/∂A in its
///                                   right half, becomes [∂L/∂G̃ | ∂L/∂Ũ]; ds: ∂L/∂side (κ)
///     finish(y)                     the output bias (clamped), else nothing
///     apply_to(expert)              writes the frozen parts into a training expert (a merged copy)
/// The frozen parts get no gradient.

#include "../core/types.hpp"
#include "../core/workspace.hpp"
#include "../inference/packed_clamped.hpp"
#include "../inference/packed_expert_kind.hpp"
#include "../inference/packed_kappa.hpp"
#include "../layers/clamped_swiglu.hpp"
#include "../layers/kappa_activation.hpp"
#include "../layers/kappa_swiglu.hpp"
#include "../layers/swiglu.hpp"
#include "../moe/expert_contract.hpp"

namespace apex {

/// The kind table of the adapters' layers: one specialisation per expert type.
template <class Expert>
struct GatedActivation;

/// SwiGLU: A = SiLU(G) ⊙ U, nothing frozen beside the weights.
template <class T>
struct GatedActivation<SwiGLU<T>> {
  using SideInput = NoSideInput;
  static GatedActivation of(const SwiGLU<T>&) { return {}; }
  static GatedActivation of(const NoExpertExtra&) { return {}; }

  template <class G, class U, class A>
  void forward(const ConstVectorRef<T>&, G&& g, U&& u, A&& a) const {
    a = g * array::sigmoid(g) * u;  // SwiGLU::forward_block's expression
  }
  template <class Work, class DH>
  void backward(const ConstVectorRef<T>&, const Work& work, DH& dh, VectorRef<T>) const {
    detail::silu_glu_backward(work, dh);
  }
  template <class Y>
  void finish(Y&&) const {}
  void apply_to(SwiGLU<T>&) const {}
};

/// κ-SwiGLU: α, b and the options frozen; κ from each row's router logit.
template <class T>
struct GatedActivation<KappaSwiGLU<T>> {
  using SideInput = RouterLogitInput;
  KappaOptions options;
  RowVector<T> alpha, bias;  ///< 1 × f each

  static GatedActivation of(const KappaSwiGLU<T>& e) { return {e.options(), e.kappa_alpha(), e.kappa_bias()}; }
  static GatedActivation of(const KappaGate& g) {
    return {g.options, g.alpha.template cast<T>(), g.bias.template cast<T>()};
  }

  template <class G, class U, class A>
  void forward(const ConstVectorRef<T>& logit, G&& g, U&& u, A&& a) const {
    detail::kappa_activation_forward(options, alpha, bias, logit, g, u, a);
  }
  /// ds = ρ·∂L/∂ℓ (KappaSwiGLU's convention); the α, b gradients are discarded.
  template <class Work, class DH>
  void backward(const ConstVectorRef<T>& logit, const Work& work, DH& dh, VectorRef<T> ds) const {
    thread_local RowVector<T> discard_a, discard_b;  // 1 × f: where the frozen α, b gradients go
    discard_a.resize(alpha.size());
    discard_b.resize(alpha.size());
    const ConstMatrixRef<T> w(work);
    detail::kappa_activation_backward(options, alpha, bias, logit, w, dh, discard_a, discard_b, ds);
  }
  template <class Y>
  void finish(Y&&) const {}
  void apply_to(KappaSwiGLU<T>& e) const {
    e.set_options(options);
    e.kappa_alpha() = alpha;
    e.kappa_bias() = bias;
  }
};

/// gpt-oss's clamped SwiGLU: the three biases and α, L frozen.
template <class T>
struct GatedActivation<ClampedSwiGLU<T>> {
  using SideInput = NoSideInput;
  ClampedSwiGLUOptions options;
  RowVector<T> b_gate, b_up;  ///< 1 × f each
  RowVector<T> b_down;        ///< 1 × d

  static GatedActivation of(const ClampedSwiGLU<T>& e) { return {e.options(), e.b_gate(), e.b_up(), e.b_down()}; }
  static GatedActivation of(const ClampedBiases& b) {
    return {b.options, b.gate.template cast<T>(), b.up.template cast<T>(), b.down.template cast<T>()};
  }

  template <class G, class U, class A>
  void forward(const ConstVectorRef<T>&, G&& g, U&& u, A&& a) const {
    g.rowwise() += b_gate.array();  // G̃ = G + b_gate
    u.rowwise() += b_up.array();    // Ũ = U + b_up
    detail::clamped_glu(g, u, a, T(options.alpha), T(options.limit));
  }
  template <class Work, class DH>
  void backward(const ConstVectorRef<T>&, const Work& work, DH& dh, VectorRef<T>) const {
    detail::clamped_glu_backward(work, dh, T(options.alpha), T(options.limit));
  }
  template <class Y>
  void finish(Y&& y) const {
    y.rowwise() += b_down;  // y = A·W_downᵀ + b_down
  }
  void apply_to(ClampedSwiGLU<T>& e) const {
    e.set_options(options);
    e.b_gate() = b_gate;
    e.b_up() = b_up;
    e.b_down() = b_down;
  }
};

}  // namespace apex
