// The expert-parallel layer's gradients follow the contract of the training
// layers (core/param.hpp, moe/expert_contract.hpp): allocated lazily, all of
// a rank's at once and before any parallel task runs, after a memory-fit
// check; and its weights are checked against physical memory before the
// constructor allocates them.
#include <apex/ffn/core/memory_budget.hpp>
#include <apex/ffn/layers/ffn_sublayer.hpp>
#include <apex/ffn/moe/moe_ffn.hpp>
#include <apex/ffn/mpi/expert_parallel_moe.hpp>

#include <catch2/catch.hpp>

#include <cstdint>

#include "mpi_fixtures.hpp"

using namespace apex;
using apex::mpi::Communicator;
using EP = apex::mpi::ExpertParallelMoE<double>;

namespace {

bool every_expert_has_gradients(const EP& ep) {
  for (const auto& e : ep.experts())
    if (!e.has_gradients()) return false;
  for (const auto& s : ep.shared_experts())
    if (!s.has_gradients()) return false;
  return ep.router().has_gradients();
}

bool no_expert_has_gradients(const EP& ep) {
  for (const auto& e : ep.experts())
    if (e.has_gradients()) return false;
  for (const auto& s : ep.shared_experts())
    if (s.has_gradients()) return false;
  return !ep.router().has_gradients();
}

}  // namespace

TEST_CASE("ExpertParallelMoE allocates its gradients lazily, all at once, before its tasks run",
          "[mpi][lazy][regression]") {
  test::HangGuard guard("lazy gradients");
  Communicator comm;
  MoEConfig cfg = test::moe_config(6, 2, 1, 8, 12);
  cfg.shared_expert_gate = true;
  EP ep(cfg, comm, 5);
  CHECK_FALSE(ep.has_gradients());
  CHECK(no_expert_has_gradients(ep));
  const Matrix<double> x = test::random_matrix(4 + comm.rank(), cfg.d_model, 7 + std::uint64_t(comm.rank()));
  EP::Cache c;
  const Matrix<double> y = ep.forward(x, &c);
  CHECK_FALSE(ep.has_gradients());  // a forward holds weights only
  (void)ep.backward(Matrix<double>::Ones(y.rows(), y.cols()), c);
  CHECK(ep.has_gradients());
  CHECK(every_expert_has_gradients(ep));

  EP fresh(cfg, comm, 5);
  fresh.allocate_gradients();  // the explicit form: every gradient, zeroed
  CHECK(every_expert_has_gradients(fresh));
  for (const auto& p : fresh.params()) CHECK(p.grad().isZero(0));
  EP zeroed(cfg, comm, 5);
  zeroed.zero_grad();
  CHECK(zeroed.has_gradients());
}

TEST_CASE("An FFN sublayer over the expert-parallel layer reports and allocates its gradients", "[mpi][lazy]") {
  test::HangGuard guard("sublayer gradients");
  Communicator comm;
  const MoEConfig cfg = test::moe_config(6, 2, 1, 8, 12);
  FFNSublayer<double, EP> sub(cfg.d_model, EP(cfg, comm, 9));
  CHECK_FALSE(sub.has_gradients());
  sub.allocate_gradients();
  CHECK(sub.has_gradients());
  CHECK(every_expert_has_gradients(sub.ffn()));
}

TEST_CASE("An expert-parallel layer too large for a rank's memory is a ConfigError on every rank before allocating",
          "[mpi][memory][regression]") {
  test::HangGuard guard("memory fit");
  Communicator comm;
  const MoEConfig cfg = ModelPreset::large().moe();  // ≥ 200 GB of double weights per rank at P ≤ 4
  if (physical_memory_bytes() == 0 || overcommit_allowed()) {
    WARN("physical memory unknown or APEX_FFN_ALLOW_OVERCOMMIT=1: nothing to reject");
  } else {
    test::throws<ConfigError>([&] { EP ep(cfg, comm, 1); },
                              {"ExpertParallelMoE: a double expert-parallel MoE rank (d_model 7168",
                               "of physical memory; set APEX_FFN_ALLOW_OVERCOMMIT=1"});
  }
}
