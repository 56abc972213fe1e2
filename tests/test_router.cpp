// The router (moe/router.hpp) and its routing options (moe/routing_config.hpp,
// docs/routing.md): the worked examples of docs/math.md#router and of sigmoid
// scoring with group-limited selection, ties toward the lower index,
// gradients by finite differences for every routing combination (κ-SwiGLU
// experts included), the packed layer routing alike, sigmoid renormalisation
// at underflow, and the error sweeps and regression tests of Router::route,
// softmax_backward and backward and of RoutingConfig.
#include <apex/ffn/inference.hpp>
#include <apex/ffn/io/name_maps.hpp>
#include <apex/ffn/layers/kappa_swiglu.hpp>
#include <apex/ffn/moe/families.hpp>
#include <apex/ffn/moe/moe_ffn.hpp>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>

#include <unistd.h>

#include "families.hpp"
#include "fixtures.hpp"
#include "gradcheck.hpp"
#include "sweep.hpp"

using namespace apex;
using apex::test::check_params;
using apex::test::check_values;
using apex::test::dot_all;
using apex::test::random_matrix;
using Catch::Matchers::WithinAbs;
using apex::test::expect;
using apex::test::outcome_isolated;
using apex::test::routed_config;

TEST_CASE("router worked example (docs/math.md#router)", "[moe][router][reference]") {
  Rng rng(0);
  Router<double> router(2, 4, 2, rng);
  // x = [0.5, −0.3]; rows of W (E × d) chosen so x·W_eᵀ = [1.2, −0.3, 0.8, 0.1].
  router.weight() << 2.4, 0, -0.6, 0, 1.6, 0, 0.2, 0;
  Matrix<double> x(1, 2);
  x << 0.5, -0.3;
  Routing<double> r;
  router.route(x, RowVector<double>::Zero(4), false, r);
  CHECK_THAT(r.logits(0, 0), WithinAbs(1.2, 1e-12));
  CHECK_THAT(r.logits(0, 1), WithinAbs(-0.3, 1e-12));
  CHECK_THAT(r.logits(0, 2), WithinAbs(0.8, 1e-12));
  CHECK_THAT(r.logits(0, 3), WithinAbs(0.1, 1e-12));
  CHECK(r.experts(0, 0) == 0);
  CHECK(r.experts(0, 1) == 2);
  CHECK_THAT(r.weights(0, 0), WithinAbs(0.599, 5e-4));
  CHECK_THAT(r.weights(0, 1), WithinAbs(0.401, 5e-4));
}

TEST_CASE("router breaks ties toward the lower expert index", "[moe][router]") {
  Rng rng(0);
  Router<double> router(2, 5, 3, rng);
  router.weight().setZero();
  Matrix<double> x = Matrix<double>::Ones(2, 2);
  RowVector<double> bias(5);
  bias << 0.1, 0.5, 0.1, 0.5, 0.1;
  Routing<double> r;
  router.route(x, bias, false, r);
  for (Index t = 0; t < 2; ++t) {
    CHECK(r.experts(t, 0) == 1);
    CHECK(r.experts(t, 1) == 3);
    CHECK(r.experts(t, 2) == 0);
  }
  // Routing weights: biased by default, unbiased (here uniform) on request.
  CHECK(r.weights(0, 0) > r.weights(0, 2));
  router.route(x, bias, true, r);
  CHECK_THAT(r.weights(0, 0), WithinAbs(1.0 / 3, 1e-15));
}

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

