// Routing options of the open MoE families (docs/routing.md): scorings,
// group-limited selection, renormalisation and routed scale against worked
// examples, gradients by finite differences for every combination, the
// default path unchanged, shared experts of another width, and the
// RoutingConfig error sweep.
#include <apex/ffn/moe.hpp>

#include <catch2/catch.hpp>

#include "gradcheck.hpp"
#include "sweep.hpp"

using namespace apex;
using apex::test::check_params;
using apex::test::check_values;
using apex::test::dot_all;
using apex::test::random_matrix;
using Catch::Matchers::WithinAbs;

namespace {

MoEConfig routed_config(Index e, Index k, Index shared, const RoutingConfig& routing) {
  MoEConfig cfg;
  cfg.d_model = 6;
  cfg.d_ffn = 5;
  cfg.n_experts = e;
  cfg.n_active = k;
  cfg.n_shared = shared;
  cfg.routing = routing;
  return cfg;
}

}  // namespace

TEST_CASE("default RoutingConfig is APEX-1's router", "[routing]") {
  MoEConfig cfg = routed_config(8, 3, 1, RoutingConfig{});
  MoEFFN<double> moe(cfg, 3);
  moe.balancer().set_bias(random_matrix(1, 8, 4, 0.2));
  const Matrix<double> x = random_matrix(9, 6, 5);
  Routing<double> r;
  moe.router().route(x, moe.balancer().bias(), false, r);
  CHECK(r.scores.size() == 0);
  // The same softmax over the selected biased logits, written out.
  for (Index t = 0; t < x.rows(); ++t) {
    Eigen::Array<double, 1, Eigen::Dynamic> v(3);
    for (Index k = 0; k < 3; ++k) v(k) = r.logits(t, r.experts(t, k)) + moe.balancer().bias()(r.experts(t, k));
    v = (v - v.maxCoeff()).exp();
    v /= v.sum();
    for (Index k = 0; k < 3; ++k) CHECK_THAT(r.weights(t, k), WithinAbs(v(k), 1e-15));
  }
}

TEST_CASE("sigmoid scoring with group-limited selection, worked example (docs/routing.md)", "[routing]") {
  // E = 8 in G = 4 groups of 2, keep 2 groups, K = 2, renormalised, c = 2.5.
  RoutingConfig rc;
  rc.scoring = Scoring::Sigmoid;
  rc.n_groups = 4;
  rc.topk_group = 2;
  rc.routed_scale = 2.5;
  Rng rng(1);
  Router<double> router(2, 8, 2, rng);
  router.set_routing(rc);
  // ℓ = x·Wᵀ with x = (1, 0): the logits are W's first column.
  router.weight().setZero();
  const double l[8] = {2.0, -3.0, 0.5, 0.4, 1.5, -2.0, 0.0, 0.1};
  for (int e = 0; e < 8; ++e) router.weight()(e, 0) = l[e];
  RowVector<double> bias = RowVector<double>::Zero(8);
  bias(3) = 0.3;  // steers selection only
  Matrix<double> x(1, 2);
  x << 1, 0;
  Routing<double> r;
  router.route(x, bias, false, r);
  auto sig = [](double v) { return 1 / (1 + std::exp(-v)); };
  // Group scores, top-2 sums of σ(ℓ) + b: g0 = 0.9282, g1 = 1.5212, g2 = 0.9368,
  // g3 = 1.0250: keep g1 and g3, then the top 2 of experts {2, 3, 6, 7}.
  CHECK(r.experts(0, 0) == 3);  // σ(.4)+.3 = 0.899 beats σ(.5) = 0.622
  CHECK(r.experts(0, 1) == 2);
  const double w3 = sig(0.4), w2 = sig(0.5);
  CHECK_THAT(r.weights(0, 0), WithinAbs(2.5 * w3 / (w3 + w2), 1e-14));  // the bias is not in the weight
  CHECK_THAT(r.weights(0, 1), WithinAbs(2.5 * w2 / (w3 + w2), 1e-14));
  // Expert 0 has the best single score but its group loses on the top-2
  // sum. With the max as group score: g0 = 0.8808, g1 = 0.8987, g2 = 0.8176,
  // g3 = 0.525: keep g1 and g0.
  rc.group_score = GroupScore::Max;
  router.set_routing(rc);
  router.route(x, bias, false, r);
  CHECK(r.experts(0, 0) == 3);
  CHECK(r.experts(0, 1) == 0);
}

