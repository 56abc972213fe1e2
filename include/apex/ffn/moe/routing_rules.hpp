#pragma once
/// \file moe/routing_rules.hpp
/// The steps of a non-default RoutingConfig (docs/routing.md) that the
/// Router (moe/router.hpp) applies per token: the scores of every expert,
/// group-limited selection, the weights of the chosen experts, and the
/// backward of those weights into the logits. Free of the Router's state,
/// so each step reads as its formula.

#include <algorithm>
#include <limits>
#include <vector>

#include "../core/types.hpp"
#include "routing_config.hpp"

namespace apex {

/// Row-major integer matrix (expert ids).
using IndexMatrix = Eigen::Matrix<Index, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// One batch's routing decision.
template <class T>
struct Routing {
  Matrix<T> logits;     ///< N × E: ℓ, unbiased
  IndexMatrix experts;  ///< N × K: chosen experts, best first
  Matrix<T> weights;    ///< N × K: g, each row sums to 1 (to routed_scale, or less without renormalisation)
  Matrix<T> scores;     ///< N × E: s = softmax(ℓ) or σ(ℓ) for those scorings; 0 × 0 otherwise
};

namespace detail {

/// scores (N × E) ← σ(ℓ) (Sigmoid) or softmax(ℓ) per row, shifted by the
/// row's max (SoftmaxAll); 0 × 0 for SoftmaxSelected, which scores only the
/// selected logits.
template <class T>
void routing_scores(Scoring scoring, const Matrix<T>& logits, Matrix<T>& scores) {
  if (scoring == Scoring::SoftmaxSelected) return scores.resize(0, 0);
  scores.resize(logits.rows(), logits.cols());
  for (Index t = 0; t < logits.rows(); ++t) {
    auto l = logits.row(t).array();
    auto s = scores.row(t).array();
    if (scoring == Scoring::Sigmoid) {
      s = T(1) / (T(1) + (-l).exp());
    } else {
      s = (l - l.maxCoeff()).exp();
      s /= s.sum();
    }
  }
}

/// What route_general needs per token, kept per thread (and scalar type)
/// between calls so a decode step allocates nothing: the selection key (E),
/// the top-K keys (K), the group keys and their order (n_groups) and the
/// allowed mask (E).
template <class T>
struct RouteScratch {
  Eigen::Array<T, 1, Eigen::Dynamic> key, top, group_key;
  std::vector<Index> group_order;
  std::vector<char> allowed;