TEST_CASE("kappa-SwiGLU experts read the raw logit under every scoring", "[routing][kappa][gradcheck]") {
  for (Scoring scoring : {Scoring::SoftmaxAll, Scoring::Sigmoid}) {
    INFO(scoring_name(scoring));
    RoutingConfig rc;
    rc.scoring = scoring;
    rc.n_groups = 2;
    rc.routed_scale = 1.5;
    MoEFFN<double, KappaSwiGLU<double>> moe(routed_config(6, 2, 1, rc), 41);
    for (auto& e : moe.experts()) {
      KappaOptions opt = e.options();
      opt.rho = 1.0;  // the analytic gradient is then the true one, router included
      opt.c = 1.5;
      e.set_options(opt);
    }
    Matrix<double> x = random_matrix(5, 6, 42, 1.5);
    Routing<double> base;
    moe.router().route(x, moe.balancer().bias(), false, base);
    int flips = 0;
    const Matrix<double> rr = random_matrix(5, 6, 43);
    auto loss = [&] {
      Routing<double> now;
      moe.router().route(x, moe.balancer().bias(), false, now);
      if (now.experts != base.experts) ++flips;
      return dot_all(moe.forward(x), rr);
    };
    MoEFFN<double, KappaSwiGLU<double>>::Cache cache;
    moe.forward(x, &cache);
    // The side input is ℓ[t, e_k], not the score s or the weight g.
    for (Index r = 0; r < cache.plan.rows(); ++r)
      CHECK(cache.side_sorted(r) == cache.routing.logits(cache.plan.token[r],
                                                          cache.routing.experts(cache.plan.token[r], cache.plan.slot[r])));
    const Matrix<double> dx = moe.backward(rr, cache);
    APEX_CHECK_GRADS(check_params(moe.params(), loss), 1e-6);
    APEX_CHECK_GRADS(std::vector{check_values("x", x.data(), dx.data(), x.size(), loss)}, 1e-6);
    CHECK(flips == 0);
  }
}

