// Faults and bad input on one rank become the same typed exception on every
// rank, and no rank is left blocked in a collective: each test below would
// hang (and be killed by the CTest timeout) if agreement were missing.
#include <apex/ffn/moe/moe_ffn.hpp>
#include <apex/ffn/mpi/expert_parallel_moe.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "mpi_fixtures.hpp"

using namespace apex;
using apex::mpi::Communicator;
using apex::mpi::ExpertParallelMoE;

namespace {
using EP = ExpertParallelMoE<double>;
}  // namespace

TEST_CASE("A configuration that differs on one rank is a ConfigError on every rank", "[mpi]") {
  Communicator comm;
  MoEConfig cfg = test::moe_config(8, 2, 1, 8, 12);
  if (comm.size() > 1 && comm.rank() == comm.size() - 1) cfg.d_ffn += 1;
  if (comm.size() > 1)
    test::throws<ConfigError>([&] { EP(cfg, comm, 1); }, {"configuration differs between ranks", "d_ffn 13"});

  // Only the scalar's bits differ: caught too.
  MoEConfig alpha = test::moe_config(8, 2, 1, 8, 12);
  if (comm.size() > 1 && comm.rank() == 0) alpha.balancer_alpha = std::nextafter(alpha.balancer_alpha, 1.0);
  if (comm.size() > 1) test::throws<ConfigError>([&] { EP(alpha, comm, 1); });

  // Invalid on one rank only: that rank's ConfigError reaches every rank.
  MoEConfig bad = test::moe_config(8, 2, 1, 8, 12);
  if (comm.rank() == comm.size() - 1) bad.n_active = 9;
  test::throws<ConfigError>([&] { EP(bad, comm, 1); }, {"n_active"});

  // Still usable afterwards: a correct construction on every rank succeeds.
  CHECK_NOTHROW(EP(test::moe_config(8, 2, 1, 8, 12), comm, 1));
}

TEST_CASE("P > E is a ConfigError on every rank", "[mpi]") {
  Communicator comm;
  const MoEConfig cfg = test::moe_config(2, 1, 1, 4, 4);
  if (comm.size() > 2)
    test::throws<ConfigError>([&] { EP(cfg, comm, 1); }, {"smaller than the number of ranks"});
  else
    CHECK_NOTHROW(EP(cfg, comm, 1));
}

TEST_CASE("An error on one rank during forward or backward throws on every rank", "[mpi]") {
  Communicator comm;
  const MoEConfig cfg = test::moe_config(6, 2, 1, 8, 12);
  EP ep(cfg, comm, 3);
  const bool culprit = comm.rank() == comm.size() - 1;
  const Matrix<double> x = test::random_matrix(5 + comm.rank(), cfg.d_model, 40 + std::uint64_t(comm.rank()));
  const std::string who = "rank " + std::to_string(comm.size() - 1) + " failed";

  SECTION("a non-finite router logit on one rank") {
    Matrix<double> bad = x;
    if (culprit) bad(1, 2) = std::numeric_limits<double>::quiet_NaN();
    EP::Cache c;
    if (culprit) test::throws<ValueError>([&] { ep.forward(bad, &c); }, {"router logits are not finite"});
    else test::throws<ValueError>([&] { ep.forward(bad, &c); }, {who, "not finite"});
  }
  SECTION("a wrong width on one rank (forward)") {
    const Matrix<double> bad = culprit ? Matrix<double>(Matrix<double>::Zero(3, cfg.d_model + 1)) : x;
    test::throws<ShapeError>([&] { ep.forward(bad); }, {"argument 'x'"});
  }
  SECTION("a wrong dy on one rank (backward), gradients untouched") {
    EP::Cache c;
    ep.forward(x, &c);
    ep.zero_grad();
    const Matrix<double> dy = Matrix<double>::Ones(culprit ? x.rows() + 1 : x.rows(), cfg.d_model);
    test::throws<ShapeError>([&] { ep.backward(dy, c); }, {"argument 'dy'"});
    for (const auto& p : ep.params()) CHECK(p.grad().isZero(0));
  }
  SECTION("a cache of another forward on one rank (backward)") {
    EP::Cache c, other;
    ep.forward(x, &c);
    ep.forward(x.topRows(x.rows() - 1), &other);
    const EP::Cache& mine = culprit && comm.size() > 1 ? other : c;
    if (comm.size() > 1)
      test::throws<ValueError>([&] { ep.backward(Matrix<double>::Ones(mine.x.rows(), cfg.d_model), mine); },
                               {"does not come from the same forward"});
  }
  SECTION("an unfilled cache on one rank (observe)") {
    EP::Cache c, empty;
    ep.forward(x, &c);
    test::throws<ShapeError>([&] { ep.observe(culprit ? empty : c); });
  }
  // After every fault the layer still works on every rank.
  EP::Cache c;
  const Matrix<double> y = ep.forward(x, &c);
  CHECK(y.allFinite());
  CHECK(ep.backward(Matrix<double>::Ones(x.rows(), cfg.d_model), c).allFinite());
}

