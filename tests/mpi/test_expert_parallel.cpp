// ExpertParallelMoE against the single-process MoEFFN on the concatenation of
// every rank's tokens: outputs, dx, every gradient, top-K, the pairs the
// capacity limit drops and the balancer bias, for whatever number of ranks
// the test runs on (CTest: 1 to 4), with APEX-1's routing and with every
// routing option of the open MoE families (docs/routing.md).
#include <apex/ffn/moe/families.hpp>
#include <apex/ffn/layers/ffn_sublayer.hpp>
#include <apex/ffn/layers/kappa_swiglu.hpp>
#include <apex/ffn/moe/gpt_oss.hpp>
#include <apex/ffn/moe/moe_ffn.hpp>
#include <apex/ffn/mpi/expert_parallel_moe.hpp>
#include <apex/ffn/mpi/fixed_order_sum.hpp>
#include <apex/ffn/mpi/kappa_regulariser.hpp>
#include <apex/ffn/layers/skip_gate.hpp>

#include <catch2/catch.hpp>

#include <functional>
#include <string>
#include <vector>

#include "mpi_fixtures.hpp"

using namespace apex;
using apex::mpi::Communicator;
using apex::mpi::ExpertParallelMoE;

namespace {

constexpr double kTol = 1e-12;  // double: relative, per tensor

/// Balancing bias that sends every token to the experts of the last rank:
/// +1 there, −1 elsewhere (router logits of inputs of scale 0.1 stay < 1).
RowVector<double> bias_to_last_rank(Index n_experts, Index first_of_last) {
  RowVector<double> b(n_experts);
  for (Index e = 0; e < n_experts; ++e) b(e) = e >= first_of_last ? 1.0 : -1.0;
  return b;
}

struct Scenario {
  std::string name;
  MoEConfig config;
  std::vector<Index> sizes;  ///< tokens of rank r: sizes[r % size]
  double scale = 1.0;        ///< input scale
  bool to_last_rank = false; ///< balancing bias sends every token to the last rank's experts
  /// Initial balancing bias (length E), if not empty and not to_last_rank.
  std::vector<double> bias = {};
  /// The reference must drop pairs (capacity on, skewed routing): the test
  /// would prove nothing about the drop rule otherwise.
  bool expect_drops = false;
  /// The router's trained logit bias (length E, config.router_bias), if not empty.
  std::vector<double> router_bias = {};
};

/// The balancing bias a scenario starts each run from.
RowVector<double> initial_bias(const Scenario& sc, Index first_of_last) {
  const Index e_count = sc.config.n_experts;
  if (sc.to_last_rank) return bias_to_last_rank(e_count, first_of_last);
  RowVector<double> b = RowVector<double>::Zero(e_count);
  for (Index e = 0; e < Index(sc.bias.size()) && e < e_count; ++e) b(e) = sc.bias[std::size_t(e)];
  return b;
}

/// The reference's dropped pairs of tokens [s.begin, s.begin + s.rows), as local pair ids.
std::vector<Index> local_drops(const std::vector<Index>& dropped, const test::Slice& s, Index k_count) {
  std::vector<Index> out;
  for (Index pr : dropped)
    if (pr >= s.begin * k_count && pr < (s.begin + s.rows) * k_count) out.push_back(pr - s.begin * k_count);
  return out;
}

/// Runs one scenario: forward, backward, observe + update twice (the second
/// forward routes with the updated bias), each compared with the reference,
/// and the whole step again to check it is bitwise repeatable.
template <class Expert>
void run_scenario(const Scenario& sc, const std::function<void(std::vector<Expert>&)>& prepare = {}) {
  INFO("scenario " << sc.name);
  Communicator comm;
  const MoEConfig& cfg = sc.config;
  const test::Slice s = test::slice_of(comm, sc.sizes);
  const Matrix<double> x_all = test::random_matrix(s.total, cfg.d_model, 11, sc.scale);
  const Matrix<double> dy_all = test::random_matrix(s.total, cfg.d_model, 12);
  const Matrix<double> x = x_all.middleRows(s.begin, s.rows), dy = dy_all.middleRows(s.begin, s.rows);

  MoEFFN<double, Expert> ref(cfg, 5);
  ExpertParallelMoE<double, Expert> ep(cfg, comm, 5);
  if (prepare) prepare(ref.experts());
  for (std::size_t e = 0; e < sc.router_bias.size(); ++e) ref.router().logit_bias()(Index(e)) = sc.router_bias[e];
  test::copy_values(ref.params(), ep.params());
  if (prepare) prepare(ep.experts());  // options that are not parameters (κ's U)
  const RowVector<double> bias0 = initial_bias(sc, ep.shard().first(comm.size() - 1));
  ref.balancer().set_bias(bias0);
  ep.balancer().set_bias(bias0);

  std::vector<Matrix<double>> first_y, first_dx, first_grads;
  for (int run = 0; run < 2; ++run) {
    ref.zero_grad();
    ep.zero_grad();
    for (int step = 0; step < 2; ++step) {
      INFO("run " << run << " step " << step);
      typename MoEFFN<double, Expert>::Cache rc;
      typename ExpertParallelMoE<double, Expert>::Cache c;
      const Matrix<double> y_ref = ref.forward(x_all, &rc);
      const Matrix<double> y = ep.forward(x, &c);
      CHECK(c.routing.experts == rc.routing.experts.middleRows(s.begin, s.rows));  // identical top-K
      CHECK(c.dropped == local_drops(rc.dropped, s, cfg.n_active));              // identical drops
      if (sc.expect_drops) CHECK(!rc.dropped.empty());
      CHECK(test::rel_error(y, y_ref.middleRows(s.begin, s.rows)) <= kTol);
      const Matrix<double> dx_ref = ref.backward(dy_all, rc);
      const Matrix<double> dx = ep.backward(dy, c);
      CHECK(test::rel_error(dx, dx_ref.middleRows(s.begin, s.rows)) <= kTol);
      test::check_params_match(ep.params(), ref.params(), kTol);
      ref.observe(rc);
      ep.observe(c);
      ref.balancer().update();
      ep.balancer().update();
      CHECK(ep.balancer().bias() == ref.balancer().bias());  // the same bias on every rank, exactly
      if (run == 0) {
        first_y.push_back(y);
        first_dx.push_back(dx);
      } else {  // bitwise repeatable
        CHECK(y == first_y[std::size_t(step)]);
        CHECK(dx == first_dx[std::size_t(step)]);
      }
    }
    const auto grads = test::grads_of(ep.params());
    if (run == 0) first_grads = grads;
    else
      for (std::size_t i = 0; i < grads.size(); ++i) CHECK(grads[i] == first_grads[i]);
    // The second run starts from the first run's initial bias again.
    ref.balancer().set_bias(bias0);
    ep.balancer().set_bias(bias0);
  }
}

}  // namespace

