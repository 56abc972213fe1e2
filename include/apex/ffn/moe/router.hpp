#pragma once
/// \file moe/router.hpp
/// Top-K router (docs/math.md#router).
///
///     ℓ = X·W_routerᵀ [+ b_r]  (N × E: the raw logits; b_r a trained bias,
///                                gpt-oss's router, with `with_bias`)
///     r = ℓ + b                (b: the load balancer's bias, not trained)
///     (e_1..e_K) = top-K(r)    per token, ties to the lower expert index
///     g = softmax(r_{e_1..e_K})   — or softmax(ℓ_{e_1..e_K}) with
///                                   `weights_from_unbiased`
///
/// Selection has no gradient; the balancing bias b gets none. Gradients flow
/// through the softmax of the K selected entries into W_router, b_r and X.
///
/// Other scorings (softmax over all E, sigmoid), group-limited selection,
/// renormalisation and a routed scaling factor: `set_routing` with a
/// RoutingConfig (moe/routing_config.hpp, docs/routing.md). The default config
/// keeps the path above unchanged; the choice is made once per call.

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "../core/checked_size.hpp"
#include "../core/errors.hpp"
#include "../core/init.hpp"
#include "../layers/linear.hpp"
#include "../core/param.hpp"
#include "routing_config.hpp"
#include "routing_rules.hpp"
#include "../core/types.hpp"

namespace apex {

template <class T>
class Router {
 public:
  /// `with_bias`: a trained logit bias b_r (1 × E, initialised to 0, so it
  /// draws nothing from rng), named `bias` beside `weight`.
  Router(Index d_model, Index n_experts, Index n_active, Rng& rng, bool with_bias = false)
      : k_(n_active), has_logit_bias_(with_bias) {
    detail::require_config(d_model > 0, "Router", "d_model must be positive");
    detail::require_config(n_experts >= 1, "Router", "n_experts must be >= 1");
    detail::require_config(n_active >= 1 && n_active <= n_experts, "Router", "need 1 <= n_active <= n_experts");
    detail::checked_product("Router", "weight size n_experts*d_model", {n_experts, d_model});
    weight_.resize(n_experts, d_model);
    init_linear(weight_, rng);  // its gradient: allocate_gradients() (core/param.hpp)
    if (with_bias) logit_bias_ = RowVector<T>::Zero(n_experts);
  }

  Index d_model() const { return weight_.cols(); }
  Index n_experts() const { return weight_.rows(); }
  Index n_active() const { return k_; }

  /// Scoring, selection and weighting (moe/routing_config.hpp). Throws
  /// ConfigError naming the field if `routing` does not fit this router's E and K.
  void set_routing(const RoutingConfig& routing) {
    routing.validate_for<T>("Router::set_routing", n_experts(), k_);
    routing_ = routing;
  }
  const RoutingConfig& routing() const { return routing_; }

  /// Routes x (N × d) with balancing bias (1 × E). Throws ShapeError if x
  /// or the bias has the wrong shape, ValueError if the bias or a logit is not
  /// finite: the top-K choice of a NaN is undefined.
  void route(const ConstMatrixRef<T>& x, const RowVector<T>& bias, bool weights_from_unbiased,
             Routing<T>& out) const {
    constexpr const char* where = "Router::route";
    detail::check_shape(where, "x", x, detail::kAny, d_model());
    detail::check_shape(where, "bias", bias, 1, n_experts());
    detail::check_finite(where, "bias", bias);  // E values: a NaN bias would give NaN weights
    const Index n = x.rows(), e_count = n_experts();
    out.logits.resize(n, e_count);
    detail::linear_nt(x, weight_, out.logits, false);
    if (has_logit_bias_) out.logits.rowwise() += logit_bias_;  // ℓ = X·Wᵀ + b_r
    if (!out.logits.allFinite())
      throw ValueError("Router::route: router logits are not finite (the input contains NaN/Inf or is too large)");
    out.experts.resize(n, k_);
    out.weights.resize(n, k_);
    if (!routing_.is_default()) return route_general(bias, weights_from_unbiased, out);
    out.scores.resize(0, 0);
    for (Index t = 0; t < n; ++t) {
      // Insertion into a sorted top-K list: a later expert displaces an
      // earlier one only if strictly greater, so ties keep the lower index.
      // The list's scores are kept in the row's weights (no scratch to allocate).
      auto top = out.weights.row(t);  // scores of the current best K, descending
      Index filled = 0;
      for (Index e = 0; e < e_count; ++e) {
        insert_top_k(out.logits(t, e) + bias(e), e, top, out.experts.row(t), filled);
      }
      // g = softmax over the selected (biased by default) scores, shifted by the max.
      if (weights_from_unbiased)
        for (Index k = 0; k < k_; ++k) top(k) = out.logits(t, out.experts(t, k));
      auto w = out.weights.row(t).array();
      w = (w - w.maxCoeff()).exp();
      w /= w.sum();
    }
  }

