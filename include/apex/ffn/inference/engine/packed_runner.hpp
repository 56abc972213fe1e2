#pragma once
/// \file inference/engine/packed_runner.hpp
/// `PackedRunner<Layer>`: the MoE pipeline's expert runner (moe/pipeline.hpp)
/// for PackedMoE — forward only. Routing, capacity, the shared gate and the
/// combine are the pipeline's (the float layer's code, so the same top-K
/// choice, weights, drops and gate bits); this runner gathers the routed
/// rows into plan order and runs (routed expert × row tile) and (shared
/// expert × row tile) tasks on the packed kernels, which take a call of
/// ≤ packed::kSmallRows rows (decode) as one weight-streaming block and
/// larger ones in packed::kRowBlock-row blocks. The kernels give each row
/// bits that depend on that row only, so results are bitwise identical for
/// any thread count and tiling. A dropped assignment's rows are still
/// computed (and weighted by 0), as in MoEFFN, so a NaN there propagates
/// the same way.
///
/// `Layer` is a const PackedMoE, which befriends this runner.

#include <utility>
#include <vector>

#include "../../core/parallel.hpp"
#include "../../core/types.hpp"
#include "../../kernels/fused_expert.hpp"
#include "../../moe/capacity.hpp"
#include "../../moe/config.hpp"
#include "../../moe/dispatch.hpp"
#include "../../moe/expert_contract.hpp"
#include "../../moe/expert_tasks.hpp"
#include "../../moe/local_runner.hpp"
#include "../../moe/moe_cache.hpp"
#include "../../moe/pipeline.hpp"
#include "../../moe/router.hpp"
#include "packed_types.hpp"
#include "expert_kind.hpp"

namespace apex::detail::inference {

/// Phases and the capacity limit are MoEFFN's (InProcessSteps): the same
/// routing gives the same drops.
template <class Layer>
struct PackedRunner : InProcessSteps<PackedRunner<Layer>> {
  using ExpertType = typename Layer::ExpertType;

  const Layer& layer;

  explicit PackedRunner(const Layer& l) : layer(l) {}

  /// Routed expert id's float parts (an empty object for a kind without any).
  const typename Layer::Extra& extra_of(Index id) const {
    if constexpr (Layer::kHasExtra) {
      return layer.extras_[std::size_t(id)];
    } else {
      static const typename Layer::Extra none{};
      return none;
    }
  }

  const MoEConfig& config() const { return layer.config(); }
  int threads() const { return resolve_threads(layer.threads()); }
  const Router<float>& router() const { return layer.router_; }
  const RowVector<float>& bias() const { return layer.bias_; }
  const Matrix<float>& shared_gate() const { return layer.shared_.gate_weight(); }

  /// Gathers x (and κ's router logit) into plan order and runs the packed
  /// experts, largest tasks first (moe/expert_tasks.hpp). A forward-only
  /// cache holds no input or workspaces: they are emptied, so a cache reused
  /// from a trainable layer cannot pass for one of its forwards.
  void run_experts(const char*, const ConstMatrixRef<float>& x, MoECache<float>& c) const {
    const Index n = x.rows(), d = config().d_model;
    const int n_threads = threads();
    const auto& shared = layer.shared_;
    c.x.resize(0, 0);
    c.work.resize(0, 0);
    c.shared_work.clear();
    if (c.exchange.ranks() != 0) c.exchange = RowExchange{};
    dispatch::gather_rows(c.plan, x, c.x_sorted, n_threads);
    dispatch::gather_side_input(expert_side_input_t<ExpertType>{}, c.plan, c.routing, c.side_sorted);
    c.y_sorted.resize(c.plan.rows(), d);
    c.shared_y.resize(std::size_t(shared.size()));
    for (auto& ys : c.shared_y) ys.resize(n, d);
    // kept between calls on this thread: a decode step allocates nothing
    const auto& tasks = kept_forward_tasks<PackedRunner>(c.plan.offset, shared.size(), n, kMaxTileRows);
    const float* xs = c.x_sorted.data();
    float* ys = c.y_sorted.data();
    const packed::ForwardOptions& kernel = layer.kernel_;
    parallel_for(Index(tasks.size()), n_threads, [&](Index i) {
      const ExpertTask& t = tasks[std::size_t(i)];
      const Index id = t.id, b = t.begin, m = t.rows;
      if (t.shared) {
        shared.forward(id, x, b, m, c.shared_y[std::size_t(id)], kernel);
        return;
      }
      // The expert's kind runs it (inference/engine/expert_kind.hpp), with
      // its float parts and the rows' side input when it reads one.
      const float* side = expert_side_cols<ExpertType> ? c.side_sorted.data() + b : nullptr;
      Layer::Kind::template forward<typename Layer::ActivationType>(layer.experts_[std::size_t(id)], extra_of(id),
                                                                    xs + b * d, d, side, m, ys + b * d, d, kernel);
    });
  }
};

}  // namespace apex::detail::inference
