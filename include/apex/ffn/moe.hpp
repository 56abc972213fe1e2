#pragma once
/// \file moe.hpp
/// Mixture-of-Experts FFN (reference §13, tutorial "MoEFFN", SPEC):
///
///     MoE(X) = Σ_s Shared_s(X) + Σ_k g_k · Expert_{e_k}(X)
///
/// with a top-K Router, the bias LoadBalancer, and grouped dispatch:
///  1. route, then counting-sort the N·K (token, slot) pairs by expert
///     (DispatchPlan) and gather X into that order;
///  2. every expert processes its contiguous block of rows with whole-block
///     matrix products (fused gate+up, then down), tiled into tasks that
///     threads share; experts no token chose cost nothing;
///  3. combine per token in fixed slot order — no atomics, bitwise identical
///     for any thread count.
/// Backward replays the same plan; each expert task writes only its own
/// weight gradients and its own sorted rows, so nothing is reduced across
/// threads.

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "dispatch.hpp"
#include "errors.hpp"
#include "init.hpp"
#include "load_balancer.hpp"
#include "moe_config.hpp"
#include "parallel.hpp"
#include "param.hpp"
#include "router.hpp"
#include "swiglu.hpp"
#include "types.hpp"
#include "workspace.hpp"

namespace apex {

namespace detail {
struct MoEDySortedTag;  ///< backward workspace: g·dy in sorted order
struct MoEDxSortedTag;  ///< backward workspace: the experts' ∂L/∂x in sorted order
struct MoESharedDxTag;  ///< backward workspace: the shared experts' ∂L/∂x
}  // namespace detail

/// MoE layer. `Expert` is the routed-expert type (SwiGLU by default,
/// KappaSwiGLU for confidence-adaptive gates); shared experts are SwiGLU.
template <class T, class Expert = SwiGLU<T>>
class MoEFFN {
 public:
  using Scalar = T;
  using ExpertType = Expert;
  using SharedType = SwiGLU<T>;

  /// Most rows of one forward task. A block of m rows is split into
  /// ⌈m / kMaxTileRows⌉ tiles of near-equal size, so threads can share one
  /// busy expert; the tiling depends on m only (never on the thread count),
  /// so results do not either. Large enough that a tile amortises packing
  /// the expert's weights (GEMM packs them on every call: 256-row tiles ran
  /// 5–8 % slower than one product here), small enough to balance two
  /// threads over the batch shapes of the benchmarks.
  static constexpr Index kMaxTileRows = 1024;

  /// Everything backward needs, owned by the caller.
  struct Cache {
    Matrix<T> x;                        ///< N × d: the input
    Routing<T> routing;                 ///< logits N × E, experts N × K, weights N × K
    DispatchPlan plan;                  ///< sorted order of the N·K pairs
    Matrix<T> x_sorted;                 ///< NK × d: x[token[r]]
    Vector<T> logit_sorted;             ///< NK: ℓ[token[r], expert of r] (experts that read it only)
    Matrix<T> work;                     ///< NK × expert.work_cols()
    Matrix<T> y_sorted;                 ///< NK × d: Expert_{e}(x) per sorted row, unweighted
    std::vector<Matrix<T>> shared_work; ///< per shared expert: N × work_cols()
    std::vector<Matrix<T>> shared_y;    ///< per shared expert: N × d, its output
  };

  MoEFFN(const MoEConfig& config, Rng& rng)
      : config_((config.validate("MoEFFN"), config)),
        router_(config.d_model, config.n_experts, config.n_active, rng),
        balancer_(config.n_experts, config.n_active, config.balancer_alpha) {
    experts_.reserve(config.n_experts);
    for (Index e = 0; e < config.n_experts; ++e) experts_.emplace_back(config.d_model, config.d_ffn, rng);
    shared_.reserve(config.n_shared);
    for (Index s = 0; s < config.n_shared; ++s) shared_.emplace_back(config.d_model, config.d_ffn, rng);
  }
  MoEFFN(const MoEConfig& config, Rng&& rng) : MoEFFN(config, rng) {}
  explicit MoEFFN(const MoEConfig& config, std::uint64_t seed = 0) : MoEFFN(config, Rng(seed)) {}

  const MoEConfig& config() const { return config_; }
  Index d_model() const { return config_.d_model; }

