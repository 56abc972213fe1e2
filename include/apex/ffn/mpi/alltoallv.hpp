#pragma once
/// \file mpi/alltoallv.hpp
/// The exchanges of expert parallelism: `alltoall_counts` (equal blocks of
/// 64-bit counts, `MPI_Alltoall`) and `alltoallv` (variable blocks of
/// scalars, `MPI_Alltoallv`) whose element counts may exceed what an `int`
/// holds.
///
/// MPI-3 counts and displacements are `int`: a block or a whole buffer above
/// 2³¹ − 1 elements (300 k tokens of width 7168) cannot be described in one
/// call. `alltoallv` therefore agrees on the largest buffer any rank sends or
/// receives (one `MPI_Allreduce` of two int64s) and, when it exceeds the
/// limit, runs rounds: in round i every pair exchanges the slice
/// [i·q, (i+1)·q) of its block, q = ⌊limit / P⌋, through staging buffers of
/// P·q elements, so every count and displacement of every call fits. All
/// ranks take the same path and the same number of rounds, so the calls
/// match. The limit is a parameter so that tests can run the chunked path on
/// small buffers.
///
/// Blocks are contiguous in rank order on both sides: rank p's block starts
/// after the blocks of ranks 0..p−1 (displacements are prefix sums of the
/// counts). The reverse exchange is the same call with the count vectors
/// swapped.

#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "../core/errors.hpp"
#include "../core/types.hpp"
#include "communicator.hpp"

