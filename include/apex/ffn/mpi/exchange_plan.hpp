#pragma once
/// \file mpi/exchange_plan.hpp
/// The MPI side of the expert-parallel row exchange: the per-(rank, local
/// expert) counts a rank sends, and `exchange_rows`, the alltoallv of rows
/// that the plan (moe/row_exchange.hpp, `ExchangePlan` here) describes.

#include <cstdint>
#include <vector>

#include "../core/types.hpp"
#include "../moe/row_exchange.hpp"
#include "alltoallv.hpp"
#include "communicator.hpp"
#include "expert_shard.hpp"

namespace apex::mpi {

/// The plan of one forward's exchange (moe/row_exchange.hpp).
using ExchangePlan = RowExchange;

/// The per-(rank, local expert) counts of plan-ordered pairs: counts[e] for
/// global expert e, laid out P × ⌈E/P⌉ for alltoall_counts.
inline std::vector<std::int64_t> counts_by_owner(const ExpertShard& shard, const std::vector<Index>& counts) {
  const Index p = shard.n_ranks(), block = shard.max_count();
  std::vector<std::int64_t> out(std::size_t(p * block), 0);
  for (Index r = 0; r < p; ++r)
    for (Index j = 0; j < shard.count(r); ++j) out[std::size_t(r * block + j)] = counts[std::size_t(shard.first(r) + j)];
  return out;
}

/// alltoallv of rows of `width` scalars, counts in rows (limit as alltoallv).
/// Returns the bytes sent to other ranks.
template <class T>
double exchange_rows(const Communicator& comm, const T* send, const std::vector<Index>& send_rows, T* recv,
                     const std::vector<Index>& recv_rows, Index width, Index limit = kMaxIntCount) {
  std::vector<Index> sc(send_rows.size()), rc(recv_rows.size());
  double bytes = 0;
  for (std::size_t r = 0; r < sc.size(); ++r) {
    sc[r] = send_rows[r] * width;
    rc[r] = recv_rows[r] * width;
    if (int(r) != comm.rank()) bytes += double(sc[r]) * sizeof(T);
  }
  alltoallv(comm, send, sc, recv, rc, limit);
  return bytes;
}

}  // namespace apex::mpi