TEST_CASE("A routing option that differs on one rank is the same ConfigError on every rank", "[mpi]") {
  Communicator comm;
  if (comm.size() == 1) return;  // nothing can differ
  const bool culprit = comm.rank() == comm.size() - 1;
  const auto base = [] {
    MoEConfig c = test::moe_config(8, 2, 1, 8, 12);
    c.routing.scoring = Scoring::SoftmaxAll;
    c.routing.n_groups = 2;
    return c;
  };
  // Each variant is a valid configuration by itself: only the comparison can catch it.
  const std::vector<std::pair<std::string, std::function<void(MoEConfig&)>>> variants = {
      {"scoring sigmoid", [](MoEConfig& c) { c.routing.scoring = Scoring::Sigmoid; }},
      {"n_groups 4", [](MoEConfig& c) { c.routing.n_groups = 4; }},
      {"topk_group 2", [](MoEConfig& c) { c.routing.topk_group = 2; }},
      {"group_score max", [](MoEConfig& c) { c.routing.group_score = GroupScore::Max; }},
      {"renormalize 0", [](MoEConfig& c) { c.routing.renormalize = false; }},
      {"routed_scale", [](MoEConfig& c) { c.routing.routed_scale = std::nextafter(1.0, 2.0); }},
      {"capacity_factor", [](MoEConfig& c) { c.routing.capacity_factor = 1.25; }},
      {"d_shared_ffn 14", [](MoEConfig& c) { c.d_shared_ffn = 14; }},
      {"shared_expert_gate 1", [](MoEConfig& c) { c.shared_expert_gate = true; }},
  };
  for (const auto& [text, change] : variants) {
    INFO("variant " << text);
    MoEConfig cfg = base();
    if (culprit) change(cfg);
    test::throws<ConfigError>([&] { EP(cfg, comm, 1); }, {"configuration differs between ranks", text});
  }
  CHECK_NOTHROW(EP(base(), comm, 1));
}

TEST_CASE("A fault on one rank with the capacity limit on throws on every rank", "[mpi]") {
  Communicator comm;
  MoEConfig cfg = test::moe_config(6, 2, 1, 8, 12);
  cfg.routing.capacity_factor = 1.0;
  cfg.routing.scoring = Scoring::Sigmoid;
  EP ep(cfg, comm, 3);
  const bool culprit = comm.rank() == comm.size() - 1;
  const Matrix<double> x = test::random_matrix(5 + comm.rank(), cfg.d_model, 40 + std::uint64_t(comm.rank()));
  Matrix<double> bad = x;
  if (culprit) bad(1, 2) = std::numeric_limits<double>::quiet_NaN();
  EP::Cache c;
  test::throws<ValueError>([&] { ep.forward(bad, &c); }, {"not finite"});
  // A cache whose dropped list is not of this forward's shape, on one rank.
  ep.forward(x, &c);
  EP::Cache broken = c;
  if (culprit) broken.dropped.push_back(x.rows() * cfg.n_active);
  test::throws<ShapeError>([&] { ep.backward(Matrix<double>::Ones(x.rows(), cfg.d_model), broken); },
                           {"cache.dropped"});
  // Still usable on every rank.
  const Matrix<double> y = ep.forward(x, &c);
  CHECK(y.allFinite());
  CHECK(ep.backward(Matrix<double>::Ones(x.rows(), cfg.d_model), c).allFinite());
}
