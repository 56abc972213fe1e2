// The MPI building blocks on their own: the chunked alltoallv, the
// fixed-order sum and the expert shard.
#include <apex/ffn/moe/moe_ffn.hpp>
#include <apex/ffn/mpi/alltoallv.hpp>
#include <apex/ffn/mpi/expert_parallel_moe.hpp>
#include <apex/ffn/mpi/expert_shard.hpp>
#include <apex/ffn/mpi/fixed_order_sum.hpp>

#include <catch2/catch.hpp>

#include <cstdint>
#include <vector>

#include "mpi_fixtures.hpp"

using namespace apex;
using apex::mpi::Communicator;

namespace {

/// Elements rank `from` sends to rank `to`: 0..12, some pairs empty.
Index pair_count(int from, int to) { return Index((from * 7 + to * 5 + 3) % 13); }
double value(int from, int to, Index i) { return from * 1e6 + to * 1e3 + double(i); }

}  // namespace

TEST_CASE("alltoallv delivers every block, in one call or in chunks", "[mpi]") {
  Communicator comm;
  const int p = comm.size(), me = comm.rank();
  std::vector<Index> sc(static_cast<std::size_t>(p)), rc(static_cast<std::size_t>(p));
  std::vector<double> send;
  for (int to = 0; to < p; ++to) {
    sc[std::size_t(to)] = pair_count(me, to);
    rc[std::size_t(to)] = pair_count(to, me);
    for (Index i = 0; i < sc[std::size_t(to)]; ++i) send.push_back(value(me, to, i));
  }
  std::vector<double> expected;
  for (int from = 0; from < p; ++from)
    for (Index i = 0; i < rc[std::size_t(from)]; ++i) expected.push_back(value(from, me, i));
  for (Index limit : {mpi::kMaxIntCount, Index(1), Index(5), Index(13), Index(40)}) {
    INFO("limit " << limit);
    std::vector<double> recv(expected.size(), -1.0);
    mpi::alltoallv(comm, send.data(), sc, recv.data(), rc, limit);
    CHECK(recv == expected);
  }
}

TEST_CASE("fixed_order_sum adds in rank order, bitwise, for any chunking", "[mpi]") {
  Communicator comm;
  const int p = comm.size();
  for (Index n : {Index(0), Index(1), Index(3), Index(17), Index(1000)}) {
    INFO("n " << n);
    // Every rank can rebuild every rank's partial, so the expected sum is computed locally.
    std::vector<Matrix<double>> partial;
    for (int r = 0; r < p; ++r) partial.push_back(test::random_matrix(1, n, 100 + std::uint64_t(r), 1e3));
    Matrix<double> expected = partial[0];
    for (int r = 1; r < p; ++r) expected += partial[std::size_t(r)];
    for (Index limit : {mpi::kMaxIntCount, Index(1), Index(7)}) {
      Matrix<double> mine = partial[std::size_t(comm.rank())];
      mpi::fixed_order_sum(comm, mine.data(), n, limit);
      CHECK(mine == expected);
    }
  }
  // Buffers of different sizes: a ShapeError on every rank, no hang.
  if (p > 1) {
    std::vector<double> v(static_cast<std::size_t>(comm.rank() + 1), 1.0);
    test::throws<ShapeError>([&] { mpi::fixed_order_sum(comm, v.data(), Index(v.size())); }, {"other ranks differ"});
  }
}

TEST_CASE("ExpertShard: contiguous near-equal shards", "[mpi]") {
  const mpi::ExpertShard s(10, 4);
  CHECK(s.boundaries() == std::vector<Index>{0, 2, 5, 7, 10});
  CHECK(s.max_count() == 3);
  for (Index e = 0; e < 10; ++e) CHECK((s.first(s.owner(e)) <= e && e < s.first(s.owner(e) + 1)));
  for (Index e = 0; e < 256; ++e) {
    const mpi::ExpertShard big(256, 7);
    CHECK((big.first(big.owner(e)) <= e && e < big.first(big.owner(e) + 1)));
  }
  CHECK_THROWS_AS(mpi::ExpertShard(3, 4), ConfigError);
  CHECK_THROWS_AS(mpi::ExpertShard(3, 0), ConfigError);
}

TEST_CASE("ExpertParallelMoE gives the same bits with chunked exchanges", "[mpi]") {
  Communicator comm;
  const MoEConfig cfg = test::moe_config(6, 2, 1, 8, 10);
  const test::Slice s = test::slice_of(comm, {9, 4, 0, 6});
  const Matrix<double> x = test::random_matrix(s.total, cfg.d_model, 7).middleRows(s.begin, s.rows);
  mpi::ExpertParallelMoE<double> a(cfg, comm, 2), b(cfg, comm, 2);
  b.set_exchange_limit(11);
  typename mpi::ExpertParallelMoE<double>::Cache ca, cb;
  CHECK(a.forward(x, &ca) == b.forward(x, &cb));
  const Matrix<double> dy = Matrix<double>::Ones(s.rows, cfg.d_model);
  CHECK(a.backward(dy, ca) == b.backward(dy, cb));
  const auto pa = a.params(), pb = b.params();
  for (std::size_t i = 0; i < pa.size(); ++i) CHECK(pa[i].grad() == pb[i].grad());
}

TEST_CASE("ExpertParallelMoE's capacity exchange gives the same drops when chunked", "[mpi]") {
  Communicator comm;
  MoEConfig cfg = test::moe_config(6, 2, 1, 8, 10);
  cfg.routing.capacity_factor = 0.5;  // drops even without skew
  const test::Slice s = test::slice_of(comm, {9, 4, 0, 6});
  const Matrix<double> x = test::random_matrix(s.total, cfg.d_model, 7).middleRows(s.begin, s.rows);
  mpi::ExpertParallelMoE<double> a(cfg, comm, 2), b(cfg, comm, 2);
  b.set_exchange_limit(3);  // the ids and weights allgathered in rounds of <= 3 / P
  typename mpi::ExpertParallelMoE<double>::Cache ca, cb;
  CHECK(a.forward(x, &ca) == b.forward(x, &cb));
  CHECK(ca.dropped == cb.dropped);
  std::int64_t mine = std::int64_t(ca.dropped.size()), all = 0;
  MPI_Allreduce(&mine, &all, 1, MPI_INT64_T, MPI_SUM, comm.get());
  CHECK(all > 0);
  const Matrix<double> dy = Matrix<double>::Ones(s.rows, cfg.d_model);
  CHECK(a.backward(dy, ca) == b.backward(dy, cb));
}
