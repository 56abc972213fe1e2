#pragma once
/// \file mpi/fixed_order_sum.hpp
/// Sums replicated gradients across ranks in a fixed rank order, so every
/// rank holds bitwise the same values and a rerun reproduces them.
///
/// `MPI_Allreduce(MPI_SUM)` adds in whatever order the implementation picks
/// (a tree, a ring, a different algorithm per message size); floating-point
/// addition is not associative, so ranks and runs may differ in the last
/// bits. Here, for a buffer of n scalars split into P near-equal chunks:
///  1. reduce-scatter by hand: chunk i of every rank goes to rank i
///     (`alltoallv`); rank i adds the P partials in rank order,
///     s = ((p₀ + p₁) + p₂) + …;
///  2. allgather: every rank receives every summed chunk.
/// Each element is summed by one rank in the order 0, 1, …, P−1, whatever P
/// ranks run it. Cost per rank: it sends and receives 2·(P−1)/P·n scalars —
/// the bytes of a bandwidth-optimal ring all-reduce — in two collective
/// steps plus two tiny size agreements, with n scalars of staging memory
/// and (P−1)·n/P additions. A plain `MPI_Allreduce` costs the same bytes;
/// the price is the staging memory and not being able to use an in-network
/// or hierarchical reduction.

#include <mpi.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "../core/param.hpp"
#include "../core/types.hpp"
#include "alltoallv.hpp"
#include "communicator.hpp"

