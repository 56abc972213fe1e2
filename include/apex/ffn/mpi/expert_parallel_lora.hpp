#pragma once
/// \file mpi/expert_parallel_lora.hpp
/// `ExpertParallelLora<Base>`: LoraMoE (adapters/lora_moe.hpp) over P MPI
/// ranks. Each rank runs the routed experts of its shard (expert_shard.hpp)
/// with their adapters, and holds a replica of the router, the balancer and
/// the shared experts' adapters; each brings its own tokens. It is the MoE
/// pipeline over the exchange of ExpertParallelMoE (mpi/exchange_runner.hpp):
/// rows go to their experts' owners and come back, and the replicated
/// gradients of a step (the shared experts' adapters, a tied routed adapter,
/// the router with train_router) are summed across ranks in rank order.
///
/// The frozen base is the whole layer on every rank, but a rank only ever
/// reads its own experts' weights: a packed base mapped from a GGUF or
/// pack-once file (inference/files/) costs each rank the pages of its shard
/// only. The adapters are drawn as the single-process layer draws them for
/// the same rng, every expert's in order, each rank keeping its own; the
/// result equals LoraMoE on the concatenated batch to rounding (rows per
/// block and the rank-order sums, as for ExpertParallelMoE), bitwise the same
/// run after run and on any thread count.
///
/// Collective: construction, forward, backward and observe — every rank
/// calls them in the same order (a rank with no tokens passes 0 × d). A bad
/// input on one rank throws on every rank (communicator.hpp).

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "../adapters/lora_moe.hpp"
#include "../core/errors.hpp"
#include "../core/types.hpp"
#include "communicator.hpp"
#include "config_agreement.hpp"
#include "exchange_runner.hpp"
#include "expert_shard.hpp"
#include "fixed_order_sum.hpp"

namespace apex::mpi {

template <class Base>
class ExpertParallelLora {
  using Frozen = FrozenLayer<Base>;
  using Single = LoraMoE<Base>;

 public:
  using Scalar = typename Frozen::Scalar;
  using T = Scalar;
  using RoutedBlock = typename Single::RoutedBlock;
  using SharedBlock = typename Single::SharedBlock;
  using ExpertType = RoutedBlock;
  using Cache = MoECache<T>;
  static constexpr bool kCollective = true;
  static constexpr Index kMaxTileRows = Single::kMaxTileRows;

  /// Adapters on `base` (frozen, moved in; every rank passes the same layer)
  /// as LoraMoE(base, options, rng) draws them, this rank keeping its
  /// shard's. ConfigError on every rank if the options do not fit, or the
  /// configuration or options differ between ranks, or P > E.
  ExpertParallelLora(Base base, const LoraOptions& options, Communicator comm, Rng& rng)
      : base_(std::move(base)), config_(base_.config()), comm_(std::move(comm)), shard_(1, 1),
        router_(Frozen::router(base_)), balancer_(config_.n_experts, config_.n_active, config_.balancer_alpha),
        shared_gate_(Frozen::shared_gate(base_)) {
    constexpr const char* where = "ExpertParallelLora";
    comm_.step(where, [&] { opt_ = Single::validated_options(options, config_); });
    agree_on_config(comm_, where, fingerprint<T, typename Frozen::ExpertType>(where, config_, describe(opt_)));
    comm_.step(where, [&] {
      shard_ = ExpertShard(config_.n_experts, comm_.size());
      const Index first = shard_.first(comm_.rank()), last = shard_.first(comm_.rank() + 1);
      routed_.emplace(config_.n_experts, config_.d_model, config_.d_ffn, opt_, !opt_.per_expert, "experts.", rng,
                      first, last);
      shared_.emplace(opt_.shared_experts ? config_.n_shared : 0, config_.d_model, config_.shared_ffn(),
                      opt_.for_shared(), false, "shared_experts.", rng);
      balancer_.set_bias(Frozen::bias(base_));
      for (Index e = first; e < last; ++e) acts_.push_back(Frozen::activation(base_, e));
    });
  }
  ExpertParallelLora(Base base, const LoraOptions& options, Communicator comm, Rng&& rng)
      : ExpertParallelLora(std::move(base), options, std::move(comm), rng) {}

