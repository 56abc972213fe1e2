#pragma once
/// \file param.hpp
/// The parameter list every layer exposes through `params()`.
///
/// Optimisers, checkpoints and gradient checks all walk this one list. A
/// `Param` is a view: it points into the layer's own storage, so it stays
/// valid while the layer lives and is not moved.

#include <string>
#include <utility>
#include <vector>

#include "types.hpp"

namespace apex {

/// One named parameter tensor and its gradient, both `rows × cols` row-major.
template <class T>
struct Param {
  std::string name;  ///< As a PyTorch `state_dict` spells it, e.g. `experts.3.w_gate.weight`.
  T* value_data;
  T* grad_data;
  Index rows;
  Index cols;

  Eigen::Map<Matrix<T>> value() const { return {value_data, rows, cols}; }
  Eigen::Map<Matrix<T>> grad() const { return {grad_data, rows, cols}; }
  Index size() const { return rows * cols; }
};

template <class T>
using ParamList = std::vector<Param<T>>;

namespace detail {

/// A Param viewing `value` and `grad` (same shape) under `name`.
template <class T, class Dense>
Param<T> make_param(std::string name, Dense& value, Dense& grad) {
  return Param<T>{std::move(name), value.data(), grad.data(), value.rows(), value.cols()};
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

/// Sets every gradient in `params` to zero.
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
