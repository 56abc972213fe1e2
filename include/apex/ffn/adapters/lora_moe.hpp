#pragma once
/// \file adapters/lora_moe.hpp
/// `LoraMoE<Base>`: low-rank adapters trained on a frozen MoE layer, the
/// base's expert weights never updated and, for a packed base, never
/// expanded to float (docs/adapters.md):
///
///     MoE(X) = Σ_s γ ⊙ Shared_s(X) + Σ_k g_k · Expert_{e_k}(X),
///     Expert_e: each adapted projection W x + s·B(A x) (adapters/lora_block.hpp)
///
/// Base is `PackedMoE<Storage, Expert>` (any weight type: the files people
/// keep) or `MoEFFN<T, Expert>` (the float reference, and in double the
/// layer of the finite-difference checks); Expert is SwiGLU, κ-SwiGLU or
/// gpt-oss's clamped SwiGLU, their frozen float parts (κ's α and b, the
/// clamped biases) frozen too. It is the MoE pipeline (moe/pipeline.hpp)
/// over adapted experts (adapters/lora_runner.hpp): routing, balancing bias,
/// capacity, shared gate and combine are the base's, so its top-K choice is
/// the base's. The layer contract holds (docs/layer_contract.md): const
/// forward into a cache the caller owns, backward returns ∂L/∂x and adds
/// into the gradients of what trains, which `params()` lists: the adapters,
/// and the router with LoraOptions::train_router. The balancer counts with
/// observe() and steps with balancer().update(), as MoEFFN's.

#include <string>
#include <utility>
#include <vector>

#include "../core/errors.hpp"
#include "../core/param.hpp"
#include "../core/types.hpp"
#include "../moe/load_balancer.hpp"
#include "../moe/moe_cache.hpp"
#include "../moe/pipeline.hpp"
#include "../moe/router.hpp"
#include "frozen_layer.hpp"
#include "lora_adapter_set.hpp"
#include "lora_block.hpp"
#include "lora_options.hpp"
#include "lora_runner.hpp"

namespace apex {

template <class Base>
class LoraMoE {
  using Frozen = FrozenLayer<Base>;

 public:
  using Scalar = typename Frozen::Scalar;
  using T = Scalar;
  using BaseType = Base;
  using Activation = typename ExpertKind<typename Frozen::ExpertType>::Activation;
  using SharedActivation = typename ExpertKind<SwiGLU<T>>::Activation;
  using RoutedBlock = LoraBlock<typename Frozen::Routed, Activation>;
  using SharedBlock = LoraBlock<typename Frozen::Shared, SharedActivation>;
  using Cache = MoECache<T>;
  static constexpr Index kMaxTileRows = MoEFFN<T>::kMaxTileRows;

  /// Adapters on `base` (moved in, frozen) as `options` say, A drawn from
  /// rng, B zero: the new layer computes exactly what `base` does.
  /// ConfigError naming the field for options that do not fit the experts.
  LoraMoE(Base base, const LoraOptions& options, Rng& rng)
      : base_(std::move(base)),
        config_(base_.config()),
        opt_(validated_options(options, config_)),
        router_(Frozen::router(base_)),
        balancer_(config_.n_experts, config_.n_active, config_.balancer_alpha),
        shared_gate_(Frozen::shared_gate(base_)),
        routed_(config_.n_experts, config_.d_model, config_.d_ffn, opt_, !opt_.per_expert, "experts.", rng),
        shared_(opt_.shared_experts ? config_.n_shared : 0, config_.d_model, config_.shared_ffn(), opt_.for_shared(),
                false, "shared_experts.", rng) {
    balancer_.set_bias(Frozen::bias(base_));
    acts_.reserve(std::size_t(config_.n_experts));
    for (Index e = 0; e < config_.n_experts; ++e) acts_.push_back(Frozen::activation(base_, e));
  }
  LoraMoE(Base base, const LoraOptions& options, Rng&& rng) : LoraMoE(std::move(base), options, rng) {}

  const MoEConfig& config() const { return config_; }
  const LoraOptions& options() const { return opt_; }
  Index d_model() const { return config_.d_model; }
  /// The frozen layer.
  const Base& base() const { return base_; }

  void set_threads(int threads) { threads_ = threads; }
  int threads() const { return threads_; }
  /// Kernel path of a packed base's products (ConfigError at the next call
  /// if the CPU lacks it); ignored for a float base.
  void set_isa(packed::Isa isa) { isa_ = isa; }
  packed::Isa isa() const { return isa_; }

  /// x: N × d → N × d. ShapeError on a wrong width, ValueError on non-finite logits.
  Matrix<T> forward(const ConstMatrixRef<T>& x, Cache* cache = nullptr) const {
    Matrix<T> y(x.rows(), d_model());
    compute("LoraMoE::forward", x, y, cache);
    return y;
  }

  /// dy: N × d → dx: N × d; adds into the adapters' (and, with
  /// train_router, the router's) gradients. ShapeError if dy or the cache
  /// does not match a forward of this layer.
  Matrix<T> backward(const ConstMatrixRef<T>& dy, const Cache& c) {
    detail::LoraRunner<LoraMoE> runner{*this};
    Matrix<T> dx = detail::MoEPipeline::backward<T>("LoraMoE::backward", runner, dy, c);
    routed_.reduce_partials();
    return dx;
  }

