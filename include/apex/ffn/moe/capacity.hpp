#pragma once
/// \file moe/capacity.hpp
/// The capacity limit (RoutingConfig::capacity_factor, docs/routing.md#capacity):
/// which (token, slot) assignments an overfull expert drops. One rule for
/// every MoE layer — MoEFFN, the packed inference layer and the
/// expert-parallel layer (which applies it to the routing of the whole
/// batch, all ranks' tokens in rank order, so it drops what the
/// single-process layer drops on the concatenated batch).
///
///     C = min(⌈φ · N·K / E⌉, N·K) assignments per expert (saturating);
///     of an expert with more, keep the C highest-weighted, ties keeping the
///     lower pair id t·K + k; drop the rest.
///
/// A dropped assignment's weight is zeroed for the combine (`kept_weights`),
/// so it adds nothing to the output and gets no gradient.

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "dispatch.hpp"
#include "../core/errors.hpp"
#include "../core/types.hpp"

namespace apex::dispatch {

/// C = min(⌈factor · rows / n_experts⌉, rows): the most assignments one
/// expert keeps of a batch of `rows` = N·K assignments. No expert holds more
/// than `rows`, so a larger C drops nothing: it saturates at `rows`, and any
/// finite factor is usable (1e300 means "no limit", not an overflow).
/// ConfigError unless factor is finite and > 0, n_experts > 0 and rows ≥ 0.
inline Index expert_capacity(double factor, Index rows, Index n_experts) {
  constexpr const char* where = "dispatch::expert_capacity";  // per forward: messages made only on failure
  detail::require_config(std::isfinite(factor) && factor > 0, where,
                         [&] { return "capacity factor must be finite and > 0, got " + std::to_string(factor); });
  detail::require_config(n_experts > 0, where,
                         [&] { return "n_experts must be positive, got " + std::to_string(n_experts); });
  detail::require_config(rows >= 0, where, [&] { return "rows must be >= 0, got " + std::to_string(rows); });
  // In double (φ·rows may be beyond Index, or +inf), clamped before the
  // conversion: converting a double outside Index's range is undefined.
  // c < double(rows) ≤ 2^63 means c ≤ 2^63 − 1024, which converts exactly.
  const double c = std::ceil(factor * double(rows) / double(n_experts));
  return c < double(rows) ? Index(c) : rows;
}

/// The pairs t·K + k (ascending) that the capacity limit drops: for every
/// expert of `plan` holding more than `capacity` rows, all but its
/// `capacity` highest-weighted ones (ties: lower pair id kept). weights:
/// N × K, the routing weights the plan was built from.
template <class T>
std::vector<Index> capacity_drops(const DispatchPlan& plan, const Matrix<T>& weights, Index capacity) {
  constexpr const char* where = "dispatch::capacity_drops";
  detail::check_shape(where, "weights", weights, plan.n_tokens, plan.n_active);
  const Index k_count = plan.n_active;
  const auto pair = [&](Index r) { return plan.token[r] * k_count + plan.slot[r]; };
  std::vector<Index> dropped, rows;
  for (Index e = 0; e < plan.n_experts; ++e) {
    if (plan.count(e) <= capacity) continue;
    rows.clear();
    for (Index r = plan.offset[e]; r < plan.offset[e + 1]; ++r) rows.push_back(r);
    std::sort(rows.begin(), rows.end(), [&](Index a, Index b) {
      const T wa = weights(plan.token[a], plan.slot[a]);
      const T wb = weights(plan.token[b], plan.slot[b]);
      return wa != wb ? wa > wb : pair(a) < pair(b);
    });
    for (std::size_t i = std::size_t(std::max<Index>(capacity, 0)); i < rows.size(); ++i) dropped.push_back(pair(rows[i]));
  }
  std::sort(dropped.begin(), dropped.end());
  return dropped;
}

/// kept (resized to N × K) = weights with every dropped pair's entry 0.
template <class T>
void zero_dropped(const Matrix<T>& weights, const std::vector<Index>& dropped, Matrix<T>& kept) {
  kept = weights;
  const Index k_count = weights.cols();
  for (Index p : dropped) kept(p / k_count, p % k_count) = T(0);
}

/// The capacity limit of one forward, as MoEFFN and PackedMoE apply it. With
/// factor > 0: `dropped` = the pairs capacity_drops gives for
/// C = expert_capacity(factor, plan.rows(), n_experts), `kept` = weights
/// with those zeroed, and `kept` is returned; with factor 0 (off): both
/// emptied and `weights` returned. The combine reads the returned weights.
template <class T>
const Matrix<T>& apply_capacity(double factor, Index n_experts, const DispatchPlan& plan, const Matrix<T>& weights,
                                std::vector<Index>& dropped, Matrix<T>& kept) {
  dropped.clear();
  if (!(factor > 0)) {
    kept.resize(0, 0);
    return weights;
  }
  dropped = capacity_drops(plan, weights, expert_capacity(factor, plan.rows(), n_experts));
  zero_dropped(weights, dropped, kept);
  return kept;
}

}  // namespace apex::dispatch
