#pragma once
/// \file moe/moe_ffn.hpp
/// Mixture-of-Experts FFN (docs/math.md#mixture-of-experts):
///
///     MoE(X) = Σ_s Shared_s(X) + Σ_k g_k · Expert_{e_k}(X)
///
/// with a top-K Router, the bias LoadBalancer, and grouped dispatch
/// (moe/dispatch.hpp moves every row; this file only orchestrates):
///  1. route, then counting-sort the N·K (token, slot) pairs by expert
///     (DispatchPlan) and gather X — and the experts' side input, if their
///     type declares one (moe/expert_contract.hpp) — into that order;
///  2. every expert processes its contiguous block of rows with whole-block
///     matrix products (fused gate+up, then down), tiled into tasks that
///     threads share; experts no token chose cost nothing;
///  3. combine per token in fixed slot order — no atomics, bitwise identical
///     for any thread count.
/// Backward replays the same plan; each expert task writes only its own
/// weight gradients and its own sorted rows, so nothing is reduced across
/// threads. Any type meeting the expert contract (moe/expert_contract.hpp) can be
/// the routed expert.
///
/// Memory: the constructor checks the layer's weight bytes against physical
/// memory before allocating anything (core/memory_budget.hpp), so a layer the
/// machine cannot hold (the `large` preset's, ≈ 412 GB in float) is a
/// ConfigError in milliseconds. Gradients are allocated lazily (core/param.hpp),
/// all of the layer's at once — on the first backward, zero_grad() or
/// params() — after checking weights plus gradients against physical memory:
/// a layer used for forward only holds its weights and nothing more.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "capacity.hpp"
#include "../core/checked_size.hpp"
#include "dispatch.hpp"
#include "../core/errors.hpp"
#include "expert_contract.hpp"
#include "expert_tasks.hpp"
#include "../core/init.hpp"
#include "load_balancer.hpp"
#include "moe_gradients.hpp"
#include "../core/memory_budget.hpp"
#include "config.hpp"
#include "../core/parallel.hpp"
#include "../core/param.hpp"
#include "../core/state_names.hpp"
#include "router.hpp"
#include "shared_expert_gate.hpp"
#include "../layers/swiglu.hpp"
#include "../core/types.hpp"
#include "../core/workspace.hpp"

namespace apex {

namespace detail {
struct MoEDySortedTag;  ///< backward workspace: g·dy in sorted order
struct MoEDxSortedTag;  ///< backward workspace: the experts' ∂L/∂x in sorted order
struct MoESharedDxTag;  ///< backward workspace: the shared experts' ∂L/∂x

/// Whether an expert type states its weight bytes before it is built
/// (`static std::uint64_t weight_bytes(const char* where, Index d_model, Index d_ffn)`).
template <class E, class = void>
struct has_static_weight_bytes : std::false_type {};
template <class E>
struct has_static_weight_bytes<E, std::void_t<decltype(E::weight_bytes("", Index(1), Index(1)))>>
    : std::true_type {};
}  // namespace detail

/// MoE layer. `Expert` is the routed-expert type (SwiGLU by default,
/// KappaSwiGLU for confidence-adaptive gates, or any type meeting the expert
/// contract); shared experts are SwiGLU.
template <class T, class Expert = SwiGLU<T>>
class MoEFFN {
  static_assert(check_expert_contract<Expert, T>());
  static_assert(std::is_same_v<typename Expert::Scalar, T>, "MoEFFN<T, Expert>: Expert::Scalar must be T");

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
    Vector<T> side_sorted;              ///< NK (or 0 without one): the experts' side input per sorted row
    Matrix<T> work;                     ///< NK × expert.work_cols()
    Matrix<T> y_sorted;                 ///< NK × d: Expert_{e}(x) per sorted row, unweighted
    std::vector<Matrix<T>> shared_work; ///< per shared expert: N × work_cols()
    std::vector<Matrix<T>> shared_y;    ///< per shared expert: N × d, its output (gated, with a shared gate)
    Vector<T> shared_gate;              ///< N: σ(x·w_gate) with shared_expert_gate, else empty
    Matrix<T> kept_weights;             ///< N × K: g with dropped assignments 0 (capacity on), else empty
    std::vector<Index> dropped;         ///< pairs t·K + k dropped by the capacity limit, ascending
  };

