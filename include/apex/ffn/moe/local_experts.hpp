#pragma once
/// \file moe/local_experts.hpp
/// The expert compute of the experts held by this process: routed experts
/// on their blocks of rows (one block per expert, at `offset`) and the
/// shared experts on the tokens, threaded over (expert × row tile) tasks —
/// the runner of MoEFFN (blocks in plan order) and of a rank of
/// ExpertParallelMoE (blocks expert-major, moe/row_exchange.hpp).
///
/// The tasks (moe/expert_tasks.hpp): forward tiles each block of m rows into
/// ⌈m / max_tile⌉ near-equal tiles (MoEFFN::kMaxTileRows), so a routed
/// expert sees the same row blocks on one rank of an expert-parallel layer
/// as in MoEFFN on the concatenated batch; backward runs one task per
/// non-empty expert (its weight gradients are its own) and per shared
/// expert. Tasks write disjoint rows, so results do not depend on threads,
/// and no task allocates (the caller allocated every gradient).

#include <algorithm>
#include <vector>

#include "../moe/expert_contract.hpp"
#include "../moe/expert_tasks.hpp"
#include "../core/parallel.hpp"
#include "../core/types.hpp"
#include "../core/workspace.hpp"

namespace apex::detail {

/// Forward of the local experts: y_local (R × d) from x_local (expert-major)
/// and its side input; the shared experts' outputs shared_y[s] (n × d) from
/// x. Fills the workspaces backward reads (work: R × w; shared_work[s]).
template <class Expert, class Shared, class T>
void local_forward(const std::vector<Expert>& experts, const std::vector<Shared>& shared, const ConstMatrixRef<T>& x,
                   const Matrix<T>& x_local, const Vector<T>& side_local, const std::vector<Index>& offset,
                   Matrix<T>& work, Matrix<T>& y_local, std::vector<Matrix<T>>& shared_work,
                   std::vector<Matrix<T>>& shared_y, Index max_tile, int threads) {
  const Index rows = x_local.rows(), n = x.rows(), d = x.cols();
  work.resize(rows, experts.front().work_cols());
  y_local.resize(rows, d);
  shared_work.resize(shared.size());
  shared_y.resize(shared.size());
  for (auto& w : shared_work) w.resize(n, shared.empty() ? 0 : shared.front().work_cols());
  for (auto& ys : shared_y) ys.resize(n, d);
  const auto tasks = forward_tasks(offset, Index(shared.size()), n, max_tile);
  parallel_for(Index(tasks.size()), threads, [&](Index i) {
    const ExpertTask& t = tasks[std::size_t(i)];
    const std::size_t id = std::size_t(t.id);
    if (t.shared)
      shared[id].forward_block(x.middleRows(t.begin, t.rows), shared_work[id].middleRows(t.begin, t.rows),
                               shared_y[id].middleRows(t.begin, t.rows));
    else
      expert_forward(experts[id], x_local.middleRows(t.begin, t.rows), side_local, t.begin, t.rows,
                                   work.middleRows(t.begin, t.rows), y_local.middleRows(t.begin, t.rows));
  });
}

/// Backward of local_forward: dx_local (R × d) and dside_local (R or 0) from
/// dy_local (expert-major g·dy); shared_dx (S·n × d, expert s in rows
/// [s·n, (s+1)·n)) from dy (n × d). Adds into every local expert's and shared
/// expert's weight gradients.
template <class Expert, class Shared, class T, class DyLocal, class DxLocal, class SharedDx>
void local_backward(std::vector<Expert>& experts, std::vector<Shared>& shared, const Matrix<T>& x,
                    const ConstMatrixRef<T>& dy, const Matrix<T>& x_local, const Vector<T>& side_local,
                    const std::vector<Index>& offset, const Matrix<T>& work, const std::vector<Matrix<T>>& shared_work,
                    const DyLocal& dy_local, DxLocal& dx_local, Vector<T>& dside_local, SharedDx& shared_dx,
                    int threads) {
  const Index n = x.rows();
  const auto tasks = backward_tasks(offset, Index(shared.size()), n);
  parallel_for(Index(tasks.size()), threads, [&](Index i) {
    const ExpertTask& t = tasks[std::size_t(i)];
    const std::size_t id = std::size_t(t.id);
    if (t.shared)
      shared[id].backward_block(x, shared_work[id], dy, shared_dx.middleRows(t.id * n, n));
    else
      expert_backward(experts[id], x_local.middleRows(t.begin, t.rows), side_local, t.begin, t.rows,
                                    work.middleRows(t.begin, t.rows), dy_local.middleRows(t.begin, t.rows),
                                    dx_local.middleRows(t.begin, t.rows), dside_local);
  });
}

}  // namespace apex::detail
