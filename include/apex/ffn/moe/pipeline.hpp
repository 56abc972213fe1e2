#pragma once
/// \file moe/pipeline.hpp
/// The MoE pipeline, written once for every MoE layer:
///
///     forward:  route → plan → capacity → [gather → experts → rows back] → shared gate → combine
///     backward: combine → shared gate → [experts] → route → gather
///
/// The bracketed step is the layer's *expert runner*; everything else —
/// routing on the float router, the capacity rule's weights, the shared
/// gate, the fixed-order combine and their backward — is here. The runners:
///  - MoEFFN (moe/local_runner.hpp): every expert local, blocks in plan order;
///  - PackedMoE (inference/engine/packed_runner.hpp): local packed experts, forward only;
///  - ExpertParallelMoE (mpi/exchange_runner.hpp): rows to the experts'
///    owners and back, the owners running moe/local_experts.hpp.
///
/// A runner `r` provides:
///  - `config()`, `threads()` (resolved), `router()`, `bias()`, `shared_gate()` (1 × d or empty);
///  - `phase(where, Phase, fn)`: runs one local step. A local runner calls
///    fn; the expert-parallel one agrees on its outcome across ranks, so a
///    bad input on one rank throws on all (mpi/communicator.hpp), and times it;
///  - `apply_capacity(where, cache)`: fills cache.dropped and kept_weights;
///  - `run_experts(where, x, cache)`: cache.y_sorted (plan order) and the
///    shared experts' outputs, with whatever its backward will need;
/// and, for a layer with a backward, `cache_shape()`, `allocate_gradients()`,
/// `check_same_forward(where, cache)`, `gradient_scope(fn)` (the
/// expert-parallel runner sums the replicated gradients of the step across
/// ranks around fn, and restores them if it throws), `backward_experts(…)`,
/// `router_grad()` (the router, to add into its gradient) and `shared_gate_grad()`.
/// Every gradient is allocated in backward's first phase, before any
/// parallel section: no task allocates, and a step that throws later has
/// added nothing to the routed experts' gradients.

#include <utility>

#include "../core/checked_size.hpp"
#include "../core/errors.hpp"
#include "../core/parallel.hpp"
#include "../core/types.hpp"
#include "../core/workspace.hpp"
#include "dispatch.hpp"
#include "expert_contract.hpp"
#include "moe_cache.hpp"
#include "shared_expert_gate.hpp"

namespace apex::detail {

struct MoEDySortedTag;  ///< backward workspace: g·dy in plan order
struct MoEDxSortedTag;  ///< backward workspace: the experts' ∂L/∂x in plan order
struct MoESharedDxTag;  ///< backward workspace: the shared experts' ∂L/∂x

/// The pipeline's steps, for a runner that agrees or times them.
enum class MoEPhase { route, combine, open_backward, combine_backward, route_backward };

struct MoEPipeline {
  /// y (N × d) = MoE(x); x (N × d) is checked here. Every read of x happens
  /// before the combine writes y, so y may be x. With `keep_input` the cache
  /// keeps x for backward.
  template <class T, class Runner>
  static void forward(const char* where, const Runner& r, const ConstMatrixRef<T>& x, MatrixRef<T> y,
                      MoECache<T>& c, bool keep_input) {
    const auto& cfg = r.config();
    r.phase(where, MoEPhase::route, [&] {
      check_shape(where, "x", x, kAny, cfg.d_model);
      serial([&] { r.router().route(x, r.bias(), cfg.weights_from_unbiased, c.routing); });
      c.plan.build(c.routing.experts, cfg.n_experts);
    });
    r.apply_capacity(where, c);
    r.run_experts(where, x, c);
    r.phase(where, MoEPhase::combine, [&] {
      // shared gate: D_s ← σ(x·w_gate) ⊙ D_s per token (Qwen2-MoE)
      if (cfg.shared_expert_gate) shared_gate_forward<T>(x, r.shared_gate(), c.shared_gate, c.shared_y);
      else c.shared_gate.resize(0);
      if (keep_input) c.x = x;  // the last read of x: y may alias it
      // combine: shared experts, then slots 0..K−1, per token in fixed order
      const bool capacity_on = cfg.routing.capacity_factor > 0;
      dispatch::combine(c.plan, combine_weights(c, capacity_on), c.y_sorted, c.shared_y, y, r.threads());
    });
  }