  /// ConfigError for an invalid config, or one whose weights exceed physical
  /// memory (weight_bytes; checked before anything is allocated).
  MoEFFN(const MoEConfig& config, Rng& rng)
      : config_((config.validate_for<T>("MoEFFN"), check_weights_fit(config), config)),
        router_(config.d_model, config.n_experts, config.n_active, rng),
        balancer_(config.n_experts, config.n_active, config.balancer_alpha) {
    router_.set_routing(config.routing);
    experts_.reserve(config.n_experts);
    for (Index e = 0; e < config.n_experts; ++e) experts_.emplace_back(config.d_model, config.d_ffn, rng);
    shared_.reserve(config.n_shared);
    for (Index s = 0; s < config.n_shared; ++s) shared_.emplace_back(config.d_model, config.shared_ffn(), rng);
    if (config.shared_expert_gate) {
      shared_gate_.resize(1, config.d_model);
      init_linear(shared_gate_, rng);
    }
    // No gradients yet: allocate_gradients().
  }
  MoEFFN(const MoEConfig& config, Rng&& rng) : MoEFFN(config, rng) {}
  explicit MoEFFN(const MoEConfig& config, std::uint64_t seed = 0) : MoEFFN(config, Rng(seed)) {}

  const MoEConfig& config() const { return config_; }
  Index d_model() const { return config_.d_model; }

  /// Threads for dispatch (0 = OpenMP's default; ignored without OpenMP).
  void set_threads(int threads) { threads_ = threads; }
  int threads() const { return threads_; }

  /// Selects routing weights from ℓ (true) or from ℓ + b (false, the default).
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
  /// ShapeError if the cache was not filled by a forward of a layer of this
  /// configuration (as backward).
  void observe(const Cache& cache) {
    check_cache("MoEFFN::observe", cache);
    balancer_.observe(cache.plan.counts(), cache.plan.n_tokens);
  }

  /// As observe(cache), counting only tokens t with token_counted[t] (e.g.
  /// the tokens a skip gate kept). ShapeError as observe(cache), or if
  /// token_counted does not have one entry per token of the cache.
  void observe(const Cache& cache, const std::vector<bool>& token_counted) {
    check_cache("MoEFFN::observe", cache);
    const Index n = cache.plan.n_tokens;
    if (Index(token_counted.size()) != n)
      throw ShapeError("MoEFFN::observe: argument 'token_counted' has length " +
                       std::to_string(token_counted.size()) + ", expected " + std::to_string(n));
    const Index tokens = Index(std::count(token_counted.begin(), token_counted.end(), true));
    balancer_.observe(cache.plan.counts(token_counted), tokens);
  }

  Router<T>& router() { return router_; }
  const Router<T>& router() const { return router_; }
  LoadBalancer<T>& balancer() { return balancer_; }
  const LoadBalancer<T>& balancer() const { return balancer_; }
  std::vector<Expert>& experts() { return experts_; }
  const std::vector<Expert>& experts() const { return experts_; }
  std::vector<SharedType>& shared_experts() { return shared_; }
  const std::vector<SharedType>& shared_experts() const { return shared_; }
  /// The shared-expert gate weight w_gate: 1 × d with shared_expert_gate, else 0 × 0.
  const Matrix<T>& shared_gate_weight() const { return shared_gate_; }

  /// `router.weight`, `experts.{e}.…`, `shared_experts.{s}.…`,
  /// `shared_expert_gate.weight` (state_dict order) with their gradients,
  /// which this allocates (zeroed, all of the layer's) if not yet: the views
  /// must stay valid for the layer's life (core/param.hpp).
  ParamList<T> params() {
    allocate_gradients();
    ParamList<T> out;
    detail::append_prefixed(out, state_names::kRouterPrefix, router_.params());
    for (std::size_t e = 0; e < experts_.size(); ++e)
      detail::append_prefixed(out, state_names::routed_expert(e), experts_[e].params());
    for (std::size_t s = 0; s < shared_.size(); ++s)
      detail::append_prefixed(out, state_names::shared_expert(s), shared_[s].params());
    if (config_.shared_expert_gate)
      out.push_back(detail::make_param<T>(state_names::kSharedGate, shared_gate_, shared_gate_grad_));
    return out;
  }
  /// The same tensors, values only: never allocates gradients (core/param.hpp),
  /// for checkpoints, packing and anything else that reads or writes values.
  ParamList<T> param_values() {
    ParamList<T> out;
    detail::append_prefixed(out, state_names::kRouterPrefix, router_.param_values());
    for (std::size_t e = 0; e < experts_.size(); ++e)
      detail::append_prefixed(out, state_names::routed_expert(e), detail::param_values_of(experts_[e]));
    for (std::size_t s = 0; s < shared_.size(); ++s)
      detail::append_prefixed(out, state_names::shared_expert(s), shared_[s].param_values());
    if (config_.shared_expert_gate)
      out.push_back(detail::make_value_param<T>(state_names::kSharedGate, shared_gate_));
    return out;
  }
  /// Zeroes every gradient (allocating them, zeroed, if not yet).
  void zero_grad() {
    if (!has_gradients()) return allocate_gradients();
    detail::zero_moe_gradients(gradient_parts());
  }
  /// Whether the layer's gradients exist (allocate_gradients ran).
  bool has_gradients() const { return has_grads_; }
  /// Allocates every gradient of the layer — router, experts, shared experts,
  /// shared gate — zeroed, unless done already; does nothing then. Called by
  /// backward before its parallel section, so expert tasks never allocate.
  /// ConfigError (core/memory_budget.hpp) naming the bytes if the weights plus
  /// all the gradients exceed physical memory; nothing is allocated then.
  void allocate_gradients() {
    if (has_grads_) return;
    constexpr const char* where = "MoEFFN::allocate_gradients";
    const std::uint64_t bytes = detail::scalar_bytes<T>(where, "gradient bytes", parameter_count(param_values()));
    detail::allocate_moe_gradients(where, description(config_), bytes, gradient_parts());
    has_grads_ = true;
  }