  /// The whole backward of route, given ∂L/∂g (d_weights, N × K) and,
  /// optionally, gradients that reach the selected logits by another path
  /// (d_pair_logits, N × K: ∂L/∂ℓ[t, e_k], e.g. from experts that read ℓ;
  /// pass an empty 0 × 0 matrix for none). With s the softmax's scores:
  ///     ∂L/∂ℓ[t, e_k] = g_k (∂L/∂g_k − Σ_j g_j ∂L/∂g_j) + d_pair_logits(t, k)
  /// (∂s/∂ℓ = 1 whichever scores the softmax read; every other ∂L/∂ℓ is 0),
  /// then ∂L/∂W_router += (∂L/∂ℓ)ᵀ·X (E × d) and, with a logit bias,
  /// ∂L/∂b_r += Σ_t ∂L/∂ℓ[t, ·]; returns ∂L/∂X = (∂L/∂ℓ)·W_router
  /// (N × d). docs/math.md#router. `routing` must come from a route of this
  /// router on x (shapes and expert ids are checked). Throws ShapeError or ValueError.
  Matrix<T> backward(const ConstMatrixRef<T>& x, const Routing<T>& routing, const ConstMatrixRef<T>& d_weights,
                     const ConstMatrixRef<T>& d_pair_logits = Matrix<T>()) {
    constexpr const char* where = "Router::backward";
    detail::check_shape(where, "x", x, detail::kAny, d_model());
    check_routing(where, routing, x.rows());
    detail::check_shape(where, "d_weights", d_weights, x.rows(), k_);
    const bool extra = d_pair_logits.rows() != 0 || d_pair_logits.cols() != 0;  // 0 × 0: none
    if (extra) detail::check_shape(where, "d_pair_logits", d_pair_logits, x.rows(), k_);
    Matrix<T> d_logits = Matrix<T>::Zero(x.rows(), n_experts());  // N × E
    add_softmax_backward(routing, d_weights, d_logits);
    if (extra)
      for (Index t = 0; t < x.rows(); ++t)
        for (Index k = 0; k < k_; ++k) d_logits(t, routing.experts(t, k)) += d_pair_logits(t, k);
    Matrix<T> dx(x.rows(), d_model());                                    // N × d
    allocate_gradients();
    detail::linear_nt_backward(d_logits, x, weight_, weight_grad_, dx);  // ℓ = X·Wᵀ
    if (has_logit_bias_) logit_bias_grad_ += d_logits.colwise().sum();  // ∂ℓ[t, e]/∂b_r[e] = 1
    return dx;
  }

  /// The softmax part alone: adds ∂L/∂ℓ = g_k (∂L/∂g_k − Σ_j g_j ∂L/∂g_j)
  /// at column e_k into d_logits (N × E), for a caller that combines it with
  /// other logit gradients itself. d_weights: N × K. Throws ShapeError or ValueError.
  void softmax_backward(const Routing<T>& routing, const ConstMatrixRef<T>& d_weights, Matrix<T>& d_logits) const {
    constexpr const char* where = "Router::softmax_backward";
    check_routing(where, routing, detail::kAny);
    detail::check_shape(where, "d_weights", d_weights, routing.weights.rows(), k_);
    detail::check_shape(where, "d_logits", d_logits, routing.weights.rows(), n_experts());
    add_softmax_backward(routing, d_weights, d_logits);
  }

  /// `weight` with its gradient, which this allocates (zeroed) if not yet:
  /// the view must stay valid for the layer's life (core/param.hpp).
  /// With a logit bias, then `bias` (1 × E) and its gradient.
  ParamList<T> params() {
    allocate_gradients();
    ParamList<T> out{detail::make_param<T>("weight", weight_, &weight_grad_)};
    if (has_logit_bias_) out.push_back(detail::make_param<T>("bias", logit_bias_, logit_bias_grad_));
    return out;
  }
  /// The same tensors, values only: never allocates the gradients (core/param.hpp).
  ParamList<T> param_values() {
    ParamList<T> out{detail::make_value_param<T>("weight", weight_)};
    if (has_logit_bias_) out.push_back(detail::make_value_param<T>("bias", logit_bias_));
    return out;
  }
  /// Zeroes the gradients (allocating them, zeroed, if not yet).
  void zero_grad() {
    if (!has_gradients()) return allocate_gradients();
    weight_grad_.setZero();
    logit_bias_grad_.setZero();
  }
  /// Whether the gradient exists (core/param.hpp: allocated lazily).
  bool has_gradients() const { return has_grads_; }
  /// Allocates the gradient, zeroed, unless it exists.
  void allocate_gradients() {
    if (has_grads_) return;
    weight_grad_ = Matrix<T>::Zero(n_experts(), d_model());
    if (has_logit_bias_) logit_bias_grad_ = RowVector<T>::Zero(n_experts());
    has_grads_ = true;
  }