  /// The calling thread's scratch, sized (a size it had keeps its buffers).
  static RouteScratch& of_thread(Index experts, Index k, Index groups) {
    thread_local RouteScratch s;
    s.key.resize(experts);
    s.top.resize(k);
    s.group_key.resize(groups);
    s.group_order.resize(std::size_t(groups));
    s.allowed.assign(std::size_t(experts), char(1));
    return s;
  }
};

/// Group-limited selection of one token: the E experts in n_groups equal
/// groups, each scored by the sum of its two largest keys (or its largest:
/// GroupScore); allowed[e] = 1 exactly for the experts of the best
/// topk_group groups, ties to the lower group index (stable sort).
/// group_key (n_groups) and group_order are the caller's scratch.
template <class T>
void allowed_by_group(const RoutingConfig& routing, const Eigen::Array<T, 1, Eigen::Dynamic>& key,
                      Eigen::Array<T, 1, Eigen::Dynamic>& group_key, std::vector<Index>& group_order,
                      std::vector<char>& allowed) {
  const Index groups = routing.n_groups, per_group = Index(allowed.size()) / groups;
  for (Index g = 0; g < groups; ++g) {
    T first = key(g * per_group), second = -std::numeric_limits<T>::infinity();
    for (Index i = 1; i < per_group; ++i) {
      const T v = key(g * per_group + i);
      if (v > first) {
        second = first;
        first = v;
      } else if (v > second) {
        second = v;
      }
    }
    group_key(g) = (routing.group_score == GroupScore::Top2Sum && per_group >= 2) ? first + second : first;
  }
  // Groups by key, descending, ties in index order: a stable insertion sort
  // (a few groups; stable_sort would allocate a buffer for every token).
  for (Index g = 0; g < groups; ++g) {
    Index i = g;
    for (; i > 0 && group_key(g) > group_key(group_order[std::size_t(i) - 1]); --i)
      group_order[std::size_t(i)] = group_order[std::size_t(i) - 1];
    group_order[std::size_t(i)] = g;
  }
  std::fill(allowed.begin(), allowed.end(), char(0));
  for (Index i = 0; i < routing.topk_group; ++i) {
    const Index g = group_order[std::size_t(i)];
    std::fill(allowed.begin() + g * per_group, allowed.begin() + (g + 1) * per_group, char(1));
  }
}

/// The weights of token t's chosen experts (out.experts row t filled, `top`
/// their selection keys, descending):
///  SoftmaxSelected: g = c · softmax(ℓ or r of the selected), shifted by the max;
///  otherwise:       g = c · s_sel, divided by D = Σ s_sel (+ ε for Sigmoid) when renormalised;
/// c = routed_scale.
template <class T>
void selected_weights(const RoutingConfig& routing, bool weights_from_unbiased, Index t,
                      const Eigen::Array<T, 1, Eigen::Dynamic>& top, Routing<T>& out) {
  const Index k_count = out.weights.cols();
  auto w = out.weights.row(t).array();
  if (routing.scoring == Scoring::SoftmaxSelected) {
    for (Index k = 0; k < k_count; ++k) w(k) = weights_from_unbiased ? out.logits(t, out.experts(t, k)) : top(k);
    w = (w - w.maxCoeff()).exp();
    w /= w.sum();
  } else {
    for (Index k = 0; k < k_count; ++k) w(k) = out.scores(t, out.experts(t, k));
    if (routing.renormalize) w /= routing.renorm_denominator(w.sum());  // + ε for Sigmoid: never 0/0
  }
  w *= T(routing.routed_scale);
}

/// Backward of selected_weights into d_logits (N × E), per token:
///  SoftmaxSelected: g = c·p, p = softmax(z_sel): ∂z_k = p_k (c ∂g_k − Σ_j p_j c ∂g_j)
///  renormalised: p_k = w_k / D: ∂w_j = (c ∂g_j − Σ_k p_k c ∂g_k) / D; else ∂w_j = c ∂g_j
///               (D = Σ_k w_k, + ε for Sigmoid: RoutingConfig::renorm_denominator)
///  sigmoid:     ∂ℓ_{e_j} += ∂w_j s_{e_j} (1 − s_{e_j})
///  softmax all: ∂ℓ_e += s_e (∂w_e − Σ_j ∂w_j s_{e_j})   (∂w_e = 0 off the selection)
/// d_weights: N × K.
template <class T>
void selected_weights_backward(const RoutingConfig& config, const Routing<T>& routing,
                               const ConstMatrixRef<T>& d_weights, Matrix<T>& d_logits) {
  const Index k_count = routing.weights.cols();
  const T scale = T(config.routed_scale);
  Eigen::Array<T, 1, Eigen::Dynamic> p(k_count), dp(k_count), dw(k_count);
  for (Index t = 0; t < routing.weights.rows(); ++t) {
    p = routing.weights.row(t).array() / scale;
    dp = d_weights.row(t).array() * scale;
    if (config.scoring == Scoring::SoftmaxSelected) {
      const T inner = (p * dp).sum();
      for (Index k = 0; k < k_count; ++k) d_logits(t, routing.experts(t, k)) += p(k) * (dp(k) - inner);
      continue;
    }
    if (config.renormalize) {
      T sum_w = 0;
      for (Index k = 0; k < k_count; ++k) sum_w += routing.scores(t, routing.experts(t, k));
      dw = (dp - (p * dp).sum()) / config.renorm_denominator(sum_w);  // the forward's D
    } else {
      dw = dp;
    }
    if (config.scoring == Scoring::Sigmoid) {
      for (Index k = 0; k < k_count; ++k) {
        const T s = routing.scores(t, routing.experts(t, k));
        d_logits(t, routing.experts(t, k)) += dw(k) * s * (T(1) - s);
      }
    } else {
      T inner = 0;
      for (Index k = 0; k < k_count; ++k) inner += dw(k) * routing.scores(t, routing.experts(t, k));
      d_logits.row(t).array() -= routing.scores.row(t).array() * inner;
      for (Index k = 0; k < k_count; ++k)
        d_logits(t, routing.experts(t, k)) += routing.scores(t, routing.experts(t, k)) * dw(k);
    }
  }
}

}  // namespace detail
}  // namespace apex
