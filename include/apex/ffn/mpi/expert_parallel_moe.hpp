#pragma once
/// \file mpi/expert_parallel_moe.hpp
/// `ExpertParallelMoE<T, Expert>`: MoEFFN over P MPI ranks, each owning a
/// contiguous shard of the routed experts (expert_shard.hpp) and a replica of
/// the router, the shared experts and the balancer; each brings its own
/// tokens (data parallel). docs/expert_parallel.md has the cost model.
///
/// Forward, per rank (N local tokens, the plan of dispatch.hpp):
///  1. route, plan, gather x (and the experts' side input, κ's logit) into
///     plan order — by global expert, hence by (owner rank, local expert);
///  2. `MPI_Alltoall` of the per-(rank, expert) row counts;
///  3. `MPI_Alltoallv` of the rows (and side inputs) to their owners;
///  4. the owner reorders what it received to expert-major order (expert j:
///     rows from rank 0, then rank 1, …), runs each expert on its block as
///     MoEFFN does (same tiling), and the shared experts on its own tokens;
///  5. the reverse `MPI_Alltoallv` (counts swapped) returns every output row
///     to its token's rank, in plan order;
///  6. combine per token in fixed slot order (dispatch::combine).
/// Backward mirrors it with the saved counts: combine_backward, g·dy out,
/// expert backward, ∂L/∂x (and ∂L/∂ℓ) back, router backward, gather_backward;
/// then the replicated gradients (router, shared experts) of this step are
/// summed across ranks in rank order (fixed_order_sum.hpp) and added, so
/// every rank holds the same values, bitwise, run after run.
///
/// Equivalence: with P ranks holding token blocks X₀ … X_{P−1}, expert e
/// sees exactly the rows, in the order, that MoEFFN sees on the concatenated
/// batch, so routed outputs and expert gradients are the single-process
/// ones; router and shared gradients differ from them only by the order of a
/// sum (≤ 1e-12 relative in double, tested).
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

#include "../dispatch.hpp"
#include "../errors.hpp"
#include "../expert_contract.hpp"
#include "../load_balancer.hpp"
#include "../moe.hpp"
#include "../parallel.hpp"
#include "../router.hpp"
#include "../swiglu.hpp"
#include "../workspace.hpp"
#include "alltoallv.hpp"
#include "communicator.hpp"
#include "config_agreement.hpp"
#include "expert_shard.hpp"
#include "fixed_order_sum.hpp"