  /// Counts the routing in `cache` for the balancer (as MoEFFN::observe).
  void observe(const Cache& cache) {
    detail::check_moe_cache("LoraMoE::observe", cache, detail::LoraRunner<const LoraMoE>{*this}.cache_shape());
    balancer_.observe(cache.plan.counts(), cache.plan.n_tokens);
  }
  LoadBalancer<T>& balancer() { return balancer_; }
  const LoadBalancer<T>& balancer() const { return balancer_; }
  const Router<T>& router() const { return router_; }
  Router<T>& router() { return router_; }

  /// The routed experts' adapters (`tied`: one set) and the shared experts'.
  LoraAdapterSet<T>& routed_adapters() { return routed_; }
  const LoraAdapterSet<T>& routed_adapters() const { return routed_; }
  LoraAdapterSet<T>& shared_adapters() { return shared_; }
  const LoraAdapterSet<T>& shared_adapters() const { return shared_; }

  /// What trains, with gradients (allocated, zeroed, if not yet): the
  /// adapters (adapters/lora_adapter_set.hpp's names), then `router.weight`
  /// (and `router.bias`) with train_router.
  ParamList<T> params() {
    allocate_gradients();
    return param_list(true);
  }
  /// The same tensors, values only (never allocates).
  ParamList<T> param_values() { return param_list(false); }
  void zero_grad() {
    routed_.zero_grad();
    shared_.zero_grad();
    router_.zero_grad();
  }
  /// Whether the gradients exist (allocate_gradients ran), as the layer
  /// contract asks (FFNSublayer::has_gradients reads it).
  bool has_gradients() const {
    return routed_.has_gradients() && shared_.has_gradients() && router_.has_gradients() &&
           shared_gate_grad_.size() == shared_gate_.size();
  }
  void allocate_gradients() {
    routed_.allocate_gradients();
    shared_.allocate_gradients();
    router_.allocate_gradients();
    if (shared_gate_grad_.size() != shared_gate_.size()) shared_gate_grad_ = Matrix<T>::Zero(shared_gate_.rows(), shared_gate_.cols());
  }

  /// `o`, or ConfigError naming the field if it does not fit a layer of `c`
  /// (routed experts, and shared ones when they get adapters).
  static LoraOptions validated_options(const LoraOptions& o, const MoEConfig& c) {
    o.validate("LoraMoE", c.d_model, c.d_ffn, "routed experts");
    if (o.shared_experts && c.n_shared > 0)
      o.for_shared().validate("LoraMoE", c.d_model, c.shared_ffn(), "shared experts");
    return o;
  }

  /// Workspace columns of a routed and of a shared expert's row.
  Index routed_work_cols() const { return 3 * config_.d_ffn + routed_.values(0).hidden_cols(); }
  Index shared_work_cols() const {
    return 3 * config_.shared_ffn() + (shared_.experts() > 0 ? shared_.values(0).hidden_cols() : 0);
  }

 private:
  template <class>
  friend struct detail::LoraRunner;


  T scale() const { return T(opt_.scale()); }
  std::vector<RoutedBlock> routed_blocks() const {
    std::vector<RoutedBlock> out;
    out.reserve(std::size_t(config_.n_experts));
    auto& grads = const_cast<LoraAdapterSet<T>&>(routed_);
    for (Index e = 0; e < config_.n_experts; ++e)
      out.emplace_back(Frozen::routed(base_, e, isa_), &acts_[std::size_t(e)], &routed_.values(e),
                       grads.has_gradients() ? grads.grads_of(e) : nullptr, scale());
    return out;
  }
  std::vector<SharedBlock> shared_blocks() const {
    std::vector<SharedBlock> out;
    static const LoraExpertAdapters<T> none;  // shared experts without adapters
    auto& grads = const_cast<LoraAdapterSet<T>&>(shared_);
    for (Index s = 0; s < config_.n_shared; ++s) {
      const bool adapted = shared_.experts() > 0;
      out.emplace_back(Frozen::shared(base_, s, isa_), &shared_act_, adapted ? &shared_.values(s) : &none,
                       adapted && grads.has_gradients() ? grads.grads_of(s) : nullptr, scale());
    }
    return out;
  }

  ParamList<T> param_list(bool grads) {
    ParamList<T> out = routed_.params(grads);
    ParamList<T> shared = shared_.params(grads);
    out.insert(out.end(), shared.begin(), shared.end());
    if (opt_.train_router)
      detail::append_prefixed(out, state_names::kRouterPrefix, grads ? router_.params() : router_.param_values());
    return out;
  }

  void compute(const char* where, const ConstMatrixRef<T>& x, MatrixRef<T> y, Cache* cache) const {
    packed::detail::require_isa(where, isa_);
    const detail::LoraRunner<const LoraMoE> runner{*this};
    detail::MoEPipeline::forward<T>(where, runner, x, y, cache ? *cache : detail::MoEPipeline::scratch<T, LoraMoE>(),
                                    cache != nullptr);
  }

  Base base_;
  MoEConfig config_;
  LoraOptions opt_;
  Router<T> router_;                ///< the base's, trainable with train_router
  LoadBalancer<T> balancer_;        ///< the base's bias, stepped by update()
  Matrix<T> shared_gate_;           ///< 1 × d (shared_expert_gate) or empty: frozen
  Matrix<T> shared_gate_grad_;      ///< the pipeline adds into it; not trained
  std::vector<Activation> acts_;    ///< E: each routed expert's activation with its frozen parts
  SharedActivation shared_act_;
  LoraAdapterSet<T> routed_;        ///< E sets, or one tied set
  LoraAdapterSet<T> shared_;        ///< S sets (or none without shared_experts)
  packed::Isa isa_ = packed::kDefaultIsa;
  int threads_ = 0;
};

}  // namespace apex
