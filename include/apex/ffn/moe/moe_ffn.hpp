#pragma once
/// \file moe/moe_ffn.hpp
/// Mixture-of-Experts FFN (docs/math.md#mixture-of-experts):
///
///     MoE(X) = Σ_s Shared_s(X) + Σ_k g_k · Expert_{e_k}(X)
///
/// with a top-K Router, the bias LoadBalancer, and grouped dispatch. The
/// layer is the MoE pipeline (moe/pipeline.hpp, shared with PackedMoE and
/// ExpertParallelMoE) over local experts (moe/local_runner.hpp); its parts
/// and lazy gradients are moe/moe_parts.hpp's, its cache moe/moe_cache.hpp's:
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
#include <cstdint>
#include <string>
#include <vector>

#include "../core/checked_size.hpp"
#include "../core/errors.hpp"
#include "../core/memory_budget.hpp"
#include "../core/param.hpp"
#include "../core/types.hpp"
#include "../layers/swiglu.hpp"
#include "config.hpp"
#include "expert_contract.hpp"
#include "load_balancer.hpp"
#include "local_runner.hpp"
#include "moe_cache.hpp"
#include "moe_parts.hpp"
#include "pipeline.hpp"
#include "router.hpp"

namespace apex {

namespace detail {
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

  /// Everything backward needs, owned by the caller (moe/moe_cache.hpp):
  /// the routing, the plan, the experts' rows in plan order and their workspaces.
  using Cache = MoECache<T>;

  /// ConfigError for an invalid config, or one whose weights exceed physical
  /// memory (weight_bytes; checked before anything is allocated).
  MoEFFN(const MoEConfig& config, Rng& rng)
      : config_((config.validate_for<T>("MoEFFN"), check_weights_fit(config), config)),
        parts_(config, rng, 0, config.n_experts) {}  // no gradients yet: allocate_gradients()
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
    Matrix<T> y(x.rows(), d_model());
    compute("MoEFFN::forward", x, y, cache);
    return y;
  }

  /// As forward, writing into the caller's y (N × d, overwritten): a serving
  /// loop that reuses y avoids allocating — and, for outputs of many MB,
  /// faulting in — a fresh output per call. Every read of x happens before
  /// the first write of y, so y may be x itself (an in-place update).
  void forward_into(const ConstMatrixRef<T>& x, MatrixRef<T> y, Cache* cache = nullptr) const {
    detail::check_shape("MoEFFN::forward_into", "x", x, detail::kAny, d_model());
    detail::check_shape("MoEFFN::forward_into", "y", y, x.rows(), d_model());
    compute("MoEFFN::forward_into", x, y, cache);
  }

  /// dy: N × d → dx: N × d; adds into the router's, every expert's and every
  /// shared expert's weight gradients. The balancing bias gets none.
  /// ShapeError if dy does not match the cache, or the cache was not filled
  /// by a forward of a layer of this configuration.
  Matrix<T> backward(const ConstMatrixRef<T>& dy, const Cache& c) {
    detail::LocalRunner<MoEFFN> runner{*this};
    return detail::MoEPipeline::backward<T>("MoEFFN::backward", runner, dy, c);
  }

  /// Adds the routing in `cache` to the balancer's counts (call once per
  /// micro-batch in training; `balancer().update()` after the optimiser step).
  /// ShapeError if the cache was not filled by a forward of a layer of this
  /// configuration (as backward).
  void observe(const Cache& cache) {
    check_cache("MoEFFN::observe", cache);
    parts_.balancer.observe(cache.plan.counts(), cache.plan.n_tokens);
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
    parts_.balancer.observe(cache.plan.counts(token_counted), tokens);
  }

  Router<T>& router() { return parts_.router; }
  const Router<T>& router() const { return parts_.router; }
  LoadBalancer<T>& balancer() { return parts_.balancer; }
  const LoadBalancer<T>& balancer() const { return parts_.balancer; }
  std::vector<Expert>& experts() { return parts_.experts; }
  const std::vector<Expert>& experts() const { return parts_.experts; }
  std::vector<SharedType>& shared_experts() { return parts_.shared; }
  const std::vector<SharedType>& shared_experts() const { return parts_.shared; }
  /// The shared-expert gate weight w_gate: 1 × d with shared_expert_gate, else 0 × 0.
  const Matrix<T>& shared_gate_weight() const { return parts_.shared_gate; }

  /// `router.weight`, `experts.{e}.…`, `shared_experts.{s}.…`,
  /// `shared_expert_gate.weight` (state_dict order) with their gradients,
  /// which this allocates (zeroed, all of the layer's) if not yet: the views
  /// must stay valid for the layer's life (core/param.hpp).
  ParamList<T> params() {
    allocate_gradients();
    return parts_.params(0);
  }
  /// The same tensors, values only: never allocates gradients (core/param.hpp),
  /// for checkpoints, packing and anything else that reads or writes values.
  ParamList<T> param_values() { return parts_.param_values(0); }
  /// Zeroes every gradient (allocating them, zeroed, if not yet).
  void zero_grad() { parts_.zero_grad("MoEFFN::zero_grad", description(config_)); }
  /// Whether the layer's gradients exist (allocate_gradients ran).
  bool has_gradients() const { return parts_.has_gradients; }
  /// Allocates every gradient of the layer — router, experts, shared experts,
  /// shared gate — zeroed, unless done already; does nothing then. Called by
  /// backward before its parallel section, so expert tasks never allocate.
  /// ConfigError (core/memory_budget.hpp) naming the bytes if the weights plus
  /// all the gradients exceed physical memory; nothing is allocated then.
  void allocate_gradients() { parts_.allocate_gradients("MoEFFN::allocate_gradients", description(config_)); }

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
  template <class>
  friend struct detail::LocalRunner;

  /// forward's body (moe/pipeline.hpp over this layer's local experts); y checked by the caller.
  void compute(const char* where, const ConstMatrixRef<T>& x, MatrixRef<T> y, Cache* cache) const {
    const detail::LocalRunner<const MoEFFN> runner{*this};
    detail::MoEPipeline::forward<T>(where, runner, x, y, cache ? *cache : detail::MoEPipeline::scratch<T, MoEFFN>(),
                                    cache != nullptr);
  }

  /// ShapeError naming the cache unless it holds a forward of a layer of
  /// this configuration (a default-constructed cache holds none).
  void check_cache(const char* where, const Cache& c) const {
    detail::check_moe_cache(where, c, detail::LocalRunner<const MoEFFN>{*this}.cache_shape());
  }

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

  MoEConfig config_;
  detail::MoEParts<T, Expert> parts_;  ///< router, balancer, experts, shared experts and gate, gradients
  int threads_ = 0;
};

}  // namespace apex
