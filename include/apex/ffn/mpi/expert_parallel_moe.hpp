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
/// Forward, per rank (N local tokens, the plan of moe/dispatch.hpp):
///  1. route, plan, gather x (and the experts' side input, κ's logit) into
///     plan order — by global expert, hence by (owner rank, local expert);
///     with a capacity factor, allgather every rank's routing and drop what
///     MoEFFN drops on the concatenated batch (dropped pairs still travel and
///     are computed, as MoEFFN computes them; their weight is 0);
///  2. `MPI_Alltoall` of the per-(rank, expert) row counts;
///  3. `MPI_Alltoallv` of the rows (and side inputs) to their owners;
///  4. the owner reorders what it received to expert-major order (expert j:
///     rows from rank 0, then rank 1, …), runs each expert on its block as
///     MoEFFN does (same tiling), and the shared experts on its own tokens;
///  5. the reverse `MPI_Alltoallv` (counts swapped) returns every output row
///     to its token's rank, in plan order;
///  6. gate the shared experts' outputs (shared_expert_gate), combine per
///     token in fixed slot order (dispatch::combine).
/// Backward mirrors it with the saved counts: combine_backward, g·dy out,
/// expert backward, ∂L/∂x (and ∂L/∂ℓ) back, router backward, gather_backward;
/// then the replicated gradients (router, shared experts, shared gate) of this step are
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

#include "../moe/dispatch.hpp"
#include "../core/errors.hpp"
#include "../moe/expert_contract.hpp"
#include "../core/checked_size.hpp"
#include "../core/init.hpp"
#include "../core/memory_budget.hpp"
#include "../moe/load_balancer.hpp"
#include "../moe/moe_ffn.hpp"
#include "../moe/moe_gradients.hpp"
#include "../core/parallel.hpp"
#include "../core/state_names.hpp"
#include "../moe/router.hpp"
#include "../moe/shared_expert_gate.hpp"
#include "../layers/swiglu.hpp"
#include "../core/workspace.hpp"
#include "communicator.hpp"
#include "config_agreement.hpp"
#include "expert_shard.hpp"
#include "exchange_plan.hpp"
#include "fixed_order_sum.hpp"
#include "global_capacity.hpp"
#include "local_experts.hpp"
#include "rank_memory.hpp"

namespace apex::mpi {

/// Seconds per phase and bytes this rank sent to other ranks, accumulated
/// over calls (MPI_Wtime). "exchange" includes waiting for slower ranks.
struct PhaseTimes {
  double route = 0, exchange = 0, experts = 0, combine = 0, reduce = 0;
  double bytes_sent = 0;
};

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

  struct Cache {
    Matrix<T> x;                         ///< N × d: the input
    Routing<T> routing;                  ///< logits N × E, experts N × K, weights N × K
    DispatchPlan plan;                   ///< the N·K local pairs by global expert
    ExchangePlan exchange;               ///< rows to and from every rank, expert-major blocks
    Matrix<T> x_local;                   ///< R × d: rows for this rank's experts, expert-major
    Vector<T> side_local;                ///< R (or 0): their side input
    Matrix<T> work;                      ///< R × expert.work_cols()
    Matrix<T> y_sorted;                  ///< NK × d: expert outputs, plan order
    std::vector<Matrix<T>> shared_work;  ///< per shared expert: N × work_cols()
    std::vector<Matrix<T>> shared_y;     ///< per shared expert: N × d (gated, with a shared gate)
    Vector<T> shared_gate;               ///< N: σ(x·w_gate) with shared_expert_gate, else empty
    Matrix<T> kept_weights;              ///< N × K: g with dropped pairs 0 (capacity on), else empty
    std::vector<Index> dropped;          ///< this rank's pairs t·K + k (local t) the capacity limit drops, ascending
  };

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
      router_.emplace(config.d_model, config.n_experts, config.n_active, rng);
      router_->set_routing(config.routing);
      balancer_.emplace(config.n_experts, config.n_active, config.balancer_alpha);
      experts_.reserve(std::size_t(last - first));
      for (Index e = 0; e < config.n_experts; ++e) {
        if (e >= first && e < last) experts_.emplace_back(config.d_model, config.d_ffn, rng);
        else Expert(config.d_model, config.d_ffn, rng);  // the same draws, discarded
      }
      for (Index s = 0; s < config.n_shared; ++s) shared_.emplace_back(config.d_model, config.shared_ffn(), rng);
      if (config.shared_expert_gate) {  // drawn last, as MoEFFN draws it
        shared_gate_.resize(1, config.d_model);
        init_linear(shared_gate_, rng);
      }
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
    constexpr const char* where = "ExpertParallelMoE::forward";
    Cache& c = cache ? *cache : thread_scratch();
    const int threads = resolve_threads(threads_);
    const Index d = d_model();
    Matrix<T> x_sorted, x_recv, y_local, y_recv, y;
    Vector<T> side_sorted, side_recv;
    std::vector<std::int64_t> send_counts, recv_counts;
    Clock clock;

