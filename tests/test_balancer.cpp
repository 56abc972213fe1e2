// The load balancer (moe/load_balancer.hpp): the worked step of
// docs/math.md#load-balancer, set_bias against the clamp of the update step,
// bias balancing of a skewed router to even load, counting under every
// scoring and with a token mask, and the error sweeps and regression tests
// of its configuration, setters and observe (with MoEFFN's observe).
#include <apex/ffn/layers/kappa_swiglu.hpp>
#include <apex/ffn/moe/moe_ffn.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include "fixtures.hpp"
#include "gradcheck.hpp"
#include "sweep.hpp"

using namespace apex;
using apex::test::expect;
using apex::test::outcome;
using apex::test::outcome_isolated;
using apex::test::moe_config;
using apex::test::random_matrix;
using Catch::Matchers::WithinAbs;
using apex::test::routed_config;

TEST_CASE("load balancer worked step (docs/math.md#load-balancer)", "[moe][balancer][reference]") {
  LoadBalancer<double> lb(4, 2, 0.1);
  // 8 tokens, K = 2: experts got 5, 4, 3, 4 of the 16 assignments — observed
  // in two micro-batches to exercise accumulation.
  lb.observe({3, 2, 1, 2}, 4);
  lb.observe({2, 2, 2, 2}, 4);
  const LoadReport r = lb.update();
  CHECK(r.tokens == 8);
  const double rates[4] = {0.3125, 0.25, 0.1875, 0.25};
  for (int e = 0; e < 4; ++e) CHECK(r.load[e] == rates[e]);
  CHECK(r.imbalance == 1.25);
  const double want[4] = {-0.1, 0.0, 0.1, 0.0};
  for (int e = 0; e < 4; ++e) CHECK_THAT(lb.bias()(e), WithinAbs(want[e], 1e-15));
  // The window was cleared: an empty update changes nothing.
  lb.update();
  for (int e = 0; e < 4; ++e) CHECK_THAT(lb.bias()(e), WithinAbs(want[e], 1e-15));
  // Clamp to [−1, 1].
  LoadBalancer<double> big(2, 1, 0.7);
  for (int i = 0; i < 3; ++i) {
    big.observe({4, 0}, 4);
    big.update();
  }
  CHECK(big.bias()(0) == -1.0);
  CHECK(big.bias()(1) == 1.0);
}

TEST_CASE("load balancer: set_bias stores any finite bias, update's steps are what is clamped",
          "[moe][balancer][regression]") {
  // set_bias clamped into [−1, 1], so a loaded DeepSeek-V3 correction bias
  // beyond it was changed on load (io/name_maps.hpp). The clamp is a rule of
  // the update step: a step never takes b_e out of [−1, 1], or further out
  // than it already is; values set from outside stay exact.
  LoadBalancer<double> lb(4, 1, 0.1);
  RowVector<double> b(4);
  b << 2.0, -3.0, 0.95, -0.5;
  lb.set_bias(b);
  CHECK(lb.bias() == b);
  lb.observe({4, 0, 0, 0}, 4);  // expert 0 overloaded: −α for it, +α for the others
  lb.update();
  CHECK(lb.bias()(0) == 2.0 - 0.1);   // towards the range
  CHECK(lb.bias()(1) == -3.0 + 0.1);  // towards the range
  CHECK(lb.bias()(2) == 1.0);         // clamped at the bound, as before
  CHECK(lb.bias()(3) == -0.5 + 0.1);
  const RowVector<double> mid = lb.bias();
  lb.observe({0, 4, 0, 0}, 4);  // now expert 1: +α for 0 and 2 and 3, −α for 1
  lb.update();
  CHECK(lb.bias()(0) == mid(0));  // a step outwards beyond 1 is clamped to where it was
  CHECK(lb.bias()(1) == mid(1));
  CHECK(lb.bias()(2) == 1.0);
  CHECK(lb.bias()(3) == mid(3) + 0.1);
}