  const MoEConfig& config() const { return config_; }
  const LoraOptions& options() const { return opt_; }
  Index d_model() const { return config_.d_model; }
  const Base& base() const { return base_; }
  const Communicator& comm() const { return comm_; }
  /// Global id of this rank's first routed expert.
  Index first_expert() const { return shard_.first(comm_.rank()); }
  void set_threads(int threads) { threads_ = threads; }
  /// Kernel path of a packed base's products (agreed with nothing: every path gives the same bits).
  void set_isa(packed::Isa isa) { isa_ = isa; }
  const PhaseTimes& phase_times() const { return times_; }

  /// x: N × d (this rank's tokens, N may be 0) → N × d.
  Matrix<T> forward(const ConstMatrixRef<T>& x, Cache* cache = nullptr) const {
    Matrix<T> y(x.rows(), d_model());
    const detail::ExchangeRunner<const ExpertParallelLora> runner{*this};
    comm_.step("ExpertParallelLora::forward", [&] { packed::detail::require_isa("ExpertParallelLora::forward", isa_); });
    apex::detail::MoEPipeline::forward<T>("ExpertParallelLora::forward", runner, x, y,
                                          cache ? *cache : apex::detail::MoEPipeline::scratch<T, ExpertParallelLora>(),
                                          cache != nullptr);
    return y;
  }
  /// dy: N × d → dx: N × d; adds into this rank's adapters' gradients and,
  /// summed over ranks in rank order, into the replicated ones'.
  Matrix<T> backward(const ConstMatrixRef<T>& dy, const Cache& c) {
    detail::ExchangeRunner<ExpertParallelLora> runner{*this};
    return apex::detail::MoEPipeline::backward<T>("ExpertParallelLora::backward", runner, dy, c);
  }
  /// Adds the routing of `cache`, summed over ranks, to the balancer's counts.
  void observe(const Cache& c) {
    constexpr const char* where = "ExpertParallelLora::observe";
    std::vector<std::int64_t> local(std::size_t(config_.n_experts) + 1, 0), global(local.size());
    comm_.step(where, [&] {
      apex::detail::check_moe_cache(where, c, detail::ExchangeRunner<const ExpertParallelLora>{*this}.cache_shape());
      const std::vector<Index> counts = c.plan.counts();
      std::copy(counts.begin(), counts.end(), local.begin());
      local.back() = c.plan.n_tokens;
    });
    detail::check(MPI_Allreduce(local.data(), global.data(), int(local.size()), MPI_INT64_T, MPI_SUM, comm_.get()),
                  "MPI_Allreduce (expert loads)");
    comm_.step(where, [&] {
      balancer_.observe(std::vector<Index>(global.begin(), global.end() - 1), Index(global.back()));
    });
  }
  LoadBalancer<T>& balancer() { return balancer_; }
  const Router<T>& router() const { return router_; }
  LoraAdapterSet<T>& routed_adapters() { return *routed_; }
  LoraAdapterSet<T>& shared_adapters() { return *shared_; }

  /// This rank's adapters (global expert ids), the shared experts', and the
  /// router with train_router: LoraMoE's names, this rank's subset.
  ParamList<T> params() {
    allocate_gradients();
    ParamList<T> out = opt_.per_expert ? routed_->params(true) : ParamList<T>();
    const ParamList<T> replicated = replicated_params();  // the tied routed set first, when tied
    out.insert(out.end(), replicated.begin(), replicated.end());
    return out;
  }
  /// What every rank holds a replica of, with gradients: a tied routed
  /// adapter, the shared experts' adapters, the router with train_router.
  ParamList<T> replicated_params() {
    allocate_gradients();
    ParamList<T> out;
    if (!opt_.per_expert) out = routed_->params(true);
    const ParamList<T> shared = shared_->params(true);
    out.insert(out.end(), shared.begin(), shared.end());
    if (opt_.train_router) apex::detail::append_prefixed(out, state_names::kRouterPrefix, router_.params());
    return out;
  }
  void zero_grad() {
    routed_->zero_grad();
    shared_->zero_grad();
    router_.zero_grad();
  }
  void allocate_gradients() {
    routed_->allocate_gradients();
    shared_->allocate_gradients();
    router_.allocate_gradients();
    if (shared_gate_grad_.size() != shared_gate_.size())
      shared_gate_grad_ = Matrix<T>::Zero(shared_gate_.rows(), shared_gate_.cols());
  }

