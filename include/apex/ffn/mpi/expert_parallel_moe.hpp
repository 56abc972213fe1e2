#pragma once
/// \file mpi/expert_parallel_moe.hpp
/// `ExpertParallelMoE<T, Expert>`: MoEFFN over P MPI ranks, each owning a
/// contiguous shard of the routed experts (expert_shard.hpp) and a replica of
/// the router, the shared experts and the balancer; each brings its own
/// tokens (data parallel). docs/expert_parallel.md has the cost model.
///
/// Every MoEConfig option is MoEFFN's: the router's scoring, groups,
/// renormalisation and scale (moe/routing_config.hpp) act per token, so each
/// rank routes its own tokens; the shared experts (of width d_shared_ffn)
/// and Qwen2-MoE's shared-expert gate are replicated; the capacity limit is
/// decided on the whole batch (global_capacity.hpp).
///
/// The layer is the MoE pipeline (moe/pipeline.hpp) — route, plan,
/// capacity, experts, shared gate, combine and the mirror for backward,
/// MoEFFN's code — over an exchange to the experts' owners
/// (mpi/exchange_runner.hpp): per rank (N local tokens), rows go to their
/// experts' ranks in plan order, come back in plan order, and the
/// replicated gradients (router, shared experts, shared gate) of a step are
/// summed across ranks in rank order (fixed_order_sum.hpp) and added, so
/// every rank holds the same values, bitwise, run after run.
///
/// Equivalence: expert e sees the rows, in the order and tiling, that
/// MoEFFN sees on the concatenated batch; results equal MoEFFN's to rounding
/// (block alignment, rows per product, sum order: docs/expert_parallel.md),
/// and are bitwise the same run to run and on any thread count.
///
/// Collectives: forward, backward, observe and the constructor are
/// collective over the communicator — every rank calls them, in the same
/// order, from one thread at a time (a rank with no tokens passes 0 × d).
/// Each local phase is followed by error agreement (communicator.hpp), so a
/// bad input on one rank throws on every rank and none blocks.

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <mpi.h>

#include "../core/errors.hpp"
#include "../core/memory_budget.hpp"
#include "../core/param.hpp"
#include "../core/types.hpp"
#include "../layers/swiglu.hpp"
#include "../moe/expert_contract.hpp"
#include "../moe/load_balancer.hpp"
#include "../moe/moe_cache.hpp"
#include "../moe/moe_ffn.hpp"
#include "../moe/moe_parts.hpp"
#include "../moe/pipeline.hpp"
#include "../moe/router.hpp"
#include "communicator.hpp"
#include "config_agreement.hpp"
#include "exchange_runner.hpp"
#include "expert_shard.hpp"
#include "rank_memory.hpp"

namespace apex::mpi {

template <class T, class Expert = SwiGLU<T>>
class ExpertParallelMoE {
  static_assert(check_expert_contract<Expert, T>());

 public:
  using Scalar = T;
  using ExpertType = Expert;
  using SharedType = SwiGLU<T>;
  /// Every rank must call forward, backward and observe the same number of
  /// times, also with 0 rows (FFNSublayer reads this).
  static constexpr bool kCollective = true;
  static constexpr Index kMaxTileRows = MoEFFN<T, Expert>::kMaxTileRows;

  /// What backward needs (moe/moe_cache.hpp); the experts' rows are this
  /// rank's, received from every rank, expert-major (cache.exchange).
  using Cache = MoECache<T>;

  /// The layer MoEFFN(config, rng) would build, this rank keeping its shard
  /// of the routed experts. Every rank draws every expert's weights in
  /// order (keeping one at a time), so the weights equal the single-process
  /// layer's for the same seed; for large layers load a checkpoint instead.
  /// ConfigError on every rank if the configuration is invalid on any rank,
  /// differs between ranks (any field, routing options included), or P > E.
  ExpertParallelMoE(const MoEConfig& config, Communicator comm, Rng& rng)
      : config_(config), comm_(std::move(comm)), shard_(1, 1) {
    constexpr const char* where = "ExpertParallelMoE";
    comm_.step(where, [&] { config.validate_for<T>(where); });
    agree_on_config(comm_, where, fingerprint<T, Expert>(where, config));
    comm_.step(where, [&] {
      shard_ = ExpertShard(config.n_experts, comm_.size());
      const Index first = shard_.first(comm_.rank()), last = shard_.first(comm_.rank() + 1);
      // Before anything is allocated: a rank that cannot hold its share is a ConfigError on every rank.
      check_memory_fit(where, detail::rank_description<T>(config, last - first),
                       detail::rank_weight_bytes<T, Expert>(config, last - first, where));
      parts_.emplace(config, rng, first, last);  // every expert drawn, this rank's kept
      // No gradients yet: allocate_gradients().
    });
  }
  ExpertParallelMoE(const MoEConfig& config, Communicator comm, Rng&& rng)
      : ExpertParallelMoE(config, std::move(comm), rng) {}
  ExpertParallelMoE(const MoEConfig& config, Communicator comm, std::uint64_t seed = 0)
      : ExpertParallelMoE(config, std::move(comm), Rng(seed)) {}