  /// Bytes of the weights (and balancing bias) of a layer of `config`, as
  /// the constructor checks them: the routed experts' from
  /// `Expert::weight_bytes` where the type states it, else estimated as a
  /// SwiGLU's (3·d_ffn·d_model scalars each). ConfigError naming the
  /// product (with `where`) beyond the index range; `config` must be valid.
  static std::uint64_t weight_bytes(const MoEConfig& config, const char* where = "MoEFFN::weight_bytes") {
    const Index d = config.d_model, f = config.d_ffn;
    Index expert = 0;
    if constexpr (detail::has_static_weight_bytes<Expert>::value) expert = Index(Expert::weight_bytes(where, d, f));
    else expert = Index(SwiGLU<T>::weight_bytes(where, d, f));
    const Index shared_one = Index(SwiGLU<T>::weight_bytes(where, d, config.shared_ffn()));
    const Index routed = detail::checked_product(where, "routed bytes n_experts*expert", {config.n_experts, expert});
    const Index shared = detail::checked_product(where, "shared bytes n_shared*expert", {config.n_shared, shared_one});
    // router E × d, shared gate d, balancing bias E
    const Index router = detail::checked_product(where, "router size (n_experts+1)*d_model", {config.n_experts + 1, d});
    const Index small = Index(detail::scalar_bytes<T>(where, "router bytes", router + config.n_experts));
    const Index experts = detail::checked_sum(where, "expert bytes", routed, shared);
    return std::uint64_t(detail::checked_sum(where, "layer bytes", experts, small));
  }

 private:
  using Side = expert_side_input_t<Expert>;

  /// forward's body; x and y checked by the caller.
  void compute(const ConstMatrixRef<T>& x, MatrixRef<T> y, Cache* cache) const {
    // Without a cache the buffers still come from a Cache: one per thread,
    // reused across calls, so a forward does not map and fault in tens of MB
    // of fresh pages every time (glibc serves blocks > 32 MB with mmap).
    Cache& c = cache ? *cache : thread_scratch();
    const Index n = x.rows(), d = d_model();
    const int threads = resolve_threads(threads_);

    // route → plan → gather
    detail::serial([&] { router_.route(x, balancer_.bias(), config_.weights_from_unbiased, c.routing); });
    c.plan.build(c.routing.experts, config_.n_experts);
    // capacity limit (moe/capacity.hpp): drops listed in c.dropped, their weights 0 in c.kept_weights
    const Matrix<T>& combine_weights = dispatch::apply_capacity(config_.routing.capacity_factor, config_.n_experts,
                                                                c.plan, c.routing.weights, c.dropped, c.kept_weights);
    dispatch::gather_rows(c.plan, x, c.x_sorted, threads);
    dispatch::gather_side_input(Side{}, c.plan, c.routing, c.side_sorted);

    // experts: tasks (expert, tile) for routed experts, then (shared expert, tile)
    c.work.resize(c.plan.rows(), work_cols());
    c.y_sorted.resize(c.plan.rows(), d);
    c.shared_work.resize(shared_.size());
    c.shared_y.resize(shared_.size());
    for (auto& w : c.shared_work) w.resize(n, shared_work_cols());
    for (auto& ys : c.shared_y) ys.resize(n, d);
    const auto tasks = detail::forward_tasks(c.plan.offset, Index(shared_.size()), n, kMaxTileRows);
    detail::parallel_for(Index(tasks.size()), threads, [&](Index i) {
      const Index id = tasks[i].id, b = tasks[i].begin, m = tasks[i].rows;
      if (tasks[i].shared)
        shared_[id].forward_block(x.middleRows(b, m), c.shared_work[id].middleRows(b, m),
                                  c.shared_y[id].middleRows(b, m));
      else
        detail::expert_forward(experts_[id], c.x_sorted.middleRows(b, m), c.side_sorted, b, m, c.work.middleRows(b, m),
                               c.y_sorted.middleRows(b, m));
    });

    // shared gate: D_s ← σ(x·w_gate) ⊙ D_s per token (Qwen2-MoE)
    if (config_.shared_expert_gate) {
      detail::shared_gate_forward<T>(x, shared_gate_, c.shared_gate, c.shared_y);
    } else {
      c.shared_gate.resize(0);
    }
    if (cache) c.x = x;  // the last read of x: y may alias it
    // combine: shared experts, then slots 0..K−1, per token in fixed order
    dispatch::combine(c.plan, combine_weights, c.y_sorted, c.shared_y, y, threads);
  }