TEST_CASE("ties in group and expert selection go to the lower index", "[routing]") {
  RoutingConfig rc;
  rc.scoring = Scoring::SoftmaxAll;
  rc.n_groups = 4;
  rc.topk_group = 2;
  Rng rng(1);
  Router<double> router(1, 8, 2, rng);
  router.set_routing(rc);
  router.weight().setZero();  // every score equal
  Matrix<double> x = Matrix<double>::Ones(1, 1);
  Routing<double> r;
  router.route(x, RowVector<double>::Zero(8), false, r);
  CHECK(r.experts(0, 0) == 0);
  CHECK(r.experts(0, 1) == 1);
  CHECK_THAT(r.weights(0, 0), WithinAbs(0.5, 1e-15));
}

TEST_CASE("every routing option: gradients by finite differences", "[routing][gradcheck]") {
  struct Opt {
    const char* what;
    Scoring scoring;
    Index groups, topk_group;
    bool renorm;
    double scale;
    GroupScore gs;
    bool unbiased;
  };
  const Opt opts[] = {
      {"softmax selected, scale 1.7", Scoring::SoftmaxSelected, 1, 1, true, 1.7, GroupScore::Top2Sum, false},
      {"softmax selected, groups, unbiased", Scoring::SoftmaxSelected, 4, 2, true, 1.0, GroupScore::Max, true},
      {"softmax all, renormalised", Scoring::SoftmaxAll, 1, 1, true, 1.0, GroupScore::Top2Sum, false},
      {"softmax all, raw", Scoring::SoftmaxAll, 1, 1, false, 1.0, GroupScore::Top2Sum, false},
      {"softmax all, raw, scaled, groups", Scoring::SoftmaxAll, 2, 1, false, 2.0, GroupScore::Max, false},
      {"sigmoid, renormalised, groups, scale 2.5", Scoring::Sigmoid, 4, 2, true, 2.5, GroupScore::Top2Sum, false},
      {"sigmoid, raw", Scoring::Sigmoid, 1, 1, false, 1.0, GroupScore::Top2Sum, false},
  };
  for (const Opt& o : opts) {
    INFO(o.what);
    RoutingConfig rc;
    rc.scoring = o.scoring;
    rc.n_groups = o.groups;
    rc.topk_group = o.topk_group;
    rc.renormalize = o.renorm;
    rc.routed_scale = o.scale;
    rc.group_score = o.gs;
    MoEConfig cfg = routed_config(8, 3, 1, rc);
    cfg.weights_from_unbiased = o.unbiased;
    cfg.d_shared_ffn = 7;
    MoEFFN<double> moe(cfg, 21);
    moe.balancer().set_bias(random_matrix(1, 8, 22, 0.1));
    const Matrix<double> x0 = random_matrix(5, 6, 23, 1.5);
    Matrix<double> x = x0;
    Routing<double> base;
    moe.router().route(x, moe.balancer().bias(), o.unbiased, base);
    // Any ±ε step that changed a choice would invalidate the check: count them.
    int flips = 0;
    const Matrix<double> rr = random_matrix(5, 6, 24);
    auto loss = [&] {
      Routing<double> now;
      moe.router().route(x, moe.balancer().bias(), o.unbiased, now);
      if (now.experts != base.experts) ++flips;
      return dot_all(moe.forward(x), rr);
    };
    MoEFFN<double>::Cache cache;
    moe.forward(x, &cache);
    const Matrix<double> dx = moe.backward(rr, cache);
    APEX_CHECK_GRADS(check_params(moe.params(), loss), 1e-6);
    APEX_CHECK_GRADS(std::vector{check_values("x", x.data(), dx.data(), x.size(), loss)}, 1e-6);
    CHECK(flips == 0);
    CHECK(moe.router().weight_grad().norm() > 0);
    CHECK(moe.shared_experts()[0].params()[0].rows == 7);
  }
}

