#pragma once
/// \file mpi/exchange_runner.hpp
/// `ExchangeRunner<Layer>`: the MoE pipeline's expert runner (moe/pipeline.hpp)
/// for ExpertParallelMoE — the routed rows go to their experts' owners and
/// come back:
///  1. gather x (and the experts' side input, κ's logit) into plan order —
///     by global expert, hence by (owner rank, local expert);
///  2. `MPI_Alltoall` of the per-(rank, expert) row counts;
///  3. `MPI_Alltoallv` of the rows (and side inputs) to their owners;
///  4. the owner reorders what it received to expert-major order
///     (moe/row_exchange.hpp), runs each expert on its block as MoEFFN does
///     (same tiling, moe/local_experts.hpp), and the shared experts on its
///     own tokens;
///  5. the reverse `MPI_Alltoallv` (counts swapped) returns every output row
///     to its token's rank, in plan order.
/// The capacity limit is decided on the whole batch (global_capacity.hpp).
/// Backward sends g·dy out and ∂L/∂x (and ∂L/∂ℓ) back with the cached plan,
/// and sums the replicated gradients of the step (router, shared experts,
/// shared gate) across ranks in rank order (fixed_order_sum.hpp).
///
/// Every local phase is followed by error agreement (communicator.hpp), so a
/// bad input on one rank throws on every rank and none blocks; every
/// allocation happens inside one. Seconds per phase go to the layer's
/// PhaseTimes. `Layer` is the layer (const for forward), which befriends this
/// and gives its parts through `ep_*` accessors: the router, the balancing
/// bias, the shared gate and its gradient, this rank's routed experts and the
/// shared experts (by reference, or made for the call: the adapters' layer,
/// mpi/expert_parallel_lora.hpp), and `ep_after_backward()` once the local
/// experts' backward has run, before the replicated gradients are summed.

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <mpi.h>

#include "../core/parallel.hpp"
#include "../core/types.hpp"
#include "../core/workspace.hpp"
#include "../moe/dispatch.hpp"
#include "../moe/expert_contract.hpp"
#include "../moe/local_experts.hpp"
#include "../moe/moe_cache.hpp"
#include "../moe/pipeline.hpp"
#include "alltoallv.hpp"
#include "config_agreement.hpp"
#include "exchange_plan.hpp"
#include "fixed_order_sum.hpp"
#include "global_capacity.hpp"

namespace apex::mpi {

/// Seconds per phase and bytes this rank sent to other ranks, accumulated
/// over calls (MPI_Wtime). "exchange" includes waiting for slower ranks.
struct PhaseTimes {
  double route = 0, exchange = 0, experts = 0, combine = 0, reduce = 0;
  double bytes_sent = 0;
};

namespace detail {

struct ExchangeDyTag;  ///< backward workspace: g·dy received, expert-major
struct ExchangeDxTag;  ///< backward workspace: the experts' ∂L/∂x, expert-major

template <class Layer>
struct ExchangeRunner {
  using Plain = std::remove_const_t<Layer>;
  using T = typename Plain::Scalar;
  using ExpertType = typename Plain::ExpertType;
  static constexpr Index kSide = expert_side_cols<ExpertType>;

  Layer& layer;
  mutable double last = MPI_Wtime();  ///< the end of the previous lap

  explicit ExchangeRunner(Layer& l) : layer(l) {}

  const MoEConfig& config() const { return layer.config(); }
  int threads() const { return resolve_threads(layer.threads_); }
  const Router<T>& router() const { return layer.ep_router(); }
  const RowVector<T>& bias() const { return layer.ep_bias(); }
  const Matrix<T>& shared_gate() const { return layer.ep_shared_gate(); }
  const Communicator& comm() const { return layer.comm_; }

  /// Adds the seconds since the previous lap to `phase`.
  void lap(double& phase) const {
    const double now = MPI_Wtime();
    phase += now - last;
    last = now;
  }