  /// Collective: runs the caller's local phase `fn` and agrees on its
  /// outcome and on `value`, named `name` in the error, so a caller that wraps
  /// this layer (FFNSublayer) can make its own checks and its calls agree
  /// across ranks: the same exception on every rank, never a hang.
  template <class Fn>
  void agree_step(const char* where, const char* name, std::int64_t value, Fn&& fn) const {
    comm_.step(where, {Agreed{name, value}}, std::forward<Fn>(fn));
  }

  const MoEConfig& config() const { return config_; }
  Index d_model() const { return config_.d_model; }
  const Communicator& comm() const { return comm_; }
  const ExpertShard& shard() const { return shard_; }
  /// Global id of this rank's first routed expert (experts()[j] is expert first_expert() + j).
  Index first_expert() const { return shard_.first(comm_.rank()); }
  void set_threads(int threads) { threads_ = threads; }
  /// Largest count of one MPI call in the exchanges (alltoallv.hpp), to test
  /// or to bound staging memory. ValueError outside [1, 2³¹ − 1]; the same on
  /// every rank (agreed per call, config_agreement.hpp).
  void set_exchange_limit(Index limit) {
    if (limit < 1 || limit > kMaxIntCount)
      throw ValueError("ExpertParallelMoE::set_exchange_limit: argument 'limit' is " + std::to_string(limit) +
                       ", expected a value in [1, " + std::to_string(kMaxIntCount) + "]");
    limit_ = limit;
  }
  const PhaseTimes& phase_times() const { return times_; }
  void reset_phase_times() { times_ = {}; }

  /// x: N × d (this rank's tokens; N may differ between ranks, also 0) → N × d.
  Matrix<T> forward(const ConstMatrixRef<T>& x, Cache* cache = nullptr) const {
    Matrix<T> y(x.rows(), d_model());
    const detail::ExchangeRunner<const ExpertParallelMoE> runner{*this};
    apex::detail::MoEPipeline::forward<T>("ExpertParallelMoE::forward", runner, x, y,
                                          cache ? *cache : apex::detail::MoEPipeline::scratch<T, ExpertParallelMoE>(),
                                          cache != nullptr);
    return y;
  }

  /// dy: N × d → dx: N × d; adds into this rank's expert gradients and, summed
  /// over ranks in rank order, into the router's and shared experts'. The
  /// mirror of forward: combine, rows to the experts' owners, experts, rows
  /// back, route and gather.
  Matrix<T> backward(const ConstMatrixRef<T>& dy, const Cache& c) {
    detail::ExchangeRunner<ExpertParallelMoE> runner{*this};
    return apex::detail::MoEPipeline::backward<T>("ExpertParallelMoE::backward", runner, dy, c);
  }

  /// Adds the routing of `cache`, summed over ranks (exact integer sums), to
  /// the balancer's counts: every rank's balancer sees the whole batch, so
  /// `balancer().update()` gives every rank the single-process bias.
  void observe(const Cache& cache) { observe_counts(cache, nullptr); }
  /// As observe(cache), counting only tokens t with token_counted[t].
  void observe(const Cache& cache, const std::vector<bool>& token_counted) { observe_counts(cache, &token_counted); }

  Router<T>& router() { return parts_->router; }
  const Router<T>& router() const { return parts_->router; }
  LoadBalancer<T>& balancer() { return parts_->balancer; }
  const LoadBalancer<T>& balancer() const { return parts_->balancer; }
  /// This rank's routed experts, first_expert() onwards.
  std::vector<Expert>& experts() { return parts_->experts; }
  const std::vector<Expert>& experts() const { return parts_->experts; }
  std::vector<SharedType>& shared_experts() { return parts_->shared; }
  const std::vector<SharedType>& shared_experts() const { return parts_->shared; }

