#pragma once
/// \file moe/moe_cache.hpp
/// `MoECache<T>`: what one forward of the MoE pipeline (moe/pipeline.hpp)
/// keeps — the same type for MoEFFN, PackedMoE and ExpertParallelMoE — and
/// its one check, which backward and observe run before reading it.
///
/// Routed rows live in two orders:
///  - *plan order* (NK rows: y_sorted): this process's N·K (token, slot)
///    pairs sorted by expert (moe/dispatch.hpp's DispatchPlan);
///  - *block order* (R rows: x_sorted, side_sorted, work): the rows the
///    experts held here ran, one block per expert. With every expert local
///    that is the plan order itself (R = NK, blocks at plan.offset); on a
///    rank of an expert-parallel layer it is the rows received from every
///    rank, expert-major (R = exchange.received(), blocks at
///    exchange.local_offset).

#include <string>
#include <vector>

#include "../core/errors.hpp"
#include "../core/types.hpp"
#include "config.hpp"
#include "dispatch.hpp"
#include "routing_rules.hpp"
#include "row_exchange.hpp"

namespace apex {

template <class T>
struct MoECache {
  Matrix<T> x;                         ///< N × d: the input (layers with a backward keep it)
  Routing<T> routing;                  ///< logits N × E, experts N × K, weights N × K
  DispatchPlan plan;                   ///< the N·K pairs sorted by expert
  Matrix<T> kept_weights;              ///< N × K: g with dropped pairs 0 (capacity on), else empty
  std::vector<Index> dropped;          ///< pairs t·K + k the capacity limit dropped, ascending
  RowExchange exchange;                ///< rows to and from every rank (expert parallel), else empty
  Matrix<T> x_sorted;                  ///< R × d: the experts' input rows, block order
  Vector<T> side_sorted;               ///< R (or 0 without one): the experts' side input, block order
  Matrix<T> work;                      ///< R × expert.work_cols() (0 × 0 for a forward-only layer)
  Matrix<T> y_sorted;                  ///< NK × d: Expert_e(x) per pair, plan order, unweighted
  std::vector<Matrix<T>> shared_work;  ///< per shared expert: N × work_cols() (layers with a backward)
  std::vector<Matrix<T>> shared_y;     ///< per shared expert: N × d, its output (gated, with a shared gate)
  Vector<T> shared_gate;               ///< N: σ(x·w_gate) with shared_expert_gate, else empty
};

/// The weights the combine reads: g, or with the capacity limit g with the dropped pairs 0.
template <class T>
const Matrix<T>& combine_weights(const MoECache<T>& c, bool capacity_on) {
  return capacity_on ? c.kept_weights : c.routing.weights;
}

/// What a layer's cache must hold: the layer's shapes and where its experts ran.
struct MoECacheShape {
  Index d_model = 0, n_experts = 0, n_active = 0, n_shared = 0;
  Index work_cols = 0;         ///< per routed row (0 for a forward-only layer)
  Index shared_work_cols = 0;  ///< per shared-expert row
  Index side_cols = 0;         ///< 1 if the experts take a side input, else 0
  Index ranks = 0;             ///< P for an expert-parallel layer, 0 with every expert local
  Index local_experts = 0;     ///< experts held here (expert parallel: this rank's)
  bool gated = false;          ///< shared_expert_gate
  bool capacity_on = false;    ///< a capacity factor is set

  /// A layer of config `cfg` with every expert local: the counts and flags
  /// from the config, the work and side columns from its experts (a runner
  /// with experts on other ranks sets ranks and local_experts after).
  static MoECacheShape local(const MoEConfig& cfg, Index work_cols, Index shared_work_cols, Index side_cols) {
    MoECacheShape s;
    s.d_model = cfg.d_model;
    s.n_experts = s.local_experts = cfg.n_experts;
    s.n_active = cfg.n_active;
    s.n_shared = cfg.n_shared;
    s.work_cols = work_cols;
    s.shared_work_cols = cfg.n_shared > 0 ? shared_work_cols : 0;
    s.side_cols = side_cols;
    s.gated = cfg.shared_expert_gate;
    s.capacity_on = cfg.routing.capacity_factor > 0;
    return s;
  }
};

namespace detail {

/// ShapeError naming the part of `c` that a forward of a layer of shape `s`
/// would not have left (a default-constructed cache holds none).
template <class T>
void check_moe_cache(const char* where, const MoECache<T>& c, const MoECacheShape& s) {
  const Index n = c.x.rows(), k = s.n_active;
  check_shape(where, "cache.x", c.x, kAny, s.d_model);
  dispatch::check_plan(where, "cache", c.plan, n, k, s.n_experts);
  check_shape(where, "cache.routing.weights", c.routing.weights, n, k);
  check_shape(where, "cache.routing.experts", c.routing.experts, n, k);
  check_shape(where, "cache.routing.logits", c.routing.logits, n, s.n_experts);
  const RowExchange& ex = c.exchange;
  const bool local = s.ranks == 0;
  if (ex.ranks() != s.ranks || Index(ex.recv_rows.size()) != s.ranks ||
      (!local && (ex.sent() != c.plan.rows() || Index(ex.local_offset.size()) != s.local_experts + 1 ||
                  ex.local_offset.back() != ex.received())))
    throw ShapeError(std::string(where) + ": argument 'cache.exchange' was not filled by a forward of this layer");
  const Index rows = local ? c.plan.rows() : ex.received();  // R, the block-order rows
  check_shape(where, "cache.x_sorted", c.x_sorted, rows, s.d_model);
  check_shape(where, "cache.side_sorted", c.side_sorted, rows * s.side_cols, 1);
  check_shape(where, "cache.work", c.work, rows, s.work_cols);
  check_shape(where, "cache.y_sorted", c.y_sorted, c.plan.rows(), s.d_model);
  if (Index(c.shared_work.size()) != s.n_shared || Index(c.shared_y.size()) != s.n_shared)
    throw ShapeError(std::string(where) + ": argument 'cache' holds " + std::to_string(c.shared_work.size()) +
                     " shared-expert workspaces, expected " + std::to_string(s.n_shared));
  for (const auto& w : c.shared_work) check_shape(where, "cache.shared_work", w, n, s.shared_work_cols);
  for (const auto& y : c.shared_y) check_shape(where, "cache.shared_y", y, n, s.d_model);
  check_shape(where, "cache.shared_gate", c.shared_gate, s.gated ? n : 0, 1);
  if (s.capacity_on) check_shape(where, "cache.kept_weights", c.kept_weights, n, k);
  for (Index p : c.dropped)
    if (p < 0 || p >= n * k)
      throw ShapeError(std::string(where) + ": argument 'cache.dropped' holds pair " + std::to_string(p) +
                       ", expected a value in [0, " + std::to_string(n * k) + ")");
}

}  // namespace detail
}  // namespace apex