TEST_CASE("sigmoid-gated shared experts: forward and gradients", "[routing][gradcheck]") {
  RoutingConfig rc;
  rc.scoring = Scoring::SoftmaxAll;
  rc.renormalize = false;
  for (Index n_shared : {1, 2}) {
    INFO("shared experts " << n_shared);
    MoEConfig cfg = routed_config(6, 2, n_shared, rc);
    cfg.shared_expert_gate = true;
    cfg.d_shared_ffn = 9;
    MoEFFN<double> moe(cfg, 31);
    Matrix<double> x = random_matrix(4, 6, 32, 1.5);
    // Forward: the gated shared sum plus the routed part.
    MoEConfig ungated = cfg;
    ungated.shared_expert_gate = false;
    MoEFFN<double> plain(ungated, 31);  // same seed: same weights but the gate
    const auto params = moe.params();
    const Param<double>& gate = params.back();
    CHECK(gate.name == "shared_expert_gate.weight");
    CHECK(gate.rows == 1);
    Matrix<double> shared_sum = Matrix<double>::Zero(4, 6);
    for (const auto& s : moe.shared_experts()) shared_sum += s.forward(x);
    const Matrix<double> y_plain = plain.forward(x);
    const Vector<double> z = x * gate.value().transpose();
    const Vector<double> sig = (1.0 + (-z.array()).exp()).inverse().matrix();
    const Matrix<double> expected = y_plain - shared_sum + sig.asDiagonal() * shared_sum;
    CHECK((moe.forward(x) - expected).cwiseAbs().maxCoeff() < 1e-13);

    const Matrix<double> rr = random_matrix(4, 6, 33);
    auto loss = [&] { return dot_all(moe.forward(x), rr); };
    MoEFFN<double>::Cache cache;
    moe.forward(x, &cache);
    const Matrix<double> dx = moe.backward(rr, cache);
    APEX_CHECK_GRADS(check_params(moe.params(), loss), 1e-6);
    APEX_CHECK_GRADS(std::vector{check_values("x", x.data(), dx.data(), x.size(), loss)}, 1e-6);
  }
}

TEST_CASE("the balancer counts selections under every scoring", "[routing]") {
  RoutingConfig rc;
  rc.scoring = Scoring::Sigmoid;
  rc.n_groups = 2;
  rc.topk_group = 1;
  MoEFFN<double> moe(routed_config(8, 2, 0, rc), 2);
  MoEFFN<double>::Cache cache;
  moe.forward(random_matrix(16, 6, 3), &cache);
  moe.observe(cache);
  const auto report = moe.balancer().update();
  Index total = 0;
  for (Index c : report.counts) total += c;
  CHECK(total == 32);
  CHECK(moe.balancer().bias().cwiseAbs().maxCoeff() > 0);
}

TEST_CASE("RoutingConfig error sweep", "[routing][errors]") {
  auto with = [](auto edit) {
    return [edit] {
      RoutingConfig rc;
      edit(rc);
      MoEFFN<double> moe(routed_config(8, 4, 0, rc), 1);
    };
  };
  apex::test::run_sweep({
      {"groups not dividing E", with([](RoutingConfig& r) { r.n_groups = 3; }), "ConfigError",
       {"MoEFFN", "routing.n_groups", "divide n_experts"}},
      {"topk_group > groups", with([](RoutingConfig& r) { r.n_groups = 2; r.topk_group = 3; }), "ConfigError",
       {"routing.topk_group"}},
      {"too few experts in kept groups", with([](RoutingConfig& r) { r.n_groups = 4; r.topk_group = 1; }),
       "ConfigError", {"routing.topk_group * n_experts / n_groups = 2", "n_active = 4"}},
      {"scale zero", with([](RoutingConfig& r) { r.routed_scale = 0; }), "ConfigError", {"routing.routed_scale"}},
      {"scale negative", with([](RoutingConfig& r) { r.routed_scale = -1; }), "ConfigError",
       {"routing.routed_scale"}},
      {"scale NaN", with([](RoutingConfig& r) { r.routed_scale = std::nan(""); }), "ConfigError",
       {"routing.routed_scale"}},
      {"scale inf", with([](RoutingConfig& r) { r.routed_scale = INFINITY; }), "ConfigError",
       {"routing.routed_scale"}},
      {"groups zero", with([](RoutingConfig& r) { r.n_groups = 0; }), "ConfigError", {"routing.n_groups"}},
      {"shared width negative", [] {
         MoEConfig c = routed_config(8, 4, 1, RoutingConfig{});
         c.d_shared_ffn = -1;
         MoEFFN<double> moe(c, 1);
       }, "ConfigError", {"d_shared_ffn"}},
  });
}
