#pragma once
/// \file routed_experts.hpp
/// The routed experts of an MoE block whose router runs elsewhere (in a
/// Hugging Face model, the block's own router module): given each token's
/// K expert ids and weights, the library's grouped dispatch runs the
/// experts and combines their outputs,
///
///     y_t = Σ_k g_tk · Expert_{e_tk}(x_t)
///
/// and its backward gives ∂L/∂x, ∂L/∂g and whatever each expert adds into
/// its own gradients:
///
///     ∂L/∂g_tk = dy_t · Expert_{e_tk}(x_t)        (y_sorted, kept from the forward)
///     ∂L/∂x_t  = Σ_k ∂L/∂x of pair (t, k)          through expert e_tk with dy g_tk·dy_t
///
/// This is the MoE pipeline of moe/pipeline.hpp without its route step:
/// the plan is moe/dispatch.hpp's counting sort, the tasks are
/// moe/expert_tasks.hpp's (expert × row tile), the experts run through the
/// expert contract's blocks; every sum over a token runs in slot order, so
/// the bits do not depend on the thread count.
///
/// Expert-parallel empty slots (transformers' `_is_expert_parallel`: ids ≥
/// E stand for experts held by another rank) sort after every expert, into
/// an extra bucket no expert runs: their rows are zero and give no
/// gradient.

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <apex/ffn/core/errors.hpp>
#include <apex/ffn/core/parallel.hpp>
#include <apex/ffn/core/types.hpp>
#include <apex/ffn/core/workspace.hpp>
#include <apex/ffn/moe/dispatch.hpp>
#include <apex/ffn/moe/expert_tasks.hpp>

namespace apex::python {

/// Most rows of a forward task (the packed layers' tile: small enough to
/// share a 2048-row batch between threads, large enough to amortise a
/// weight stream).
inline constexpr Index kTileRows = 256;

/// One call's routing: the plan over E experts and the empty-slot bucket.
struct Routing {
  DispatchPlan plan;          ///< over E + 1 buckets; bucket E: the empty slots
  std::vector<Index> offset;  ///< E + 1: the experts' blocks, plan.offset without the empty bucket
  Matrix<float> weights;      ///< N × K: g, 0 at the empty slots
  IndexMatrix buckets;        ///< N × K: each slot's bucket (E for an empty slot), the plan's input
  Index n = 0, k = 0, experts = 0;

