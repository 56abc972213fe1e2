#pragma once
/// \file moe/dispatch.hpp
/// Grouped dispatch: the plan (a counting sort of (token, slot) pairs by
/// expert) and every movement of data it drives, for MoEFFN and for any layer
/// that sends sorted rows elsewhere (an expert-parallel exchange, a packed
/// expert engine). Nothing here knows about experts; see
/// docs/math.md#mixture-of-experts for the layer these serve.
///
/// Row r of the sorted buffers holds pair (token[r], slot[r]); expert e owns
/// the contiguous rows [offset[e], offset[e+1]). The sort is stable, so within
/// an expert rows are in token order, and the plan depends only on the
/// routing — never on thread count — which is what makes every result built
/// from it bitwise reproducible. `row(t, k)` is the inverse map: the sorted
/// row of pair (t, k).
///
/// The movements (namespace apex::dispatch), forward and their backward:
///
///     gather_rows        x_sorted[r] = x[token[r]]              (NK × d)
///     gather_side_input  s_sorted[r] = side input of pair r     (NK)
///     combine            y_t = Σ_s D_s[t] + Σ_k g_tk·y_sorted[row(t,k)]
///     combine_backward   ∂L/∂g_tk = dy_t·y_sorted[row(t,k)],  dy_sorted[row(t,k)] = g_tk·dy_t
///     gather_backward    dx_t += Σ_s dD_s[t] + Σ_k dx_sorted[row(t,k)]
///     scatter_side_grad  d_pair(t, k) = ds_sorted[row(t,k)]     (N × K)
///
/// Every sum over a token runs in fixed order (dense terms, then slots
/// 0..K−1) inside one task, so no atomics and no thread-count dependence.

#include <algorithm>
#include <string>
#include <type_traits>
#include <vector>

#include "../core/errors.hpp"
#include "expert_contract.hpp"
#include "../core/parallel.hpp"
#include "router.hpp"
#include "../core/types.hpp"

namespace apex {

struct DispatchPlan {
  Index n_tokens = 0, n_active = 0, n_experts = 0;
  std::vector<Index> offset;  ///< E + 1: prefix sums of per-expert counts
  std::vector<Index> token;   ///< N·K: sorted row → token
  std::vector<Index> slot;    ///< N·K: sorted row → slot k
  std::vector<Index> row_of;  ///< N·K: (t, k) → sorted row

  Index rows() const { return n_tokens * n_active; }
  /// The sorted row of pair (token t, slot k).
  Index row(Index t, Index k) const { return row_of[t * n_active + k]; }
  Index count(Index e) const { return offset[e + 1] - offset[e]; }
  /// c_e for every expert.
  std::vector<Index> counts() const {
    std::vector<Index> c(n_experts);
    for (Index e = 0; e < n_experts; ++e) c[e] = count(e);
    return c;
  }

  /// c_e counting only the pairs of tokens t with token_counted[t] (length
  /// N, checked by the caller): expert e's rows are its pairs.
  std::vector<Index> counts(const std::vector<bool>& token_counted) const {
    std::vector<Index> c(n_experts, 0);
    for (Index e = 0; e < n_experts; ++e)
      for (Index r = offset[e]; r < offset[e + 1]; ++r) c[e] += token_counted[token[r]];
    return c;
  }

  /// Builds the plan from N × K expert ids in [0, n_experts). Throws
  /// ValueError for a negative n_experts or an id outside that range, and
  /// then leaves the plan empty.
  void build(const IndexMatrix& experts, Index n_experts_) {
    if (n_experts_ < 0) fail("n_experts is " + std::to_string(n_experts_) + ", expected a value >= 0");
    n_tokens = experts.rows();
    n_active = experts.cols();
    n_experts = n_experts_;
    // 1. histogram  2. exclusive prefix sum  3. stable scatter + inverse map
    offset.assign(std::size_t(n_experts) + 1, 0);
    // One unsigned compare per id covers both < 0 and ≥ E: an id outside the
    // range would write past `offset` here and past the sorted rows below.
    const auto limit = static_cast<std::make_unsigned_t<Index>>(n_experts);
    for (Index t = 0; t < n_tokens; ++t)
      for (Index k = 0; k < n_active; ++k) {
        const Index e = experts(t, k);
        if (static_cast<std::make_unsigned_t<Index>>(e) >= limit)
          fail("argument 'experts' has expert id " + std::to_string(e) + " at (" + std::to_string(t) + ", " +
               std::to_string(k) + "), expected a value in [0, " + std::to_string(n_experts) + ")");
        ++offset[std::size_t(e) + 1];
      }
    for (Index e = 0; e < n_experts; ++e) offset[e + 1] += offset[e];
    token.resize(rows());
    slot.resize(rows());
    row_of.resize(rows());
    // offset[e] is expert e's cursor during the scatter (no scratch to
    // allocate): it ends at e's end, offset[e + 1], and is shifted back after.
    for (Index t = 0; t < n_tokens; ++t)
      for (Index k = 0; k < n_active; ++k) {
        const Index r = offset[std::size_t(experts(t, k))]++;
        token[r] = t;
        slot[r] = k;
        row_of[t * n_active + k] = r;
      }
    for (Index e = n_experts; e > 0; --e) offset[std::size_t(e)] = offset[std::size_t(e) - 1];
    offset[0] = 0;
  }

