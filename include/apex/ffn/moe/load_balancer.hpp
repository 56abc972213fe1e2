#pragma once
/// \file moe/load_balancer.hpp
/// Auxiliary-loss-free, bias-based load balancing (docs/math.md#load-balancer).
///
/// Per expert, over the tokens routed since the last update:
///     f_e = c_e / (N·K),  τ = 1/E,  b_e ← clamp(b_e + α·sign(τ − f_e), −1, 1).
/// The bias is not a trained parameter: it only shifts which experts the
/// router selects. Counts accumulate over any number of micro-batches
/// (`observe`) before one `update`.
///
/// The clamp bounds the balancer's own steps, not the bias: `set_bias` (and
/// so every checkpoint loader) stores any finite value exactly, since a
/// loaded bias — DeepSeek-V3's `e_score_correction_bias` — is the model's and
/// must route as its file says. A step never takes b_e out of [−1, 1], nor
/// further out than it already is: b_e ← clamp(b_e + α·s, min(b_e, −1),
/// max(b_e, 1)), the rule above for every b_e inside the range.

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "../core/checked_size.hpp"
#include "../core/errors.hpp"
#include "../core/scalar_range.hpp"
#include "../core/types.hpp"

namespace apex {

/// Per-expert load over an observation window.
struct LoadReport {
  std::vector<Index> counts;  ///< c_e: (token, slot) assignments per expert
  std::vector<double> load;   ///< f_e = c_e / (N·K)
  Index tokens = 0;           ///< N
  /// max load / mean load (1 = perfectly even; E = everything on one expert;
  /// 0 when nothing was observed).
  double imbalance = 0;
};

template <class T>
class LoadBalancer {
 public:
  /// Throws ConfigError unless 1 ≤ n_active ≤ n_experts and α is finite and ≥ 0.
  LoadBalancer(Index n_experts, Index n_active, double alpha = 1e-3)
      : n_active_(validated(n_experts, n_active, alpha)),  // first member: nothing is sized before the checks
        alpha_(alpha),
        bias_(RowVector<T>::Zero(n_experts)),
        counts_(std::size_t(n_experts), 0) {}

  Index n_experts() const { return bias_.cols(); }
  Index n_active() const { return n_active_; }
  double alpha() const { return alpha_; }
  void set_alpha(double alpha) {
    check_alpha("LoadBalancer::set_alpha", alpha);
    alpha_ = alpha;
  }

  /// 1 × E: the balancing bias b added to the router logits for selection.
  const RowVector<T>& bias() const { return bias_; }
  /// Stores `bias` exactly (1 × E, finite: ShapeError or ValueError, and then
  /// nothing changes). Not clamped: [−1, 1] bounds update()'s steps only.
  void set_bias(const RowVector<T>& bias) {
    detail::check_shape("LoadBalancer::set_bias", "bias", bias, 1, n_experts());
    detail::check_finite("LoadBalancer::set_bias", "bias", bias);
    bias_ = bias;
  }