  bool capacity_on() const { return config_.routing.capacity_factor > 0; }

  /// The constructor's memory-fit check (core/memory_budget.hpp).
  static void check_weights_fit(const MoEConfig& config) {
    check_memory_fit("MoEFFN", description(config), weight_bytes(config, "MoEFFN"));
  }
  /// "a float MoE layer (d_model 2048, d_ffn 5504, 64 + 2 experts)", for the memory-fit messages.
  static std::string description(const MoEConfig& config) {
    return std::string("a ") + (sizeof(T) == 4 ? "float" : sizeof(T) == 8 ? "double" : "") + " MoE layer (d_model " +
           std::to_string(config.d_model) + ", d_ffn " + std::to_string(config.d_ffn) + ", " +
           std::to_string(config.n_experts) + " + " + std::to_string(config.n_shared) + " experts)";
  }

  /// ShapeError naming the cache unless it holds a forward of a layer of
  /// this configuration (a default-constructed cache holds none).
  void check_cache(const char* where, const Cache& c) const {
    const Index n = c.x.rows(), rows = c.plan.rows(), e_count = config_.n_experts;
    detail::check_shape(where, "cache.x", c.x, detail::kAny, d_model());
    dispatch::check_plan(where, "cache", c.plan, n, config_.n_active, e_count);
    detail::check_shape(where, "cache.routing.weights", c.routing.weights, n, config_.n_active);
    detail::check_shape(where, "cache.routing.experts", c.routing.experts, n, config_.n_active);
    detail::check_shape(where, "cache.routing.logits", c.routing.logits, n, e_count);
    detail::check_shape(where, "cache.x_sorted", c.x_sorted, rows, d_model());
    detail::check_shape(where, "cache.work", c.work, rows, work_cols());
    detail::check_shape(where, "cache.y_sorted", c.y_sorted, rows, d_model());
    detail::check_shape(where, "cache.side_sorted", c.side_sorted, rows * expert_side_cols<Expert>, 1);
    if (c.shared_work.size() != shared_.size() || c.shared_y.size() != shared_.size())
      throw ShapeError(std::string(where) + ": argument 'cache' holds " + std::to_string(c.shared_work.size()) +
                       " shared-expert workspaces, expected " + std::to_string(shared_.size()));
    for (const auto& w : c.shared_work) detail::check_shape(where, "cache.shared_work", w, n, shared_work_cols());
    detail::check_shape(where, "cache.shared_gate", c.shared_gate, config_.shared_expert_gate ? n : 0, 1);
    if (capacity_on()) detail::check_shape(where, "cache.kept_weights", c.kept_weights, n, config_.n_active);
    for (Index p : c.dropped)
      if (p < 0 || p >= n * config_.n_active)
        throw ShapeError(std::string(where) + ": argument 'cache.dropped' holds pair " + std::to_string(p) +
                         ", expected a value in [0, " + std::to_string(n * config_.n_active) + ")");
  }