TEST_CASE("ExpertParallelMoE equals MoEFFN on the concatenated batch", "[mpi]") {
  const int p = Communicator().size();
  std::vector<Scenario> scenarios = {
      {"uneven batches, a rank with 0 tokens", test::moe_config(8, 2, 1, 8, 12), {7, 0, 12, 4}},
      {"E = 7 not divisible by P", test::moe_config(7, 3, 2, 6, 10), {5, 9, 1}},
      {"no shared experts, K = 1", test::moe_config(5, 1, 0, 6, 7), {4, 6}},
      {"one rank's batch far larger", test::moe_config(8, 2, 1, 8, 12), {300, 2, 3, 1}},
      {"every token to the last rank's experts", test::moe_config(8, 2, 1, 8, 12), {40, 0, 25, 9}, 0.1, true},
      {"tiled expert blocks (> 1024 rows)", test::moe_config(8, 2, 1, 8, 6), {1100, 5}, 0.1, true},
      // 3f = 39 scalars per workspace row: an expert's block starts at other
      // alignments than in MoEFFN, so results agree to rounding, not bitwise
      // (docs/expert_parallel.md); rerun bits stay identical.
      {"blocks at other alignments, every token on rank 0", test::moe_config(8, 2, 1, 8, 13), {37, 0, 0, 0}},
      {"blocks at other alignments, tokens spread", test::moe_config(8, 2, 1, 8, 13), {20, 13, 7, 11}},
  };
  for (const auto& sc : scenarios) run_scenario<SwiGLU<double>>(sc);
  (void)p;
}