 private:
  template <class>
  friend struct detail::ExchangeRunner;

  static std::string describe(const LoraOptions& o) {
    const auto t = [](const LoraTargets& x) {
      return std::to_string(x.gate) + std::to_string(x.up) + std::to_string(x.gate_up) + std::to_string(x.down);
    };
    return "lora rank " + std::to_string(o.rank) + "; alpha " + exact(o.alpha) + "; rslora " + std::to_string(o.rslora) +
           "; targets " + t(o.targets) + "; shared targets " + t(o.for_shared().targets) + "; per_expert " +
           std::to_string(o.per_expert) + "; shared_experts " + std::to_string(o.shared_experts) + "; train_router " +
           std::to_string(o.train_router);
  }

  /// \name What the exchange runner reads (mpi/exchange_runner.hpp)
  ///@{
  const Router<T>& ep_router() const { return router_; }
  Router<T>& ep_router() { return router_; }
  const RowVector<T>& ep_bias() const { return balancer_.bias(); }
  const Matrix<T>& ep_shared_gate() const { return shared_gate_; }
  Matrix<T>& ep_shared_gate_grad() { return shared_gate_grad_; }
  std::vector<RoutedBlock> ep_experts() const {
    std::vector<RoutedBlock> out;
    auto& grads = const_cast<LoraAdapterSet<T>&>(*routed_);
    const Index first = first_expert();
    for (Index j = 0; j < routed_->experts(); ++j)
      out.emplace_back(Frozen::routed(base_, first + j, isa_), &acts_[std::size_t(j)], &routed_->values(j),
                       grads.has_gradients() ? grads.grads_of(j) : nullptr, T(opt_.scale()));
    return out;
  }
  std::vector<SharedBlock> ep_shared() const {
    std::vector<SharedBlock> out;
    static const LoraExpertAdapters<T> none;
    auto& grads = const_cast<LoraAdapterSet<T>&>(*shared_);
    for (Index s = 0; s < config_.n_shared; ++s) {
      const bool adapted = shared_->experts() > 0;
      out.emplace_back(Frozen::shared(base_, s, isa_), &shared_act_, adapted ? &shared_->values(s) : &none,
                       adapted && grads.has_gradients() ? grads.grads_of(s) : nullptr, T(opt_.scale()));
    }
    return out;
  }
  Index ep_local_count() const { return routed_->experts(); }
  Index ep_work_cols() const { return 3 * config_.d_ffn + routed_->values(0).hidden_cols(); }
  Index ep_shared_work_cols() const {
    return 3 * config_.shared_ffn() + (shared_->experts() > 0 ? shared_->values(0).hidden_cols() : 0);
  }
  void ep_after_backward() { routed_->reduce_partials(); }
  ///@}

  Base base_;
  MoEConfig config_;
  LoraOptions opt_;
  Communicator comm_;
  ExpertShard shard_;
  Router<T> router_;                 ///< replica: the base's, trainable with train_router
  LoadBalancer<T> balancer_;         ///< replica, fed the whole batch's counts
  Matrix<T> shared_gate_, shared_gate_grad_;
  std::vector<typename Single::Activation> acts_;  ///< this rank's experts' activations
  typename Single::SharedActivation shared_act_;
  std::optional<LoraAdapterSet<T>> routed_;  ///< this rank's experts (or the tied set)
  std::optional<LoraAdapterSet<T>> shared_;  ///< replica
  packed::Isa isa_ = packed::kDefaultIsa;
  int threads_ = 0;
  Index limit_ = kMaxIntCount;
  std::vector<T> grad_stash_;  ///< the replicated gradients before a backward (StepGradientSum)
  mutable PhaseTimes times_;
};

}  // namespace apex::mpi
