#pragma once
/// \file moe/row_exchange.hpp
/// `RowExchange`: who sends how many rows to whom when the routed experts
/// live on other ranks (mpi/expert_parallel_moe.hpp), and the reordering of
/// what a rank receives into one block per local expert. Plain data — the
/// MPI calls that move the rows are in mpi/exchange_plan.hpp — so the MoE
/// cache (moe/moe_cache.hpp) can hold one without the core depending on MPI;
/// a layer whose experts are all local leaves it empty.
///
/// The sender's rows are in dispatch-plan order: by global expert, hence by
/// (owner rank, local expert), then token. After the exchange the owner
/// holds them rank-major: [from rank 0: expert 0, expert 1, …][from rank 1:
/// …]…. Its experts need them expert-major — expert j's block holds rank 0's
/// rows for j, then rank 1's, … — which is exactly the order MoEFFN gives
/// expert first + j on the concatenated batch. `perm` maps expert-major row
/// i to received row perm[i]; the reverse exchange sends rows back in
/// received order, so the sender gets them in its plan order. Backward reuses
/// the same plan (the cache keeps it).

#include <cstdint>
#include <vector>

#include "../core/types.hpp"

namespace apex {

struct RowExchange {
  std::vector<Index> send_rows;     ///< P: rows this rank sends to each rank
  std::vector<Index> recv_rows;     ///< P: rows this rank receives from each rank
  std::vector<Index> local_offset;  ///< S + 1: expert-major block of each local expert
  std::vector<Index> perm;          ///< R: expert-major row → received row

  /// Ranks the plan spans: P for an expert-parallel layer, 0 when every expert is local.
  Index ranks() const { return Index(send_rows.size()); }
  Index received() const { return Index(perm.size()); }
  Index sent() const {
    Index s = 0;
    for (Index r : send_rows) s += r;
    return s;
  }

  /// From the per-(rank, local expert) counts this rank sends (`send`) and
  /// receives (`recv`), both P × ⌈E/P⌉ (padded; see alltoall_counts), for a
  /// rank owning `n_local` experts.
  void build(const std::vector<std::int64_t>& send, const std::vector<std::int64_t>& recv, Index p, Index block,
             Index n_local) {
    send_rows.assign(std::size_t(p), 0);
    recv_rows.assign(std::size_t(p), 0);
    local_offset.assign(std::size_t(n_local) + 1, 0);
    const auto at = [&](Index r, Index j) { return std::size_t(r * block + j); };
    for (Index r = 0; r < p; ++r)
      for (Index j = 0; j < block; ++j) {
        send_rows[std::size_t(r)] += send[at(r, j)];
        recv_rows[std::size_t(r)] += recv[at(r, j)];
        if (j < n_local) local_offset[std::size_t(j) + 1] += recv[at(r, j)];
      }
    for (Index j = 0; j < n_local; ++j) local_offset[std::size_t(j) + 1] += local_offset[std::size_t(j)];
    // Received rows of (rank r, local expert j) start at begin(r) + Σ_{i<j} count(r, i).
    std::vector<Index> begin(std::size_t(p) + 1, 0);
    for (Index r = 0; r < p; ++r) begin[std::size_t(r) + 1] = begin[std::size_t(r)] + recv_rows[std::size_t(r)];
    perm.resize(std::size_t(begin[std::size_t(p)]));
    std::size_t i = 0;
    for (Index j = 0; j < n_local; ++j)
      for (Index r = 0; r < p; ++r) {
        Index first = begin[std::size_t(r)];
        for (Index k = 0; k < j; ++k) first += recv[at(r, k)];
        for (Index k = 0; k < recv[at(r, j)]; ++k) perm[i++] = first + k;
      }
  }

  /// dst (R × cols) = src rows in expert-major order: dst[i] = src[perm[i]].
  template <class Src, class Dst>
  void to_expert_major(const Src& src, Dst& dst) const {
    for (Index i = 0; i < received(); ++i) dst.row(i) = src.row(perm[std::size_t(i)]);
  }
  /// The inverse: dst[perm[i]] = src[i].
  template <class Src, class Dst>
  void to_received(const Src& src, Dst& dst) const {
    for (Index i = 0; i < received(); ++i) dst.row(perm[std::size_t(i)]) = src.row(i);
  }
};


}  // namespace apex