TEST_CASE("ExpertParallelMoE with weights_from_unbiased and kappa-SwiGLU experts", "[mpi]") {
  Scenario sc{"kappa-SwiGLU", test::moe_config(6, 2, 1, 8, 10), {9, 3, 0, 14}};
  sc.config.weights_from_unbiased = true;
  run_scenario<KappaSwiGLU<double>>(sc, [](std::vector<KappaSwiGLU<double>>& experts) {
    // Non-zero α and b, so κ ≠ 1 and the logit path carries gradient.
    for (auto& e : experts) {
      e.kappa_alpha() = test::random_matrix(1, e.d_ffn(), 31, 0.5);
      e.kappa_bias() = test::random_matrix(1, e.d_ffn(), 32, 0.5);
      e.set_U(3.0);
    }
  });
}

TEST_CASE("ExpertParallelMoE with gpt-oss experts and the router's logit bias", "[mpi][gpt_oss]") {
  Scenario sc{"gpt-oss", gpt_oss_moe(8, 10, 6, 2), {9, 3, 0, 14}};
  sc.router_bias = {0.3, -0.2, 0.1, 0.0, -0.4, 0.25};
  run_scenario<ClampedSwiGLU<double>>(sc, [](std::vector<ClampedSwiGLU<double>>& experts) {
    // Biases wide enough that the gate and up clamps act on some units.
    for (auto& e : experts) {
      e.b_gate() = test::random_matrix(1, e.d_ffn(), 33, 8.0);
      e.b_up() = test::random_matrix(1, e.d_ffn(), 34, 8.0);
      e.b_down() = test::random_matrix(1, e.d_model(), 35, 0.5);
    }
  });
}

TEST_CASE("ExpertParallelMoE in float agrees with the float MoEFFN", "[mpi]") {
  Communicator comm;
  const MoEConfig cfg = test::moe_config(6, 2, 1, 8, 12);
  const test::Slice s = test::slice_of(comm, {10, 3, 7});
  const Matrix<float> x_all = test::rnd<float>(s.total, cfg.d_model, 3);
  MoEFFN<float> ref(cfg, 9);
  ExpertParallelMoE<float> ep(cfg, comm, 9);
  typename MoEFFN<float>::Cache rc;
  typename ExpertParallelMoE<float>::Cache c;
  const Matrix<float> y_ref = ref.forward(x_all, &rc);
  const Matrix<float> y = ep.forward(x_all.middleRows(s.begin, s.rows), &c);
  CHECK(test::rel_error(y, y_ref.middleRows(s.begin, s.rows)) <= 1e-5);
  const Matrix<float> dx = ep.backward(Matrix<float>::Ones(s.rows, cfg.d_model), c);
  const Matrix<float> dx_ref = ref.backward(Matrix<float>::Ones(s.total, cfg.d_model), rc);
  CHECK(test::rel_error(dx, dx_ref.middleRows(s.begin, s.rows)) <= 1e-5);
  test::check_params_match(ep.params(), ref.params(), 1e-4);
}

