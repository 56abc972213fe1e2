#pragma once
/// \file layers/rms_norm.hpp
/// RMSNorm: y = x / sqrt(mean(x²) + ε) · γ, per token (row)
/// (docs/math.md#rmsnorm). Rows whose mean square overflows the scalar type
/// are normalised in a scaled form instead of collapsing to 0.

#include <cmath>
#include <string>

#include "../core/errors.hpp"
#include "../core/param.hpp"
#include "../core/scalar_range.hpp"
#include "../core/types.hpp"

namespace apex {

/// Root-mean-square normalisation with a learnable gain γ (init 1).
template <class T>
class RMSNorm {
 public:
  using Scalar = T;

  /// Activations kept for backward.
  struct Cache {
    Matrix<T> x_hat;  ///< N × d: x · r
    Vector<T> r;      ///< N: 1 / sqrt(mean(x²) + ε)
  };

  /// Throws ConfigError unless d_model > 0 and ε is finite and > 0 as a T.
  /// ε = 0 is rejected because an all-zero row would give r = 1/√0 = ∞ and
  /// x̂ = 0·∞ = NaN; any ε > 0 (even a subnormal one) keeps r finite. ε is
  /// taken as a double and checked before the conversion: 1e39 is beyond
  /// float's range, and 1e-50 would round to a float ε of 0.
  explicit RMSNorm(Index d_model, double eps = 1e-6) {
    constexpr const char* where = "RMSNorm";
    detail::require_config(d_model > 0, where, "d_model must be positive, got " + std::to_string(d_model));
    detail::require_config(eps > 0 && std::isfinite(eps), where, "eps must be finite and > 0, got " + detail::number(eps));
    detail::require_fits<T>(where, "eps", eps);
    eps_ = T(eps);
    detail::require_config(eps_ > T(0), where,
                           "eps must be > 0 in the layer's scalar type " + std::string(detail::scalar_name<T>()) +
                               ", got " + detail::number(eps) + ", which rounds to 0");
    gain_ = RowVector<T>::Ones(d_model);  // dγ: allocate_gradients() (core/param.hpp)
  }

  Index d_model() const { return gain_.cols(); }
  T eps() const { return eps_; }

  /// x: N × d → N × d.
  Matrix<T> forward(const ConstMatrixRef<T>& x, Cache* cache = nullptr) const {
    detail::check_shape("RMSNorm::forward", "x", x, detail::kAny, d_model());
    // r_t = (mean_j x_tj² + ε)^(−1/2)
    Vector<T> r = ((x.array().square().rowwise().sum() / T(d_model())) + eps_).rsqrt();
    Matrix<T> x_hat = r.asDiagonal() * x;                                  // N × d
    // r_t = 0 only where mean(x²) overflowed (|x| ≳ 1.8e19 in float): a finite
    // row would normalise to 0. Such rows are recomputed scaled by s = max|x|.
    if ((r.array() == T(0)).any()) rescale_overflowed_rows(x, r, x_hat);
    Matrix<T> y = (x_hat.array().rowwise() * gain_.array()).matrix();     // N × d
    if (cache) {
      cache->x_hat = std::move(x_hat);
      cache->r = std::move(r);
    }
    return y;
  }

  /// dy: N × d → dx: N × d; adds into dγ. Throws ShapeError if the cache
  /// was not filled by a forward of this width (checked first: an unfilled
  /// cache and an empty dy would otherwise pass) or dy is not N × d.
  Matrix<T> backward(const ConstMatrixRef<T>& dy, const Cache& cache) {
    detail::check_shape("RMSNorm::backward", "cache.x_hat", cache.x_hat, detail::kAny, d_model());
    detail::check_shape("RMSNorm::backward", "cache.r", cache.r, cache.x_hat.rows(), 1);
    detail::check_shape("RMSNorm::backward", "dy", dy, cache.x_hat.rows(), d_model());
    allocate_gradients();
    // dγ_j += Σ_t dy_tj · x̂_tj
    gain_grad_.noalias() += (dy.array() * cache.x_hat.array()).colwise().sum().matrix();
    // dx̂ = dy ⊙ γ;  dx = r · (dx̂ − x̂ · mean_j(dx̂ ⊙ x̂))
    const Matrix<T> dx_hat = (dy.array().rowwise() * gain_.array()).matrix();                    // N × d
    const Vector<T> proj = (dx_hat.array() * cache.x_hat.array()).rowwise().sum() / T(d_model());  // N
    Matrix<T> dx = cache.r.asDiagonal() * (dx_hat - proj.asDiagonal() * cache.x_hat);
    return dx;
  }

  /// `weight` (γ) with its gradient, which this allocates (zeroed) if not
  /// yet: the view must stay valid for the layer's life (core/param.hpp).
  ParamList<T> params() {
    allocate_gradients();
    return {detail::make_param<T>("weight", gain_, &gain_grad_)};
  }
  /// The same tensor, values only: never allocates the gradient (core/param.hpp).
  ParamList<T> param_values() { return {detail::make_value_param<T>("weight", gain_)}; }
  /// Zeroes dγ (allocating it, zeroed, if not yet).
  void zero_grad() {
    if (!has_gradients()) return allocate_gradients();
    gain_grad_.setZero();
  }
  /// Whether dγ exists (core/param.hpp: allocated lazily).
  bool has_gradients() const { return has_grads_; }
  /// Allocates dγ, zeroed, unless it exists.
  void allocate_gradients() {
    if (has_grads_) return;
    gain_grad_ = RowVector<T>::Zero(d_model());
    has_grads_ = true;
  }

  RowVector<T>& gain() { return gain_; }
  const RowVector<T>& gain() const { return gain_; }
  /// 1 × d once allocated (has_gradients()), else empty.
  const RowVector<T>& gain_grad() const { return gain_grad_; }

 private:
  /// For each finite row t with r_t = 0, with s = max_j |x_tj|:
  ///     r_t = (mean_j (x_tj/s)² + ε/s²)^(−1/2) / s,   x̂_t = (x_t/s) · s·r_t
  /// the same values as the plain formula in exact arithmetic, none of the
  /// intermediates overflowing. Rows holding Inf or NaN keep r = 0 and give
  /// NaN, as every other layer propagates them.
  void rescale_overflowed_rows(const ConstMatrixRef<T>& x, Vector<T>& r, Matrix<T>& x_hat) const {
    for (Index t = 0; t < x.rows(); ++t) {
      if (r(t) != T(0) || !x.row(t).allFinite()) continue;
      const T s = x.row(t).cwiseAbs().maxCoeff();
      const auto scaled = x.row(t).array() / s;                                       // 1 × d, |·| ≤ 1
      const T r_scaled = T(1) / std::sqrt(scaled.square().mean() + eps_ / s / s);   // s · r_t
      x_hat.row(t) = (scaled * r_scaled).matrix();
      r(t) = r_scaled / s;
    }
  }

  T eps_;
  RowVector<T> gain_;       ///< 1 × d: γ
  RowVector<T> gain_grad_;  ///< 1 × d: ∂L/∂γ once allocated, else empty
  bool has_grads_ = false;
};

}  // namespace apex