  /// Adds one micro-batch: `n_tokens` ≥ 0 tokens whose K choices gave
  /// `counts` (length E, each in [0, n_tokens] — a token picks K distinct
  /// experts — summing to n_tokens·K). Throws ShapeError (length),
  /// ValueError, or ConfigError if the window's E·tokens would not fit an
  /// Index (update compares E·c_e with tokens·K), and then counts nothing.
  void observe(const std::vector<Index>& counts, Index n_tokens) {
    constexpr const char* where = "LoadBalancer::observe";
    if (Index(counts.size()) != n_experts())
      throw ShapeError(std::string(where) + ": argument 'counts' has length " + std::to_string(counts.size()) +
                       ", expected " + std::to_string(n_experts()));
    if (n_tokens < 0)
      throw ValueError(std::string(where) + ": argument 'n_tokens' is " + std::to_string(n_tokens) +
                       ", expected a value >= 0");
    // Every product update forms (tokens·K, E·c_e with c_e ≤ tokens) fits if
    // E·tokens of the window does; n_tokens·K then fits too (K ≤ E).
    detail::checked_product(where, "n_experts*tokens of the window",
                            {n_experts(), detail::checked_sum(where, "tokens of the window", tokens_, n_tokens)});
    // A negative count or one above n_tokens could still sum to N·K and would
    // turn an expert's load negative or above 1/K. Each count is ≤ n_tokens,
    // so the running total stays ≤ E·n_tokens, which fits.
    Index total = 0;
    for (std::size_t e = 0; e < counts.size(); ++e) {
      const Index c = counts[e];
      if (c < 0 || c > n_tokens)
        throw ValueError(std::string(where) + ": argument 'counts' has " + std::to_string(c) + " for expert " +
                         std::to_string(e) + ", expected a value in [0, n_tokens = " + std::to_string(n_tokens) +
                         "]");
      total += c;
    }
    if (total != n_tokens * n_active_)
      throw ValueError("LoadBalancer::observe: counts sum to " + std::to_string(total) + ", expected N*K = " +
                       std::to_string(n_tokens * n_active_));
    for (Index e = 0; e < n_experts(); ++e) counts_[e] += counts[e];
    tokens_ += n_tokens;
  }

  /// Load over the tokens observed since the last update.
  LoadReport report() const { return make_report(counts_, tokens_, n_active_); }

  /// Applies the bias rule to the observed window, clears it, and returns the
  /// window's report. With no tokens observed the bias is left unchanged.
  LoadReport update() {
    LoadReport r = report();
    if (tokens_ > 0) {
      // sign(τ − f_e) = sign(N·K − E·c_e), compared exactly in integers so a
      // perfectly balanced expert (f_e = τ) gets exactly 0.
      const Index target = tokens_ * n_active_;
      for (Index e = 0; e < n_experts(); ++e) {
        const Index diff = target - n_experts() * counts_[e];
        const int sign = (diff > 0) - (diff < 0);
        // A step stays in [−1, 1], or no further out than b_e already was.
        const T b = bias_(e);
        bias_(e) = std::clamp(T(double(b) + alpha_ * sign), std::min(b, T(-1)), std::max(b, T(1)));
      }
    }
    std::fill(counts_.begin(), counts_.end(), 0);
    tokens_ = 0;
    return r;
  }

  /// Report of arbitrary counts (helper for callers that keep their own window).
  static LoadReport make_report(const std::vector<Index>& counts, Index tokens, Index n_active) {
    LoadReport r;
    r.counts = counts;
    r.tokens = tokens;
    r.load.assign(counts.size(), 0.0);
    if (tokens == 0 || counts.empty()) return r;
    const double assignments = double(tokens) * double(n_active);
    double max_load = 0;
    for (std::size_t e = 0; e < counts.size(); ++e) {
      r.load[e] = double(counts[e]) / assignments;
      max_load = std::max(max_load, r.load[e]);
    }
    r.imbalance = max_load * double(counts.size());  // mean load is 1/E
    return r;
  }

 private:
  /// Checks the constructor's arguments; returns n_active.
  static Index validated(Index n_experts, Index n_active, double alpha) {
    detail::require_config(n_experts >= 1, "LoadBalancer", "n_experts must be >= 1, got " + std::to_string(n_experts));
    detail::require_config(n_active >= 1 && n_active <= n_experts, "LoadBalancer",
                           "need 1 <= n_active <= n_experts = " + std::to_string(n_experts) + ", got n_active " +
                               std::to_string(n_active));
    check_alpha("LoadBalancer", alpha);
    return n_active;
  }
  /// α steps a bias held in T: finite, ≥ 0 and within T's range.
  static void check_alpha(const char* where, double alpha) {
    detail::require_config(std::isfinite(alpha) && alpha >= 0, where,
                           "alpha must be finite and >= 0, got " + detail::number(alpha));
    detail::require_fits<T>(where, "alpha", alpha);
  }

  Index n_active_;
  double alpha_;
  RowVector<T> bias_;           ///< 1 × E
  std::vector<Index> counts_;   ///< E: assignments since the last update
  Index tokens_ = 0;            ///< tokens since the last update
};

}  // namespace apex