  /// Threads for dispatch (0 = OpenMP's default; ignored without OpenMP).
  void set_threads(int threads) { threads_ = threads; }
  int threads() const { return threads_; }

  /// Selects routing weights from ℓ (true) or from ℓ + b (false, the reference).
  void set_weights_from_unbiased(bool on) { config_.weights_from_unbiased = on; }

  /// x: N × d → N × d. Throws ShapeError on a wrong width and ValueError on
  /// non-finite router logits.
  Matrix<T> forward(const ConstMatrixRef<T>& x, Cache* cache = nullptr) const {
    detail::check_shape("MoEFFN::forward", "x", x, detail::kAny, d_model());
    Matrix<T> y(x.rows(), d_model());
    compute(x, y, cache);
    return y;
  }

  /// As forward, writing into the caller's y (N × d, overwritten): a serving
  /// loop that reuses y avoids allocating — and, for outputs of many MB,
  /// faulting in — a fresh output per call. Every read of x happens before
  /// the first write of y, so y may be x itself (an in-place update).
  void forward_into(const ConstMatrixRef<T>& x, MatrixRef<T> y, Cache* cache = nullptr) const {
    detail::check_shape("MoEFFN::forward_into", "x", x, detail::kAny, d_model());
    detail::check_shape("MoEFFN::forward_into", "y", y, x.rows(), d_model());
    compute(x, y, cache);
  }

  /// dy: N × d → dx: N × d; adds into the router's, every expert's and every
  /// shared expert's weight gradients. The balancing bias gets none.
  /// ShapeError if dy does not match the cache, or the cache was not filled
  /// by a forward of a layer of this configuration.
  Matrix<T> backward(const ConstMatrixRef<T>& dy, const Cache& c) {
    check_cache("MoEFFN::backward", c);
    detail::check_shape("MoEFFN::backward", "dy", dy, c.x.rows(), d_model());
    return backward_unchecked(dy, c);
  }

  /// Adds the routing in `cache` to the balancer's counts (call once per
  /// micro-batch in training; `balancer().update()` after the optimiser step).
  void observe(const Cache& cache) { balancer_.observe(cache.plan.counts(), cache.plan.n_tokens); }

  /// As observe(cache), counting only tokens t with token_counted[t] (e.g.
  /// the tokens a skip gate kept).
  void observe(const Cache& cache, const std::vector<bool>& token_counted) {
    const Index n = cache.routing.experts.rows();
    if (Index(token_counted.size()) != n)
      throw ShapeError("MoEFFN::observe: argument 'token_counted' has length " +
                       std::to_string(token_counted.size()) + ", expected " + std::to_string(n));
    std::vector<Index> counts(config_.n_experts, 0);
    Index tokens = 0;
    for (Index t = 0; t < n; ++t) {
      if (!token_counted[t]) continue;
      ++tokens;
      for (Index k = 0; k < config_.n_active; ++k) ++counts[cache.routing.experts(t, k)];
    }
    balancer_.observe(counts, tokens);
  }

  Router<T>& router() { return router_; }
  const Router<T>& router() const { return router_; }
  LoadBalancer<T>& balancer() { return balancer_; }
  const LoadBalancer<T>& balancer() const { return balancer_; }
  std::vector<Expert>& experts() { return experts_; }
  const std::vector<Expert>& experts() const { return experts_; }
  std::vector<SharedType>& shared_experts() { return shared_; }
  const std::vector<SharedType>& shared_experts() const { return shared_; }

  /// `router.weight`, `experts.{e}.…`, `shared_experts.{s}.…` (state_dict order).
  ParamList<T> params() {
    ParamList<T> out;
    detail::append_prefixed(out, "router.", router_.params());
    for (std::size_t e = 0; e < experts_.size(); ++e)
      detail::append_prefixed(out, "experts." + std::to_string(e) + ".", experts_[e].params());
    for (std::size_t s = 0; s < shared_.size(); ++s)
      detail::append_prefixed(out, "shared_experts." + std::to_string(s) + ".", shared_[s].params());
    return out;
  }
  void zero_grad() {
    router_.zero_grad();
    for (auto& e : experts_) e.zero_grad();
    for (auto& s : shared_) s.zero_grad();
  }