  /// backward's body; dy and the cache checked by the caller. The mirror of
  /// compute: combine → experts → gather → route.
  Matrix<T> backward_unchecked(const ConstMatrixRef<T>& dy, const Cache& c) {
    const Index n = dy.rows(), d = d_model(), rows = c.plan.rows(), n_shared = Index(shared_.size());
    const int threads = resolve_threads(threads_);
    // Every gradient exists before the expert tasks run: no task allocates.
    allocate_gradients();

    // combine: ∂L/∂g (N × K) and g·dy in sorted order. The large scratch is
    // per-thread workspace, reused across steps (core/workspace.hpp).
    Matrix<T> d_weights;                                                             // N × K
    auto dy_sorted = detail::thread_workspace<T, detail::MoEDySortedTag>(rows, d);  // NK × d
    dispatch::combine_backward(c.plan, capacity_on() ? c.kept_weights : c.routing.weights, dy, c.y_sorted, d_weights,
                               dy_sorted, threads);
    for (Index p : c.dropped) d_weights(p / config_.n_active, p % config_.n_active) = T(0);  // no effect, no gradient

    // experts: one task per non-empty expert (its gradients are its own),
    // shared experts as further tasks (moe/expert_tasks.hpp).
    auto dx_sorted = detail::thread_workspace<T, detail::MoEDxSortedTag>(rows, d);  // NK × d
    Vector<T> dside_sorted = Vector<T>::Zero(rows * expert_side_cols<Expert>);      // NK or 0
    // S·N × d: shared expert s writes rows [s·N, (s+1)·N)
    auto shared_dx = detail::thread_workspace<T, detail::MoESharedDxTag>(
        detail::checked_product("MoEFFN::backward", "shared gradient rows n_shared*N", {n_shared, n}), d);
    // shared gate: the shared experts see σ ⊙ dy; ∂L/∂z_t = (1 − σ_t) ⟨dy_t, Σ_s D_s[t]⟩
    // (D_s gated), z = x·w_gate: ∂L/∂w_gate += ∂zᵀ·X, ∂L/∂x += ∂z·w_gate.
    const bool gated = config_.shared_expert_gate && n_shared > 0;
    Matrix<T> dy_shared, dz;  // N × d, N × 1
    if (gated) detail::shared_gate_backward<T>(c.x, dy, c.shared_gate, c.shared_y, shared_gate_grad_, dy_shared, dz);
    const ConstMatrixRef<T> dy_for_shared = gated ? ConstMatrixRef<T>(dy_shared) : dy;
    const auto tasks = detail::backward_tasks(c.plan.offset, n_shared, n);
    detail::parallel_for(Index(tasks.size()), threads, [&](Index i) {
      const Index id = tasks[i].id, b = tasks[i].begin, m = tasks[i].rows;
      if (tasks[i].shared)
        shared_[id].backward_block(c.x, c.shared_work[id], dy_for_shared, shared_dx.middleRows(id * n, n));
      else
        detail::expert_backward(experts_[id], c.x_sorted.middleRows(b, m), c.side_sorted, b, m,
                                c.work.middleRows(b, m), dy_sorted.middleRows(b, m), dx_sorted.middleRows(b, m),
                                dside_sorted);
    });

    // route: ∂L/∂ℓ from the softmax and from the side input, into W_router and x.
    Matrix<T> d_pair_logits;  // N × K, or 0 × 0 without a side input
    dispatch::scatter_side_grad(Side{}, c.plan, dside_sorted, d_pair_logits);
    Matrix<T> dx;  // N × d
    detail::serial([&] { dx = router_.backward(c.x, c.routing, d_weights, d_pair_logits); });

    // gather: ∂L/∂x per token in fixed order: router, shared, slots 0..K−1.
    dispatch::gather_backward(c.plan, dx_sorted, shared_dx, n_shared, dx, threads);
    if (gated) dx.noalias() += dz * shared_gate_;
    return dx;
  }

  detail::MoEGradientParts<T, Expert> gradient_parts() {
    return {router_, experts_, shared_, shared_gate_grad_, config_.shared_expert_gate ? d_model() : 0};
  }

  Index work_cols() const { return experts_.empty() ? 0 : experts_.front().work_cols(); }
  Index shared_work_cols() const { return shared_.empty() ? 0 : shared_.front().work_cols(); }

  static Cache& thread_scratch() {
    thread_local Cache scratch;
    return scratch;
  }

  MoEConfig config_;
  Router<T> router_;
  LoadBalancer<T> balancer_;
  std::vector<Expert> experts_;
  std::vector<SharedType> shared_;
  Matrix<T> shared_gate_;       ///< 1 × d with shared_expert_gate (Qwen2-MoE), else 0 × 0
  Matrix<T> shared_gate_grad_;  ///< 1 × d with shared_expert_gate, once allocated; else 0 × 0
  bool has_grads_ = false;      ///< allocate_gradients ran
  int threads_ = 0;
};

}  // namespace apex
