#pragma once
/// \file mpi/expert_shard.hpp
/// Which rank owns which routed expert: contiguous, near-equal shards.
///
/// Rank r of P owns experts [first(r), first(r + 1)) with
/// first(r) = ⌊r·E / P⌋, so shard sizes differ by at most one when P does
/// not divide E (E = 10 on P = 4: 2, 3, 2, 3 experts) and expert ids stay in
/// order across ranks. Contiguity is what lets the dispatch plan's sorted
/// order — pairs by global expert id — be the send order of the exchange:
/// grouped by destination rank, then by local expert, with no extra sort.
/// P > E would leave ranks without experts; it is rejected (ConfigError).

#include <string>
#include <vector>

#include "../core/errors.hpp"
#include "../core/types.hpp"

namespace apex::mpi {

/// The contiguous partition of E experts over P ranks.
class ExpertShard {
 public:
  /// ConfigError unless 1 ≤ P ≤ E.
  ExpertShard(Index n_experts, Index n_ranks) : e_(n_experts), p_(n_ranks) {
    apex::detail::require_config(n_ranks >= 1, "ExpertShard", "need at least one rank, got " + std::to_string(n_ranks));
    apex::detail::require_config(n_experts >= n_ranks, "ExpertShard",
                           "n_experts = " + std::to_string(n_experts) + " is smaller than the number of ranks " +
                               std::to_string(n_ranks) + "; every rank must own at least one routed expert");
  }

  Index n_experts() const { return e_; }
  Index n_ranks() const { return p_; }
  /// First expert of rank r (r in [0, P]; first(P) = E).
  Index first(Index r) const { return r * e_ / p_; }
  /// Experts rank r owns.
  Index count(Index r) const { return first(r + 1) - first(r); }
  /// ⌈E / P⌉: the largest shard.
  Index max_count() const { return (e_ + p_ - 1) / p_; }
  /// The rank that owns expert e (e in [0, E)).
  Index owner(Index e) const {
    Index r = (e * p_) / e_;  // first(r) ≤ e up to rounding; fix by at most one step
    while (r + 1 < p_ && first(r + 1) <= e) ++r;
    while (r > 0 && first(r) > e) --r;
    return r;
  }
  /// first(r) for r = 0..P (P + 1 boundaries).
  std::vector<Index> boundaries() const {
    std::vector<Index> b(std::size_t(p_) + 1);
    for (Index r = 0; r <= p_; ++r) b[std::size_t(r)] = first(r);
    return b;
  }

 private:
  Index e_, p_;
};

}  // namespace apex::mpi
