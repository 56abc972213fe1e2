#pragma once
/// \file optim/adamw.hpp
/// AdamW (Loshchilov & Hutter, "Decoupled Weight Decay Regularization") over
/// a `ParamList`, with the semantics of PyTorch's `torch.optim.AdamW`. At
/// step t (from 1), learning rate lr, for each parameter θ and its gradient g:
///
///     θ ← θ · (1 − lr·λ)                 decoupled weight decay, before the Adam update
///     m ← β₁·m + (1 − β₁)·g              first moment  (PyTorch's exp_avg)
///     v ← β₂·v + (1 − β₂)·g²             second moment (exp_avg_sq)
///     m̂ = m / (1 − β₁ᵗ),  v̂ = v / (1 − β₂ᵗ)   bias corrections: m and v start at 0
///     θ ← θ − lr · m̂ / (√v̂ + ε)          ε added to √v̂, as PyTorch does
///
/// The decay shrinks θ itself instead of adding λ·θ to g, so it is not
/// rescaled by 1/√v̂ (that is the "decoupled"). It applies to the parameters
/// the decay rule selects: by default all but norm gains, biases and
/// κ-SwiGLU's α (decays_by_default), since shrinking a gain or a bias towards
/// 0 is not a prior anyone wants; PyTorch users get the same by putting those
/// in a parameter group with weight_decay 0.
///
/// The code folds the bias corrections into two scalars, bc₁ = 1 − β₁ᵗ and
/// bc₂ = 1 − β₂ᵗ, so that each element costs one square root and one division:
///
///     lr · (m/bc₁) / (√(v/bc₂) + ε)  =  (lr·√bc₂/bc₁) · m / (√v + ε·√bc₂)
///
/// (multiply numerator and denominator by √bc₂). The two differ only in
/// rounding; tests/test_optim.cpp checks the fold against the unfolded
/// formula in double and both against PyTorch.

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "../core/errors.hpp"
#include "../core/param.hpp"
#include "../core/scalar_range.hpp"
#include "../core/types.hpp"
#include "non_finite.hpp"