TEST_CASE("ExpertParallelMoE in float agrees to rounding where blocks sit at other alignments, bitwise on rerun",
          "[mpi]") {
  Communicator comm;
  const MoEConfig cfg = test::moe_config(8, 2, 1, 8, 13);  // 3f·4 = 156 bytes per workspace row
  for (const std::vector<Index>& sizes : {std::vector<Index>{37, 0, 0, 0}, std::vector<Index>{20, 13, 7, 11}}) {
    const test::Slice s = test::slice_of(comm, sizes);
    const Matrix<float> x_all = test::rnd<float>(s.total, cfg.d_model, 4);
    const Matrix<float> dy_all = test::rnd<float>(s.total, cfg.d_model, 5);
    const Matrix<float> x = x_all.middleRows(s.begin, s.rows), dy = dy_all.middleRows(s.begin, s.rows);
    MoEFFN<float> ref(cfg, 9);
    ExpertParallelMoE<float> ep(cfg, comm, 9);
    typename MoEFFN<float>::Cache rc;
    const Matrix<float> y_ref = ref.forward(x_all, &rc);
    const Matrix<float> dx_ref = ref.backward(dy_all, rc);
    std::vector<Matrix<float>> first;
    for (int run = 0; run < 2; ++run) {
      ep.zero_grad();
      typename ExpertParallelMoE<float>::Cache c;
      const Matrix<float> y = ep.forward(x, &c), dx = ep.backward(dy, c);
      CHECK(test::rel_error(y, y_ref.middleRows(s.begin, s.rows)) <= 1e-5);
      CHECK(test::rel_error(dx, dx_ref.middleRows(s.begin, s.rows)) <= 1e-5);
      test::check_params_match(ep.params(), ref.params(), 1e-4);
      std::vector<Matrix<float>> now = test::grads_of(ep.params());
      now.push_back(y);
      now.push_back(dx);
      if (run == 0) first = now;
      else CHECK(now == first);  // bitwise run to run
    }
  }
}

TEST_CASE("ExpertParallelMoE inside FFNSublayer with the skip gate", "[mpi]") {
  Communicator comm;
  const MoEConfig cfg = test::moe_config(6, 2, 1, 8, 10);
  const Index d = cfg.d_model;
  SkipGateConfig gc = test::gate_config(d, 4, 0.9);  // g ≈ 0.9 at initialisation: about half skipped
  const test::Slice s = test::slice_of(comm, {12, 0, 9, 5});
  const Matrix<double> x_all = test::random_matrix(s.total, d, 21);
  const Matrix<double> dy_all = test::random_matrix(s.total, d, 22);
  const Matrix<double> x = x_all.middleRows(s.begin, s.rows), dy = dy_all.middleRows(s.begin, s.rows);

  FFNSublayer<double, MoEFFN<double>> ref(d, MoEFFN<double>(cfg, 4), SkipGate<double>(gc, 8));
  FFNSublayer<double, ExpertParallelMoE<double>> ep(d, ExpertParallelMoE<double>(cfg, comm, 4),
                                                    SkipGate<double>(gc, 8));
  // Tokens skipped somewhere, kept somewhere: both paths of the sublayer run.
  typename FFNSublayer<double, MoEFFN<double>>::Cache rc;
  const Matrix<double> y_ref = ref.forward(x_all, &rc);
  REQUIRE(rc.skipped() > 0);
  REQUIRE(rc.kept.size() > 0);

  typename FFNSublayer<double, ExpertParallelMoE<double>>::Cache c;
  const Matrix<double> y = ep.forward(x, &c);
  CHECK(test::rel_error(y, y_ref.middleRows(s.begin, s.rows)) <= kTol);
  const Matrix<double> dx_ref = ref.backward(dy_all, rc);
  const Matrix<double> dx = ep.backward(dy, c);
  CHECK(test::rel_error(dx, dx_ref.middleRows(s.begin, s.rows)) <= kTol);
  // The sublayer's own parameters (norm, gate) are data parallel: sum them.
  ParamList<double> outside;
  for (const auto& prm : ep.params())
    if (prm.name.rfind("ffn.", 0) != 0) outside.push_back(prm);
  mpi::sum_gradients(comm, outside);
  test::check_params_match(ep.params(), ref.params(), kTol);

  ref.observe(rc);
  ep.observe(c);
  CHECK(ep.ffn().balancer().report().counts == ref.ffn().balancer().report().counts);
  ref.ffn().balancer().update();
  ep.ffn().balancer().update();
  CHECK(ep.ffn().balancer().bias() == ref.ffn().balancer().bias());

  // Inference: only kept tokens are routed (and sent); the same y.
  typename FFNSublayer<double, ExpertParallelMoE<double>>::Cache ci;
  typename FFNSublayer<double, MoEFFN<double>>::Cache rci;
  const Matrix<double> yi_ref = ref.forward(x_all, SublayerMode::inference, &rci);
  const Matrix<double> yi = ep.forward(x, SublayerMode::inference, &ci);
  CHECK(test::rel_error(yi, yi_ref.middleRows(s.begin, s.rows)) <= kTol);
  CHECK(ci.ffn.plan.n_tokens == Index(ci.kept.size()));
  // Without a cache too (no second call for skipped tokens).
  CHECK(test::rel_error(ep.forward(x, SublayerMode::inference, nullptr), yi_ref.middleRows(s.begin, s.rows)) <= kTol);
}

