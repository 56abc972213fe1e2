// Per-rank settings that shape the messages of a collective (the exchange
// chunk limit of the layer and of the building blocks, the capacity
// exchange's arguments, the router's routing options), set differently on
// one rank: the same typed exception on every rank, before any rank enters
// the collective they shape, and the layer usable afterwards. Each test runs
// under a HangGuard, so a rank left alone in a collective fails the run
// within a minute instead of blocking until the CTest timeout.
#include <apex/ffn/layers/ffn_sublayer.hpp>
#include <apex/ffn/moe/moe_ffn.hpp>
#include <apex/ffn/mpi/alltoallv.hpp>
#include <apex/ffn/mpi/expert_parallel_moe.hpp>
#include <apex/ffn/mpi/fixed_order_sum.hpp>
#include <apex/ffn/mpi/global_capacity.hpp>

#include <catch2/catch.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "mpi_fixtures.hpp"

using namespace apex;
using apex::mpi::Communicator;
using EP = apex::mpi::ExpertParallelMoE<double>;

namespace {

/// The last rank: the one whose setting differs.
bool culprit(const Communicator& comm) { return comm.rank() == comm.size() - 1; }

/// x of this rank: 7 tokens on rank 0, 5 on the others (the sizes of the report).
Matrix<double> tokens(const Communicator& comm, Index d) {
  return test::random_matrix(comm.rank() == 0 ? 7 : 5, d, 40 + std::uint64_t(comm.rank()));
}

/// A routing of n tokens over E experts, K = 2, the same rule on every rank.
Routing<double> some_routing(Index n, Index n_experts) {
  Routing<double> r;
  r.experts.resize(n, 2);
  r.weights.resize(n, 2);
  for (Index t = 0; t < n; ++t) {
    r.experts(t, 0) = t % n_experts;
    r.experts(t, 1) = (t + 1) % n_experts;
    r.weights(t, 0) = 0.75 - 0.01 * double(t % 5);
    r.weights(t, 1) = 0.25;
  }
  return r;
}

}  // namespace

TEST_CASE("An exchange limit set on one rank only is the same ConfigError on every rank", "[mpi][regression]") {
  test::HangGuard guard("exchange limit on one rank");
  Communicator comm;
  if (comm.size() == 1) return;  // nothing can differ
  const MoEConfig cfg = test::moe_config(6, 2, 1, 8, 12);
  EP ep(cfg, comm, 3);
  const Matrix<double> x = tokens(comm, cfg.d_model);
  const Matrix<double> dy = Matrix<double>::Ones(x.rows(), cfg.d_model);
  EP::Cache c;
  if (comm.rank() == 0) ep.set_exchange_limit(11);
  test::throws<ConfigError>([&] { ep.forward(x, &c); }, {"exchange limit", "differs between ranks", "11"});

  // The same limit everywhere works; changed on one rank between forward and
  // backward, the backward refuses on every rank and adds no gradient.
  ep.set_exchange_limit(11);
  const Matrix<double> y = ep.forward(x, &c);
  ep.zero_grad();
  if (culprit(comm)) ep.set_exchange_limit(mpi::kMaxIntCount);
  test::throws<ConfigError>([&] { ep.backward(dy, c); }, {"exchange limit"});
  for (const auto& p : ep.params()) CHECK(p.grad().isZero(0));
  ep.set_exchange_limit(11);
  CHECK(ep.backward(dy, c).allFinite());
  EP other(cfg, comm, 3);  // the same bits as with the default limit
  EP::Cache oc;
  CHECK(other.forward(x, &oc) == y);
}