  /// One agreed local step; the opening ones also agree on the settings that could differ per rank.
  template <class Fn>
  void phase(const char* where, apex::detail::MoEPhase p, Fn&& fn) const {
    using apex::detail::MoEPhase;
    PhaseTimes& t = layer.times_;
    if (p == MoEPhase::route)
      comm().step(where, {exchange_limit_setting(layer.limit_), routing_setting(router().routing())}, fn);
    else if (p == MoEPhase::open_backward) comm().step(where, {exchange_limit_setting(layer.limit_)}, fn);
    else comm().step(where, fn);
    lap(p == MoEPhase::route || p == MoEPhase::route_backward ? t.route : t.combine);
  }

  /// The capacity limit on the whole batch, collective: this rank's dropped
  /// pairs listed, their weights 0 in kept_weights.
  void apply_capacity(const char* where, MoECache<T>& c) const {
    const MoEConfig& cfg = config();
    c.dropped.clear();
    if (cfg.routing.capacity_factor > 0) {
      c.dropped = global_capacity_drops(comm(), where, c.routing, cfg.routing.capacity_factor, cfg.n_experts,
                                        layer.limit_, layer.times_.bytes_sent);
      comm().step(where, [&] { dispatch::zero_dropped(c.routing.weights, c.dropped, c.kept_weights); });
    } else {
      c.kept_weights.resize(0, 0);
    }
    lap(layer.times_.exchange);
  }

  /// Steps 1–5 of the file comment: c.y_sorted (plan order) from the owners' experts.
  void run_experts(const char* where, const ConstMatrixRef<T>& x, MoECache<T>& c) const {
    const Index d = config().d_model;
    const ExpertShard& shard = layer.shard_;
    Matrix<T> x_send, x_recv, y_local, y_recv;  // NK × d, R × d (rank blocks), R × d (expert-major), R × d
    Vector<T> side_send, side_recv;             // NK, R (or 0)
    std::vector<std::int64_t> send_counts, recv_counts;
    comm().step(where, [&] {
      dispatch::gather_rows(c.plan, x, x_send, threads());
      dispatch::gather_side_input(expert_side_input_t<ExpertType>{}, c.plan, c.routing, side_send);
      send_counts = counts_by_owner(shard, c.plan.counts());
    });
    lap(layer.times_.route);
    alltoall_counts(comm(), send_counts, shard.max_count(), recv_counts);
    comm().step(where, [&] {
      c.exchange.build(send_counts, recv_counts, comm().size(), shard.max_count(), layer.ep_local_count());
      x_recv.resize(c.exchange.received(), d);
      side_recv.resize(c.exchange.received() * kSide);
    });
    exchange(x_send.data(), c.exchange.send_rows, x_recv.data(), c.exchange.recv_rows, d);
    if constexpr (kSide == 1)
      exchange(side_send.data(), c.exchange.send_rows, side_recv.data(), c.exchange.recv_rows, 1);
    lap(layer.times_.exchange);
    comm().step(where, [&] {
      c.x_sorted.resize(x_recv.rows(), d);
      c.side_sorted.resize(side_recv.size());
      c.exchange.to_expert_major(x_recv, c.x_sorted);
      if constexpr (kSide == 1) c.exchange.to_expert_major(side_recv, c.side_sorted);
      const auto& experts = layer.ep_experts();
      const auto& shared = layer.ep_shared();
      apex::detail::local_forward(experts, shared, x, c.x_sorted, c.side_sorted,
                                  c.exchange.local_offset, c.work, y_local, c.shared_work, c.shared_y,
                                  Plain::kMaxTileRows, threads());
      y_recv.resize(y_local.rows(), d);
      c.exchange.to_received(y_local, y_recv);
      c.y_sorted.resize(c.plan.rows(), d);
    });
    lap(layer.times_.experts);
    exchange(y_recv.data(), c.exchange.recv_rows, c.y_sorted.data(), c.exchange.send_rows, d);
    lap(layer.times_.exchange);
  }

  MoECacheShape cache_shape() const {
    const MoEConfig& cfg = config();
    MoECacheShape s = MoECacheShape::local(cfg, layer.ep_work_cols(),
                                           cfg.n_shared > 0 ? layer.ep_shared_work_cols() : 0, kSide);
    s.ranks = comm().size();
    s.local_experts = layer.ep_local_count();
    return s;
  }
  void allocate_gradients() const { layer.allocate_gradients(); }