namespace apex {

/// AdamW's hyperparameters other than the learning rate (given per step).
/// The defaults are PyTorch's.
struct AdamWOptions {
  double beta1 = 0.9;           ///< β₁ in [0, 1)
  double beta2 = 0.999;         ///< β₂ in [0, 1)
  double eps = 1e-8;            ///< ε > 0, added to √v̂
  double weight_decay = 0.01;   ///< λ ≥ 0, for the parameters the decay rule selects
};

/// Throws ConfigError "where: field must …, got value" unless `o` is valid
/// for an AdamW<T>: β₁, β₂ in [0, 1); ε finite, > 0 and, scaled by the
/// first step's √bc₂ = √(1 − β₂), not 0 in T (else a zero gradient gives
/// 0/0); λ finite and ≥ 0; ε and λ within T's range.
template <class T>
void check_adamw_options(const AdamWOptions& o, const char* where = "AdamW") {
  using detail::number;
  detail::require_config(o.beta1 >= 0 && o.beta1 < 1, where, "beta1 must lie in [0, 1), got " + number(o.beta1));
  detail::require_config(o.beta2 >= 0 && o.beta2 < 1, where, "beta2 must lie in [0, 1), got " + number(o.beta2));
  detail::require_config(std::isfinite(o.eps) && o.eps > 0, where, "eps must be finite and > 0, got " + number(o.eps));
  detail::require_fits<T>(where, "eps", o.eps);
  detail::require_config(T(o.eps * std::sqrt(1.0 - o.beta2)) > 0, where,
                         "eps must not vanish in " + std::string(detail::scalar_name<T>()) +
                             ": the first step adds eps·sqrt(1 - beta2) = " +
                             number(o.eps * std::sqrt(1.0 - o.beta2)) + " to sqrt(v), which rounds to 0");
  detail::require_config(std::isfinite(o.weight_decay) && o.weight_decay >= 0, where,
                         "weight_decay must be finite and >= 0, got " + number(o.weight_decay));
  detail::require_fits<T>(where, "weight_decay", o.weight_decay);
}

/// Which parameters receive weight decay, by name.
using DecayRule = std::function<bool(const std::string&)>;

/// Whether `s` ends with `tail`.
inline bool name_ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

/// The default decay rule: every parameter except norm gains (`…norm.weight`),
/// biases (`…bias`, including κ-SwiGLU's `kappa_bias` and the router's
/// `router.bias`) and κ-SwiGLU's `kappa_alpha` (which has its own regulariser).
inline bool decays_by_default(const std::string& name) {
  return !(name_ends_with(name, "norm.weight") || name_ends_with(name, "bias") ||
           name_ends_with(name, "kappa_alpha"));
}

/// Everything a resumed run needs to continue bitwise as the uninterrupted
/// one: the step count, the options and decay flags, and the two moments of
/// every parameter (in the parameter list's order, each shaped as its
/// parameter). io/optimizer_state.hpp saves and loads it.
template <class T>
struct AdamWState {
  long step = 0;                      ///< updates done (PyTorch's state["step"])
  AdamWOptions options;
  std::vector<bool> decay;            ///< per parameter: whether λ applies
  std::vector<Matrix<T>> exp_avg;     ///< m per parameter, rows × cols of it
  std::vector<Matrix<T>> exp_avg_sq;  ///< v per parameter, rows × cols of it
};

namespace detail {

/// The value rule of a saved or restored state: ValueError naming
/// `'<param>.exp_avg'` / `'<param>.exp_avg_sq'` and the element unless m
/// and v (shaped as p) are finite and v ≥ 0. A step can overflow v to +Inf
/// (a finite gradient whose square is not, 1e20 in float): such a state
/// saves nothing, so that no state file is written that would not load.
template <class T>
void require_valid_moments(const std::string& where, const Param<T>& p, const Matrix<T>& m, const Matrix<T>& v) {
  require_finite_tensor(where, "'" + p.name + ".exp_avg'", m.data(), m.rows(), m.cols());
  require_finite_tensor(where, "'" + p.name + ".exp_avg_sq'", v.data(), v.rows(), v.cols());
  for (Index k = 0; k < v.size(); ++k)
    if (v.data()[k] < 0)
      throw ValueError(where + ": '" + p.name + ".exp_avg_sq' is negative (" + number(double(v.data()[k])) + ") at " +
                       element_name(k, p.cols) + "; a second moment is a mean of squares");
}

}  // namespace detail

template <class T>
class AdamW {
 public:
  /// Optimises the parameters `params` views (their layers must outlive the
  /// optimiser and not move). ConfigError for invalid options,
  /// NoGradientError for a values-only view (param_values()): an optimiser
  /// needs the gradients, so take the list from params().
  explicit AdamW(ParamList<T> params, const AdamWOptions& opt = {}, DecayRule decays = decays_by_default)
      : params_(std::move(params)), opt_(opt) {
    check_adamw_options<T>(opt);
    for (const auto& p : params_)
      if (!p.has_grad())
        throw NoGradientError("AdamW: parameter '" + p.name +
                              "' is a values-only view (param_values()); take the list from params()");
    for (const auto& p : params_) {
      m_.push_back(Matrix<T>::Zero(p.rows, p.cols));
      v_.push_back(Matrix<T>::Zero(p.rows, p.cols));
      decay_.push_back(decays(p.name));
    }
  }

