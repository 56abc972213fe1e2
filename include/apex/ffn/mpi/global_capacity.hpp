#pragma once
/// \file mpi/global_capacity.hpp
/// The capacity limit (moe/capacity.hpp) of an expert-parallel layer, decided on
/// the whole batch.
///
/// The rule keeps, per expert, the C = ⌈φ·N·K/E⌉ highest-weighted of the
/// batch's assignments (ties: the lower pair id t·K + k). Under expert
/// parallelism "the batch" is every rank's tokens in rank order, so the
/// decision needs every rank's routing: an expert is fed by all ranks, and C
/// depends on the total N. Deciding per rank (C from the local N) would drop
/// other pairs than MoEFFN on the concatenated batch. So:
///  1. `MPI_Allgather` of every rank's token count N_r;
///  2. `MPI_Allgatherv` of every rank's N_r × K expert ids (int32) and
///     weights (T), row-major — K·(4 + sizeof T) bytes per token, K·12 in
///     double;
///  3. every rank builds the global DispatchPlan and runs `capacity_drops`
///     with C from the global N·K, then keeps the pairs of its own token
///     range, shifted to local ids.
/// Every rank computes the same list from the same bytes, so the ranks agree
/// without further messages; a failure in step 3 (e.g. too many tokens for
/// an Index) is the same on every rank and goes through error agreement.
/// Memory and time per rank: O(ΣN_r · K) for the global ids, weights and
/// plan, plus a sort of each overfull expert's rows.

#include <mpi.h>

#include <climits>
#include <cstdint>
#include <string>
#include <vector>

#include "../moe/capacity.hpp"
#include "../core/checked_size.hpp"
#include "../moe/dispatch.hpp"
#include "../core/errors.hpp"
#include "../moe/router.hpp"
#include "../core/types.hpp"
#include "communicator.hpp"
#include "fixed_order_sum.hpp"

namespace apex::mpi {

namespace detail {

/// This rank's routing as the capacity exchange sends it: ids (int32) and
/// weights of the N·K pairs, row-major (pair t·K + k).
template <class T>
void flatten_routing(const Routing<T>& routing, std::vector<int>& ids, std::vector<T>& weights) {
  const Index n = routing.experts.rows(), k_count = routing.experts.cols();
  ids.resize(std::size_t(n * k_count));
  weights.resize(std::size_t(n * k_count));
  for (Index t = 0; t < n; ++t)
    for (Index k = 0; k < k_count; ++k) {
      ids[std::size_t(t * k_count + k)] = int(routing.experts(t, k));
      weights[std::size_t(t * k_count + k)] = routing.weights(t, k);
    }
}

/// The single-process capacity decision (moe/capacity.hpp) on every rank's
/// pairs (all_ids, all_weights: ΣN·K, row-major, in rank order), restricted
/// to this rank's tokens [begin, begin + n): their pairs t·K + k, local t.
template <class T>
std::vector<Index> rank_drops(const std::vector<int>& all_ids, const std::vector<T>& all_weights, Index k_count,
                              Index n_experts, double factor, Index begin, Index n) {
  const Index total = Index(all_ids.size()) / k_count;
  IndexMatrix experts(total, k_count);  // ΣN × K
  Matrix<T> w(total, k_count);          // ΣN × K
  for (Index t = 0; t < total; ++t)
    for (Index k = 0; k < k_count; ++k) {
      experts(t, k) = all_ids[std::size_t(t * k_count + k)];
      w(t, k) = all_weights[std::size_t(t * k_count + k)];
    }
  DispatchPlan plan;
  plan.build(experts, n_experts);
  const Index cap = dispatch::expert_capacity(factor, plan.rows(), n_experts);
  const Index first = begin * k_count, last = (begin + n) * k_count;
  std::vector<Index> dropped;
  for (Index pair : dispatch::capacity_drops(plan, w, cap))
    if (pair >= first && pair < last) dropped.push_back(pair - first);
  return dropped;
}

}  // namespace detail

/// The pairs t·K + k of this rank's tokens (local t, ascending) that the
/// capacity limit with factor `factor` drops from the concatenation of every
/// rank's `routing` (experts and weights N_r × K, ids in [0, n_experts)).
/// Collective; adds the bytes this rank sent to `bytes_sent`. Throws the same
/// exception on every rank (error agreement). `limit`: largest count of one
/// MPI call (as the row exchange). `limit`, `factor`, `n_experts` and K must
/// be the same on every rank: agreed first, a ConfigError on every rank
/// otherwise.
template <class T>
std::vector<Index> global_capacity_drops(const Communicator& comm, const char* where, const Routing<T>& routing,
                                         double factor, Index n_experts, Index limit, double& bytes_sent) {
  const Index p = comm.size(), me = comm.rank();
  const Index n = routing.experts.rows(), k_count = routing.experts.cols();
  // 1. every rank's token count
  std::vector<std::int64_t> tokens(static_cast<std::size_t>(p));
  const std::int64_t mine = n;
  detail::check(MPI_Allgather(&mine, 1, MPI_INT64_T, tokens.data(), 1, MPI_INT64_T, comm.get()),
                "MPI_Allgather (capacity token counts)");

  Index begin = 0, total = 0;  // this rank's first global token; all tokens
  std::vector<Index> pairs(static_cast<std::size_t>(p));  // N_r·K per rank
  std::vector<int> ids;                                   // N_r·K, row-major: e(t, k) at t·K + k
  std::vector<T> weights;                                 // N_r·K, row-major
  std::vector<int> all_ids;                               // ΣN_r·K
  std::vector<T> all_weights;                             // ΣN_r·K
  // What shapes the allgathers and the decision must be the same everywhere.
  comm.step(where, {{"argument 'limit' (the exchange limit)", limit}, {"argument 'n_experts'", n_experts},
                    {"the experts per token K", k_count}, {"argument 'factor' (its bits)", bits_of(factor)}},
            [&] {
    apex::detail::require_config(n_experts <= INT_MAX, where,
                           "the capacity exchange sends expert ids as int32; n_experts = " + std::to_string(n_experts));
    for (Index r = 0; r < p; ++r) {
      if (r == me) begin = total;
      total = apex::detail::checked_sum(where, "tokens of all ranks", total, Index(tokens[std::size_t(r)]));
      pairs[std::size_t(r)] =
          apex::detail::checked_product(where, "pairs of a rank N*K", {Index(tokens[std::size_t(r)]), k_count});
    }
    const Index all = apex::detail::checked_product(where, "pairs of all ranks N*K", {total, k_count});
    detail::flatten_routing(routing, ids, weights);
    all_ids.resize(std::size_t(all));
    all_weights.resize(std::size_t(all));
  });
  // 2. every rank's ids and weights, in rank order
  detail::allgatherv(comm, ids.data(), pairs, all_ids.data(), limit);
  detail::allgatherv(comm, weights.data(), pairs, all_weights.data(), limit);
  bytes_sent += double(p - 1) * double(n * k_count) * double(sizeof(int) + sizeof(T));

  // 3. the single-process decision on the whole batch, restricted to this rank's tokens
  std::vector<Index> dropped;
  comm.step(where, [&] {
    dropped = detail::rank_drops(all_ids, all_weights, k_count, n_experts, factor, begin, n);
  });
  return dropped;
}

}  // namespace apex::mpi