  /// ValueError on every rank unless every rank's cache comes from the same
  /// forward: they agree on who sends what (a cache from another step would
  /// not, and the exchange would fail or block).
  void check_same_forward(const char* where, const MoECache<T>& c) const {
    const RowExchange& ex = c.exchange;
    std::vector<std::int64_t> peer_rows;
    alltoall_counts(comm(), std::vector<std::int64_t>(ex.send_rows.begin(), ex.send_rows.end()), 1, peer_rows);
    comm().step(where, [&] {
      if (!std::equal(ex.recv_rows.begin(), ex.recv_rows.end(), peer_rows.begin()))
        throw ValueError(std::string(where) + ": argument 'cache' does not come from the same forward on every rank");
    });
    lap(layer.times_.combine);
  }

  /// Runs fn between stashing the replicated gradients and summing this
  /// step's across ranks in rank order; restores them if fn throws (on every rank, at the same step).
  template <class Fn>
  void gradient_scope(Fn&& fn) const {
    StepGradientSum<T> replicated(comm(), layer.replicated_params(), layer.grad_stash_);
    replicated.begin();
    try {
      std::forward<Fn>(fn)();
      replicated.finish();
      lap(layer.times_.reduce);
    } catch (...) {
      replicated.restore();
      throw;
    }
  }

  /// g·dy to the owners, the experts' backward on expert-major blocks and the
  /// shared experts' on dy_shared, ∂L/∂x (and the side input's gradient) back in plan order.
  template <class DySorted, class DxSorted, class SharedDx>
  void backward_experts(const char* where, const MoECache<T>& c, const DySorted& dy_sorted,
                        const ConstMatrixRef<T>& dy_shared, DxSorted& dx_sorted, Vector<T>& dside_sorted,
                        SharedDx& shared_dx) const {
    const Index d = config().d_model, rows = c.exchange.received();
    const RowExchange& ex = c.exchange;
    Matrix<T> dy_recv, dx_recv;   // R × d: as received / to return, rank blocks
    Vector<T> dside_recv;         // R (or 0)
    comm().step(where, [&] { dy_recv.resize(rows, d); });
    exchange(dy_sorted.data(), ex.send_rows, dy_recv.data(), ex.recv_rows, d);
    lap(layer.times_.exchange);
    comm().step(where, [&] {
      auto dy_local = apex::detail::thread_workspace<T, ExchangeDyTag>(rows, d);  // R × d, expert-major
      auto dx_local = apex::detail::thread_workspace<T, ExchangeDxTag>(rows, d);  // R × d, expert-major
      Vector<T> dside_local = Vector<T>::Zero(rows * kSide);
      ex.to_expert_major(dy_recv, dy_local);
      auto&& experts = layer.ep_experts();
      auto&& shared = layer.ep_shared();
      apex::detail::local_backward(experts, shared, c.x, dy_shared, c.x_sorted,
                                   c.side_sorted, ex.local_offset, c.work, c.shared_work, dy_local, dx_local,
                                   dside_local, shared_dx, threads());
      layer.ep_after_backward();
      dx_recv.resize(rows, d);
      dside_recv.resize(dside_local.size());
      ex.to_received(dx_local, dx_recv);
      if constexpr (kSide == 1) ex.to_received(dside_local, dside_recv);
    });
    lap(layer.times_.experts);
    exchange(dx_recv.data(), ex.recv_rows, dx_sorted.data(), ex.send_rows, d);
    if constexpr (kSide == 1) exchange(dside_recv.data(), ex.recv_rows, dside_sorted.data(), ex.send_rows, 1);
    lap(layer.times_.exchange);
  }
  Router<T>& router_grad() const { return layer.ep_router(); }
  Matrix<T>& shared_gate_grad() const { return layer.ep_shared_gate_grad(); }

 private:
  void exchange(const T* send, const std::vector<Index>& send_rows, T* recv, const std::vector<Index>& recv_rows,
                Index width) const {
    layer.times_.bytes_sent += exchange_rows(comm(), send, send_rows, recv, recv_rows, width, layer.limit_);
  }
};

}  // namespace detail
}  // namespace apex::mpi