  /// `router.weight`, `experts.{e}.…` for this rank's e (global ids),
  /// `shared_experts.{s}.…`, `shared_expert_gate.weight`: MoEFFN's names and
  /// order, this rank's subset, with their gradients, which this allocates
  /// (zeroed, all of this rank's) if not yet.
  ParamList<T> params() {
    allocate_gradients();
    return parts_->params(first_expert());
  }
  /// params() values only: never allocates gradients (core/param.hpp), for checkpoints.
  ParamList<T> param_values() { return parts_->param_values(first_expert()); }
  /// The parameters every rank holds a replica of (router, shared experts,
  /// shared gate), with their gradients (allocate_gradients if not yet).
  ParamList<T> replicated_params() {
    allocate_gradients();
    return parts_->replicated_params();
  }
  /// Zeroes this rank's gradients (allocating them, zeroed, if not yet). Local.
  void zero_grad() { parts_->zero_grad("ExpertParallelMoE::zero_grad", description()); }
  /// Whether this rank's gradients exist (allocate_gradients ran).
  bool has_gradients() const { return parts_->has_gradients; }
  /// Allocates every gradient of this rank — router, its routed experts,
  /// shared experts, shared gate — zeroed, unless done already. Local, not
  /// collective; backward calls it before its parallel section. ConfigError
  /// (core/memory_budget.hpp) naming the bytes if this rank's weights plus
  /// gradients exceed physical memory; nothing is allocated then.
  void allocate_gradients() { parts_->allocate_gradients("ExpertParallelMoE::allocate_gradients", description()); }

 private:
  template <class>
  friend struct detail::ExchangeRunner;

  std::string description() const { return detail::rank_description<T>(config_, Index(parts_->experts.size())); }

  /// \name What the exchange runner reads (mpi/exchange_runner.hpp)
  ///@{
  const Router<T>& ep_router() const { return parts_->router; }
  Router<T>& ep_router() { return parts_->router; }
  const RowVector<T>& ep_bias() const { return parts_->balancer.bias(); }
  const Matrix<T>& ep_shared_gate() const { return parts_->shared_gate; }
  Matrix<T>& ep_shared_gate_grad() { return parts_->shared_gate_grad; }
  const std::vector<Expert>& ep_experts() const { return parts_->experts; }
  std::vector<Expert>& ep_experts() { return parts_->experts; }
  const std::vector<SharedType>& ep_shared() const { return parts_->shared; }
  std::vector<SharedType>& ep_shared() { return parts_->shared; }
  Index ep_local_count() const { return Index(parts_->experts.size()); }
  Index ep_work_cols() const { return parts_->experts.front().work_cols(); }
  Index ep_shared_work_cols() const { return parts_->shared.front().work_cols(); }
  void ep_after_backward() {}
  ///@}

  void observe_counts(const Cache& c, const std::vector<bool>* counted) {
    constexpr const char* where = "ExpertParallelMoE::observe";
    const Index e_count = config_.n_experts;
    std::vector<std::int64_t> local(std::size_t(e_count) + 1, 0), global(local.size());
    comm_.step(where, [&] {
      check_cache(where, c);
      if (counted && Index(counted->size()) != c.plan.n_tokens)
        throw ShapeError(std::string(where) + ": argument 'token_counted' has length " +
                         std::to_string(counted->size()) + ", expected " + std::to_string(c.plan.n_tokens));
      const std::vector<Index> counts = counted ? c.plan.counts(*counted) : c.plan.counts();
      std::copy(counts.begin(), counts.end(), local.begin());
      local.back() = counted ? std::count(counted->begin(), counted->end(), true) : c.plan.n_tokens;
    });
    // Integer sums: exact in any order, so MPI_Allreduce is fine here.
    detail::check(MPI_Allreduce(local.data(), global.data(), int(local.size()), MPI_INT64_T, MPI_SUM, comm_.get()),
                  "MPI_Allreduce (expert loads)");
    comm_.step(where, [&] {
      parts_->balancer.observe(std::vector<Index>(global.begin(), global.end() - 1), Index(global.back()));
    });
  }

  /// ShapeError unless `c` holds a forward of a layer of this configuration.
  void check_cache(const char* where, const Cache& c) const {
    apex::detail::check_moe_cache(where, c, detail::ExchangeRunner<const ExpertParallelMoE>{*this}.cache_shape());
  }

  MoEConfig config_;
  Communicator comm_;
  ExpertShard shard_;
  std::optional<apex::detail::MoEParts<T, Expert>> parts_;  ///< router, balancer, this rank's experts, shared
  int threads_ = 0;
  Index limit_ = kMaxIntCount;
  std::vector<T> grad_stash_;  ///< the replicated gradients before a backward (StepGradientSum)
  mutable PhaseTimes times_;
};

}  // namespace apex::mpi