 private:
  /// Empties the plan and throws ValueError naming build.
  [[noreturn]] void fail(const std::string& what) {
    *this = DispatchPlan{};
    throw ValueError("DispatchPlan::build: " + what);
  }
};

namespace dispatch {

/// T as written, in a position template deduction skips, so an argument that
/// converts (a Matrix for a Ref) does not need the exact type.
template <class T>
using Same = typename std::common_type<T>::type;

/// Rows per task of the movement loops: a token's K rows are a few KB, so a
/// block amortises the scheduling of one task.
inline constexpr Index kRowBlock = 64;

/// fn(i) for i in [0, n), in blocks of kRowBlock indices shared by threads.
template <class Fn>
void for_each_blocked(Index n, int threads, Fn&& fn) {
  detail::parallel_for((n + kRowBlock - 1) / kRowBlock, threads, [&](Index blk) {
    const Index i0 = blk * kRowBlock, i1 = std::min(n, i0 + kRowBlock);
    for (Index i = i0; i < i1; ++i) fn(i);
  });
}

/// ShapeError naming `where` and argument `arg` unless `plan` is a plan of
/// n_tokens tokens, K = n_active and E = n_experts, with every array of its
/// size (a default-constructed plan has none).
inline void check_plan(const char* where, const char* arg, const DispatchPlan& plan, Index n_tokens, Index n_active,
                       Index n_experts) {
  const Index rows = plan.n_tokens * plan.n_active;
  if (plan.n_tokens != n_tokens || plan.n_active != n_active || plan.n_experts != n_experts ||
      Index(plan.offset.size()) != n_experts + 1 || Index(plan.row_of.size()) != rows ||
      Index(plan.token.size()) != rows || Index(plan.slot.size()) != rows)
    throw ShapeError(std::string(where) + ": argument '" + arg + "' holds a dispatch plan for " +
                     std::to_string(plan.n_tokens) + " tokens, K = " + std::to_string(plan.n_active) +
                     ", E = " + std::to_string(plan.n_experts) + ", expected " + std::to_string(n_tokens) +
                     " tokens, K = " + std::to_string(n_active) + ", E = " + std::to_string(n_experts));
}

/// x_sorted (resized to NK × d) [r] = x[token[r]].  x: N × d.
template <class T>
void gather_rows(const DispatchPlan& plan, const ConstMatrixRef<Same<T>>& x, Matrix<T>& x_sorted, int threads) {
  check_plan("dispatch::gather_rows", "plan", plan, x.rows(), plan.n_active, plan.n_experts);
  x_sorted.resize(plan.rows(), x.cols());
  for_each_blocked(plan.rows(), threads, [&](Index r) { x_sorted.row(r) = x.row(plan.token[r]); });
}

/// The side input of every sorted row (resized to NK, or to 0 for
/// NoSideInput): for RouterLogitInput, ℓ[t, e] of pair r = (t, k), e = e_k.
template <class T>
void gather_side_input(NoSideInput, const DispatchPlan&, const Routing<T>&, Vector<T>& side_sorted) {
  side_sorted.resize(0);
}
template <class T>
void gather_side_input(RouterLogitInput, const DispatchPlan& plan, const Routing<T>& routing,
                       Vector<T>& side_sorted) {
  check_plan("dispatch::gather_side_input", "plan", plan, routing.experts.rows(), routing.experts.cols(), plan.n_experts);
  detail::check_shape("dispatch::gather_side_input", "routing.logits", routing.logits, plan.n_tokens, plan.n_experts);
  side_sorted.resize(plan.rows());
  for (Index r = 0; r < plan.rows(); ++r)
    side_sorted(r) = routing.logits(plan.token[r], routing.experts(plan.token[r], plan.slot[r]));
}

/// ∂L/∂s per pair in token order: d_pair (N × K) (t, k) = d_side_sorted[row(t, k)]
/// (d_side_sorted: NK); for NoSideInput d_pair is left empty (0 × 0), which
/// Router::backward reads as "no extra logit gradient".
template <class T>
void scatter_side_grad(NoSideInput, const DispatchPlan&, const Vector<T>&, Matrix<T>& d_pair) {
  d_pair.resize(0, 0);
}
template <class T>
void scatter_side_grad(RouterLogitInput, const DispatchPlan& plan, const Vector<T>& d_side_sorted, Matrix<T>& d_pair) {
  check_plan("dispatch::scatter_side_grad", "plan", plan, plan.n_tokens, plan.n_active, plan.n_experts);
  detail::check_shape("dispatch::scatter_side_grad", "d_side_sorted", d_side_sorted, plan.rows(), 1);
  d_pair.resize(plan.n_tokens, plan.n_active);
  for (Index t = 0; t < plan.n_tokens; ++t)
    for (Index k = 0; k < plan.n_active; ++k) d_pair(t, k) = d_side_sorted(plan.row(t, k));
}

/// y_t = Σ_s dense[s][t] + Σ_k g_tk·y_sorted[row(t, k)], in that order (the
/// first term assigns, so y is written once per term and never cleared).
/// weights: N × K, y_sorted: NK × d, dense: each N × d, y: N × d.
template <class T>
void combine(const DispatchPlan& plan, const Matrix<T>& weights, const Matrix<T>& y_sorted,
             const std::vector<Matrix<T>>& dense, MatrixRef<Same<T>> y, int threads) {
  constexpr const char* where = "dispatch::combine";
  const Index n = plan.n_tokens, k_count = plan.n_active;
  check_plan(where, "plan", plan, n, k_count, plan.n_experts);
  detail::check_shape(where, "weights", weights, n, k_count);
  detail::check_shape(where, "y_sorted", y_sorted, plan.rows(), y.cols());
  detail::check_shape(where, "y", y, n, detail::kAny);
  for (const auto& term : dense) detail::check_shape(where, "dense", term, n, y.cols());
  if (k_count == 0 && dense.empty()) {  // nothing to add: y = 0
    y.setZero();
    return;
  }
  for_each_blocked(n, threads, [&](Index t) {
    auto yt = y.row(t);
    Index k = 0;
    if (dense.empty()) {
      yt = weights(t, 0) * y_sorted.row(plan.row(t, 0));
      k = 1;
    } else {
      yt = dense.front().row(t);
      for (std::size_t s = 1; s < dense.size(); ++s) yt += dense[s].row(t);
    }
    for (; k < k_count; ++k) yt += weights(t, k) * y_sorted.row(plan.row(t, k));
  });
}

/// Backward of combine's routed part, given dy (N × d):
///     d_weights (N × K) (t, k) = ∂L/∂g_tk = dy_t · y_sorted[row(t, k)]
///     dy_sorted (NK × d) [row(t, k)] = ∂L/∂y_sorted = g_tk · dy_t
/// (both assigned). The dense terms' gradient is dy itself.
template <class T, class DYSorted>
void combine_backward(const DispatchPlan& plan, const Matrix<T>& weights, const ConstMatrixRef<Same<T>>& dy,
                      const Matrix<T>& y_sorted, Matrix<T>& d_weights, const Eigen::MatrixBase<DYSorted>& dy_sorted_,
                      int threads) {
  constexpr const char* where = "dispatch::combine_backward";
  auto& dy_sorted = const_cast<Eigen::MatrixBase<DYSorted>&>(dy_sorted_);
  const Index n = plan.n_tokens, k_count = plan.n_active;
  check_plan(where, "plan", plan, n, k_count, plan.n_experts);
  detail::check_shape(where, "weights", weights, n, k_count);
  detail::check_shape(where, "dy", dy, n, detail::kAny);
  detail::check_shape(where, "y_sorted", y_sorted, plan.rows(), dy.cols());
  detail::check_shape(where, "dy_sorted", dy_sorted, plan.rows(), dy.cols());
  d_weights.resize(n, k_count);
  for_each_blocked(n, threads, [&](Index t) {
    for (Index k = 0; k < k_count; ++k) {
      const Index r = plan.row(t, k);
      d_weights(t, k) = dy.row(t).dot(y_sorted.row(r));
      dy_sorted.row(r) = weights(t, k) * dy.row(t);
    }
  });
}

/// Backward of gather_rows, plus dense terms: adds into dx (N × d), per token
/// in this order, Σ_s dense_dx[s·N + t] then Σ_k dx_sorted[row(t, k)].
/// dense_dx: S·N × d (term s in rows [s·N, (s+1)·N)), dx_sorted: NK × d.
template <class T, class DXSorted, class DenseDX>
void gather_backward(const DispatchPlan& plan, const Eigen::MatrixBase<DXSorted>& dx_sorted,
                     const Eigen::MatrixBase<DenseDX>& dense_dx, Index n_dense, Matrix<T>& dx, int threads) {
  constexpr const char* where = "dispatch::gather_backward";
  const Index n = plan.n_tokens, k_count = plan.n_active;
  check_plan(where, "plan", plan, n, k_count, plan.n_experts);
  detail::check_shape(where, "dx", dx, n, detail::kAny);
  detail::check_shape(where, "dx_sorted", dx_sorted, plan.rows(), dx.cols());
  detail::check_shape(where, "dense_dx", dense_dx, n_dense * n, dx.cols());
  for_each_blocked(n, threads, [&](Index t) {
    auto dxt = dx.row(t);
    for (Index s = 0; s < n_dense; ++s) dxt += dense_dx.row(s * n + t);
    for (Index k = 0; k < k_count; ++k) dxt += dx_sorted.row(plan.row(t, k));
  });
}

}  // namespace dispatch
}  // namespace apex