namespace apex::mpi {

/// Seconds per phase and bytes this rank sent, accumulated over calls
/// (MPI_Wtime). "exchange" includes waiting for slower ranks.
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
    std::vector<Index> send_rows;        ///< P: rows sent to each rank
    std::vector<Index> recv_rows;        ///< P: rows received from each rank
    std::vector<Index> local_offset;     ///< S + 1: local expert blocks in expert-major order
    std::vector<Index> perm;             ///< R: expert-major row → received row
    Matrix<T> x_local;                   ///< R × d: rows for this rank's experts, expert-major
    Vector<T> side_local;                ///< R (or 0): their side input
    Matrix<T> work;                      ///< R × expert.work_cols()
    Matrix<T> y_sorted;                  ///< NK × d: expert outputs, plan order
    std::vector<Matrix<T>> shared_work;  ///< per shared expert: N × work_cols()
    std::vector<Matrix<T>> shared_y;     ///< per shared expert: N × d
  };

  /// The layer MoEFFN(config, rng) would build, this rank keeping its shard
  /// of the routed experts. Every rank draws every expert's weights in
  /// order (keeping one at a time), so the weights equal the single-process
  /// layer's for the same seed; for large layers load a checkpoint instead.
  /// ConfigError on every rank if the configuration is invalid on any rank,
  /// differs between ranks, or P > E.
  ExpertParallelMoE(const MoEConfig& config, Communicator comm, Rng& rng)
      : config_(config), comm_(std::move(comm)), shard_(1, 1) {
    constexpr const char* where = "ExpertParallelMoE";
    comm_.step(where, [&] { config.validate(where); });
    agree_on_config(comm_, where, fingerprint<T, Expert>(where, config));
    comm_.step(where, [&] {
      shard_ = ExpertShard(config.n_experts, comm_.size());
      router_.emplace(config.d_model, config.n_experts, config.n_active, rng);
      balancer_.emplace(config.n_experts, config.n_active, config.balancer_alpha);
      const Index first = shard_.first(comm_.rank()), last = shard_.first(comm_.rank() + 1);
      experts_.reserve(std::size_t(last - first));
      for (Index e = 0; e < config.n_experts; ++e) {
        if (e >= first && e < last) experts_.emplace_back(config.d_model, config.d_ffn, rng);
        else Expert(config.d_model, config.d_ffn, rng);  // the same draws, discarded
      }
      for (Index s = 0; s < config.n_shared; ++s) shared_.emplace_back(config.d_model, config.d_ffn, rng);
    });
  }
  ExpertParallelMoE(const MoEConfig& config, Communicator comm, Rng&& rng)
      : ExpertParallelMoE(config, std::move(comm), rng) {}
  ExpertParallelMoE(const MoEConfig& config, Communicator comm, std::uint64_t seed = 0)
      : ExpertParallelMoE(config, std::move(comm), Rng(seed)) {}

  const MoEConfig& config() const { return config_; }
  Index d_model() const { return config_.d_model; }
  const Communicator& comm() const { return comm_; }
  const ExpertShard& shard() const { return shard_; }
  /// Global id of this rank's first routed expert (experts()[j] is expert first_expert() + j).
  Index first_expert() const { return shard_.first(comm_.rank()); }
  void set_threads(int threads) { threads_ = threads; }
  /// Largest count of one MPI call in the exchanges (alltoallv.hpp); lower
  /// it to test or to bound staging memory. ValueError outside [1, 2³¹ − 1].
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
    const Index p = comm_.size(), smax = shard_.max_count(), d = d_model();
    Matrix<T> x_sorted, x_recv, y_recv, y;
    Vector<T> side_sorted, side_recv;
    std::vector<std::int64_t> send_counts(std::size_t(p * smax), 0), recv_counts;

    double t0 = MPI_Wtime();
    comm_.step(where, [&] {  // 1. route → plan → gather
      apex::detail::check_shape(where, "x", x, apex::detail::kAny, d);
      apex::detail::serial([&] { router_->route(x, balancer_->bias(), config_.weights_from_unbiased, c.routing); });
      c.plan.build(c.routing.experts, config_.n_experts);
      dispatch::gather_rows(c.plan, x, x_sorted, threads);
      dispatch::gather_side_input(Side{}, c.plan, c.routing, side_sorted);
      for (Index r = 0; r < p; ++r)
        for (Index j = 0; j < shard_.count(r); ++j) send_counts[std::size_t(r * smax + j)] = c.plan.count(shard_.first(r) + j);
    });
    double t1 = MPI_Wtime();
    times_.route += t1 - t0;
    alltoall_counts(comm_, send_counts, smax, recv_counts);  // 2. counts
    comm_.step(where, [&] {
      size_exchange(c, send_counts, recv_counts);
      x_recv.resize(total(c.recv_rows), d);
      side_recv.resize(total(c.recv_rows) * expert_side_cols<Expert>);
    });
    exchange(x_sorted.data(), c.send_rows, x_recv.data(), c.recv_rows, d);  // 3. rows out
    if constexpr (expert_side_cols<Expert> == 1) exchange(side_sorted.data(), c.send_rows, side_recv.data(), c.recv_rows, 1);
    double t2 = MPI_Wtime();
    times_.exchange += t2 - t1;
    comm_.step(where, [&] { compute(x, x_recv, side_recv, c, y_recv, threads); });  // 4. experts
    double t3 = MPI_Wtime();
    times_.experts += t3 - t2;
    comm_.step(where, [&] { c.y_sorted.resize(c.plan.rows(), d); });
    exchange(y_recv.data(), c.recv_rows, c.y_sorted.data(), c.send_rows, d);  // 5. rows back
    double t4 = MPI_Wtime();
    times_.exchange += t4 - t3;
    comm_.step(where, [&] {  // 6. combine
      y.resize(x.rows(), d);
      dispatch::combine(c.plan, c.routing.weights, c.y_sorted, c.shared_y, y, threads);
      if (cache) c.x = x;
    });
    times_.combine += MPI_Wtime() - t4;
    return y;
  }

  /// dy: N × d → dx: N × d; adds into this rank's expert gradients and, summed
  /// over ranks in rank order, into the router's and shared experts'.
  Matrix<T> backward(const ConstMatrixRef<T>& dy, const Cache& c) {
    constexpr const char* where = "ExpertParallelMoE::backward";
    const int threads = resolve_threads(threads_);
    const Index p = comm_.size(), d = d_model();
    Matrix<T> d_weights, dy_sorted, dy_recv, dx;
    std::vector<T> stash;
    ParamList<T> replicated = replicated_params();
    std::vector<std::int64_t> rows(c.send_rows.begin(), c.send_rows.end()), peer_rows;

    double t0 = MPI_Wtime();
    comm_.step(where, [&] {
      check_cache(where, c);
      apex::detail::check_shape(where, "dy", dy, c.x.rows(), d);
      dy_sorted.resize(c.plan.rows(), d);
      dispatch::combine_backward(c.plan, c.routing.weights, dy, c.y_sorted, d_weights, dy_sorted, threads);
      dy_recv.resize(Index(c.perm.size()), d);
    });
    // The caches of one forward on all ranks agree on who sends what; a cache
    // from another step would not (and the exchange would fail or block).
    alltoall_counts(comm_, rows, 1, peer_rows);
    comm_.step(where, [&] {
      for (Index r = 0; r < p; ++r)
        if (peer_rows[std::size_t(r)] != c.recv_rows[std::size_t(r)])
          throw ValueError(std::string(where) + ": argument 'cache' does not come from the same forward on every rank");
    });
    double t1 = MPI_Wtime();
    times_.combine += t1 - t0;
    exchange(dy_sorted.data(), c.send_rows, dy_recv.data(), c.recv_rows, d);
    double t2 = MPI_Wtime();
    times_.exchange += t2 - t1;
    // One rank: the gradients are already the whole sum, add them directly.
    if (p > 1) stash_and_zero(replicated, stash);
    try {
      backward_rest(c, dy, d_weights, dy_recv, dx, stash, replicated, threads, t2);
    } catch (...) {  // every rank gets here at the same step: put the replicated gradients back
      if (p == 1) throw;  // nothing stashed (as MoEFFN: every check precedes the first gradient)
      std::size_t at = 0;
      for (const auto& prm : replicated)
        for (Index i = 0; i < prm.size(); ++i) prm.grad_data[i] = stash[at++];
      throw;
    }
    return dx;
  }

 private:
  /// backward from the experts on (steps 4–1 of forward, mirrored); the
  /// replicated gradients hold this step's partial only until the final sum.
  void backward_rest(const Cache& c, const ConstMatrixRef<T>& dy, const Matrix<T>& d_weights, const Matrix<T>& dy_recv,
                     Matrix<T>& dx, const std::vector<T>& stash, const ParamList<T>& replicated, int threads,
                     double t2) {
    constexpr const char* where = "ExpertParallelMoE::backward";
    const Index d = d_model(), n_shared = Index(shared_.size());
    Matrix<T> dx_recv, dx_sorted, d_pair;
    Vector<T> dside_recv, dside_sorted;
    comm_.step(where, [&] {
      backward_experts(c, dy, dy_recv, dx_recv, dside_recv, threads);
      dx_sorted.resize(c.plan.rows(), d);
      dside_sorted.resize(c.plan.rows() * expert_side_cols<Expert>);
    });
    double t3 = MPI_Wtime();
    times_.experts += t3 - t2;
    exchange(dx_recv.data(), c.recv_rows, dx_sorted.data(), c.send_rows, d);
    if constexpr (expert_side_cols<Expert> == 1) exchange(dside_recv.data(), c.recv_rows, dside_sorted.data(), c.send_rows, 1);
    double t4 = MPI_Wtime();
    times_.exchange += t4 - t3;
    comm_.step(where, [&] {
      dispatch::scatter_side_grad(Side{}, c.plan, dside_sorted, d_pair);
      apex::detail::serial([&] { dx = router_->backward(c.x, c.routing, d_weights, d_pair); });
      auto shared_dx = apex::detail::thread_workspace<T, SharedDxTag>(n_shared * c.x.rows(), d);
      dispatch::gather_backward(c.plan, dx_sorted, shared_dx, n_shared, dx, threads);
    });
    double t5 = MPI_Wtime();
    times_.route += t5 - t4;
    if (comm_.size() > 1) sum_replicated(replicated, stash);
    times_.reduce += MPI_Wtime() - t5;
  }

 public:

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
  /// `shared_experts.{s}.…`: MoEFFN's names, this rank's subset.
  ParamList<T> params() {
    ParamList<T> out;
    apex::detail::append_prefixed(out, "router.", router_->params());
    for (std::size_t j = 0; j < experts_.size(); ++j)
      apex::detail::append_prefixed(out, "experts." + std::to_string(first_expert() + Index(j)) + ".", experts_[j].params());
    for (std::size_t s = 0; s < shared_.size(); ++s)
      apex::detail::append_prefixed(out, "shared_experts." + std::to_string(s) + ".", shared_[s].params());
    return out;
  }
  /// The parameters every rank holds a replica of (router, shared experts).
  ParamList<T> replicated_params() {
    ParamList<T> out;
    apex::detail::append_prefixed(out, "router.", router_->params());
    for (std::size_t s = 0; s < shared_.size(); ++s)
      apex::detail::append_prefixed(out, "shared_experts." + std::to_string(s) + ".", shared_[s].params());
    return out;
  }
  void zero_grad() {
    router_->zero_grad();
    for (auto& e : experts_) e.zero_grad();
    for (auto& s : shared_) s.zero_grad();
  }

 private:
  using Side = expert_side_input_t<Expert>;
  struct DyTag;
  struct DxTag;
  struct SharedDxTag;
  struct Task {
    bool shared;
    Index id, begin, rows;
  };

  static Index total(const std::vector<Index>& v) {
    Index s = 0;
    for (Index x : v) s += x;
    return s;
  }

  /// Rows to and from every rank, the expert-major blocks and the permutation.
  void size_exchange(Cache& c, const std::vector<std::int64_t>& send, const std::vector<std::int64_t>& recv) const {
    const Index p = comm_.size(), smax = shard_.max_count(), s_count = Index(experts_.size());
    c.send_rows.assign(std::size_t(p), 0);
    c.recv_rows.assign(std::size_t(p), 0);
    c.local_offset.assign(std::size_t(s_count) + 1, 0);
    for (Index r = 0; r < p; ++r)
      for (Index j = 0; j < smax; ++j) {
        c.send_rows[std::size_t(r)] += send[std::size_t(r * smax + j)];
        c.recv_rows[std::size_t(r)] += recv[std::size_t(r * smax + j)];
        if (j < s_count) c.local_offset[std::size_t(j) + 1] += recv[std::size_t(r * smax + j)];
      }
    for (Index j = 0; j < s_count; ++j) c.local_offset[std::size_t(j) + 1] += c.local_offset[std::size_t(j)];
    // Received: rank-major, then local expert. Expert-major row → received row.
    std::vector<Index> rank_begin(std::size_t(p) + 1, 0);
    for (Index r = 0; r < p; ++r) rank_begin[std::size_t(r) + 1] = rank_begin[std::size_t(r)] + c.recv_rows[std::size_t(r)];
    c.perm.resize(std::size_t(rank_begin[std::size_t(p)]));
    std::size_t at = 0;
    for (Index j = 0; j < s_count; ++j)
      for (Index r = 0; r < p; ++r) {
        Index begin = rank_begin[std::size_t(r)];
        for (Index i = 0; i < j; ++i) begin += recv[std::size_t(r * smax + i)];
        for (Index i = 0; i < recv[std::size_t(r * smax + j)]; ++i) c.perm[at++] = begin + i;
      }
  }

  /// alltoallv of `width`-scalar rows (counts in rows).
  void exchange(const T* send, const std::vector<Index>& send_rows, T* recv, const std::vector<Index>& recv_rows,
                Index width) const {
    std::vector<Index> sc(send_rows.size()), rc(recv_rows.size());
    for (std::size_t r = 0; r < sc.size(); ++r) {
      sc[r] = send_rows[r] * width;
      rc[r] = recv_rows[r] * width;
      if (Index(r) != comm_.rank()) times_.bytes_sent += double(sc[r]) * sizeof(T);
    }
    alltoallv(comm_, send, sc, recv, rc, limit_);
  }

  /// Step 4: experts on the expert-major rows, shared experts on x; y_recv
  /// (received order) gets the routed outputs.
  void compute(const ConstMatrixRef<T>& x, const Matrix<T>& x_recv, const Vector<T>& side_recv, Cache& c,
               Matrix<T>& y_recv, int threads) const {
    const Index rows = Index(c.perm.size()), n = x.rows(), d = d_model();
    c.x_local.resize(rows, d);
    c.side_local.resize(rows * expert_side_cols<Expert>);
    for (Index i = 0; i < rows; ++i) {
      c.x_local.row(i) = x_recv.row(c.perm[std::size_t(i)]);
      if constexpr (expert_side_cols<Expert> == 1) c.side_local(i) = side_recv(c.perm[std::size_t(i)]);
    }
    const Index work_cols = experts_.front().work_cols();
    c.work.resize(rows, work_cols);
    Matrix<T> y_local(rows, d);
    c.shared_work.resize(shared_.size());
    c.shared_y.resize(shared_.size());
    for (auto& w : c.shared_work) w.resize(n, shared_.empty() ? 0 : shared_.front().work_cols());
    for (auto& ys : c.shared_y) ys.resize(n, d);
    std::vector<Task> tasks;  // as MoEFFN::forward_tasks: tiles of ≤ kMaxTileRows, largest first
    auto tile = [&](bool shared, Index id, Index begin, Index count) {
      const Index tiles = (count + kMaxTileRows - 1) / kMaxTileRows;
      for (Index i = 0; i < tiles; ++i) tasks.push_back({shared, id, begin + count * i / tiles, count * (i + 1) / tiles - count * i / tiles});
    };
    for (Index j = 0; j < Index(experts_.size()); ++j)
      tile(false, j, c.local_offset[std::size_t(j)], c.local_offset[std::size_t(j) + 1] - c.local_offset[std::size_t(j)]);
    for (Index s = 0; s < Index(shared_.size()); ++s) tile(true, s, 0, n);
    std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.rows > b.rows; });
    apex::detail::parallel_for(Index(tasks.size()), threads, [&](Index i) {
      const Index id = tasks[std::size_t(i)].id, b = tasks[std::size_t(i)].begin, m = tasks[std::size_t(i)].rows;
      if (tasks[std::size_t(i)].shared)
        shared_[std::size_t(id)].forward_block(x.middleRows(b, m), c.shared_work[std::size_t(id)].middleRows(b, m),
                                               c.shared_y[std::size_t(id)].middleRows(b, m));
      else
        apex::detail::expert_forward(experts_[std::size_t(id)], c.x_local.middleRows(b, m), c.side_local, b, m,
                                     c.work.middleRows(b, m), y_local.middleRows(b, m));
    });
    y_recv.resize(rows, d);
    for (Index i = 0; i < rows; ++i) y_recv.row(c.perm[std::size_t(i)]) = y_local.row(i);
  }

  /// Backward of step 4: dy_recv (received order) → dx_recv, dside_recv;
  /// adds the expert and (partial) shared gradients.
  void backward_experts(const Cache& c, const ConstMatrixRef<T>& dy, const Matrix<T>& dy_recv, Matrix<T>& dx_recv,
                        Vector<T>& dside_recv, int threads) {
    const Index rows = Index(c.perm.size()), n = c.x.rows(), d = d_model(), n_shared = Index(shared_.size());
    auto dy_local = apex::detail::thread_workspace<T, DyTag>(rows, d);
    auto dx_local = apex::detail::thread_workspace<T, DxTag>(rows, d);
    Vector<T> dside_local = Vector<T>::Zero(rows * expert_side_cols<Expert>);
    for (Index i = 0; i < rows; ++i) dy_local.row(i) = dy_recv.row(c.perm[std::size_t(i)]);
    auto shared_dx = apex::detail::thread_workspace<T, SharedDxTag>(n_shared * n, d);
    std::vector<Task> tasks;
    for (Index j = 0; j < Index(experts_.size()); ++j) {
      const Index b = c.local_offset[std::size_t(j)], m = c.local_offset[std::size_t(j) + 1] - b;
      if (m > 0) tasks.push_back({false, j, b, m});
    }
    for (Index s = 0; s < n_shared; ++s)
      if (n > 0) tasks.push_back({true, s, 0, n});
    std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.rows > b.rows; });
    apex::detail::parallel_for(Index(tasks.size()), threads, [&](Index i) {
      const Index id = tasks[std::size_t(i)].id, b = tasks[std::size_t(i)].begin, m = tasks[std::size_t(i)].rows;
      if (tasks[std::size_t(i)].shared)
        shared_[std::size_t(id)].backward_block(c.x, c.shared_work[std::size_t(id)], dy, shared_dx.middleRows(id * n, n));
      else
        apex::detail::expert_backward(experts_[std::size_t(id)], c.x_local.middleRows(b, m), c.side_local, b, m,
                                      c.work.middleRows(b, m), dy_local.middleRows(b, m), dx_local.middleRows(b, m),
                                      dside_local);
    });
    dx_recv.resize(rows, d);
    dside_recv.resize(rows * expert_side_cols<Expert>);
    for (Index i = 0; i < rows; ++i) {
      dx_recv.row(c.perm[std::size_t(i)]) = dx_local.row(i);
      if constexpr (expert_side_cols<Expert> == 1) dside_recv(c.perm[std::size_t(i)]) = dside_local(i);
    }
  }

  /// Saves the replicated gradients into `stash` and zeroes them, so the
  /// backward leaves this rank's partial of this step alone in them.
  static void stash_and_zero(const ParamList<T>& params, std::vector<T>& stash) {
    stash.clear();
    for (const auto& p : params) {
      stash.insert(stash.end(), p.grad_data, p.grad_data + p.size());
      p.grad().setZero();
    }
  }

  /// grad = stash + Σ_ranks partial, the sum in rank order.
  void sum_replicated(const ParamList<T>& params, const std::vector<T>& stash) {
    sum_gradients(comm_, params);
    std::size_t at = 0;
    for (const auto& p : params)
      for (Index i = 0; i < p.size(); ++i) p.grad_data[i] += stash[at++];
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
      for (Index e = 0; e < e_count; ++e) local[std::size_t(e)] = counts[std::size_t(e)];
      local[std::size_t(e_count)] = counted ? std::count(counted->begin(), counted->end(), true) : c.plan.n_tokens;
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
    const Index n = c.x.rows(), rows = Index(c.perm.size()), p = comm_.size();
    apex::detail::check_shape(where, "cache.x", c.x, apex::detail::kAny, d_model());
    dispatch::check_plan(where, "cache", c.plan, n, config_.n_active, config_.n_experts);
    apex::detail::check_shape(where, "cache.routing.weights", c.routing.weights, n, config_.n_active);
    apex::detail::check_shape(where, "cache.routing.logits", c.routing.logits, n, config_.n_experts);
    apex::detail::check_shape(where, "cache.y_sorted", c.y_sorted, c.plan.rows(), d_model());
    apex::detail::check_shape(where, "cache.x_local", c.x_local, rows, d_model());
    apex::detail::check_shape(where, "cache.work", c.work, rows, experts_.front().work_cols());
    apex::detail::check_shape(where, "cache.side_local", c.side_local, rows * expert_side_cols<Expert>, 1);
    if (Index(c.send_rows.size()) != p || Index(c.recv_rows.size()) != p || total(c.send_rows) != c.plan.rows() ||
        total(c.recv_rows) != rows || Index(c.local_offset.size()) != Index(experts_.size()) + 1 ||
        c.shared_work.size() != shared_.size() || c.shared_y.size() != shared_.size())
      throw ShapeError(std::string(where) + ": argument 'cache' was not filled by a forward of this layer");
    for (const auto& w : c.shared_work) apex::detail::check_shape(where, "cache.shared_work", w, n, apex::detail::kAny);
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
  int threads_ = 0;
  Index limit_ = kMaxIntCount;
  mutable PhaseTimes times_;
};

}  // namespace apex::mpi