 private:
  /// forward's body; x and y checked by the caller.
  void compute(const ConstMatrixRef<T>& x, MatrixRef<T> y, Cache* cache) const {
    // Without a cache the buffers still come from a Cache: one per thread,
    // reused across calls, so a forward does not map and fault in tens of MB
    // of fresh pages every time (glibc serves blocks > 32 MB with mmap).
    Cache& c = cache ? *cache : thread_scratch();
    const Index n = x.rows(), d = d_model(), k_count = config_.n_active;
    const int threads = resolve_threads(threads_);

    detail::serial([&] { router_.route(x, balancer_.bias(), config_.weights_from_unbiased, c.routing); });
    c.plan.build(c.routing.experts, config_.n_experts);
    const DispatchPlan& plan = c.plan;
    const Index rows = plan.rows();

    gather(x, c, threads);
    c.work.resize(rows, work_cols());
    c.y_sorted.resize(rows, d);

    // Tasks: (expert, tile) for routed experts, then (shared expert, tile).
    const std::vector<Task> tasks = forward_tasks(plan, n);
    c.shared_work.resize(shared_.size());
    c.shared_y.resize(shared_.size());
    for (auto& w : c.shared_work) w.resize(n, shared_work_cols());
    for (auto& ys : c.shared_y) ys.resize(n, d);
    auto& shared_y = c.shared_y;
    detail::parallel_for(Index(tasks.size()), threads, [&](Index i) {
      const Task& task = tasks[i];
      const Index b = task.begin, m = task.rows;
      if (task.shared) {
        shared_[task.id].forward_block(x.middleRows(b, m), no_logit(m), c.shared_work[task.id].middleRows(b, m),
                                       shared_y[task.id].middleRows(b, m));
      } else {
        experts_[task.id].forward_block(c.x_sorted.middleRows(b, m), logit_block(c, b, m),
                                        c.work.middleRows(b, m), c.y_sorted.middleRows(b, m));
      }
    });

    if (cache) c.x = x;  // the last read of x: y may alias it
    // Combine per token in fixed order: shared experts, then slots 0..K−1
    // (the first term assigns, so y is written once per term, never cleared).
    detail::parallel_for(token_blocks(n), threads, [&](Index blk) {
      const Index t0 = blk * kTokenBlock, t1 = std::min(n, t0 + kTokenBlock);
      for (Index t = t0; t < t1; ++t) {
        auto yt = y.row(t);
        Index k = 0;
        if (shared_y.empty()) {
          yt = c.routing.weights(t, 0) * c.y_sorted.row(plan.row_of[t * k_count]);
          k = 1;
        } else {
          yt = shared_y.front().row(t);
          for (std::size_t s = 1; s < shared_y.size(); ++s) yt += shared_y[s].row(t);
        }
        for (; k < k_count; ++k) yt += c.routing.weights(t, k) * c.y_sorted.row(plan.row_of[t * k_count + k]);
      }
    });
  }

  /// ShapeError naming the cache unless it holds a forward of a layer of
  /// this configuration (a default-constructed cache holds none).
  void check_cache(const char* where, const Cache& c) const {
    const Index n = c.x.rows(), rows = c.plan.rows(), e_count = config_.n_experts;
    detail::check_shape(where, "cache.x", c.x, detail::kAny, d_model());
    if (c.plan.n_tokens != n || c.plan.n_active != config_.n_active || c.plan.n_experts != e_count ||
        Index(c.plan.offset.size()) != e_count + 1 || Index(c.plan.row_of.size()) != rows ||
        Index(c.plan.token.size()) != rows || Index(c.plan.slot.size()) != rows)
      throw ShapeError(std::string(where) + ": argument 'cache' holds a dispatch plan for " +
                       std::to_string(c.plan.n_tokens) + " tokens, K = " + std::to_string(c.plan.n_active) +
                       ", E = " + std::to_string(c.plan.n_experts) + ", expected " + std::to_string(n) +
                       " tokens, K = " + std::to_string(config_.n_active) + ", E = " + std::to_string(e_count));
    detail::check_shape(where, "cache.routing.weights", c.routing.weights, n, config_.n_active);
    detail::check_shape(where, "cache.routing.experts", c.routing.experts, n, config_.n_active);
    detail::check_shape(where, "cache.routing.logits", c.routing.logits, n, e_count);
    detail::check_shape(where, "cache.x_sorted", c.x_sorted, rows, d_model());
    detail::check_shape(where, "cache.work", c.work, rows, work_cols());
    detail::check_shape(where, "cache.y_sorted", c.y_sorted, rows, d_model());
    if constexpr (Expert::uses_router_logit) detail::check_shape(where, "cache.logit_sorted", c.logit_sorted, rows, 1);
    if (c.shared_work.size() != shared_.size() || c.shared_y.size() != shared_.size())
      throw ShapeError(std::string(where) + ": argument 'cache' holds " + std::to_string(c.shared_work.size()) +
                       " shared-expert workspaces, expected " + std::to_string(shared_.size()));
    for (const auto& w : c.shared_work) detail::check_shape(where, "cache.shared_work", w, n, shared_work_cols());
  }

