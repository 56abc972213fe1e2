#pragma once
/// \file moe/routing_config.hpp
/// How the router scores, selects and weights experts (docs/routing.md).
/// The open MoE families differ only in these choices; the default is
/// APEX-1's router and takes the unchanged fast path in moe/router.hpp.
///
///     s = score(ℓ)                     softmax over the K selected (default),
///                                      softmax over all E, or sigmoid per expert
///     r = s + b                        selection key (ℓ + b for the default);
///                                      b steers selection, never a weight
///     groups: keep the best `topk_group` of `n_groups` groups of E/G experts
///             (group score = sum of its top-2 r, or its max r)
///     (e_1..e_K) = top-K(r) inside the kept groups, ties to the lower index
///     g_k = c · s_{e_k} [/ D if renormalize]              (c = routed_scale)
///     D = Σ_j s_{e_j} (+ 1e-20 for Sigmoid: renorm_denominator)

#include <cmath>
#include <string>

#include "../core/errors.hpp"
#include "../core/scalar_range.hpp"
#include "../core/types.hpp"

namespace apex {

/// Scoring function of the router logits ℓ.
enum class Scoring {
  SoftmaxSelected,  ///< softmax over the K selected (biased, or with weights_from_unbiased raw) logits: APEX-1
  SoftmaxAll,       ///< softmax over all E logits (Mixtral, Qwen-MoE, OLMoE)
  Sigmoid,          ///< σ(ℓ_e) per expert (DeepSeek-V3)
};

/// Name of a scoring ("softmax_selected", "softmax_all", "sigmoid").
inline const char* scoring_name(Scoring s) {
  switch (s) {
    case Scoring::SoftmaxSelected: return "softmax_selected";
    case Scoring::SoftmaxAll: return "softmax_all";
    case Scoring::Sigmoid: return "sigmoid";
  }
  return "?";
}

/// Group score of group-limited selection.
enum class GroupScore {
  Top2Sum,  ///< sum of the group's two largest biased scores (DeepSeek-V3 with a correction bias)
  Max,      ///< the group's largest score (DeepSeek-V3's `Gate` without a bias)
};

/// Scoring, selection and weighting of one router. Validated against the
/// layer's E and K by `validate`.
struct RoutingConfig {
  Scoring scoring = Scoring::SoftmaxSelected;
  /// Expert groups G (1: no group limit). G must divide E.
  Index n_groups = 1;
  /// Groups kept per token (1 ≤ topk_group ≤ G; topk_group·E/G ≥ K).
  Index topk_group = 1;
  GroupScore group_score = GroupScore::Top2Sum;
  /// Divide the K selected scores by their sum (SoftmaxAll, Sigmoid; the
  /// SoftmaxSelected weights already sum to 1).
  bool renormalize = true;
  /// Routed scaling factor c > 0 multiplying every weight.
  double routed_scale = 1.0;
  /// Capacity factor φ of MoEFFN (0: off, dropless, the default). Each
  /// expert takes at most C = min(⌈φ·N·K/E⌉, N·K) of a batch's N·K
  /// assignments (so a huge φ saturates and drops nothing); of an
  /// overfull expert's, the lowest-weighted are dropped (ties: the higher
  /// token index, then the higher slot, is dropped first). A dropped
  /// assignment adds nothing to the output and gets no gradient; the
  /// balancer still counts it (it counts selections).
  double capacity_factor = 0.0;

  /// D of the renormalisation g_k = c·s_k / D, from S = Σ_j s_{e_j}:
  /// S + 1e-20 for Sigmoid, S otherwise. Every σ can underflow to 0 (float
  /// logits ≲ −104, double ≲ −745), and 0/0 would be NaN; Hugging Face's
  /// DeepSeek-V3 adds the same 1e-20, so this matches it. The ε is exact:
  /// ∂g_k/∂s_{e_i} = c (δ_ki − g_k / c) / D, D including the ε. For every
  /// S ≥ 2⁻⁴² ≈ 2.3e-13 (float) or 2⁻¹³ ≈ 1.2e-4 (double) S + 1e-20 rounds
  /// to S, so ordinary inputs are bitwise unchanged. A softmax's selected sum is ≥ 1/E and
  /// needs no ε (nor do Hugging Face's Mixtral and Qwen3-MoE add one).
  template <class T>
  T renorm_denominator(T sum) const {
    return scoring == Scoring::Sigmoid ? sum + T(kSigmoidRenormEpsilon) : sum;
  }
  static constexpr double kSigmoidRenormEpsilon = 1e-20;  ///< normal in float (min normal 1.2e-38)

  /// True for APEX-1's router (bitwise-unchanged fast path).
  bool is_default() const {
    return scoring == Scoring::SoftmaxSelected && n_groups == 1 && routed_scale == 1.0;
  }

  /// Throws ConfigError naming the first field out of range for a layer of
  /// `n_experts` experts, `n_active` per token.
  void validate(const char* where, Index n_experts, Index n_active) const {
    auto need = [&](bool ok, const std::string& what) { detail::require_config(ok, where, what); };
    // An enum cast from an out-of-range integer would be read as some other
    // choice by the router's comparisons: name the value instead.
    need(scoring == Scoring::SoftmaxSelected || scoring == Scoring::SoftmaxAll || scoring == Scoring::Sigmoid,
         "routing.scoring must be softmax_selected, softmax_all or sigmoid, got " + std::to_string(int(scoring)));
    need(group_score == GroupScore::Top2Sum || group_score == GroupScore::Max,
         "routing.group_score must be top2_sum or max, got " + std::to_string(int(group_score)));
    need(n_groups >= 1, "routing.n_groups must be >= 1, got " + std::to_string(n_groups));
    need(n_experts % n_groups == 0, "routing.n_groups = " + std::to_string(n_groups) +
                                        " must divide n_experts = " + std::to_string(n_experts));
    need(topk_group >= 1 && topk_group <= n_groups, "routing.topk_group must satisfy 1 <= topk_group <= n_groups = " +
                                                        std::to_string(n_groups) + ", got " + std::to_string(topk_group));
    need(topk_group * (n_experts / n_groups) >= n_active,
         "routing.topk_group * n_experts / n_groups = " + std::to_string(topk_group * (n_experts / n_groups)) +
             " must be >= n_active = " + std::to_string(n_active) + " (too few experts in the kept groups)");
    need(std::isfinite(routed_scale) && routed_scale > 0,
         "routing.routed_scale must be finite and > 0, got " + std::to_string(routed_scale));
    need(std::isfinite(capacity_factor) && capacity_factor >= 0,
         "routing.capacity_factor must be finite and >= 0 (0: off), got " + std::to_string(capacity_factor));
  }

  /// As validate(), for a layer that computes in T (the router converts c to
  /// T: 1e39 would be +inf in float).
  template <class T>
  void validate_for(const char* where, Index n_experts, Index n_active) const {
    validate(where, n_experts, n_active);
    check_scalar_range<T>(where);
  }
  /// The range part of validate_for alone. The capacity factor is exempt: it
  /// is only used in double, and its capacity saturates (moe/capacity.hpp).
  template <class T>
  void check_scalar_range(const char* where) const {
    detail::require_fits<T>(where, "routing.routed_scale", routed_scale);
  }
};

}  // namespace apex