namespace apex::mpi {

/// Largest element count or displacement one MPI call takes.
inline constexpr Index kMaxIntCount = INT_MAX;

/// Every rank sends `block` counts to every rank: send (P·block) [p·block + i]
/// goes to rank p as recv [me·block + i]. Collective.
inline void alltoall_counts(const Communicator& comm, const std::vector<std::int64_t>& send, Index block,
                            std::vector<std::int64_t>& recv) {
  const Index p = comm.size();
  if (Index(send.size()) != p * block)
    throw ShapeError("apex::mpi::alltoall_counts: argument 'send' has length " + std::to_string(send.size()) +
                     ", expected " + std::to_string(p * block));
  if (block > kMaxIntCount / std::max<Index>(p, 1))
    throw ValueError("apex::mpi::alltoall_counts: block of " + std::to_string(block) + " counts is too large");
  recv.assign(std::size_t(p * block), 0);
  detail::check(MPI_Alltoall(send.data(), int(block), MPI_INT64_T, recv.data(), int(block), MPI_INT64_T, comm.get()),
                "MPI_Alltoall");
}

namespace detail {

/// The largest buffer and largest block any rank sends or receives (into
/// `global`), after checking every rank's arguments. Bad arguments on one
/// rank must not leave the others in the exchange: the verdict (0 fine,
/// 1 shape, 2 value), the limit and the sizes go into one MPI_Allreduce
/// (MAX), so every rank throws the same type, or none does.
inline void agree_exchange_sizes(const Communicator& comm, const char* where, const std::vector<Index>& send_counts,
                                 const std::vector<Index>& recv_counts, Index limit, std::int64_t global[2]) {
  const Index p = comm.size();
  std::string problem;
  std::int64_t local[5] = {0, 0, limit, -limit, 0};  // largest buffer, largest block, limit, −limit, verdict
  if (Index(send_counts.size()) != p || Index(recv_counts.size()) != p) {
    problem = "count vectors have lengths " + std::to_string(send_counts.size()) + " and " +
              std::to_string(recv_counts.size()) + ", expected " + std::to_string(p);
    local[4] = 1;
  } else if (limit < 1 || limit > kMaxIntCount) {
    problem = "argument 'limit' is " + std::to_string(limit) + ", expected a value in [1, " +
              std::to_string(kMaxIntCount) + "]";
    local[4] = 2;
  } else {
    std::int64_t send_total = 0, recv_total = 0;
    for (Index i = 0; i < p; ++i) {
      send_total += send_counts[std::size_t(i)];
      recv_total += recv_counts[std::size_t(i)];
      local[1] = std::max<std::int64_t>({local[1], send_counts[std::size_t(i)], recv_counts[std::size_t(i)]});
    }
    local[0] = std::max(send_total, recv_total);
  }
  std::int64_t all[5] = {0, 0, 0, 0, 0};
  check(MPI_Allreduce(local, all, 5, MPI_INT64_T, MPI_MAX, comm.get()), "MPI_Allreduce (alltoallv size)");
  if (all[4] != 0) {
    if (problem.empty()) problem = "another rank's arguments are invalid";
    if (all[4] == 1) throw ShapeError(std::string(where) + ": " + problem);
    throw ValueError(std::string(where) + ": " + problem);
  }
  if (all[2] != -all[3])
    throw ConfigError(std::string(where) + ": argument 'limit' differs between ranks, got values from " +
                      std::to_string(-all[3]) + " to " + std::to_string(all[2]) +
                      "; every rank must pass the same limit");
  global[0] = all[0];
  global[1] = all[1];
}

}  // namespace detail

/// Sends send_counts[p] scalars to rank p and receives recv_counts[p] from
/// it; both buffers hold their blocks contiguously in rank order (see the
/// file comment). Collective; every rank's counts must match its peers'
/// (rank a's send_counts[b] = rank b's recv_counts[a]). `limit` (≤ 2³¹ − 1)
/// is the largest count or displacement of one MPI call, the same on every
/// rank. Bad arguments or limits that differ on some rank are the same
/// ShapeError, ValueError or ConfigError on every rank.
template <class T>
void alltoallv(const Communicator& comm, const T* send, const std::vector<Index>& send_counts, T* recv,
               const std::vector<Index>& recv_counts, Index limit = kMaxIntCount) {
  constexpr const char* where = "apex::mpi::alltoallv";
  const Index p = comm.size();
  std::int64_t global[2] = {0, 0};  // largest buffer, largest block of any rank
  detail::agree_exchange_sizes(comm, where, send_counts, recv_counts, limit, global);
  const MPI_Datatype type = datatype<T>();

  if (global[0] <= limit) {  // one call: every count and displacement fits
    std::vector<int> sc(p), sd(p), rc(p), rd(p);
    int so = 0, ro = 0;
    for (Index i = 0; i < p; ++i) {
      sc[i] = int(send_counts[i]);
      sd[i] = so;
      so += sc[i];
      rc[i] = int(recv_counts[i]);
      rd[i] = ro;
      ro += rc[i];
    }
    detail::check(MPI_Alltoallv(send, sc.data(), sd.data(), type, recv, rc.data(), rd.data(), type, comm.get()),
                  "MPI_Alltoallv");
    return;
  }

  // Rounds through staging buffers of P·q elements: pair slices of ≤ q.
  const Index q = std::max<Index>(1, limit / p);
  const Index rounds = (global[1] + q - 1) / q;
  std::vector<Index> send_off(p + 1, 0), recv_off(p + 1, 0);
  for (Index i = 0; i < p; ++i) {
    send_off[i + 1] = send_off[i] + send_counts[i];
    recv_off[i + 1] = recv_off[i] + recv_counts[i];
  }
  std::vector<T> send_stage(static_cast<std::size_t>(p * q)), recv_stage(static_cast<std::size_t>(p * q));
  std::vector<int> sc(p), sd(p), rc(p), rd(p);
  for (Index i = 0; i < p; ++i) {
    sd[i] = int(i * q);
    rd[i] = int(i * q);
  }
  for (Index round = 0; round < rounds; ++round) {
    const Index begin = round * q;
    for (Index i = 0; i < p; ++i) {
      const Index s = std::clamp<Index>(send_counts[i] - begin, 0, q);
      const Index r = std::clamp<Index>(recv_counts[i] - begin, 0, q);
      sc[i] = int(s);
      rc[i] = int(r);
      if (s > 0) std::memcpy(send_stage.data() + i * q, send + send_off[i] + begin, std::size_t(s) * sizeof(T));
    }
    detail::check(MPI_Alltoallv(send_stage.data(), sc.data(), sd.data(), type, recv_stage.data(), rc.data(),
                                rd.data(), type, comm.get()),
                  "MPI_Alltoallv (chunked)");
    for (Index i = 0; i < p; ++i)
      if (rc[i] > 0)
        std::memcpy(recv + recv_off[i] + begin, recv_stage.data() + i * q, std::size_t(rc[i]) * sizeof(T));
  }
}

}  // namespace apex::mpi