  /// dy: N × d → dx: N × d, adding into every gradient the runner holds. The
  /// mirror of forward: combine → experts → route → gather.
  template <class T, class Runner>
  static Matrix<T> backward(const char* where, Runner& r, const ConstMatrixRef<T>& dy, const MoECache<T>& c) {
    const auto& cfg = r.config();
    const Index n = c.x.rows(), d = cfg.d_model, k = cfg.n_active, n_shared = cfg.n_shared;
    r.phase(where, MoEPhase::open_backward, [&] {
      check_moe_cache(where, c, r.cache_shape());
      check_shape(where, "dy", dy, n, d);
      checked_product(where, "shared gradient rows n_shared*N", {n_shared, n});
      r.allocate_gradients();  // before any task: none allocates
      // The workspaces below grow here, where a failed allocation is agreed like any error.
      thread_workspace<T, MoEDySortedTag>(c.plan.rows(), d);
      thread_workspace<T, MoEDxSortedTag>(c.plan.rows(), d);
      thread_workspace<T, MoESharedDxTag>(n_shared * n, d);
    });
    r.check_same_forward(where, c);

    // The large scratch is per-thread workspace, reused across steps (core/workspace.hpp).
    const Index rows = c.plan.rows();
    auto dy_sorted = thread_workspace<T, MoEDySortedTag>(rows, d);          // NK × d: g·dy, plan order
    auto dx_sorted = thread_workspace<T, MoEDxSortedTag>(rows, d);          // NK × d: the experts' ∂L/∂x
    auto shared_dx = thread_workspace<T, MoESharedDxTag>(n_shared * n, d);  // S·N × d: expert s at rows s·N
    using Side = expert_side_input_t<typename Runner::ExpertType>;
    Vector<T> dside_sorted;   // NK (or 0): ∂L/∂ of the experts' side input
    Matrix<T> d_weights;      // N × K: ∂L/∂g
    Matrix<T> dy_shared, dz;  // N × d: σ ⊙ dy for the shared experts; N × 1: ∂L/∂(x·w_gate)
    Matrix<T> d_pair, dx;     // N × K (or 0 × 0): ∂L/∂ℓ from the side input; N × d: the result
    const bool gated = cfg.shared_expert_gate && n_shared > 0;
    const bool capacity_on = cfg.routing.capacity_factor > 0;
    r.gradient_scope([&] {
      r.phase(where, MoEPhase::combine_backward, [&] {
        dispatch::combine_backward(c.plan, combine_weights(c, capacity_on), dy, c.y_sorted, d_weights, dy_sorted,
                                   r.threads());
        for (Index p : c.dropped) d_weights(p / k, p % k) = T(0);  // no effect on y, no gradient
        // shared gate: the shared experts see σ ⊙ dy; ∂L/∂z_t = (1 − σ_t) ⟨dy_t, Σ_s D_s[t]⟩
        // (D_s gated), z = x·w_gate: ∂L/∂w_gate += ∂zᵀ·X, ∂L/∂x += ∂z·w_gate (after the gather).
        if (gated) shared_gate_backward<T>(c.x, dy, c.shared_gate, c.shared_y, r.shared_gate_grad(), dy_shared, dz);
        dside_sorted = Vector<T>::Zero(rows * expert_side_cols<typename Runner::ExpertType>);
      });
      const ConstMatrixRef<T> dy_for_shared = gated ? ConstMatrixRef<T>(dy_shared) : dy;
      r.backward_experts(where, c, dy_sorted, dy_for_shared, dx_sorted, dside_sorted, shared_dx);
      r.phase(where, MoEPhase::route_backward, [&] {
        // route: ∂L/∂ℓ from the softmax and from the side input, into W_router and x
        dispatch::scatter_side_grad(Side{}, c.plan, dside_sorted, d_pair);
        serial([&] { dx = r.router_grad().backward(c.x, c.routing, d_weights, d_pair); });
        // gather: ∂L/∂x per token in fixed order: router, shared, slots 0..K−1
        dispatch::gather_backward(c.plan, dx_sorted, shared_dx, n_shared, dx, r.threads());
        if (gated) dx.noalias() += dz * r.shared_gate();
      });
    });
    return dx;
  }

  /// One reusable cache per thread and layer type for a forward without one, so
  /// a forward does not map and fault in tens of MB of fresh pages every
  /// time (glibc serves blocks > 32 MB with mmap).
  template <class T, class Layer>
  static MoECache<T>& scratch() {
    thread_local MoECache<T> cache;
    return cache;
  }
};

}  // namespace apex::detail