  /// One update with learning rate `lr` from the gradients in the params.
  /// ConfigError unless lr is finite and ≥ 0; ValueError naming the
  /// parameter and element if a gradient holds NaN or Inf, or if the step
  /// count is already the largest a long holds. All are checked before
  /// anything changes: a rejected step leaves parameters, moments and the
  /// step count as they were.
  void step(double lr) {
    detail::require_config(std::isfinite(lr) && lr >= 0, "AdamW::step", "lr must be finite and >= 0, got " +
                                                                            detail::number(lr));
    detail::require_fits<T>("AdamW::step", "lr", lr);
    detail::require_finite_gradients("AdamW::step", params_);
    // No run gets here by stepping, but a restored state (a state file) may
    // say any step >= 0, and ++t_ past the largest long is undefined.
    if (t_ == std::numeric_limits<long>::max())
      throw ValueError("AdamW::step: the step count is " + std::to_string(t_) +
                       ", the largest a long holds; it cannot count another step");
    ++t_;
    const double bc1 = 1.0 - std::pow(opt_.beta1, double(t_));
    const double bc2 = 1.0 - std::pow(opt_.beta2, double(t_));
    const T b1 = T(opt_.beta1), b2 = T(opt_.beta2);
    const T step = T(lr * std::sqrt(bc2) / bc1);  // lr·√bc₂/bc₁, the fold of the file comment
    const T eps = T(opt_.eps * std::sqrt(bc2));   // ε·√bc₂
    const T shrink = T(1.0 - lr * opt_.weight_decay);
    for (std::size_t i = 0; i < params_.size(); ++i) {
      auto theta = params_[i].value().array();  // rows × cols
      const auto g = params_[i].grad().array();
      auto m = m_[i].array();
      auto v = v_[i].array();
      m = b1 * m + (T(1) - b1) * g;
      v = b2 * v + (T(1) - b2) * g.square();
      if (decay_[i]) theta *= shrink;  // θ ← θ − lr·λ·θ
      theta -= step * m / (v.sqrt() + eps);
    }
  }

  long steps() const { return t_; }
  const AdamWOptions& options() const { return opt_; }
  const ParamList<T>& params() const { return params_; }
  /// Whether parameter i receives weight decay.
  bool decays(std::size_t i) const { return decay_.at(i); }
  /// m and v of parameter i, rows × cols of it.
  const Matrix<T>& exp_avg(std::size_t i) const { return m_.at(i); }
  const Matrix<T>& exp_avg_sq(std::size_t i) const { return v_.at(i); }

  /// A copy of the whole state.
  AdamWState<T> state() const { return {t_, opt_, decay_, m_, v_}; }

  /// Replaces the whole state by `s` after checking all of it, so a rejected
  /// state changes nothing: ConfigError for invalid options; ShapeError for
  /// another number of parameters or a moment of another shape; ValueError
  /// for a negative step, a NaN or Inf in a moment, a negative v (each
  /// named `'<param>.exp_avg'` / `'<param>.exp_avg_sq'`, as the state file
  /// names them, with the element).
  void restore(AdamWState<T> s) {
    check_state(s);
    t_ = s.step;
    opt_ = s.options;
    decay_.swap(s.decay);
    m_.swap(s.exp_avg);
    v_.swap(s.exp_avg_sq);
  }

 private:
  void check_state(const AdamWState<T>& s) const {
    constexpr const char* where = "AdamW::restore";
    check_adamw_options<T>(s.options, where);
    if (s.step < 0) throw ValueError(std::string(where) + ": step must be >= 0, got " + std::to_string(s.step));
    const std::size_t n = params_.size();
    if (s.decay.size() != n || s.exp_avg.size() != n || s.exp_avg_sq.size() != n)
      throw ShapeError(std::string(where) + ": the state has " + std::to_string(s.decay.size()) + " decay flags, " +
                       std::to_string(s.exp_avg.size()) + " exp_avg and " + std::to_string(s.exp_avg_sq.size()) +
                       " exp_avg_sq tensors; the optimiser has " + std::to_string(n) + " parameters");
    for (std::size_t i = 0; i < n; ++i) {
      const Param<T>& p = params_[i];
      for (const auto& [what, x] : {std::pair<std::string, const Matrix<T>*>{p.name + ".exp_avg", &s.exp_avg[i]},
                                    {p.name + ".exp_avg_sq", &s.exp_avg_sq[i]}}) {
        const std::string arg = what;
        detail::check_shape(where, arg.c_str(), *x, p.rows, p.cols);
      }
      detail::require_valid_moments(where, p, s.exp_avg[i], s.exp_avg_sq[i]);
    }
  }

  ParamList<T> params_;
  AdamWOptions opt_;
  std::vector<Matrix<T>> m_, v_;  ///< first and second moments, rows × cols of each parameter
  std::vector<bool> decay_;       ///< per parameter: whether λ applies
  long t_ = 0;                    ///< steps done
};

}  // namespace apex
