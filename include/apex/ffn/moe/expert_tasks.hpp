#pragma once
/// \file moe/expert_tasks.hpp
/// How expert compute is split into thread tasks: (routed expert × row tile)
/// and (shared expert × row tile), largest first. Shared by MoEFFN and any
/// layer that runs experts on plan-ordered blocks (the expert-parallel layer).
///
/// Forward tiles a block of m rows into ⌈m / max_tile⌉ near-equal tiles; the
/// tiling depends on m only, never on the thread count, so results do not
/// either. Backward runs one task per non-empty expert (its weight gradients
/// are its own, so nothing is reduced across threads) and one per shared
/// expert. Largest first: with a dynamic schedule the big tasks start early
/// and the small ones fill the gaps at the end (longest processing time
/// first). Order never affects results: tasks write disjoint rows.

#include <algorithm>
#include <vector>

#include "../core/types.hpp"

namespace apex::detail {

/// Rows [begin, begin + rows) of routed expert `id` (sorted rows) or of
/// shared expert `id` (token rows).
struct ExpertTask {
  bool shared;
  Index id, begin, rows;
};

/// Orders tasks by rows, largest first, ties in creation order (routed
/// before shared, then by id, then by first row). The order is total, so a
/// plain sort gives it without stable_sort's temporary buffer.
inline void largest_first(std::vector<ExpertTask>& tasks) {
  std::sort(tasks.begin(), tasks.end(), [](const ExpertTask& a, const ExpertTask& b) {
    if (a.rows != b.rows) return a.rows > b.rows;
    if (a.shared != b.shared) return !a.shared;
    return a.id != b.id ? a.id < b.id : a.begin < b.begin;
  });
}

/// Forward tasks into `tasks` (replaced; its capacity is reused, so a
/// decode step that keeps the vector allocates nothing): tiles of every
/// routed block (`offset`: E + 1 prefix sums, expert e owns
/// [offset[e], offset[e+1])) and of the n token rows of each of n_shared
/// shared experts, at most max_tile rows each, largest first.
inline void forward_tasks(const std::vector<Index>& offset, Index n_shared, Index n, Index max_tile,
                          std::vector<ExpertTask>& tasks) {
  tasks.clear();
  // Room for the most tiles these sizes can give, whatever the routing
  // (Σ_e ⌈c_e / T⌉ ≤ ⌊R / T⌋ + nonempty experts): a kept list grows with the
  // row count only, not with which experts a step's tokens chose.
  const Index experts = std::max<Index>(Index(offset.size()) - 1, 0), routed = offset.empty() ? 0 : offset.back();
  const Index most = std::min(experts, routed) + routed / max_tile + n_shared * ((n + max_tile - 1) / max_tile);
  tasks.reserve(std::size_t(most));
  const auto tile = [&](bool shared, Index id, Index begin, Index count) {
    const Index tiles = (count + max_tile - 1) / max_tile;
    for (Index i = 0; i < tiles; ++i) {
      const Index b = count * i / tiles, e = count * (i + 1) / tiles;
      tasks.push_back({shared, id, begin + b, e - b});
    }
  };
  for (std::size_t e = 0; e + 1 < offset.size(); ++e) tile(false, Index(e), offset[e], offset[e + 1] - offset[e]);
  for (Index s = 0; s < n_shared; ++s) tile(true, s, 0, n);
  largest_first(tasks);
}

/// The same tasks in a new vector.
inline std::vector<ExpertTask> forward_tasks(const std::vector<Index>& offset, Index n_shared, Index n,
                                             Index max_tile) {
  std::vector<ExpertTask> tasks;
  forward_tasks(offset, n_shared, n, max_tile, tasks);
  return tasks;
}

/// forward_tasks into the calling thread's kept list, which is returned:
/// its capacity survives the call, so a decode step allocates nothing. One
/// list per Owner (the layer type calling), so a task of one layer kind that
/// runs another kind on the same thread never overwrites the list being run.
/// Workers read the returned reference: a thread_local named inside their
/// lambda would be each worker's own, not the caller's.
template <class Owner>
const std::vector<ExpertTask>& kept_forward_tasks(const std::vector<Index>& offset, Index n_shared, Index n,
                                                  Index max_tile) {
  thread_local std::vector<ExpertTask> kept;
  forward_tasks(offset, n_shared, n, max_tile, kept);
  return kept;
}

/// Backward tasks: one per non-empty routed block and one per shared expert
/// (when n > 0), largest first.
inline std::vector<ExpertTask> backward_tasks(const std::vector<Index>& offset, Index n_shared, Index n) {
  std::vector<ExpertTask> tasks;
  for (std::size_t e = 0; e + 1 < offset.size(); ++e)
    if (offset[e + 1] > offset[e]) tasks.push_back({false, Index(e), offset[e], offset[e + 1] - offset[e]});
  for (Index s = 0; s < n_shared; ++s)
    if (n > 0) tasks.push_back({true, s, 0, n});
  largest_first(tasks);
  return tasks;
}

}  // namespace apex::detail
