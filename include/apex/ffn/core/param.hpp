#pragma once
/// \file core/param.hpp
/// The parameter lists every layer exposes: `params()` and `param_values()`.
///
/// Optimisers, checkpoints and gradient checks all walk these lists. A
/// `Param` is a view: it points into the layer's own storage, so it stays
/// valid while the layer lives and is not moved.
///
/// Gradients are allocated lazily. A layer built only to run forward (or to
/// be loaded, saved or packed) never needs them, and they are as large as
/// the weights: a `medium` MoE layer would hold 8.6 GB of zeros. So every
/// layer allocates its gradient buffers, zeroed, on the first of
///  - a backward (which adds into them),
///  - `zero_grad()`,
///  - `params()`: it hands out `grad_data` pointers that must stay valid
///    for the layer's life (an optimiser keeps them), so it allocates them,
///  - `allocate_gradients()`, the explicit form;
/// and `has_gradients()` says whether that has happened. Once allocated, the
/// buffers are never reallocated or freed, so every pointer stays stable.
///
/// `param_values()` lists the same tensors under the same names with
/// `grad_data == nullptr` and never allocates: checkpoints, packing and
/// anything else that only reads or writes values use it. `Param::grad()`
/// of such a view throws NoGradientError.

#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "errors.hpp"
#include "types.hpp"

namespace apex {

/// One named parameter tensor and its gradient, both `rows × cols` row-major.
template <class T>
struct Param {
  std::string name;  ///< As a PyTorch `state_dict` spells it, e.g. `experts.3.w_gate.weight`.
  T* value_data;
  T* grad_data;  ///< nullptr in a values-only view (param_values())
  Index rows;
  Index cols;

  Eigen::Map<Matrix<T>> value() const { return {value_data, rows, cols}; }
  /// Whether this view carries a gradient (false for param_values()).
  bool has_grad() const { return grad_data != nullptr; }
  /// The gradient; NoGradientError for a values-only view.
  Eigen::Map<Matrix<T>> grad() const {
    if (grad_data == nullptr)
      throw NoGradientError("Param::grad: '" + name +
                            "' is a values-only view (param_values()) and has no gradient; take the list from "
                            "params() to use gradients");
    return {grad_data, rows, cols};
  }
  Index size() const { return rows * cols; }
};

template <class T>
using ParamList = std::vector<Param<T>>;

namespace detail {

template <class L, class = void>
struct has_param_values : std::false_type {};
template <class L>
struct has_param_values<L, std::void_t<decltype(std::declval<L&>().param_values())>> : std::true_type {};
template <class L, class = void>
struct has_allocate_gradients : std::false_type {};
template <class L>
struct has_allocate_gradients<L, std::void_t<decltype(std::declval<L&>().allocate_gradients())>> : std::true_type {};

/// A Param viewing `value` and `grad` (same shape) under `name`.
template <class T, class Dense>
Param<T> make_param(std::string name, Dense& value, Dense& grad) {
  return Param<T>{std::move(name), value.data(), grad.data(), value.rows(), value.cols()};
}

/// A Param viewing `value` and, unless `grad` is null, `*grad` (a values-only
/// view otherwise): one list builder serves params() and param_values().
template <class T, class Dense>
Param<T> make_param(std::string name, Dense& value, Dense* grad) {
  return Param<T>{std::move(name), value.data(), grad ? grad->data() : nullptr, value.rows(), value.cols()};
}

/// A values-only Param viewing `value` under `name`.
template <class T, class Dense>
Param<T> make_value_param(std::string name, Dense& value) {
  return Param<T>{std::move(name), value.data(), nullptr, value.rows(), value.cols()};
}

/// `base + offset`, or nullptr for a null base (a values-only view).
template <class T>
T* offset_or_null(T* base, Index offset) {
  return base ? base + offset : nullptr;
}

/// A layer's `param_values()` if it has one, else its `params()` (a layer
/// type from outside the library without the values-only view: correct, but
/// it allocates that layer's gradients).
template <class Layer>
auto param_values_of(Layer& layer) {
  if constexpr (has_param_values<Layer>::value) return layer.param_values();
  else return layer.params();
}

/// Allocates a layer's gradients: `allocate_gradients()` if it has one, else
/// `params()`, which allocates them by the contract above.
template <class Layer>
void allocate_gradients_of(Layer& layer) {
  if constexpr (has_allocate_gradients<Layer>::value) layer.allocate_gradients();
  else (void)layer.params();
}

/// Appends `inner` to `out`, each name prefixed by `prefix` (e.g. "experts.3.").
template <class T>
void append_prefixed(ParamList<T>& out, const std::string& prefix, ParamList<T> inner) {
  for (auto& p : inner) {
    p.name = prefix + p.name;
    out.push_back(std::move(p));
  }
}

}  // namespace detail

/// Sets every gradient in `params` to zero (NoGradientError for a values-only view).
template <class T>
void zero_grad(const ParamList<T>& params) {
  for (const auto& p : params) p.grad().setZero();
}

/// Total number of scalars in `params`.
template <class T>
Index parameter_count(const ParamList<T>& params) {
  Index n = 0;
  for (const auto& p : params) n += p.size();
  return n;
}

}  // namespace apex
