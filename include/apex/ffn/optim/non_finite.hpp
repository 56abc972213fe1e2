#pragma once
/// \file optim/non_finite.hpp
/// Finding the first NaN or Inf in a gradient or an optimiser state tensor,
/// for messages that name the tensor and the element.
///
/// Exists because an optimiser step must check every gradient before it
/// changes any parameter or moment (a rejected step changes nothing), and
/// because "the gradient contains NaN" is of little use in a model of a
/// thousand tensors: the message says which tensor, which element, and
/// whether it is NaN, +Inf or -Inf.

#include <cmath>
#include <string>

#include "../core/errors.hpp"
#include "../core/param.hpp"
#include "../core/scalar_range.hpp"
#include "../core/types.hpp"

namespace apex::detail {

/// Index of the first non-finite of the `n` values at `data`, or -1.
template <class T>
Index first_non_finite(const T* data, Index n) {
  for (Index i = 0; i < n; ++i)
    if (!std::isfinite(data[i])) return i;
  return -1;
}

/// "NaN", "+Inf" or "-Inf".
template <class T>
const char* non_finite_name(T v) {
  return std::isnan(v) ? "NaN" : (v > 0 ? "+Inf" : "-Inf");
}

/// "element 5 (row 1, column 2)" of a row-major `rows × cols` tensor.
inline std::string element_name(Index i, Index cols) {
  return "element " + std::to_string(i) + " (row " + std::to_string(i / cols) + ", column " +
         std::to_string(i % cols) + ")";
}

/// Throws ValueError "where: what is NaN at element i (row r, column c)"
/// unless every value of the row-major `rows × cols` tensor at `data` is finite.
template <class T>
void require_finite_tensor(const std::string& where, const std::string& what, const T* data, Index rows, Index cols) {
  const Index i = first_non_finite(data, rows * cols);
  if (i >= 0)
    throw ValueError(where + ": " + what + " is " + non_finite_name(data[i]) + " at " + element_name(i, cols));
}

/// The value rule of the library's files, for loads and saves alike: throws
/// ValueError "where: what contains NaN or Inf: +Inf at element i (row r,
/// column c) (why)" unless each of the n values at `checked` is finite
/// (`cols` ≤ 0: a tensor of another rank, "element i" alone; `why` empty:
/// no parenthesis). `shown[i]` is the value named: a load passes the values
/// it checks, a save the layer's own while checking them as the file will
/// store them ("1e+39 (+Inf)" for a value beyond the stored dtype's range).
template <class T, class U>
void require_finite_values(const std::string& where, const std::string& what, const T* checked, const U* shown,
                           Index n, Index cols, const std::string& why = "") {
  const Index i = first_non_finite(checked, n);
  if (i < 0) return;
  const U x = shown[i];
  const std::string value = std::isfinite(x) ? number(double(x)) + " (" + non_finite_name(checked[i]) + ")"
                                             : std::string(non_finite_name(x));
  throw ValueError(where + ": " + what + " contains NaN or Inf: " + value + " at " +
                   (cols > 0 ? element_name(i, cols) : "element " + std::to_string(i)) +
                   (why.empty() ? "" : " (" + why + ")"));
}

/// Throws ValueError naming the first parameter whose gradient holds a NaN
/// or Inf, and the element, before anything is changed. Eigen's allFinite
/// is the fast pass; the element is located only for the message.
template <class T>
void require_finite_gradients(const std::string& where, const ParamList<T>& params) {
  for (const auto& p : params)
    if (!p.grad().allFinite())
      require_finite_tensor(where, "the gradient of '" + p.name + "'", p.grad_data, p.rows, p.cols);
}

}  // namespace apex::detail
