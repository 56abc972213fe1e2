#pragma once
/// \file moe/local_runner.hpp
/// `LocalRunner<Layer>`: the MoE pipeline's expert runner (moe/pipeline.hpp)
/// when every expert is local and trainable — MoEFFN's. The capacity limit
/// is decided on this batch (moe/capacity.hpp); the experts run on their
/// blocks of the plan-ordered rows (blocks at plan.offset) and the shared
/// experts on the tokens, as (expert × row tile) tasks
/// (moe/local_experts.hpp); backward runs the same tasks' mirror. Nothing is
/// agreed with anyone: a phase is just its function (InProcessSteps, which
/// the packed runner shares).
///
/// `Layer` is the layer (const for forward); it keeps its trainable parts
/// in `parts_` (moe/moe_parts.hpp) and befriends this runner.

#include <type_traits>
#include <utility>

#include "../core/parallel.hpp"
#include "../core/types.hpp"
#include "capacity.hpp"
#include "config.hpp"
#include "dispatch.hpp"
#include "expert_contract.hpp"
#include "local_experts.hpp"
#include "moe_cache.hpp"
#include "pipeline.hpp"
#include "router.hpp"

namespace apex::detail {

/// What every runner whose experts are all in this process does alike
/// (`Derived` has `config()`): a phase is just its function — there is no
/// one to agree with — and the capacity limit is decided on this batch.
template <class Derived>
struct InProcessSteps {
  template <class Fn>
  void phase(const char*, MoEPhase, Fn&& fn) const {
    std::forward<Fn>(fn)();
  }

  /// The capacity limit (moe/capacity.hpp): dropped pairs listed, their weights 0 in kept_weights.
  template <class T>
  void apply_capacity(const char*, MoECache<T>& c) const {
    const MoEConfig& cfg = static_cast<const Derived&>(*this).config();
    dispatch::apply_capacity(cfg.routing.capacity_factor, cfg.n_experts, c.plan, c.routing.weights, c.dropped,
                             c.kept_weights);
  }
};

template <class Layer>
struct LocalRunner : InProcessSteps<LocalRunner<Layer>> {
  using Plain = std::remove_const_t<Layer>;
  using T = typename Plain::Scalar;
  using ExpertType = typename Plain::ExpertType;

  Layer& layer;

  explicit LocalRunner(Layer& l) : layer(l) {}

  const MoEConfig& config() const { return layer.config(); }
  int threads() const { return resolve_threads(layer.threads()); }
  const Router<T>& router() const { return layer.parts_.router; }
  const RowVector<T>& bias() const { return layer.parts_.balancer.bias(); }
  const Matrix<T>& shared_gate() const { return layer.parts_.shared_gate; }

  /// Gathers x (and the experts' side input) into plan order and runs every
  /// expert on its block and the shared experts on x.
  void run_experts(const char*, const ConstMatrixRef<T>& x, MoECache<T>& c) const {
    const int n_threads = threads();
    if (c.exchange.ranks() != 0) c.exchange = RowExchange{};  // every expert is here
    dispatch::gather_rows(c.plan, x, c.x_sorted, n_threads);
    dispatch::gather_side_input(expert_side_input_t<ExpertType>{}, c.plan, c.routing, c.side_sorted);
    local_forward(layer.parts_.experts, layer.parts_.shared, x, c.x_sorted, c.side_sorted, c.plan.offset, c.work,
                  c.y_sorted, c.shared_work, c.shared_y, Plain::kMaxTileRows, n_threads);
  }

  MoECacheShape cache_shape() const {
    const auto& p = layer.parts_;
    const MoEConfig& cfg = config();
    return MoECacheShape::local(cfg, p.experts.front().work_cols(),
                                p.shared.empty() ? 0 : p.shared.front().work_cols(), expert_side_cols<ExpertType>);
  }
  void allocate_gradients() const { layer.allocate_gradients(); }
  void check_same_forward(const char*, const MoECache<T>&) const {}
  template <class Fn>
  void gradient_scope(Fn&& fn) const {
    std::forward<Fn>(fn)();
  }

  /// The experts' backward on their plan-order blocks (g·dy in dy_sorted)
  /// and the shared experts' on dy_shared (N × d): ∂L/∂x into dx_sorted and
  /// shared_dx, the side input's gradient into dside_sorted, and every
  /// expert's weight gradients.
  template <class DySorted, class DxSorted, class SharedDx>
  void backward_experts(const char*, const MoECache<T>& c, const DySorted& dy_sorted,
                        const ConstMatrixRef<T>& dy_shared, DxSorted& dx_sorted, Vector<T>& dside_sorted,
                        SharedDx& shared_dx) const {
    local_backward(layer.parts_.experts, layer.parts_.shared, c.x, dy_shared, c.x_sorted, c.side_sorted,
                   c.plan.offset, c.work, c.shared_work, dy_sorted, dx_sorted, dside_sorted, shared_dx, threads());
  }
  Router<T>& router_grad() const { return layer.parts_.router; }
  Matrix<T>& shared_gate_grad() const { return layer.parts_.shared_gate_grad; }
};

}  // namespace apex::detail