TEST_CASE("the packed layer routes with the float layer's routing options", "[routing][inference]") {
  for (MoEFamily f : {MoEFamily::DeepSeekV3, MoEFamily::OLMoE, MoEFamily::Mixtral}) {
    INFO(family_name(f));
    RoutingConfig rc = family_routing(f);
    if (f == MoEFamily::DeepSeekV3) rc.n_groups = 4, rc.topk_group = 2;
    MoEConfig c = routed_config(8, 2, 1, rc);
    MoEFFN<float> moe(c, 5);
    moe.balancer().set_bias(random_matrix(1, 8, 6, 0.05).cast<float>());
    const auto p = PackedMoE<float>::from(moe);
    const Matrix<float> x = random_matrix(17, 6, 7).cast<float>();
    MoEFFN<float>::Cache c0;
    PackedMoE<float>::Cache c1;
    const Matrix<float> y0 = moe.forward(x, &c0), y1 = p.forward(x, &c1);
    CHECK(c1.routing.experts == c0.routing.experts);
    CHECK(c1.routing.weights == c0.routing.weights);
    CHECK((y1 - y0).norm() <= 1e-6 * y0.norm());
  }
  // Qwen2-MoE's gated shared expert of its own width (tests/test_inference.cpp tests more).
  MoEConfig gated = routed_config(8, 2, 1, family_routing(MoEFamily::Qwen2MoE));
  gated.shared_expert_gate = true;
  gated.d_shared_ffn = 7;
  MoEFFN<float> moe(gated, 5);
  const auto p = PackedMoE<float>::from(moe);
  const Matrix<float> x = random_matrix(17, 6, 8).cast<float>();
  const Matrix<float> y0 = moe.forward(x);
  CHECK((p.forward(x) - y0).norm() <= 1e-6 * y0.norm());
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

namespace {

/// A sigmoid-renormalised layer (DeepSeek-V3's rule, no groups) whose router
/// logits all lie near `logit`: column 0 of x is 1 and the router's column 0
/// is `logit`, the other columns add ±0.3 · x.
template <class T>
MoEFFN<T> sigmoid_layer_near(double logit, Matrix<T>& x) {
  RoutingConfig rc;
  rc.scoring = Scoring::Sigmoid;
  rc.renormalize = true;
  rc.routed_scale = 2.5;
  MoEFFN<T> moe(routed_config(8, 3, 1, rc), 31);
  Matrix<double> w = random_matrix(8, 6, 32, 0.3);
  w.col(0).setConstant(logit);
  moe.router().weight() = w.cast<T>();
  Matrix<double> xd = random_matrix(5, 6, 33, 1.0);
  xd.col(0).setOnes();
  x = xd.cast<T>();
  return moe;
}

}  // namespace

TEST_CASE("sigmoid renormalisation is finite when every score underflows", "[routing][regression]") {
  // moe/router.hpp: with sigmoid scoring and renormalisation the weights were
  // g_k = c·s_k / Σ_j s_j. In float, logits near −160 give σ = 0 exactly
  // (exp(160) overflows), so the weights were 0/0 = NaN and the output NaN
  // for a finite input. Fixed (DeepSeek-V3's rule as Hugging Face writes
  // it): the denominator is Σ_j s_j + 1e-20; the weights are then 0, the
  // layer returns its shared experts, and the backward is finite.
  auto finite_everywhere = [](auto& moe, const auto& x) {
    using M = std::decay_t<decltype(x)>;
    typename std::decay_t<decltype(moe)>::Cache c;
    const M y = moe.forward(x, &c);
    CHECK(y.allFinite());
    CHECK(c.routing.weights.allFinite());
    const M dx = moe.backward(M::Ones(x.rows(), x.cols()), c);
    CHECK(dx.allFinite());
    for (const auto& p : moe.params()) {
      INFO(p.name);
      CHECK(p.grad().allFinite());
    }
  };
  Matrix<float> xf;
  MoEFFN<float> f = sigmoid_layer_near<float>(-160, xf);
  finite_everywhere(f, xf);
  CHECK(f.forward(xf) == f.shared_experts()[0].forward(xf));  // every routed weight is 0
  Matrix<double> xd;
  MoEFFN<double> d = sigmoid_layer_near<double>(-800, xd);  // σ = 0 in double too
  finite_everywhere(d, xd);
}

TEST_CASE("sigmoid renormalisation divides by the sum plus 1e-20", "[routing][gradcheck]") {
  // Where the scores are tiny but not zero (double, logits near −40: σ ≈
  // 4e-18) the 1e-20 is visible: the weights sum to c·S/(S + 1e-20), as in
  // Hugging Face's DeepSeek-V3, and the backward (∂g/∂s includes the ε)
  // matches central differences.
  Matrix<double> x;
  MoEFFN<double> moe = sigmoid_layer_near<double>(-40, x);
  MoEFFN<double>::Cache c;
  moe.forward(x, &c);
  for (Index t = 0; t < x.rows(); ++t) {
    double sum = 0;
    for (Index k = 0; k < 3; ++k) sum += c.routing.scores(t, c.routing.experts(t, k));
    REQUIRE(sum < 1e-15);
    for (Index k = 0; k < 3; ++k)
      CHECK(c.routing.weights(t, k) == 2.5 * (c.routing.scores(t, c.routing.experts(t, k)) / (sum + 1e-20)));
    CHECK(c.routing.weights.row(t).sum() < 2.5 * (1 - 1e-6));
  }
  const Matrix<double> rr = random_matrix(5, 6, 34);
  Matrix<double> xv = x;
  int flips = 0;
  auto loss = [&] {
    MoEFFN<double>::Cache cc;
    const double l = dot_all(moe.forward(xv, &cc), rr);
    if (cc.routing.experts != c.routing.experts) ++flips;
    return l;
  };
  const Matrix<double> dx = moe.backward(rr, c);
  APEX_CHECK_GRADS(check_params(moe.params(), loss), 1e-6);
  APEX_CHECK_GRADS(std::vector{check_values("x", xv.data(), dx.data(), xv.size(), loss)}, 1e-6);
  CHECK(flips == 0);
  CHECK(moe.router().weight_grad().norm() > 0);
}

// ---- error handling (sweeps) ----
using namespace apex::test;  // the sweep machinery of support/sweep.hpp

TEST_CASE("Router::route checks the width of x and the bias", "[sweeps][regression][router]") {
  // moe/router.hpp, Router::route: neither `x` (N × d) nor `bias` (1 × E) was
  // checked. A wrong width of x failed an eigen_assert in linear_nt (abort;
  // out-of-bounds reads with NDEBUG); a short bias was read past its end
  // (`bias(e)`); a NaN bias silently yielded NaN routing weights. route is
  // public (the tests and the plain-loop reference call it). Fixed: route
  // checks the shapes of x and bias and that the bias is finite.
  const auto route = [](Index rows, Index cols, Index bias_len, double bias_value) {
    return [=] {
      Rng rng(0);
      const Router<double> router(6, 4, 2, rng);
      Routing<double> out;
      RowVector<double> bias = RowVector<double>::Zero(bias_len);
      if (bias_len > 0) bias(0) = bias_value;
      router.route(Matrix<double>::Ones(rows, cols), bias, false, out);
    };
  };
  for (Index rows : {Index(3), Index(20)})  // both paths of linear_nt
    for (Index cols : {Index(5), Index(7), Index(0)}) {
      INFO("x " << shape(rows, cols));
      expect(outcome_isolated(route(rows, cols, 4, 0)), "ShapeError", {"Router::route", "'x'"});
    }
  for (Index len : {Index(3), Index(0), Index(5)}) {
    INFO("bias of length " << len);
    expect(outcome_isolated(route(3, 6, len, 0)), "ShapeError", {"Router::route", "'bias'"});
  }
  for (double b : {kNaN, kInf}) {
    INFO("bias " << b);
    expect(outcome_isolated(route(3, 6, 4, b)), "ValueError", {"Router::route", "'bias'"});
  }
}

TEST_CASE("Router::softmax_backward and Router::backward check their shapes", "[sweeps][regression][router]") {
  // moe/router.hpp: softmax_backward(routing, d_weights, d_logits) and
  // backward(x, d_logits) checked nothing; d_weights that is not N × K,
  // d_logits that is not N × E or x that is not N × d failed eigen_asserts or
  // read and wrote out of bounds. Fixed: softmax_backward checks the routing,
  // d_weights (N × K) and d_logits (N × E); backward (now one call from ∂L/∂g)
  // checks x (N × d), the routing, d_weights and d_pair_logits (N × K).
  const auto setup = [] {
    Rng rng(0);
    Router<double> router(6, 4, 2, rng);
    Routing<double> r;
    router.route(random_matrix(3, 6, 1), RowVector<double>::Zero(4), false, r);
    return std::make_pair(router, r);
  };
  expect(outcome_isolated([&] {
           auto [router, r] = setup();
           Matrix<double> dl = Matrix<double>::Zero(3, 4);
           router.softmax_backward(r, Matrix<double>::Zero(2, 2), dl);
         }),
         "ShapeError", {"Router::softmax_backward", "'d_weights'"});
  expect(outcome_isolated([&] {
           auto [router, r] = setup();
           Matrix<double> dl = Matrix<double>::Zero(3, 3);
           router.softmax_backward(r, Matrix<double>::Zero(3, 2), dl);
         }),
         "ShapeError", {"Router::softmax_backward", "'d_logits'"});
  expect(outcome_isolated([&] {
           auto [router, r] = setup();
           router.backward(Matrix<double>::Ones(3, 6), r, Matrix<double>::Zero(3, 2), Matrix<double>::Zero(3, 3));
         }),
         "ShapeError", {"Router::backward", "'d_pair_logits'"});
  expect(outcome_isolated([&] {
           auto [router, r] = setup();
           router.backward(Matrix<double>::Ones(3, 5), r, Matrix<double>::Zero(3, 2));
         }),
         "ShapeError", {"Router::backward", "'x'"});
  // A routing made by a router of another K or E would scatter past d_logits.
  for (const auto& [e, k] : {std::pair<Index, Index>{5, 2}, std::pair<Index, Index>{4, 3}}) {
    INFO("routing of a router with E = " << e << " and K = " << k);
    expect(outcome_isolated([e = e, k = k] {
             Rng rng(0);
             Router<double> router(6, 4, 2, rng), other(6, e, k, rng);
             Routing<double> r;
             other.route(random_matrix(3, 6, 1), RowVector<double>::Zero(e), false, r);
             Matrix<double> dl = Matrix<double>::Zero(3, 4);
             router.softmax_backward(r, Matrix<double>::Zero(3, 2), dl);
           }),
           "ShapeError", {"Router::softmax_backward", "'routing."});
  }
}