  /// backward's body; dy and the cache checked by the caller.
  Matrix<T> backward_unchecked(const ConstMatrixRef<T>& dy, const Cache& c) {
    const Index n = dy.rows(), d = d_model(), k_count = config_.n_active;
    const DispatchPlan& plan = c.plan;
    const Index rows = plan.rows();
    const int threads = resolve_threads(threads_);

    // ∂L/∂g_{t,k} = dy_t · Expert_{e_k}(x_t);   ∂L/∂y_sorted[r] = g_{t,k} · dy_t
    // The large scratch is per-thread workspace, reused across steps (workspace.hpp).
    Matrix<T> d_weights(n, k_count);                                                    // N × K
    auto dy_sorted = detail::thread_workspace<T, detail::MoEDySortedTag>(rows, d);  // NK × d
    detail::parallel_for(token_blocks(n), threads, [&](Index blk) {
      const Index t0 = blk * kTokenBlock, t1 = std::min(n, t0 + kTokenBlock);
      for (Index t = t0; t < t1; ++t)
        for (Index k = 0; k < k_count; ++k) {
          const Index r = plan.row_of[t * k_count + k];
          d_weights(t, k) = dy.row(t).dot(c.y_sorted.row(r));
          dy_sorted.row(r) = c.routing.weights(t, k) * dy.row(t);
        }
    });

    // Expert backward, one task per non-empty expert (its gradients are its
    // own), shared experts as further tasks.
    auto dx_sorted = detail::thread_workspace<T, detail::MoEDxSortedTag>(rows, d);  // NK × d
    Vector<T> dlogit_sorted = Vector<T>::Zero(Expert::uses_router_logit ? rows : 0);  // NK
    // S·N × d: shared expert s writes rows [s·N, (s+1)·N)
    auto shared_dx = detail::thread_workspace<T, detail::MoESharedDxTag>(Index(shared_.size()) * n, d);
    std::vector<Task> tasks;  // largest first, as in forward_tasks
    for (Index e = 0; e < config_.n_experts; ++e)
      if (plan.count(e) > 0) tasks.push_back({false, e, plan.offset[e], plan.count(e)});
    for (Index s = 0; s < Index(shared_.size()); ++s)
      if (n > 0) tasks.push_back({true, s, 0, n});
    largest_first(tasks);
    detail::parallel_for(Index(tasks.size()), threads, [&](Index i) {
      const Task& task = tasks[i];
      const Index b = task.begin, m = task.rows;
      if (task.shared) {
        Vector<T> unused;
        shared_[task.id].backward_block(c.x, no_logit(m), c.shared_work[task.id], dy,
                                        shared_dx.middleRows(task.id * n, n), unused);
      } else {
        auto dl = Expert::uses_router_logit ? dlogit_sorted.segment(b, m) : dlogit_sorted.segment(0, 0);
        experts_[task.id].backward_block(c.x_sorted.middleRows(b, m), logit_block(c, b, m),
                                         c.work.middleRows(b, m), dy_sorted.middleRows(b, m),
                                         dx_sorted.middleRows(b, m), dl);
      }
    });

    // ∂L/∂ℓ: the routing softmax, plus what experts that read ℓ send back.
    Matrix<T> d_logits = Matrix<T>::Zero(n, config_.n_experts);  // N × E
    router_.softmax_backward(c.routing, d_weights, d_logits);
    if constexpr (Expert::uses_router_logit) {
      for (Index t = 0; t < n; ++t)
        for (Index k = 0; k < k_count; ++k)
          d_logits(t, c.routing.experts(t, k)) += dlogit_sorted(plan.row_of[t * k_count + k]);
    }
    Matrix<T> dx;
    detail::serial([&] { dx = router_.backward(c.x, d_logits); });

    // Combine ∂L/∂x per token in fixed order: router, shared, slots 0..K−1.
    detail::parallel_for(token_blocks(n), threads, [&](Index blk) {
      const Index t0 = blk * kTokenBlock, t1 = std::min(n, t0 + kTokenBlock);
      for (Index t = t0; t < t1; ++t) {
        auto dxt = dx.row(t);
        for (Index s = 0; s < Index(shared_.size()); ++s) dxt += shared_dx.row(s * n + t);
        for (Index k = 0; k < k_count; ++k) dxt += dx_sorted.row(plan.row_of[t * k_count + k]);
      }
    });
    return dx;
  }