TEST_CASE("bias balancing drives a skewed router to even load", "[moe][balancer]") {
  MoEConfig cfg = moe_config(8, 2, 0, 16, 8);
  cfg.balancer_alpha = 0.01;
  MoEFFN<double> moe(cfg, 30);
  const Matrix<double> x = random_matrix(512, 16, 31) + Matrix<double>::Constant(512, 16, 0.2);
  // Skew: experts 0 and 1 favoured by ~+0.6 logits on these tokens.
  moe.router().weight().topRows(2).array() += 0.2;
  MoEFFN<double>::Cache cache;
  moe.forward(x, &cache);
  moe.observe(cache);
  const double start = moe.balancer().update().imbalance;
  INFO("initial imbalance " << start);
  REQUIRE(start > 2.0);
  double last = start;
  for (int step = 0; step < 300; ++step) {
    moe.forward(x, &cache);
    moe.observe(cache);
    last = moe.balancer().update().imbalance;
  }
  INFO("final imbalance " << last);
  CHECK(last <= 1.2);
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

TEST_CASE("observe with a token mask counts only those tokens", "[moe][balancer]") {
  MoEFFN<double> moe(moe_config(4, 2, 0), 1);
  const Matrix<double> x = random_matrix(10, 6, 2);
  MoEFFN<double>::Cache cache;
  moe.forward(x, &cache);
  std::vector<bool> keep(10, false);
  keep[3] = keep[7] = true;
  moe.observe(cache, keep);
  const LoadReport r = moe.balancer().report();
  CHECK(r.tokens == 2);
  Index total = 0;
  for (Index c : r.counts) total += c;
  CHECK(total == 4);
  CHECK_THROWS_AS(moe.observe(cache, std::vector<bool>(3, true)), ShapeError);
}

TEST_CASE("observe with and without a mask rejects a cache of a layer of another E or K",
          "[moe][balancer][regression]") {
  // moe/moe_ffn.hpp, observe(cache, token_counted) trusted the cache: one filled by a
  // layer with more experts (E = 8 into E = 4) made `++counts[expert]` write
  // past `counts`, one of another K read past the routing matrix. Fixed: both
  // overloads check the cache against the layer as backward does.
  struct Other {
    Index e, k;
  };
  for (const Other o : {Other{8, 2}, Other{4, 3}, Other{4, 1}}) {
    INFO("cache of a layer with E = " << o.e << ", K = " << o.k);
    for (const bool masked : {true, false}) {
      INFO("masked " << masked);
      expect(outcome_isolated([o, masked] {
               MoEFFN<double> moe(moe_config(4, 2, 1), 1), other(moe_config(o.e, o.k, 1), 2);
               moe.set_threads(1);
               other.set_threads(1);
               MoEFFN<double>::Cache cache;
               other.forward(random_matrix(12, 6, 3), &cache);
               if (masked)
                 moe.observe(cache, std::vector<bool>(12, true));
               else
                 moe.observe(cache);
             }),
             "ShapeError", {"MoEFFN::observe", "'cache'"});
    }
  }
  // An unfilled cache with a mask of its (zero) length is rejected too.
  MoEFFN<double> moe(moe_config(4, 2, 1), 1);
  expect(outcome([&] { moe.observe(MoEFFN<double>::Cache{}, std::vector<bool>()); }), "ShapeError",
         {"MoEFFN::observe", "'cache"});
  CHECK(moe.balancer().report().tokens == 0);
}

// ---- error handling (sweeps) ----
using namespace apex::test;  // the sweep machinery of support/sweep.hpp

TEMPLATE_TEST_CASE("Router and LoadBalancer sweep: configurations and setters and inputs",
                   "[sweeps][router][balancer]", float, double) {
  using T = TestType;
  const Index d = 6, e = 4, k = 2;
  Rng rng(1);
  const Router<T> router(d, e, k, rng);
  LoadBalancer<T> balancer(e, k, 0.01);
  RowVector<T> bias(e);
  bias << T(0.5), T(-0.25), T(0), T(1);
  balancer.set_bias(bias);
  Routing<T> routing;
  std::vector<Case> cases;

  struct Shape3 {
    Index d, e, k;
    const char* field;
  };
  for (const Shape3& s : {Shape3{0, 4, 2, "d_model"}, Shape3{-1, 4, 2, "d_model"}, Shape3{6, 0, 1, "n_experts"},
                          Shape3{6, -1, 1, "n_experts"}, Shape3{6, 4, 0, "n_active"}, Shape3{6, 4, 5, "n_active"},
                          Shape3{6, 4, -1, "n_active"}})
    cases.push_back({"Router(" + std::to_string(s.d) + ", " + std::to_string(s.e) + ", " + std::to_string(s.k) + ")",
                     [=] {
                       Rng r(0);
                       (void)Router<T>(s.d, s.e, s.k, r);
                     },
                     "ConfigError", {"Router", s.field}});
  for (double v : {kNaN, kInf, -kInf})
    for (Index rows : {Index(3), Index(12)})
      cases.push_back({"Router::route with " + std::to_string(v) + " in x of " + std::to_string(rows) + " rows",
                       [=, &router, &routing, &bias] {
                         Matrix<T> x = rnd<T>(rows, d, 2);
                         x(rows - 1, 2) = T(v);
                         router.route(x, bias, false, routing);
                       },
                       "ValueError", {"Router::route", "not finite"}});

  const std::pair<Index, Index> bad_balancers[] = {{0, 1}, {4, 0}, {4, 5}, {4, -2}};
  for (const auto& [be, bk] : bad_balancers)
    cases.push_back({"LoadBalancer(" + std::to_string(be) + ", " + std::to_string(bk) + ")",
                     [=] { (void)LoadBalancer<T>(be, bk); }, "ConfigError", {"LoadBalancer", be < 1 ? "n_experts" : "n_active"}});
  for (double a : {-1e-3, kNaN, kInf}) {
    cases.push_back({"LoadBalancer alpha " + std::to_string(a), [=] { (void)LoadBalancer<T>(e, k, a); }, "ConfigError",
                     {"LoadBalancer", "alpha"}});
    cases.push_back({"LoadBalancer::set_alpha(" + std::to_string(a) + ")", [=, &balancer] { balancer.set_alpha(a); },
                     "ConfigError", {"LoadBalancer::set_alpha", "alpha"}});
  }
  for (Index len : {e - 1, e + 1, Index(0)})
    cases.push_back({"LoadBalancer::set_bias of length " + std::to_string(len),
                     [=, &balancer] { balancer.set_bias(RowVector<T>::Zero(len)); }, "ShapeError",
                     {"LoadBalancer::set_bias", "'bias'", shape(1, len)}});
  for (double v : {kNaN, kInf, -kInf})
    cases.push_back({"LoadBalancer::set_bias with " + std::to_string(v),
                     [=, &balancer] {
                       RowVector<T> b = RowVector<T>::Zero(e);
                       b(2) = T(v);
                       balancer.set_bias(b);
                     },
                     "ValueError", {"LoadBalancer::set_bias", "'bias'", "NaN or Inf"}});
  for (std::size_t len : {std::size_t(e - 1), std::size_t(e + 1), std::size_t(0)})
    cases.push_back({"LoadBalancer::observe with " + std::to_string(len) + " counts",
                     [=, &balancer] { balancer.observe(std::vector<Index>(len, 1), 1); }, "ShapeError",
                     {"LoadBalancer::observe", "'counts'"}});
  cases.push_back({"LoadBalancer::observe with counts not summing to N*K",
                   [&] { balancer.observe({1, 1, 1, 0}, 1); }, "ValueError", {"LoadBalancer::observe", "counts", "N*K"}});
  run_sweep(cases);

  // A rejected call changes nothing.
  CHECK(balancer.bias() == bias);
  CHECK(balancer.alpha() == 0.01);
  CHECK(balancer.report().tokens == 0);
}

TEST_CASE("LoadBalancer with a negative expert count raises ConfigError", "[sweeps][regression][balancer]") {
  // moe/load_balancer.hpp, constructor: the member initialisers built
  // `bias_(RowVector<T>::Zero(n_experts))` and `counts_(n_experts, 0)` before
  // the body's require_config ran, so n_experts = -1 tripped Eigen's size
  // assertion (abort; undefined behaviour with NDEBUG) instead of raising
  // ConfigError. Fixed: the first member initialiser validates every argument.
  expect(outcome_isolated([] { (void)LoadBalancer<double>(-1, 1); }), "ConfigError", {"LoadBalancer", "n_experts"});
  expect(outcome_isolated([] { (void)LoadBalancer<double>(-5, -6); }), "ConfigError", {"LoadBalancer", "n_experts"});
}

TEST_CASE("LoadBalancer::observe rejects negative counts and token numbers", "[sweeps][regression][balancer]") {
  // moe/load_balancer.hpp, observe: only the length of `counts` and its sum
  // (= n_tokens·K) were checked. {−2, 4, 0, 0} for one token with K = 2 sums
  // to 2 and was accepted, making expert 0's load −1; {−1, −1, 0, 0} with
  // n_tokens = −1 was accepted too, and the next update() moved the bias
  // from a window of −1 tokens. Fixed: ValueError unless n_tokens ≥ 0 and
  // every count is in [0, n_tokens] (a token picks K distinct experts).
  LoadBalancer<double> balancer(4, 2);
  expect(outcome([&] { balancer.observe({-2, 4, 0, 0}, 1); }), "ValueError", {"LoadBalancer::observe", "counts"});
  expect(outcome([&] { balancer.observe({-1, -1, 0, 0}, -1); }), "ValueError", {"LoadBalancer::observe", "n_tokens"});
  expect(outcome([&] { balancer.observe({3, 0, 0, 1}, 2); }), "ValueError", {"LoadBalancer::observe", "counts"});
  CHECK(balancer.report().tokens == 0);  // a rejected observe counts nothing
  // The bounds are inclusive: one expert may take every token, and an empty batch counts nothing.
  CHECK_NOTHROW(balancer.observe({2, 2, 0, 0}, 2));
  CHECK_NOTHROW(balancer.observe({0, 0, 0, 0}, 0));
  CHECK(balancer.report().tokens == 2);
  balancer = LoadBalancer<double>(4, 2);
  CHECK(balancer.update().tokens == 0);
  CHECK(balancer.bias().isZero(0));
}
