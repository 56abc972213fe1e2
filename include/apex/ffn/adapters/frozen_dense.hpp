#pragma once
/// \file adapters/frozen_dense.hpp
/// One expert's frozen weights held as dense matrices of T (a training
/// layer's SwiGLU, never updated): the four products an adapted expert
/// needs around its adapters,
///
///     [G | U] = x·W_guᵀ     (n × 2f)      W_gu: 2f × d, gate rows first
///     y       = a·W_downᵀ   (n × d)       W_down: d × f
///     dx      = [dG | dU]·W_gu            (the transposed products of the backward)
///     da      = dy·W_down
///
/// Eigen's products (the forward ones through the training layers'
/// routing, layers/gated_products.hpp). This is the reference the packed
/// form (adapters/frozen_packed.hpp) is tested against, and in double the
/// layer the finite-difference checks run on.

#include "../core/types.hpp"
#include "../layers/gated_products.hpp"
#include "../layers/swiglu.hpp"

namespace apex {

template <class T>
struct FrozenDenseExpert {
  using Scalar = T;
  const SwiGLU<T>* weights = nullptr;  ///< w_gate_up 2f × d, w_down d × f

  Index d_model() const { return weights->d_model(); }
  Index d_ffn() const { return weights->d_ffn(); }

  /// gu (n × 2f) = x (n × d) · W_guᵀ.
  template <class GU>
  void gate_up(const ConstMatrixRef<T>& x, GU&& gu) const {
    detail::train_linear_nt(x, weights->w_gate_up(), gu);
  }
  /// y (n × d) = a (n × f) · W_downᵀ.
  template <class A, class Y>
  void down(const A& a, Y&& y) const {
    detail::train_linear_nt(a, weights->w_down(), y);
  }
  /// dx (n × d) = dgu (n × 2f) · W_gu.
  template <class DGU, class DX>
  void gate_up_t(const DGU& dgu, DX&& dx) const {
    dx.noalias() = dgu * weights->w_gate_up();
  }
  /// da (n × f) = dy (n × d) · W_down.
  template <class DY, class DA>
  void down_t(const DY& dy, DA&& da) const {
    da.noalias() = dy * weights->w_down();
  }
};

}  // namespace apex
