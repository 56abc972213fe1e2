#pragma once
/// \file adamw.hpp
/// The demo's optimiser: AdamW (Loshchilov & Hutter) over a `ParamList`,
/// global-norm gradient clipping, and the warmup + cosine learning-rate
/// schedule. Written out in full so the update rule is on the page:
///
///     m ← β₁m + (1−β₁)g,   v ← β₂v + (1−β₂)g²
///     θ ← θ − lr·( (m/(1−β₁ᵗ)) / (√(v/(1−β₂ᵗ)) + ε) + λ·θ )
///
/// The weight decay λ is decoupled (applied to θ, not added to g) and is
/// skipped for gains, biases and κ-SwiGLU's α (which has its own regulariser):
/// shrinking a norm gain towards 0 or a bias towards 0 is not a prior anyone
/// wants.

#include <apex/ffn/core/errors.hpp>
#include <apex/ffn/core/param.hpp>
#include <apex/ffn/core/types.hpp>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

namespace apex::demo {

struct AdamWOptions {
  double beta1 = 0.9;
  double beta2 = 0.99;
  double eps = 1e-8;
  double weight_decay = 0.1;  ///< λ, for the parameters `decays` selects
};

inline bool name_ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

/// Default weight-decay rule: every parameter except norm gains (`…norm.weight`),
/// biases (`…bias`, including `kappa_bias`) and `kappa_alpha`.
inline bool decays_by_default(const std::string& name) {
  return !(name_ends_with(name, "norm.weight") || name_ends_with(name, "bias") ||
           name_ends_with(name, "kappa_alpha"));
}

template <class T>
class AdamW {
 public:
  /// Optimises the parameters `params` views (they must outlive the optimiser).
  explicit AdamW(ParamList<T> params, const AdamWOptions& opt = {},
                 std::function<bool(const std::string&)> decays = decays_by_default)
      : params_(std::move(params)), opt_(opt) {
    detail_check(opt);
    for (const auto& p : params_) {
      m_.push_back(Matrix<T>::Zero(p.rows, p.cols));
      v_.push_back(Matrix<T>::Zero(p.rows, p.cols));
      decay_.push_back(decays(p.name));
    }
  }

  /// One update with learning rate `lr` from the gradients in the params.
  void step(double lr) {
    ++t_;
    const double bc1 = 1.0 - std::pow(opt_.beta1, double(t_));  // bias corrections: m and v start at 0
    const double bc2 = 1.0 - std::pow(opt_.beta2, double(t_));
    const T b1 = T(opt_.beta1), b2 = T(opt_.beta2);
    // θ −= lr·m̂/(√v̂ + ε) with m̂ = m/bc1, v̂ = v/bc2, folded as step·m/(√v + ε·√bc2), step = lr·√bc2/bc1
    const T step = T(lr * std::sqrt(bc2) / bc1);
    const T eps = T(opt_.eps * std::sqrt(bc2));
    for (std::size_t i = 0; i < params_.size(); ++i) {
      auto theta = params_[i].value().array();
      const auto g = params_[i].grad().array();
      auto m = m_[i].array();
      auto v = v_[i].array();
      m = b1 * m + (T(1) - b1) * g;
      v = b2 * v + (T(1) - b2) * g.square();
      if (decay_[i]) theta *= T(1.0 - lr * opt_.weight_decay);  // decoupled: θ ← θ − lr·λ·θ
      theta -= step * m / (v.sqrt() + eps);
    }
  }

  long steps() const { return t_; }
  const ParamList<T>& params() const { return params_; }
  /// Whether parameter i receives weight decay.
  bool decays(std::size_t i) const { return decay_[i]; }

 private:
  static void detail_check(const AdamWOptions& o) {
    detail::require_config(o.beta1 >= 0 && o.beta1 < 1, "AdamW", "beta1 must be in [0, 1)");
    detail::require_config(o.beta2 >= 0 && o.beta2 < 1, "AdamW", "beta2 must be in [0, 1)");
    detail::require_config(o.eps > 0, "AdamW", "eps must be positive");
    detail::require_config(o.weight_decay >= 0, "AdamW", "weight_decay must be >= 0");
  }

  ParamList<T> params_;
  AdamWOptions opt_;
  std::vector<Matrix<T>> m_, v_;  ///< first and second moments, shaped as each parameter
  std::vector<bool> decay_;
  long t_ = 0;
};

/// Global L2 norm of every gradient in `params` (accumulated in double).
template <class T>
double grad_norm(const ParamList<T>& params) {
  double s = 0;
  for (const auto& p : params) s += p.grad().template cast<double>().squaredNorm();
  return std::sqrt(s);
}

/// Scales every gradient by min(1, max_norm / ‖g‖) and returns ‖g‖ before
/// clipping (PyTorch's `clip_grad_norm_`).
template <class T>
double clip_grad_norm(const ParamList<T>& params, double max_norm) {
  const double norm = grad_norm(params);
  if (norm > max_norm && norm > 0) {
    const T scale = T(max_norm / (norm + 1e-6));
    for (const auto& p : params) p.grad() *= scale;
  }
  return norm;
}

/// Linear warmup over `warmup` steps to `peak`, then cosine decay to
/// `floor_fraction·peak` at `total` steps. `step` counts from 0.
inline double warmup_cosine(long step, long total, long warmup, double peak, double floor_fraction = 0.1) {
  if (warmup > 0 && step < warmup) return peak * double(step + 1) / double(warmup);
  const double span = double(std::max(1L, total - warmup));
  const double p = std::min(1.0, double(step - warmup) / span);
  return peak * (floor_fraction + (1.0 - floor_fraction) * 0.5 * (1.0 + std::cos(3.141592653589793 * p)));
}

}  // namespace apex::demo