    comm_.step(where, {exchange_limit_setting(limit_), routing_setting(router_->routing())}, [&] {  // 1. route
      apex::detail::check_shape(where, "x", x, apex::detail::kAny, d);
      apex::detail::serial([&] { router_->route(x, balancer_->bias(), config_.weights_from_unbiased, c.routing); });
      c.plan.build(c.routing.experts, config_.n_experts);
      dispatch::gather_rows(c.plan, x, x_sorted, threads);
      dispatch::gather_side_input(Side{}, c.plan, c.routing, side_sorted);
      send_counts = counts_by_owner(shard_, c.plan.counts());
    });
    clock.lap(times_.route);
    apply_capacity(where, c);
    clock.lap(times_.exchange);
    alltoall_counts(comm_, send_counts, shard_.max_count(), recv_counts);  // 2. counts
    comm_.step(where, [&] {
      c.exchange.build(send_counts, recv_counts, comm_.size(), shard_.max_count(), Index(experts_.size()));
      x_recv.resize(c.exchange.received(), d);
      side_recv.resize(c.exchange.received() * expert_side_cols<Expert>);
    });
    exchange(x_sorted.data(), c.exchange.send_rows, x_recv.data(), c.exchange.recv_rows, d);  // 3. rows out
    if constexpr (expert_side_cols<Expert> == 1)
      exchange(side_sorted.data(), c.exchange.send_rows, side_recv.data(), c.exchange.recv_rows, 1);
    clock.lap(times_.exchange);
    comm_.step(where, [&] {  // 4. experts, on expert-major blocks
      c.x_local.resize(x_recv.rows(), d);
      c.side_local.resize(side_recv.size());
      c.exchange.to_expert_major(x_recv, c.x_local);
      if constexpr (expert_side_cols<Expert> == 1) c.exchange.to_expert_major(side_recv, c.side_local);
      detail::local_forward(experts_, shared_, x, c.x_local, c.side_local, c.exchange.local_offset, c.work, y_local,
                            c.shared_work, c.shared_y, kMaxTileRows, threads);
      // shared gate: D_s ← σ(x·w_gate) ⊙ D_s per token (Qwen2-MoE), MoEFFN's expression
      if (config_.shared_expert_gate) {
        apex::detail::shared_gate_forward<T>(x, shared_gate_, c.shared_gate, c.shared_y);
      } else {
        c.shared_gate.resize(0);
      }
      y_recv.resize(y_local.rows(), d);
      c.exchange.to_received(y_local, y_recv);
      c.y_sorted.resize(c.plan.rows(), d);
    });
    clock.lap(times_.experts);
    exchange(y_recv.data(), c.exchange.recv_rows, c.y_sorted.data(), c.exchange.send_rows, d);  // 5. rows back
    clock.lap(times_.exchange);
    comm_.step(where, [&] {  // 6. combine
      y.resize(x.rows(), d);
      dispatch::combine(c.plan, combine_weights(c), c.y_sorted, c.shared_y, y, threads);
      if (cache) c.x = x;
    });
    clock.lap(times_.combine);
    return y;
  }

  /// dy: N × d → dx: N × d; adds into this rank's expert gradients and, summed
  /// over ranks in rank order, into the router's and shared experts'. The
  /// mirror of forward: combine, rows to the experts' owners, experts, rows
  /// back, route and gather.
  Matrix<T> backward(const ConstMatrixRef<T>& dy, const Cache& c) {
    constexpr const char* where = "ExpertParallelMoE::backward";
    const Index d = d_model();
    const ExchangePlan& ex = c.exchange;
    BackwardState s;
    Clock clock;
    backward_combine(where, dy, c, s);
    clock.lap(times_.combine);
    exchange(s.dy_sorted.data(), ex.send_rows, s.dy_recv.data(), ex.recv_rows, d);
    clock.lap(times_.exchange);
    StepGradientSum<T> replicated(comm_, replicated_params(), grad_stash_);
    replicated.begin();
    try {
      backward_experts(where, dy, c, s);
      clock.lap(times_.experts);
      exchange(s.dx_recv.data(), ex.recv_rows, s.dx_sorted.data(), ex.send_rows, d);
      if constexpr (expert_side_cols<Expert> == 1)
        exchange(s.dside_recv.data(), ex.recv_rows, s.dside_sorted.data(), ex.send_rows, 1);
      clock.lap(times_.exchange);
      backward_route(where, c, s);
      clock.lap(times_.route);
      replicated.finish();
      clock.lap(times_.reduce);
    } catch (...) {  // every rank is here, at the same step
      replicated.restore();
      throw;
    }
    return std::move(s.dx);
  }

  /// Adds the routing of `cache`, summed over ranks (exact integer sums), to
  /// the balancer's counts: every rank's balancer sees the whole batch, so
  /// `balancer().update()` gives every rank the single-process bias.
  void observe(const Cache& cache) { observe_counts(cache, nullptr); }
  /// As observe(cache), counting only tokens t with token_counted[t].
  void observe(const Cache& cache, const std::vector<bool>& token_counted) { observe_counts(cache, &token_counted); }

  Router<T>& router() { return *router_; }
  const Router<T>& router() const { return *router_; }
  LoadBalancer<T>& balancer() { return *balancer_; }
  const LoadBalancer<T>& balancer() const { return *balancer_; }
  /// This rank's routed experts, first_expert() onwards.
  std::vector<Expert>& experts() { return experts_; }
  const std::vector<Expert>& experts() const { return experts_; }
  std::vector<SharedType>& shared_experts() { return shared_; }
  const std::vector<SharedType>& shared_experts() const { return shared_; }

  /// `router.weight`, `experts.{e}.…` for this rank's e (global ids),
  /// `shared_experts.{s}.…`, `shared_expert_gate.weight`: MoEFFN's names and
  /// order, this rank's subset, with their gradients, which this allocates
  /// (zeroed, all of this rank's) if not yet.
  ParamList<T> params() {
    ParamList<T> out = replicated_params();
    ParamList<T> routed;
    for (std::size_t j = 0; j < experts_.size(); ++j)
      apex::detail::append_prefixed(routed, state_names::routed_expert(first_expert() + Index(j)),
                                    experts_[j].params());
    out.insert(out.begin() + 1, routed.begin(), routed.end());  // after router.weight, as MoEFFN orders them
    return out;
  }
  /// params() values only: never allocates gradients (core/param.hpp), for checkpoints.
  ParamList<T> param_values() {
    ParamList<T> out;
    apex::detail::append_prefixed(out, state_names::kRouterPrefix, router_->param_values());
    for (std::size_t j = 0; j < experts_.size(); ++j)
      apex::detail::append_prefixed(out, state_names::routed_expert(first_expert() + Index(j)),
                                    apex::detail::param_values_of(experts_[j]));
    for (std::size_t s = 0; s < shared_.size(); ++s)
      apex::detail::append_prefixed(out, state_names::shared_expert(s), shared_[s].param_values());
    if (config_.shared_expert_gate)
      out.push_back(apex::detail::make_value_param<T>(state_names::kSharedGate, shared_gate_));
    return out;
  }
  /// The parameters every rank holds a replica of (router, shared experts,
  /// shared gate), with their gradients (allocate_gradients if not yet).
  ParamList<T> replicated_params() {
    allocate_gradients();
    ParamList<T> out;
    apex::detail::append_prefixed(out, state_names::kRouterPrefix, router_->params());
    for (std::size_t s = 0; s < shared_.size(); ++s)
      apex::detail::append_prefixed(out, state_names::shared_expert(s), shared_[s].params());
    if (config_.shared_expert_gate)
      out.push_back(apex::detail::make_param<T>(state_names::kSharedGate, shared_gate_, shared_gate_grad_));
    return out;
  }
  /// Zeroes this rank's gradients (allocating them, zeroed, if not yet). Local.
  void zero_grad() {
    if (!has_gradients()) return allocate_gradients();
    apex::detail::zero_moe_gradients(gradient_parts());
  }
  /// Whether this rank's gradients exist (allocate_gradients ran).
  bool has_gradients() const { return has_grads_; }
  /// Allocates every gradient of this rank — router, its routed experts,
  /// shared experts, shared gate — zeroed, unless done already. Local, not
  /// collective; backward calls it before its parallel section. ConfigError
  /// (core/memory_budget.hpp) naming the bytes if this rank's weights plus
  /// gradients exceed physical memory; nothing is allocated then.
  void allocate_gradients() {
    if (has_grads_) return;
    constexpr const char* where = "ExpertParallelMoE::allocate_gradients";
    const std::uint64_t bytes =
        apex::detail::scalar_bytes<T>(where, "gradient bytes", parameter_count(param_values()));
    apex::detail::allocate_moe_gradients(where, detail::rank_description<T>(config_, Index(experts_.size())), bytes,
                                         gradient_parts());
    has_grads_ = true;
  }

 private:
  using Side = expert_side_input_t<Expert>;
  struct DyTag;
  struct DxTag;
  struct SharedDxTag;

  /// Adds the seconds since the previous lap to a phase.
  struct Clock {
    double last = MPI_Wtime();
    void lap(double& phase) {
      const double now = MPI_Wtime();
      phase += now - last;
      last = now;
    }
  };

  /// What one backward carries from phase to phase.
  struct BackwardState {
    Matrix<T> d_weights;             ///< N × K: ∂L/∂g
    Matrix<T> dy_sorted, dx_sorted;  ///< NK × d: g·dy out, ∂L/∂x back, plan order
    Matrix<T> dy_recv, dx_recv;      ///< R × d: as received / to return, rank blocks
    Matrix<T> d_pair;                ///< N × K (or 0 × 0): ∂L/∂ℓ of the selected pairs from the side input
    Matrix<T> dy_shared, dz;         ///< N × d: σ ⊙ dy for the shared experts; N × 1: ∂L/∂(x·w_gate)
    Vector<T> dside_local, dside_recv, dside_sorted;  ///< R, R, NK (or 0): side-input gradients
    Matrix<T> dx;                    ///< N × d: the result
  };

  /// Checks, allocates every gradient and computes g·dy in plan order and
  /// ∂L/∂g (combine_backward); then checks that every rank's cache comes from
  /// the same forward.
  void backward_combine(const char* where, const ConstMatrixRef<T>& dy, const Cache& c, BackwardState& s) {
    const int threads = resolve_threads(threads_);
    const Index d = d_model(), n = c.x.rows(), n_shared = Index(shared_.size());
    const ExchangePlan& ex = c.exchange;
    comm_.step(where, {exchange_limit_setting(limit_)}, [&] {
      check_cache(where, c);
      apex::detail::check_shape(where, "dy", dy, n, d);
      apex::detail::checked_product(where, "shared gradient rows n_shared*N", {n_shared, n});
      // Every gradient exists before the expert tasks run: no task allocates
      // (moe/expert_contract.hpp), and the experts step cannot fail part-way
      // with this rank's expert gradients half accumulated.
      allocate_gradients();
      s.dy_sorted.resize(c.plan.rows(), d);
      dispatch::combine_backward(c.plan, combine_weights(c), dy, c.y_sorted, s.d_weights, s.dy_sorted, threads);
      // A dropped pair has no effect on y, so no gradient (MoEFFN::backward).
      for (Index pr : c.dropped) s.d_weights(pr / config_.n_active, pr % config_.n_active) = T(0);
      s.dy_recv.resize(ex.received(), d);
    });
    // The caches of one forward agree on who sends what; a cache from
    // another step would not (and the exchange would fail or block).
    std::vector<std::int64_t> peer_rows;
    alltoall_counts(comm_, std::vector<std::int64_t>(ex.send_rows.begin(), ex.send_rows.end()), 1, peer_rows);
    comm_.step(where, [&] {
      if (!std::equal(ex.recv_rows.begin(), ex.recv_rows.end(), peer_rows.begin()))
        throw ValueError(std::string(where) + ": argument 'cache' does not come from the same forward on every rank");
    });
  }

  /// The experts' backward on expert-major blocks and the shared experts'
  /// (behind their gate) on this rank's tokens; stages ∂L/∂x (and the side
  /// input's gradient) to return to the tokens' ranks.
  void backward_experts(const char* where, const ConstMatrixRef<T>& dy, const Cache& c, BackwardState& s) {
    const int threads = resolve_threads(threads_);
    const Index d = d_model(), n = c.x.rows(), rows = c.exchange.received(), n_shared = Index(shared_.size());
    const ExchangePlan& ex = c.exchange;
    comm_.step(where, [&] {
      auto dy_local = apex::detail::thread_workspace<T, DyTag>(rows, d);
      auto dx_local = apex::detail::thread_workspace<T, DxTag>(rows, d);
      auto shared_dx = apex::detail::thread_workspace<T, SharedDxTag>(n_shared * n, d);  // checked in combine
      s.dside_local = Vector<T>::Zero(rows * expert_side_cols<Expert>);
      ex.to_expert_major(s.dy_recv, dy_local);
      // shared gate: the shared experts see σ ⊙ dy; ∂L/∂z_t = (1 − σ_t) ⟨dy_t, Σ_s D_s[t]⟩
      // (D_s gated), z = x·w_gate: ∂L/∂w_gate += ∂zᵀ·X (this rank's part of
      // a replicated gradient, summed later), ∂L/∂x += ∂z·w_gate (after the gather).
      if (gated())
        apex::detail::shared_gate_backward<T>(c.x, dy, c.shared_gate, c.shared_y, shared_gate_grad_, s.dy_shared,
                                              s.dz);
      const ConstMatrixRef<T> dy_for_shared = gated() ? ConstMatrixRef<T>(s.dy_shared) : dy;
      detail::local_backward(experts_, shared_, c.x, dy_for_shared, c.x_local, c.side_local, ex.local_offset, c.work,
                             c.shared_work, dy_local, dx_local, s.dside_local, shared_dx, threads);
      s.dx_recv.resize(rows, d);
      s.dside_recv.resize(s.dside_local.size());
      ex.to_received(dx_local, s.dx_recv);
      if constexpr (expert_side_cols<Expert> == 1) ex.to_received(s.dside_local, s.dside_recv);
      s.dx_sorted.resize(c.plan.rows(), d);
      s.dside_sorted.resize(c.plan.rows() * expert_side_cols<Expert>);
    });
  }

  /// The router's backward (∂L/∂g and the side input's ∂L/∂ℓ) and the
  /// gather's: ∂L/∂x per token in fixed order, plus the shared gate's part.
  void backward_route(const char* where, const Cache& c, BackwardState& s) {
    const int threads = resolve_threads(threads_);
    const Index d = d_model(), n = c.x.rows(), n_shared = Index(shared_.size());
    comm_.step(where, [&] {
      dispatch::scatter_side_grad(Side{}, c.plan, s.dside_sorted, s.d_pair);
      apex::detail::serial([&] { s.dx = router_->backward(c.x, c.routing, s.d_weights, s.d_pair); });
      // The same per-thread buffer local_backward wrote (same tag, same size: not reallocated).
      auto shared_dx = apex::detail::thread_workspace<T, SharedDxTag>(n_shared * n, d);
      dispatch::gather_backward(c.plan, s.dx_sorted, shared_dx, n_shared, s.dx, threads);
      if (gated()) s.dx.noalias() += s.dz * shared_gate_;
    });
  }

  apex::detail::MoEGradientParts<T, Expert> gradient_parts() {
    return {*router_, experts_, shared_, shared_gate_grad_, config_.shared_expert_gate ? d_model() : 0};
  }

  bool capacity_on() const { return config_.routing.capacity_factor > 0; }
  /// The gate acts only if there are shared experts to gate (as in MoEFFN).
  bool gated() const { return config_.shared_expert_gate && !shared_.empty(); }
  /// The weights the combine reads: with the capacity limit, g with the dropped pairs 0.
  const Matrix<T>& combine_weights(const Cache& c) const { return capacity_on() ? c.kept_weights : c.routing.weights; }

  /// Capacity limit (moe/capacity.hpp) on the whole batch (global_capacity.hpp),
  /// collective: lists this rank's dropped pairs in c.dropped and zeroes
  /// their weights in c.kept_weights.
  void apply_capacity(const char* where, Cache& c) const {
    c.dropped.clear();
    if (!capacity_on()) {
      c.kept_weights.resize(0, 0);
      return;
    }
    c.dropped = global_capacity_drops(comm_, where, c.routing, config_.routing.capacity_factor, config_.n_experts,
                                      limit_, times_.bytes_sent);
    comm_.step(where, [&] { dispatch::zero_dropped(c.routing.weights, c.dropped, c.kept_weights); });
  }

  void exchange(const T* send, const std::vector<Index>& send_rows, T* recv, const std::vector<Index>& recv_rows,
                Index width) const {
    times_.bytes_sent += exchange_rows(comm_, send, send_rows, recv, recv_rows, width, limit_);
  }

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
      balancer_->observe(std::vector<Index>(global.begin(), global.end() - 1), Index(global.back()));
    });
  }

  /// ShapeError unless `c` holds a forward of a layer of this configuration.
  void check_cache(const char* where, const Cache& c) const {
    const Index n = c.x.rows(), rows = c.exchange.received(), p = comm_.size();
    apex::detail::check_shape(where, "cache.x", c.x, apex::detail::kAny, d_model());
    dispatch::check_plan(where, "cache", c.plan, n, config_.n_active, config_.n_experts);
    apex::detail::check_shape(where, "cache.routing.weights", c.routing.weights, n, config_.n_active);
    apex::detail::check_shape(where, "cache.routing.logits", c.routing.logits, n, config_.n_experts);
    apex::detail::check_shape(where, "cache.y_sorted", c.y_sorted, c.plan.rows(), d_model());
    apex::detail::check_shape(where, "cache.x_local", c.x_local, rows, d_model());
    apex::detail::check_shape(where, "cache.work", c.work, rows, experts_.front().work_cols());
    apex::detail::check_shape(where, "cache.side_local", c.side_local, rows * expert_side_cols<Expert>, 1);
    const ExchangePlan& ex = c.exchange;
    if (Index(ex.send_rows.size()) != p || Index(ex.recv_rows.size()) != p || ex.sent() != c.plan.rows() ||
        Index(ex.local_offset.size()) != Index(experts_.size()) + 1 || ex.local_offset.back() != rows ||
        c.shared_work.size() != shared_.size() || c.shared_y.size() != shared_.size())
      throw ShapeError(std::string(where) + ": argument 'cache' was not filled by a forward of this layer");
    for (const auto& w : c.shared_work) apex::detail::check_shape(where, "cache.shared_work", w, n, apex::detail::kAny);
    apex::detail::check_shape(where, "cache.shared_gate", c.shared_gate, config_.shared_expert_gate ? n : 0, 1);
    if (capacity_on())
      apex::detail::check_shape(where, "cache.kept_weights", c.kept_weights, n, config_.n_active);
    for (Index pr : c.dropped)
      if (pr < 0 || pr >= n * config_.n_active)
        throw ShapeError(std::string(where) + ": argument 'cache.dropped' holds pair " + std::to_string(pr) +
                         ", expected a value in [0, " + std::to_string(n * config_.n_active) + ")");
  }

  static Cache& thread_scratch() {
    thread_local Cache scratch;
    return scratch;
  }

  MoEConfig config_;
  Communicator comm_;
  ExpertShard shard_;
  std::optional<Router<T>> router_;
  std::optional<LoadBalancer<T>> balancer_;
  std::vector<Expert> experts_;
  std::vector<SharedType> shared_;
  Matrix<T> shared_gate_;       ///< 1 × d with shared_expert_gate (Qwen2-MoE), else 0 × 0
  Matrix<T> shared_gate_grad_;  ///< 1 × d with shared_expert_gate, once allocated; else 0 × 0
  bool has_grads_ = false;      ///< allocate_gradients ran
  int threads_ = 0;
  Index limit_ = kMaxIntCount;
  std::vector<T> grad_stash_;  ///< the replicated gradients before a backward (StepGradientSum)
  mutable PhaseTimes times_;
};

}  // namespace apex::mpi