  /// Rows the experts run (the empty slots' rows follow them).
  Index routed_rows() const { return offset.back(); }
};

/// Fills `r` with the routing of ids (N × K) and weights (N × K) over E
/// experts, reusing its buffers (a decode step that keeps `r` allocates
/// nothing). ValueError naming the pair for a negative id, or an id ≥ E
/// unless `expert_parallel`; `r` is then to be rebuilt before use.
inline void build_routing(Routing& r, const char* where, const std::int64_t* ids, const float* weights, Index n,
                          Index k, Index experts, bool expert_parallel) {
  r.n = n, r.k = k, r.experts = experts;
  r.buckets.resize(n, k);
  r.weights.resize(n, k);
  for (Index t = 0; t < n; ++t)
    for (Index s = 0; s < k; ++s) {
      const std::int64_t e = ids[t * k + s];
      const bool empty = e >= experts && expert_parallel;
      if (e < 0 || (e >= experts && !expert_parallel))
        throw ValueError(std::string(where) + ": argument 'top_k_index' has expert id " + std::to_string(e) +
                         " at (" + std::to_string(t) + ", " + std::to_string(s) + "), expected a value in [0, " +
                         std::to_string(experts) + ")" +
                         (e >= experts ? " (ids >= num_experts are empty slots only in an expert-parallel module)" : ""));
      r.buckets(t, s) = empty ? experts : Index(e);
      r.weights(t, s) = empty ? 0.0f : weights[t * k + s];
    }
  r.plan.build(r.buckets, experts + 1);
  r.offset.assign(r.plan.offset.begin(), r.plan.offset.end() - 1);
}

/// The routing in a new value (a training call keeps it between its steps).
inline Routing make_routing(const char* where, const std::int64_t* ids, const float* weights, Index n, Index k,
                            Index experts, bool expert_parallel) {
  Routing r;
  build_routing(r, where, ids, weights, n, k, experts, expert_parallel);
  return r;
}

/// The routing in the calling thread's kept value: for inference calls,
/// which read it only until they return.
inline const Routing& thread_routing(const char* where, const std::int64_t* ids, const float* weights, Index n,
                                     Index k, Index experts, bool expert_parallel) {
  thread_local Routing kept;
  build_routing(kept, where, ids, weights, n, k, experts, expert_parallel);
  return kept;
}

namespace detail_routed {
struct XSortedTag;
struct DySortedTag;
struct DxSortedTag;
}  // namespace detail_routed

/// x_sorted (rows × d) [r] = x[token[r]] for the experts' rows.
inline auto gather(const Routing& r, const float* x, Index d, int threads) {
  auto xs = apex::detail::thread_workspace<float, detail_routed::XSortedTag>(r.routed_rows(), d);
  dispatch::for_each_blocked(r.routed_rows(), threads, [&](Index row) {
    std::memcpy(xs.row(row).data(), x + r.plan.token[row] * d, std::size_t(d) * sizeof(float));
  });
  return xs;
}

/// The forward: y_sorted (NK × d, plan order) from every expert's block,
/// then y (N × d) = Σ_k g_tk · y_sorted[row(t, k)] in slot order.
/// run(task, x_rows, y_rows) runs one (expert × row tile) task: x_rows,
/// y_rows are its m × d blocks of x_sorted and y_sorted.
template <class RunTask>
void forward(const Routing& r, const float* x, Index d, float* y_sorted, float* y, int threads, RunTask&& run) {
  const Index rows = r.plan.rows(), routed = r.routed_rows();
  Eigen::Map<Matrix<float>> ys(y_sorted, rows, d);
  if (routed > 0) {
    const auto xs = gather(r, x, d, threads);
    const auto& tasks = apex::detail::kept_forward_tasks<Routing>(r.offset, 0, r.n, kTileRows);
    apex::detail::parallel_for(Index(tasks.size()), threads, [&](Index i) {
      const apex::detail::ExpertTask& t = tasks[std::size_t(i)];
      run(t, xs.middleRows(t.begin, t.rows), ys.middleRows(t.begin, t.rows));
    });
  }
  ys.bottomRows(rows - routed).setZero();  // empty slots
  Eigen::Map<Matrix<float>> out(y, r.n, d);
  dispatch::for_each_blocked(r.n, threads, [&](Index t) {
    auto yt = out.row(t);
    yt.setZero();
    for (Index s = 0; s < r.k; ++s) yt += r.weights(t, s) * ys.row(r.plan.row(t, s));
  });
}

/// The backward of forward, given dy (N × d) and the forward's y_sorted:
/// d_weights (N × K) = ∂L/∂g (0 at the empty slots), dx (N × d) = ∂L/∂x.
/// run(task, x_rows, dy_rows, dx_rows) runs one expert's backward on its
/// block (one task per non-empty expert: its gradients are its own), given
/// ∂L/∂(its outputs) = g·dy in dy_rows, writing ∂L/∂(its inputs) into dx_rows.
template <class RunTask>
void backward(const Routing& r, const float* x, const float* dy, const float* y_sorted, Index d, float* dx,
              float* d_weights, int threads, RunTask&& run) {
  const Index routed = r.routed_rows();
  Eigen::Map<const Matrix<float>> ys(y_sorted, r.plan.rows(), d), dyt(dy, r.n, d);
  auto dys = apex::detail::thread_workspace<float, detail_routed::DySortedTag>(routed, d);
  auto dxs = apex::detail::thread_workspace<float, detail_routed::DxSortedTag>(routed, d);
  // ∂L/∂g_tk = dy_t · y_sorted[row(t, k)],  dy_sorted[row(t, k)] = g_tk · dy_t
  dispatch::for_each_blocked(r.n, threads, [&](Index t) {
    for (Index s = 0; s < r.k; ++s) {
      const Index row = r.plan.row(t, s);
      const bool empty = row >= routed;
      d_weights[t * r.k + s] = empty ? 0.0f : dyt.row(t).dot(ys.row(row));
      if (!empty) dys.row(row) = r.weights(t, s) * dyt.row(t);
    }
  });
  if (routed > 0) {
    const auto xs = gather(r, x, d, threads);
    const auto tasks = apex::detail::backward_tasks(r.offset, 0, r.n);
    apex::detail::parallel_for(Index(tasks.size()), threads, [&](Index i) {
      const apex::detail::ExpertTask& t = tasks[std::size_t(i)];
      run(t, xs.middleRows(t.begin, t.rows), dys.middleRows(t.begin, t.rows), dxs.middleRows(t.begin, t.rows));
    });
  }
  // ∂L/∂x_t = Σ_k dx_sorted[row(t, k)], slots in order
  Eigen::Map<Matrix<float>> dxt(dx, r.n, d);
  dispatch::for_each_blocked(r.n, threads, [&](Index t) {
    auto out = dxt.row(t);
    out.setZero();
    for (Index s = 0; s < r.k; ++s) {
      const Index row = r.plan.row(t, s);
      if (row < routed) out += dxs.row(row);
    }
  });
}

}  // namespace apex::python