TEST_CASE("Every per-rank setting that shapes messages, differing on one rank, throws alike everywhere",
          "[mpi][regression]") {
  test::HangGuard guard("per-rank setting sweep");
  Communicator comm;
  if (comm.size() == 1) return;
  const bool odd = culprit(comm);
  const int p = comm.size();

  SECTION("the exchange limit with the capacity limit on (the capacity allgather chunks too)") {
    MoEConfig cfg = test::moe_config(6, 2, 1, 8, 12);
    cfg.routing.capacity_factor = 1.0;
    EP ep(cfg, comm, 3);
    if (odd) ep.set_exchange_limit(5);
    test::throws<ConfigError>([&] { ep.forward(tokens(comm, cfg.d_model)); }, {"exchange limit"});
    ep.set_exchange_limit(5);
    CHECK(ep.forward(tokens(comm, cfg.d_model)).allFinite());
  }
  SECTION("the router's routing options, changed through router().set_routing on one rank") {
    const MoEConfig cfg = test::moe_config(6, 2, 1, 8, 12);
    EP ep(cfg, comm, 3);
    RoutingConfig changed = cfg.routing;
    changed.scoring = Scoring::Sigmoid;
    if (odd) ep.router().set_routing(changed);
    test::throws<ConfigError>([&] { ep.forward(tokens(comm, cfg.d_model)); }, {"router's routing options"});
    ep.router().set_routing(cfg.routing);
    CHECK(ep.forward(tokens(comm, cfg.d_model)).allFinite());
  }
  // The building blocks take the limit per call: the same rule.
  const std::vector<Index> counts(static_cast<std::size_t>(p), 3);
  const std::vector<double> send(std::size_t(3 * p), 1.0);
  std::vector<double> recv(std::size_t(3 * p));
  SECTION("alltoallv: a limit that makes one rank chunk") {
    test::throws<ConfigError>(
        [&] { mpi::alltoallv(comm, send.data(), counts, recv.data(), counts, odd ? 5 : mpi::kMaxIntCount); },
        {"argument 'limit' differs between ranks"});
  }
  SECTION("alltoallv: an invalid limit on one rank") {
    test::throws<ValueError>([&] { mpi::alltoallv(comm, send.data(), counts, recv.data(), counts, odd ? 0 : 5); },
                             {"apex::mpi::alltoallv"});
  }
  SECTION("alltoallv: count vectors of the wrong length on one rank") {
    const std::vector<Index> short_counts(static_cast<std::size_t>(p - 1), 3);
    test::throws<ShapeError>(
        [&] { mpi::alltoallv(comm, send.data(), odd ? short_counts : counts, recv.data(), counts); },
        {"apex::mpi::alltoallv"});
  }
  SECTION("fixed_order_sum and sum_gradients: the limit") {
    std::vector<double> data(1000, 1.0);
    test::throws<ConfigError>([&] { mpi::fixed_order_sum(comm, data.data(), 1000, odd ? 7 : mpi::kMaxIntCount); },
                              {"argument 'limit'"});
    Matrix<double> w = Matrix<double>::Ones(3, 4), g = Matrix<double>::Ones(3, 4);
    const ParamList<double> params = {Param<double>{"w", w.data(), g.data(), 3, 4}};
    test::throws<ConfigError>([&] { mpi::sum_gradients(comm, params, odd ? 2 : 9); }, {"argument 'limit'"});
    CHECK(g.isOnes(0));
  }
  SECTION("global_capacity_drops: the limit, the factor and the expert count") {
    const Routing<double> r = some_routing(comm.rank() == 0 ? 7 : 5, 6);
    double bytes = 0;
    const auto drops = [&](double factor, Index n_experts, Index limit) {
      return mpi::global_capacity_drops(comm, "test", r, factor, n_experts, limit, bytes);
    };
    test::throws<ConfigError>([&] { drops(1.0, 6, odd ? 3 : 1000); }, {"argument 'limit'"});
    test::throws<ConfigError>([&] { drops(odd ? 1.25 : 1.0, 6, 1000); }, {"argument 'factor'"});
    test::throws<ConfigError>([&] { drops(1.0, odd ? 7 : 6, 1000); }, {"argument 'n_experts'"});
    CHECK(drops(1.0, 6, 3) == drops(1.0, 6, 1000));  // agreed: chunking changes nothing
  }
}

TEST_CASE("The thread count may differ between ranks: it changes neither messages nor bits", "[mpi]") {
  test::HangGuard guard("threads on one rank");
  Communicator comm;
  const MoEConfig cfg = test::moe_config(6, 2, 2, 8, 10);
  const Matrix<double> x = test::random_matrix(comm.rank() == 0 ? 1500 : 40, cfg.d_model, 8);
  EP a(cfg, comm, 2), b(cfg, comm, 2);
  a.set_threads(1);
  b.set_threads(culprit(comm) ? 2 : 1);
  EP::Cache ca, cb;
  CHECK(a.forward(x, &ca) == b.forward(x, &cb));
  const Matrix<double> dy = test::random_matrix(x.rows(), cfg.d_model, 9);
  CHECK(a.backward(dy, ca) == b.backward(dy, cb));
  const auto pa = a.params(), pb = b.params();
  for (std::size_t i = 0; i < pa.size(); ++i) CHECK(pa[i].grad() == pb[i].grad());
}

TEST_CASE("A gated sublayer in different modes or with a bad input on one rank throws alike everywhere",
          "[mpi][regression]") {
  // Training with a gate calls the FFN twice per forward (kept rows, then
  // skipped rows), inference and cacheless calls once: before the sublayer
  // agreed on its call count, a rank in inference mode left the others
  // blocked in the second call's exchange.
  test::HangGuard guard("sublayer mode on one rank");
  Communicator comm;
  if (comm.size() == 1) return;
  const MoEConfig cfg = test::moe_config(6, 2, 1, 8, 10);
  const Index d = cfg.d_model;
  using Sub = FFNSublayer<double, EP>;
  Sub layer(d, EP(cfg, comm, 4), SkipGate<double>(test::gate_config(d, 4, 0.9), 8));
  const Matrix<double> x = tokens(comm, d);
  Sub::Cache c;
  if (culprit(comm)) layer.set_mode(SublayerMode::inference);
  test::throws<ConfigError>([&] { layer.forward(x, &c); }, {"FFNSublayer::forward", "number of FFN calls"});
  // A cache passed on some ranks only: the same refusal.
  layer.set_mode(SublayerMode::training);
  test::throws<ConfigError>([&] { layer.forward(x, culprit(comm) ? nullptr : &c); }, {"number of FFN calls"});

  // A wrong shape on one rank is that rank's ShapeError, raised on every rank.
  const Matrix<double> bad = culprit(comm) ? Matrix<double>(x.leftCols(d - 1)) : x;
  test::throws<ShapeError>([&] { layer.forward(bad, &c); }, {"FFNSublayer::forward", "argument 'x'"});

  // Agreed again, the layer works; a backward fed an inference cache on one
  // rank is that rank's ValueError everywhere, and adds no gradient.
  const Matrix<double> y = layer.forward(x, &c);
  CHECK(y.allFinite());
  Sub::Cache ci;
  layer.forward(x, SublayerMode::inference, &ci);
  layer.zero_grad();
  const Matrix<double> dy = Matrix<double>::Ones(x.rows(), d);
  test::throws<ValueError>([&] { layer.backward(dy, culprit(comm) ? ci : c); }, {"inference-mode forward"});
  for (const auto& p : layer.params()) CHECK(p.grad().isZero(0));
  CHECK(layer.backward(dy, c).allFinite());
}