TEST_CASE("The kappa regulariser of an expert-parallel layer is the layer-wide one", "[mpi]") {
  Communicator comm;
  const MoEConfig cfg = test::moe_config(7, 2, 1, 6, 8);
  MoEFFN<double, KappaSwiGLU<double>> ref(cfg, 3);
  mpi::ExpertParallelMoE<double, KappaSwiGLU<double>> ep(cfg, comm, 3);
  for (auto& e : ref.experts()) {
    e.kappa_alpha() = test::random_matrix(1, e.d_ffn(), 61, 0.5);
    e.kappa_bias() = test::random_matrix(1, e.d_ffn(), 62, 0.5);
  }
  test::copy_values(ref.params(), ep.params());
  const double r_ref = add_kappa_regularizer_grad(ref);
  const double r = mpi::add_kappa_regularizer_grad(ep);
  CHECK(std::abs(r - r_ref) <= 1e-14 * std::abs(r_ref));
  test::check_params_match(ep.params(), ref.params(), 1e-15);
}

TEST_CASE("ExpertParallelMoE gives the same bits on 1 and 2 threads per rank", "[mpi]") {
  Communicator comm;
  const MoEConfig cfg = test::moe_config(6, 2, 2, 8, 10);
  const test::Slice s = test::slice_of(comm, {1500, 40, 0});
  const Matrix<double> x = test::random_matrix(s.total, cfg.d_model, 8).middleRows(s.begin, s.rows);
  mpi::ExpertParallelMoE<double> a(cfg, comm, 2), b(cfg, comm, 2);
  a.set_threads(1);
  b.set_threads(2);
  typename mpi::ExpertParallelMoE<double>::Cache ca, cb;
  CHECK(a.forward(x, &ca) == b.forward(x, &cb));
  const Matrix<double> dy = test::random_matrix(s.rows, cfg.d_model, 9);
  CHECK(a.backward(dy, ca) == b.backward(dy, cb));
  const auto pa = a.params(), pb = b.params();
  for (std::size_t i = 0; i < pa.size(); ++i) CHECK(pa[i].grad() == pb[i].grad());
}