  struct Task {
    bool shared;
    Index id, begin, rows;
  };
  static constexpr Index kTokenBlock = 64;  ///< tokens per combine task

  static Index token_blocks(Index n) { return (n + kTokenBlock - 1) / kTokenBlock; }
  Index work_cols() const { return experts_.empty() ? 0 : experts_.front().work_cols(); }
  Index shared_work_cols() const { return shared_.empty() ? 0 : shared_.front().work_cols(); }

  /// Orders tasks by rows, largest first, ties in creation order.
  static void largest_first(std::vector<Task>& tasks) {
    std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.rows > b.rows; });
  }

  /// Forward tasks, largest first: with a dynamic schedule the big tiles
  /// start early and the small ones fill the gaps at the end (longest
  /// processing time first). Order never affects results: tasks write
  /// disjoint rows.
  std::vector<Task> forward_tasks(const DispatchPlan& plan, Index n) const {
    std::vector<Task> tasks;
    auto tile = [&](bool shared, Index id, Index begin, Index count) {
      const Index tiles = (count + kMaxTileRows - 1) / kMaxTileRows;
      for (Index i = 0; i < tiles; ++i) {
        const Index b = count * i / tiles, e = count * (i + 1) / tiles;
        tasks.push_back({shared, id, begin + b, e - b});
      }
    };
    for (Index e = 0; e < config_.n_experts; ++e) tile(false, e, plan.offset[e], plan.count(e));
    for (Index s = 0; s < Index(shared_.size()); ++s) tile(true, s, 0, n);
    largest_first(tasks);
    return tasks;
  }

  /// x_sorted[r] = x[token[r]]; for experts that read it, ℓ of the row's expert.
  void gather(const ConstMatrixRef<T>& x, Cache& c, int threads) const {
    const DispatchPlan& plan = c.plan;
    c.x_sorted.resize(plan.rows(), d_model());
    detail::parallel_for(token_blocks(plan.rows()), threads, [&](Index blk) {
      const Index r0 = blk * kTokenBlock, r1 = std::min(plan.rows(), r0 + kTokenBlock);
      for (Index r = r0; r < r1; ++r) c.x_sorted.row(r) = x.row(plan.token[r]);
    });
    if constexpr (Expert::uses_router_logit) {
      c.logit_sorted.resize(plan.rows());
      for (Index r = 0; r < plan.rows(); ++r)
        c.logit_sorted(r) = c.routing.logits(plan.token[r], c.routing.experts(plan.token[r], plan.slot[r]));
    } else {
      c.logit_sorted.resize(0);
    }
  }

  static Cache& thread_scratch() {
    thread_local Cache scratch;
    return scratch;
  }

  static ConstVectorRef<T> no_logit(Index) {
    static const Vector<T> empty;
    return empty;
  }
  static ConstVectorRef<T> logit_block(const Cache& c, Index begin, Index rows) {
    if constexpr (Expert::uses_router_logit) return c.logit_sorted.segment(begin, rows);
    else return no_logit(rows);
  }

  MoEConfig config_;
  Router<T> router_;
  LoadBalancer<T> balancer_;
  std::vector<Expert> experts_;
  std::vector<SharedType> shared_;
  int threads_ = 0;
};

}  // namespace apex
