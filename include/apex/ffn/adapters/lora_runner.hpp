#pragma once
/// \file adapters/lora_runner.hpp
/// `LoraRunner<Layer>`: the MoE pipeline's expert runner (moe/pipeline.hpp)
/// for LoraMoE. Routing, capacity, the shared gate, the combine and their
/// backward are the pipeline's; this runner gathers the routed rows into
/// plan order and runs the adapted experts (adapters/lora_block.hpp) as the
/// local experts' (expert × row tile) tasks (moe/local_experts.hpp), and
/// their mirror in backward. Every expert is local (InProcessSteps); the
/// router's gradient is added as MoEFFN adds it; the shared gate is frozen
/// (its gradient goes to a buffer nobody lists).
///
/// The blocks are views made for each call from the layer's frozen experts,
/// activations and adapters, so a moved layer has no stale pointers.

#include <utility>
#include <vector>

#include "../core/parallel.hpp"
#include "../core/types.hpp"
#include "../moe/dispatch.hpp"
#include "../moe/local_experts.hpp"
#include "../moe/local_runner.hpp"
#include "../moe/moe_cache.hpp"
#include "../moe/pipeline.hpp"

namespace apex::detail {

template <class Layer>
struct LoraRunner : InProcessSteps<LoraRunner<Layer>> {
  using Plain = std::remove_const_t<Layer>;
  using T = typename Plain::Scalar;
  using ExpertType = typename Plain::RoutedBlock;

  Layer& layer;
  explicit LoraRunner(Layer& l) : layer(l) {}

  const MoEConfig& config() const { return layer.config(); }
  int threads() const { return resolve_threads(layer.threads()); }
  const Router<T>& router() const { return layer.router_; }
  const RowVector<T>& bias() const { return layer.balancer_.bias(); }
  const Matrix<T>& shared_gate() const { return layer.shared_gate_; }

  void run_experts(const char*, const ConstMatrixRef<T>& x, MoECache<T>& c) const {
    const int n_threads = threads();
    if (c.exchange.ranks() != 0) c.exchange = RowExchange{};  // every expert is here
    dispatch::gather_rows(c.plan, x, c.x_sorted, n_threads);
    dispatch::gather_side_input(expert_side_input_t<ExpertType>{}, c.plan, c.routing, c.side_sorted);
    auto& l = const_cast<Plain&>(layer);  // the blocks' gradient targets are unused in forward
    const auto routed = l.routed_blocks();
    const auto shared = l.shared_blocks();
    local_forward(routed, shared, x, c.x_sorted, c.side_sorted, c.plan.offset, c.work, c.y_sorted, c.shared_work,
                  c.shared_y, Plain::kMaxTileRows, n_threads);
  }

  MoECacheShape cache_shape() const {
    const MoEConfig& cfg = config();
    return MoECacheShape::local(cfg, layer.routed_work_cols(), cfg.n_shared > 0 ? layer.shared_work_cols() : 0,
                                expert_side_cols<ExpertType>);
  }
  void allocate_gradients() const { layer.allocate_gradients(); }
  void check_same_forward(const char*, const MoECache<T>&) const {}
  template <class Fn>
  void gradient_scope(Fn&& fn) const {
    std::forward<Fn>(fn)();
  }

  template <class DySorted, class DxSorted, class SharedDx>
  void backward_experts(const char*, const MoECache<T>& c, const DySorted& dy_sorted,
                        const ConstMatrixRef<T>& dy_shared, DxSorted& dx_sorted, Vector<T>& dside_sorted,
                        SharedDx& shared_dx) const {
    auto routed = layer.routed_blocks();
    auto shared = layer.shared_blocks();
    local_backward(routed, shared, c.x, dy_shared, c.x_sorted, c.side_sorted, c.plan.offset, c.work, c.shared_work,
                   dy_sorted, dx_sorted, dside_sorted, shared_dx, threads());
  }
  Router<T>& router_grad() const { return layer.router_; }
  Matrix<T>& shared_gate_grad() const { return layer.shared_gate_grad_; }
};

}  // namespace apex::detail