TEST_CASE("FFNSublayer with the expert-parallel FFN when one rank skips every token", "[mpi]") {
  Communicator comm;
  const int p = comm.size();
  const MoEConfig cfg = test::moe_config(6, 2, 1, 8, 10);
  const Index d = cfg.d_model;
  const SkipGateConfig gc = test::gate_config(d, 4, 0.9);
  using Ref = FFNSublayer<double, MoEFFN<double>>;
  using Dist = FFNSublayer<double, ExpertParallelMoE<double>>;
  Ref ref(d, MoEFFN<double>(cfg, 4), SkipGate<double>(gc, 8));
  Dist ep(d, ExpertParallelMoE<double>(cfg, comm, 4), SkipGate<double>(gc, 8));

  // Sort a batch so that rank 1 (if any) holds only tokens the gate skips,
  // and the other ranks share the kept ones.
  const Matrix<double> pool = test::random_matrix(40, d, 23);
  typename Ref::Cache probe;
  ref.forward(pool, &probe);
  const std::vector<bool> keep = probe.keep_mask();
  std::vector<Index> kept, skipped;
  for (Index t = 0; t < pool.rows(); ++t) (keep[std::size_t(t)] ? kept : skipped).push_back(t);
  REQUIRE(!kept.empty());
  REQUIRE(!skipped.empty());
  std::vector<Index> order, sizes(static_cast<std::size_t>(p), 0);
  const int others = p > 1 ? p - 1 : 1;
  std::size_t next = 0;
  for (int r = 0; r < p; ++r) {
    if (r == 1) {
      order.insert(order.end(), skipped.begin(), skipped.end());
      sizes[1] = Index(skipped.size());
      continue;
    }
    const std::size_t share = kept.size() / std::size_t(others) + (r == 0 ? kept.size() % std::size_t(others) : 0);
    for (std::size_t i = 0; i < share; ++i) order.push_back(kept[next++]);
    sizes[std::size_t(r)] = Index(share);
  }
  Matrix<double> x_all(Index(order.size()), d);
  for (Index i = 0; i < x_all.rows(); ++i) x_all.row(i) = pool.row(order[std::size_t(i)]);
  const Matrix<double> dy_all = test::random_matrix(x_all.rows(), d, 24);
  const test::Slice s = test::slice_of(comm, sizes);
  const Matrix<double> x = x_all.middleRows(s.begin, s.rows), dy = dy_all.middleRows(s.begin, s.rows);

  for (SublayerMode mode : {SublayerMode::training, SublayerMode::inference}) {
    typename Ref::Cache rc;
    typename Dist::Cache c;
    ref.zero_grad();
    ep.zero_grad();
    const Matrix<double> y_ref = ref.forward(x_all, mode, &rc);
    const Matrix<double> y = ep.forward(x, mode, &c);
    if (comm.rank() == 1) CHECK(c.kept.empty());
    CHECK(test::rel_error(y, y_ref.middleRows(s.begin, s.rows)) <= kTol);
    ref.observe(rc);
    ep.observe(c);
    CHECK(ep.ffn().balancer().report().counts == ref.ffn().balancer().report().counts);
    ref.ffn().balancer().update();
    ep.ffn().balancer().update();
    if (mode == SublayerMode::training) {
      const Matrix<double> dx_ref = ref.backward(dy_all, rc);
      const Matrix<double> dx = ep.backward(dy, c);
      CHECK(test::rel_error(dx, dx_ref.middleRows(s.begin, s.rows)) <= kTol);
      ParamList<double> outside;
      for (const auto& prm : ep.params())
        if (prm.name.rfind("ffn.", 0) != 0) outside.push_back(prm);
      mpi::sum_gradients(comm, outside);
      test::check_params_match(ep.params(), ref.params(), kTol);
    }
  }
}

// ---- Routing options, the shared-expert gate and the capacity limit ----

namespace {

/// The family's MoEConfig on test shapes: d = 8, f = 6, E experts, K per token.
MoEConfig small_family(MoEFamily family, Index n_experts, Index k, Index n_shared, Index d_shared = 0) {
  MoEConfig c = family_preset(family);
  c.d_model = 8;
  c.d_ffn = 6;
  c.n_experts = n_experts;
  c.n_active = k;
  c.n_shared = n_shared;
  c.d_shared_ffn = d_shared;
  return c;
}

/// Non-zero α and b, so κ ≠ 1 and the logit path carries gradient.
void prepare_kappa(std::vector<KappaSwiGLU<double>>& experts) {
  for (auto& e : experts) {
    e.kappa_alpha() = test::random_matrix(1, e.d_ffn(), 31, 0.5);
    e.kappa_bias() = test::random_matrix(1, e.d_ffn(), 32, 0.5);
    e.set_U(3.0);
  }
}

/// A bias that steers most tokens to experts 0 and 1 (so they overflow any
/// capacity near the mean), and mildly perturbs the rest.
const std::vector<double> kSkewed = {1.0, 1.0, -0.6, -0.2, -1.0, -0.4, -0.8, 0.0};
/// A balancing bias of moderate size, so selection depends on it.
const std::vector<double> kMixed = {0.3, -0.2, 0.5, -0.4, 0.1, 0.0, -0.3, 0.2};

}  // namespace