namespace apex::mpi {

namespace detail {

/// Every rank's `counts[rank]` scalars at `mine` land in `all` at the prefix
/// sum of counts before it; in rounds of ≤ limit/P per rank (as alltoallv).
template <class T>
void allgatherv(const Communicator& comm, const T* mine, const std::vector<Index>& counts, T* all, Index limit) {
  const Index p = comm.size();
  std::vector<Index> off(p + 1, 0);
  Index largest = 0;
  for (Index i = 0; i < p; ++i) {
    off[i + 1] = off[i] + counts[i];
    largest = std::max(largest, counts[i]);
  }
  const MPI_Datatype type = datatype<T>();
  std::vector<int> c(p), d(p);
  if (off[p] <= limit) {
    for (Index i = 0; i < p; ++i) {
      c[i] = int(counts[i]);
      d[i] = int(off[i]);
    }
    check(MPI_Allgatherv(mine, c[comm.rank()], type, all, c.data(), d.data(), type, comm.get()), "MPI_Allgatherv");
    return;
  }
  const Index q = std::max<Index>(1, limit / p);
  std::vector<T> stage(static_cast<std::size_t>(p * q));
  for (Index i = 0; i < p; ++i) d[i] = int(i * q);
  for (Index begin = 0; begin < largest; begin += q) {
    for (Index i = 0; i < p; ++i) c[i] = int(std::clamp<Index>(counts[i] - begin, 0, q));
    const int me = comm.rank();
    check(MPI_Allgatherv(mine + std::min(begin, counts[me]), c[me], type, stage.data(), c.data(), d.data(), type,
                         comm.get()),
          "MPI_Allgatherv (chunked)");
    for (Index i = 0; i < p; ++i)
      if (c[i] > 0) std::memcpy(all + off[i] + begin, stage.data() + i * q, std::size_t(c[i]) * sizeof(T));
  }
}

}  // namespace detail

/// Replaces data[0, n) on every rank by the sum over ranks, added in rank
/// order (see the file comment). Collective; n must be the same on every
/// rank (ShapeError on every rank otherwise, agreed before any data moves),
/// and so must `limit` (ConfigError on every rank otherwise).
template <class T>
void fixed_order_sum(const Communicator& comm, T* data, Index n, Index limit = kMaxIntCount) {
  const Index p = comm.size();
  // The limit decides how many MPI calls each step takes: agreed with the size.
  comm.step("apex::mpi::fixed_order_sum", {{"argument 'limit'", limit}}, [&] {
    std::int64_t mine[2] = {n, -n}, agreed[2] = {0, 0};
    detail::check(MPI_Allreduce(mine, agreed, 2, MPI_INT64_T, MPI_MAX, comm.get()), "MPI_Allreduce (sum size)");
    if (agreed[0] != n || -agreed[1] != n)
      throw ShapeError("apex::mpi::fixed_order_sum: buffers of " + std::to_string(n) +
                       " scalars on this rank, other ranks differ");
  });
  if (p == 1 || n == 0) return;
  std::vector<Index> chunk(p), off(p + 1, 0);
  for (Index i = 0; i < p; ++i) {
    off[i + 1] = n * (i + 1) / p;
    chunk[i] = off[i + 1] - off[i];
  }
  const Index me = comm.rank(), mine = chunk[me];
  // 1. chunk i of every rank to rank i: P partials of my chunk, rank order.
  // The buffers are the thread's, reused: a fresh buffer of many MB would be
  // mapped and faulted in on every step.
  thread_local std::vector<T> partials, sum;
  partials.resize(static_cast<std::size_t>(p * mine));
  alltoallv(comm, data, chunk, partials.data(), std::vector<Index>(p, mine), limit);
  sum.assign(partials.begin(), partials.begin() + mine);
  for (Index r = 1; r < p; ++r)
    for (Index j = 0; j < mine; ++j) sum[j] += partials[r * mine + j];
  // 2. every summed chunk to every rank.
  detail::allgatherv(comm, sum.data(), chunk, data, limit);
}

/// Sums the gradients of `params` (the same list, in the same order, on
/// every rank) across ranks in rank order, in place. Use it for the
/// replicated parameters outside an expert-parallel layer — data-parallel
/// parameters such as an FFN sublayer's norm and skip gate.
template <class T>
void sum_gradients(const Communicator& comm, const ParamList<T>& params, Index limit = kMaxIntCount) {
  Index n = 0;
  for (const auto& p : params) n += p.size();
  thread_local std::vector<T> flat;  // reused across calls, as in fixed_order_sum
  flat.resize(static_cast<std::size_t>(n));
  Index at = 0;
  for (const auto& p : params) {
    std::copy(p.grad_data, p.grad_data + p.size(), flat.data() + at);
    at += p.size();
  }
  fixed_order_sum(comm, flat.data(), n, limit);
  at = 0;
  for (const auto& p : params) {
    std::copy(flat.data() + at, flat.data() + at + p.size(), p.grad_data);
    at += p.size();
  }
}

/// The replicated gradients of one backward, summed across ranks while
/// keeping what they held before (gradient accumulation over micro-batches):
/// `begin` stashes and zeroes them, the backward adds this rank's partial,
/// `finish` sums the partials in rank order and adds the stash back, and
/// `restore` (a failed step, on every rank) puts the stash back. On one rank
/// nothing needs summing and all three do nothing.
template <class T>
class StepGradientSum {
 public:
  /// `stash` is the caller's buffer (kept between steps, so it is not
  /// allocated afresh every step).
  StepGradientSum(const Communicator& comm, ParamList<T> params, std::vector<T>& stash)
      : comm_(comm), params_(std::move(params)), stash_(stash) {}

  void begin() {
    if (comm_.size() == 1) return;
    stash_.clear();
    for (const auto& p : params_) {
      stash_.insert(stash_.end(), p.grad_data, p.grad_data + p.size());
      p.grad().setZero();
    }
  }
  void finish() {
    if (comm_.size() == 1) return;
    sum_gradients(comm_, params_);
    add_stash(false);
  }
  void restore() {
    if (comm_.size() > 1) add_stash(true);
  }

 private:
  void add_stash(bool replace) {
    std::size_t at = 0;
    for (const auto& p : params_)
      for (Index i = 0; i < p.size(); ++i, ++at) p.grad_data[i] = replace ? stash_[at] : p.grad_data[i] + stash_[at];
  }

  const Communicator& comm_;
  ParamList<T> params_;
  std::vector<T>& stash_;
};

}  // namespace apex::mpi