  /// E × d (PyTorch `nn.Linear(d, E).weight`).
  Matrix<T>& weight() { return weight_; }
  const Matrix<T>& weight() const { return weight_; }
  /// E × d once allocated (has_gradients()), else 0 × 0.
  const Matrix<T>& weight_grad() const { return weight_grad_; }
  /// Whether the logits carry a trained bias b_r (constructed `with_bias`).
  bool has_logit_bias() const { return has_logit_bias_; }
  /// b_r: 1 × E with a logit bias, else 1 × 0; its gradient 1 × E once allocated.
  RowVector<T>& logit_bias() { return logit_bias_; }
  const RowVector<T>& logit_bias() const { return logit_bias_; }
  const RowVector<T>& logit_bias_grad() const { return logit_bias_grad_; }

 private:
  /// Sorted insertion of (score, e) into the current best K (`top` descending,
  /// `experts` their ids, `filled` of them valid): a later expert displaces an
  /// earlier one only if strictly greater, so ties keep the lower index.
  template <class TopArray, class ExpertRow>
  void insert_top_k(T score, Index e, TopArray& top, ExpertRow experts, Index& filled) const {
    if (filled == k_ && !(score > top(k_ - 1))) return;
    Index pos = filled < k_ ? filled++ : k_ - 1;
    while (pos > 0 && score > top(pos - 1)) {
      top(pos) = top(pos - 1);
      experts(pos) = experts(pos - 1);
      --pos;
    }
    top(pos) = score;
    experts(pos) = e;
  }

  /// ShapeError unless `routing` is a routing of this router (logits N × E,
  /// experts and weights N × K), ValueError for an expert id outside [0, E):
  /// a routing of another router would scatter past d_logits.
  void check_routing(const char* where, const Routing<T>& routing, Index n) const {
    detail::check_shape(where, "routing.weights", routing.weights, n, k_);
    n = routing.weights.rows();
    detail::check_shape(where, "routing.experts", routing.experts, n, k_);
    detail::check_shape(where, "routing.logits", routing.logits, n, n_experts());
    if (routing_.scoring != Scoring::SoftmaxSelected)
      detail::check_shape(where, "routing.scores", routing.scores, n, n_experts());
    for (Index t = 0; t < n; ++t)
      for (Index k = 0; k < k_; ++k)
        if (routing.experts(t, k) < 0 || routing.experts(t, k) >= n_experts())
          throw ValueError(std::string(where) + ": argument 'routing.experts' has expert id " +
                           std::to_string(routing.experts(t, k)) + " at (" + std::to_string(t) + ", " +
                           std::to_string(k) + "), expected a value in [0, " + std::to_string(n_experts()) + ")");
  }

  /// d_logits(t, e_k) += g_k (∂L/∂g_k − Σ_j g_j ∂L/∂g_j); shapes checked by the caller.
  void add_softmax_backward(const Routing<T>& routing, const ConstMatrixRef<T>& d_weights, Matrix<T>& d_logits) const {
    if (!routing_.is_default()) return detail::selected_weights_backward(routing_, routing, d_weights, d_logits);
    for (Index t = 0; t < routing.weights.rows(); ++t) {
      const auto g = routing.weights.row(t).array();
      const auto dg = d_weights.row(t).array();
      const T inner = (g * dg).sum();
      for (Index k = 0; k < k_; ++k) d_logits(t, routing.experts(t, k)) += g(k) * (dg(k) - inner);
    }
  }

  /// route for a non-default RoutingConfig (docs/routing.md); logits filled,
  /// experts and weights sized by the caller. Per token: the selection key
  /// r = s + b (ℓ + b for SoftmaxSelected), optionally limited to the best
  /// groups, its top K, then their weights (moe/routing_rules.hpp).
  void route_general(const RowVector<T>& bias, bool weights_from_unbiased, Routing<T>& out) const {
    const Index n = out.logits.rows(), e_count = n_experts();
    detail::routing_scores(routing_.scoring, out.logits, out.scores);
    auto& scratch = detail::RouteScratch<T>::of_thread(e_count, k_, routing_.n_groups);
    auto& [key, top, group_key, group_order, allowed] = scratch;
    for (Index t = 0; t < n; ++t) {
      if (routing_.scoring == Scoring::SoftmaxSelected)
        key = out.logits.row(t).array() + bias.array();
      else
        key = out.scores.row(t).array() + bias.array();
      if (routing_.n_groups > 1) detail::allowed_by_group(routing_, key, group_key, group_order, allowed);
      // Top-K of the allowed keys by sorted insertion; ties keep the lower index.
      Index filled = 0;
      for (Index e = 0; e < e_count; ++e) {
        if (!allowed[std::size_t(e)]) continue;
        insert_top_k(key(e), e, top, out.experts.row(t), filled);
      }
      detail::selected_weights(routing_, weights_from_unbiased, t, top, out);
    }
  }

  Index k_;
  RoutingConfig routing_;
  Matrix<T> weight_;       ///< E × d
  Matrix<T> weight_grad_;  ///< E × d once allocated, else 0 × 0
  bool has_logit_bias_ = false;
  RowVector<T> logit_bias_;       ///< 1 × E with a logit bias, else empty
  RowVector<T> logit_bias_grad_;  ///< 1 × E once allocated with a logit bias, else empty
  bool has_grads_ = false;
};

}  // namespace apex