TEST_CASE("ExpertParallelMoE with DeepSeek-V3 routing: sigmoid, groups, bias, renormalisation, scale", "[mpi]") {
  // 4 groups of 2 experts, the best 2 kept; σ scores, renormalised, × 2.5.
  MoEConfig cfg = small_family(MoEFamily::DeepSeekV3, 8, 3, 1, 12);
  cfg.routing.n_groups = 4;
  cfg.routing.topk_group = 2;
  REQUIRE(cfg.routing.scoring == Scoring::Sigmoid);
  REQUIRE(cfg.routing.routed_scale == 2.5);
  std::vector<Scenario> scenarios = {
      {"top-2-sum groups, a rank with 0 tokens", cfg, {7, 0, 12, 4}, 1.0, false, kMixed},
      {"one rank's batch far larger", cfg, {300, 2, 3, 1}, 1.0, false, kMixed},
  };
  MoEConfig max_groups = cfg;  // DeepSeek-V3's Gate without a bias: groups by their max, weights from ℓ
  max_groups.routing.group_score = GroupScore::Max;
  max_groups.weights_from_unbiased = true;
  scenarios.push_back(
      {"max-score groups, weights from the unbiased scores", max_groups, {5, 9, 1}, 1.0, false, kMixed});
  for (const auto& sc : scenarios) run_scenario<SwiGLU<double>>(sc);
}

TEST_CASE("ExpertParallelMoE with softmax over all experts", "[mpi]") {
  const MoEConfig olmoe = small_family(MoEFamily::OLMoE, 7, 3, 0);  // not renormalised
  REQUIRE(olmoe.routing.scoring == Scoring::SoftmaxAll);
  REQUIRE(!olmoe.routing.renormalize);
  const MoEConfig mixtral = small_family(MoEFamily::Mixtral, 8, 2, 1);  // renormalised
  std::vector<Scenario> scenarios = {
      {"without renormalisation, E = 7", olmoe, {5, 9, 0, 3}, 1.0, false, kMixed},
      {"without renormalisation, every token to the last rank", olmoe, {40, 0, 25, 9}, 0.1, true},
      {"renormalised (Mixtral)", mixtral, {11, 4, 6}, 1.0, false, kMixed},
  };
  for (const auto& sc : scenarios) run_scenario<SwiGLU<double>>(sc);
}

TEST_CASE("ExpertParallelMoE with Qwen2-MoE's gated shared expert of another width", "[mpi]") {
  const MoEConfig qwen = small_family(MoEFamily::Qwen2MoE, 6, 2, 1, 14);
  REQUIRE(qwen.shared_expert_gate);
  REQUIRE(qwen.shared_ffn() != qwen.d_ffn);
  MoEConfig two = qwen;  // the gate scales the sum of several shared experts
  two.n_shared = 2;
  MoEConfig none = qwen;  // a gate without shared experts gates nothing
  none.n_shared = 0;
  std::vector<Scenario> scenarios = {
      {"one gated shared expert, f_shared = 14", qwen, {9, 3, 0, 14}},
      {"two gated shared experts", two, {6, 0, 10}, 1.0, false, kMixed},
      {"gate without shared experts", none, {4, 7}},
  };
  for (const auto& sc : scenarios) run_scenario<SwiGLU<double>>(sc);
}

TEST_CASE("ExpertParallelMoE with kappa-SwiGLU experts under sigmoid and softmax-over-all scoring", "[mpi]") {
  MoEConfig sigmoid = test::moe_config(6, 2, 1, 8, 10);
  sigmoid.routing = family_routing(MoEFamily::DeepSeekV3);
  sigmoid.routing.n_groups = 3;
  sigmoid.routing.topk_group = 2;
  MoEConfig softmax_all = test::moe_config(6, 2, 1, 8, 10);
  softmax_all.routing = family_routing(MoEFamily::OLMoE);
  std::vector<Scenario> scenarios = {
      {"kappa, sigmoid with groups", sigmoid, {9, 3, 0, 14}, 1.0, false, kMixed},
      {"kappa, softmax over all", softmax_all, {5, 8, 2}},
  };
  for (const auto& sc : scenarios) run_scenario<KappaSwiGLU<double>>(sc, prepare_kappa);
}

TEST_CASE("ExpertParallelMoE with a capacity factor drops what MoEFFN drops on the concatenated batch", "[mpi]") {
  MoEConfig cfg = test::moe_config(8, 2, 1, 8, 12);
  cfg.routing.capacity_factor = 1.0;
  MoEConfig tight = cfg;
  tight.routing.capacity_factor = 0.3;  // C = 1 for small batches
  MoEConfig qwen = small_family(MoEFamily::Qwen2MoE, 8, 2, 1, 14);
  qwen.routing.capacity_factor = 1.25;
  MoEConfig deepseek = small_family(MoEFamily::DeepSeekV3, 8, 2, 1, 12);
  deepseek.routing.n_groups = 4;
  deepseek.routing.topk_group = 2;
  deepseek.routing.capacity_factor = 1.0;
  std::vector<Scenario> scenarios = {
      {"skewed, a rank with 0 tokens", cfg, {9, 0, 14, 6}, 1.0, false, kSkewed, true},
      {"every token to the last rank's experts", cfg, {40, 0, 25, 9}, 0.1, true, {}, true},
      {"tight, one rank's batch far larger", tight, {300, 2, 3, 1}, 1.0, false, kSkewed, true},
      {"Qwen2-MoE routing and gate", qwen, {7, 12, 0}, 1.0, false, kSkewed, true},
      {"DeepSeek-V3 routing", deepseek, {10, 5, 8, 0}, 1.0, false, kSkewed, true},
      {"no tokens anywhere but rank 0", cfg, {12, 0}, 1.0, false, kSkewed, true},
  };
  for (const auto& sc : scenarios) run_scenario<SwiGLU<double>>(sc);

  MoEConfig kappa = deepseek;  // κ's logit path of a dropped pair gets no gradient either
  run_scenario<KappaSwiGLU<double>>({"kappa, sigmoid, capacity", kappa, {9, 0, 14, 6}, 1.0, false, kSkewed, true},
                                    prepare_kappa);
}

TEST_CASE("ExpertParallelMoE's capacity limit in float drops what the float MoEFFN drops", "[mpi]") {
  Communicator comm;
  MoEConfig cfg = test::moe_config(8, 2, 1, 8, 12);
  cfg.routing.capacity_factor = 1.0;
  const test::Slice s = test::slice_of(comm, {10, 0, 7, 13});
  const Matrix<float> x_all = test::rnd<float>(s.total, cfg.d_model, 3);
  MoEFFN<float> ref(cfg, 9);
  ExpertParallelMoE<float> ep(cfg, comm, 9);
  RowVector<float> b(cfg.n_experts);
  for (Index e = 0; e < cfg.n_experts; ++e) b(e) = float(kSkewed[std::size_t(e)]);
  ref.balancer().set_bias(b);
  ep.balancer().set_bias(b);
  typename MoEFFN<float>::Cache rc;
  typename ExpertParallelMoE<float>::Cache c;
  const Matrix<float> y_ref = ref.forward(x_all, &rc);
  const Matrix<float> y = ep.forward(x_all.middleRows(s.begin, s.rows), &c);
  REQUIRE(!rc.dropped.empty());
  CHECK(c.dropped == local_drops(rc.dropped, s, cfg.n_active));
  CHECK(test::rel_error(y, y_ref.middleRows(s.begin, s.rows)) <= 1e-5);
}
