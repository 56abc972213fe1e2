// MoEFFN: router and load balancer worked examples (docs/math.md#router,
// docs/math.md#load-balancer), grouped dispatch against a plain per-expert loop, gradients by finite
// differences, determinism across runs and thread counts, balancing, and
// the error sweeps and regression tests of the router, the load balancer,
// MoEConfig and MoEFFN.
#include <apex/ffn/layers/kappa_swiglu.hpp>
#include <apex/ffn/moe/moe_ffn.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include "gradcheck.hpp"
#include "sweep.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

using namespace apex;
using apex::test::check_params;
using apex::test::check_values;
using apex::test::dot_all;
using apex::test::expect;
using apex::test::outcome;
using apex::test::outcome_isolated;
using apex::test::moe_config;
using apex::test::random_matrix;
using apex::test::topk_margin;
using Catch::Matchers::WithinAbs;

namespace {

// The plain dispatch: for each expert, scan all tokens
// for those that chose it, gather them, run the expert, scatter-add g·out.
template <class T, class Expert>
Matrix<T> plain_loop(const MoEFFN<T, Expert>& moe, const Matrix<T>& x) {
  Routing<T> routing;
  moe.router().route(x, moe.balancer().bias(), moe.config().weights_from_unbiased, routing);
  Matrix<T> out = Matrix<T>::Zero(x.rows(), x.cols());
  for (Index e = 0; e < moe.config().n_experts; ++e) {
    std::vector<Index> rows, slots;
    for (Index t = 0; t < x.rows(); ++t)
      for (Index k = 0; k < moe.config().n_active; ++k)
        if (routing.experts(t, k) == e) {
          rows.push_back(t);
          slots.push_back(k);
        }
    if (rows.empty()) continue;
    Matrix<T> xe(Index(rows.size()), x.cols());
    for (std::size_t i = 0; i < rows.size(); ++i) xe.row(Index(i)) = x.row(rows[i]);
    const Matrix<T> ye = moe.experts()[e].forward(xe);
    for (std::size_t i = 0; i < rows.size(); ++i) out.row(rows[i]) += routing.weights(rows[i], slots[i]) * ye.row(Index(i));
  }
  for (const auto& s : moe.shared_experts()) out += s.forward(x);
  return out;
}

}  // namespace

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

TEST_CASE("grouped dispatch equals the plain per-expert loop", "[moe][dispatch]") {
  struct Case {
    const char* what;
    Index n, experts, k, shared;
    double skew;  // added to expert 0's bias-free logit scale
  };
  const Case cases[] = {{"uniform", 50, 6, 2, 1, 0.0}, {"skewed", 300, 8, 2, 2, 3.0},
                        {"K = E", 20, 3, 3, 0, 0.0},   {"K = 1", 600, 4, 1, 1, 5.0},
                        {"N = 1", 1, 4, 2, 1, 0.0},    {"N = 0", 0, 4, 2, 1, 0.0},
                        // a busy expert and the shared expert split into several row tiles
                        {"several tiles", 2500, 4, 1, 1, 5.0}};
  for (const Case& cs : cases) {
    INFO(cs.what);
    MoEFFN<double> moe(moe_config(cs.experts, cs.k, cs.shared, 8, 12), 3);
    // Skew: pull expert 0's router row toward the mean input direction.
    moe.router().weight().row(0).array() += cs.skew;
    const Matrix<double> x = random_matrix(cs.n, 8, 4) + Matrix<double>::Constant(cs.n, 8, 0.3);
    const Matrix<double> y = moe.forward(x);
    const Matrix<double> want = plain_loop(moe, x);
    REQUIRE(y.rows() == cs.n);
    CHECK((y - want).norm() <= 1e-12 * (1 + want.norm()));
  }
}

TEST_CASE("zero, one and all tokens on one expert", "[moe][dispatch]") {
  // BUG-08 class: the dispatch must handle any count per expert.
  MoEFFN<double> moe(moe_config(4, 1, 1), 5);
  moe.router().weight().setZero();
  const Matrix<double> x = random_matrix(9, 6, 6);
  for (int target = 0; target < 4; ++target) {
    RowVector<double> bias = RowVector<double>::Zero(4);
    bias(target) = 1.0;
    moe.balancer().set_bias(bias);
    MoEFFN<double>::Cache cache;
    const Matrix<double> y = moe.forward(x, &cache);
    CHECK(cache.plan.count(target) == 9);
    CHECK((y - plain_loop(moe, x)).cwiseAbs().maxCoeff() < 1e-12);
  }
  // One token to expert 3, the rest to expert 0 and 1, expert 2 to none.
  moe.balancer().set_bias(RowVector<double>::Zero(4));
  Matrix<double> xs = Matrix<double>::Zero(9, 6);
  for (Index t = 0; t < 9; ++t) xs(t, t % 2) = 1.0;
  xs(4, 0) = 0;
  xs(4, 2) = 1.0;
  moe.router().weight()(0, 0) = 1;
  moe.router().weight()(1, 1) = 1;
  moe.router().weight()(3, 2) = 1;
  MoEFFN<double>::Cache cache;
  const Matrix<double> y = moe.forward(xs, &cache);
  CHECK(cache.plan.count(2) == 0);
  CHECK(cache.plan.count(3) == 1);
  CHECK((y - plain_loop(moe, xs)).cwiseAbs().maxCoeff() < 1e-12);
}

TEST_CASE("forward_into writes the forward's output into a caller's buffer, also in place", "[moe][dispatch]") {
  MoEFFN<double> moe(moe_config(6, 2, 1, 8, 12), 11);
  const Matrix<double> x = random_matrix(40, 8, 12);
  MoEFFN<double>::Cache want_cache;
  const Matrix<double> want = moe.forward(x, &want_cache);

  Matrix<double> y = Matrix<double>::Constant(40, 8, 7.0);  // stale contents are overwritten
  MoEFFN<double>::Cache cache;
  moe.forward_into(x, y, &cache);
  CHECK(y == want);
  const Matrix<double> dy = random_matrix(40, 8, 13);
  CHECK(moe.backward(dy, cache) == moe.backward(dy, want_cache));

  Matrix<double> inplace = x;  // y aliases x: every read of x precedes the first write of y
  moe.forward_into(inplace, inplace, &cache);
  CHECK(inplace == want);
  CHECK(cache.x == x);  // the cache keeps the input, not the output written over it

  Matrix<double> wrong(39, 8);
  CHECK_THROWS_AS(moe.forward_into(x, wrong), ShapeError);
  CHECK_THROWS_WITH(moe.forward_into(x, wrong), Catch::Contains("MoEFFN::forward_into") && Catch::Contains("'y'"));
}

TEST_CASE("MoE gradients match central differences", "[moe][gradcheck]") {
  struct Case {
    const char* what;
    Index n, experts, k, shared;
    bool unbiased;
  };
  const Case cases[] = {{"N = 5 biased weights", 5, 4, 2, 1, false},
                        {"N = 12 unbiased weights", 12, 5, 2, 2, true},
                        {"K = E", 4, 3, 3, 1, false},
                        {"N = 1", 1, 4, 2, 1, false},
                        {"N = 0", 0, 4, 2, 1, false}};
  for (const Case& cs : cases) {
    INFO(cs.what);
    MoEConfig cfg = moe_config(cs.experts, cs.k, cs.shared);
    cfg.weights_from_unbiased = cs.unbiased;
    MoEFFN<double> moe(cfg, 21);
    RowVector<double> bias = random_matrix(1, cs.experts, 22, 0.3);
    moe.balancer().set_bias(bias);
    // Find an input whose top-K choice has a clear margin, so ±ε never flips it.
    Matrix<double> x;
    for (std::uint64_t seed = 100;; ++seed) {
      x = random_matrix(cs.n, 6, seed, 1.5);
      if (topk_margin(moe, x) > 1e-2) break;
    }
    const Matrix<double> r = random_matrix(cs.n, 6, 23);
    auto loss = [&] { return dot_all(moe.forward(x), r); };

    MoEFFN<double>::Cache cache;
    moe.forward(x, &cache);
    const Matrix<double> dx = moe.backward(r, cache);
    APEX_CHECK_GRADS(check_params(moe.params(), loss), 1e-6);
    APEX_CHECK_GRADS(std::vector{check_values("x", x.data(), dx.data(), x.size(), loss)}, 1e-6);
    if (cs.n > 0) CHECK(moe.router().weight_grad().norm() > 0);
    // The balancing bias is not a parameter and gets no gradient.
    for (const auto& p : moe.params()) CHECK(p.name.find("bias") == std::string::npos);
  }
}

TEST_CASE("MoE params are named like a PyTorch state_dict", "[moe]") {
  MoEFFN<float> moe(moe_config(3, 2, 2), 0);
  const auto ps = moe.params();
  REQUIRE(ps.size() == 1 + 3 * 3 + 2 * 3);
  CHECK(ps[0].name == "router.weight");
  CHECK(ps[0].rows == 3);
  CHECK(ps[0].cols == 6);
  CHECK(ps[1].name == "experts.0.w_gate.weight");
  CHECK(ps[9].name == "experts.2.w_down.weight");
  CHECK(ps[10].name == "shared_experts.0.w_gate.weight");
  CHECK(ps.back().name == "shared_experts.1.w_down.weight");
}

TEST_CASE("MoE output is bitwise identical across runs and thread counts", "[moe][determinism]") {
  MoEFFN<float> moe(moe_config(6, 2, 1, 32, 48), 8);
  // One busy expert: its block and the shared expert's span several row tiles
  // (kMaxTileRows = 1024), so 1 and 2 threads split them differently.
  moe.router().weight().row(2).array() += 0.5f;
  const Matrix<float> x = random_matrix(2200, 32, 9).cast<float>();
  const Matrix<float> dy = random_matrix(2200, 32, 10).cast<float>();
  auto run = [&](int threads, Matrix<float>& dx, Matrix<float>& grads) {
    moe.set_threads(threads);
    moe.zero_grad();
    MoEFFN<float>::Cache cache;
    Matrix<float> y = moe.forward(x, &cache);
    dx = moe.backward(dy, cache);
    grads.resize(1, parameter_count(moe.params()));
    Index at = 0;
    for (const auto& p : moe.params()) {
      grads.block(0, at, 1, p.size()) = Eigen::Map<const Matrix<float>>(p.grad_data, 1, p.size());
      at += p.size();
    }
    return y;
  };
  Matrix<float> dx1, g1, dx1b, g1b, dx2, g2;
  const Matrix<float> y1 = run(1, dx1, g1);
  const Matrix<float> y1b = run(1, dx1b, g1b);
  const Matrix<float> y2 = run(2, dx2, g2);
  CHECK(y1 == y1b);
  CHECK(dx1 == dx1b);
  CHECK(g1 == g1b);
  CHECK(y1 == y2);
  CHECK(dx1 == dx2);
  CHECK(g1 == g2);
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

TEST_CASE("constructors with sizes near the Index limit raise ConfigError, not overflow",
          "[moe][errors][regression]") {
  // A size product that does not fit an Index (2·f·d of SwiGLU, 8·d of the
  // default width, E·d of the router, E·tokens of a balancer window) was
  // signed overflow: undefined behaviour, in practice a wrapped size. Each
  // is now a ConfigError naming the product, before any allocation.
  const Index huge = Index(1) << 62;
  auto config = [](Index d, Index f) {
    MoEConfig c = moe_config(4, 2, 1);
    c.d_model = d;
    c.d_ffn = f;
    return c;
  };
  struct Probe {
    const char* what;
    std::function<void()> call;
    std::vector<std::string> names;
  };
  const std::vector<Probe> probes = {
      {"SwiGLU d = 2^62", [=] { SwiGLU<float>(huge, 4, 0); }, {"SwiGLU", "2*d_ffn*d_model"}},
      {"SwiGLU f = 2^62", [=] { SwiGLU<float>(4, huge, 0); }, {"SwiGLU", "2*d_ffn*d_model"}},
      {"KappaSwiGLU d = 2^62", [=] { KappaSwiGLU<float>(huge, 4, 0); }, {"SwiGLU", "2*d_ffn*d_model"}},
      {"default_ffn_width", [=] { (void)default_ffn_width(huge); }, {"default_ffn_width", "8*d_model"}},
      {"Router d = 2^62", [=] { Rng rng(0); Router<float>(huge, 4, 2, rng); }, {"Router", "n_experts*d_model"}},
      // MoEFFN counts its weight bytes before it builds anything (core/memory_budget.hpp).
      {"MoEFFN d = 2^62", [=] { MoEFFN<float>(config(huge, 4)); }, {"MoEFFN", "d_ffn*d_model"}},
      {"MoEFFN f = 2^62", [=] { MoEFFN<float>(config(4, huge)); }, {"MoEFFN", "d_ffn*d_model"}},
      {"LoadBalancer::observe N = 2^62",
       [=] { LoadBalancer<float>(4, 2).observe({huge, huge, 0, 0}, huge); },
       {"LoadBalancer::observe", "n_experts*tokens"}},
  };
  for (const Probe& p : probes) {
    INFO(p.what);
    expect(outcome_isolated(p.call), "ConfigError", p.names);
  }
}

namespace {

/// Whether the router, every routed and shared expert, and the layer say they hold gradients.
template <class Expert>
std::vector<bool> gradient_state(const MoEFFN<double, Expert>& moe) {
  std::vector<bool> out{moe.has_gradients(), moe.router().has_gradients()};
  for (const auto& e : moe.experts()) out.push_back(e.has_gradients());
  for (const auto& s : moe.shared_experts()) out.push_back(s.has_gradients());
  return out;
}

template <class Expert>
void check_moe_lazy_gradients() {
  MoEConfig cfg = moe_config(4, 2, 2, 6, 5);
  cfg.shared_expert_gate = true;
  const Matrix<double> x = random_matrix(9, 6, 81), dy = random_matrix(9, 6, 82);
  const auto step = [&](MoEFFN<double, Expert>& m) {
    typename MoEFFN<double, Expert>::Cache c;
    m.forward(x, &c);
    m.backward(dy, c);
  };
  const std::vector<bool> none(2 + 4 + 2, false), all(2 + 4 + 2, true);

  MoEFFN<double, Expert> moe(cfg, 7);
  CHECK(gradient_state(moe) == none);
  const ParamList<double> values = moe.param_values();
  CHECK(gradient_state(moe) == none);           // param_values() allocates nothing
  CHECK(moe.params().size() == values.size());  // params() allocates every gradient
  CHECK(gradient_state(moe) == all);

  MoEFFN<double, Expert> fwd(cfg, 7);
  for (const auto& p : fwd.param_values()) CHECK_THROWS_AS(p.grad(), NoGradientError);
  typename MoEFFN<double, Expert>::Cache c;
  fwd.forward(x, &c);
  fwd.forward(x);
  fwd.observe(c);
  CHECK(gradient_state(fwd) == none);
  fwd.backward(dy, c);  // allocates every gradient before the parallel expert tasks
  CHECK(gradient_state(fwd) == all);

  MoEFFN<double, Expert> zeroed(cfg, 7);
  zeroed.zero_grad();
  CHECK(gradient_state(zeroed) == all);
  for (const auto& p : zeroed.params()) CHECK(p.grad().isZero());

  // Lazily allocated gradients equal those of a layer zeroed first, bitwise,
  // with threads, and accumulate; views taken before backward see them.
  MoEFFN<double, Expert> lazy(cfg, 7), eager(cfg, 7);
  lazy.set_threads(2);
  eager.set_threads(2);
  eager.zero_grad();
  const ParamList<double> before = eager.params();
  step(lazy);
  step(eager);
  step(lazy);
  step(eager);
  const ParamList<double> a = lazy.params(), b = eager.params();
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    INFO(a[i].name);
    CHECK(a[i].name == values[i].name);
    CHECK(b[i].grad_data == before[i].grad_data);
    CHECK(std::memcmp(a[i].grad_data, b[i].grad_data, std::size_t(a[i].size()) * sizeof(double)) == 0);
  }
  CHECK(a.back().name == "shared_expert_gate.weight");
  CHECK(a.back().grad().norm() > 0);
}

}  // namespace

TEST_CASE("MoEFFN allocates every gradient lazily, all at once", "[moe][lazy]") {
  SECTION("SwiGLU experts") { check_moe_lazy_gradients<SwiGLU<double>>(); }
  SECTION("kappa-SwiGLU experts") { check_moe_lazy_gradients<KappaSwiGLU<double>>(); }
}

TEST_CASE("A large-preset MoE layer is a ConfigError in milliseconds, naming bytes needed and available",
          "[moe][memory]") {
  const MoEConfig large = ModelPreset::large().moe();
  const std::uint64_t bytes = MoEFFN<float>::weight_bytes(large);
  CHECK(bytes > 400000000000ull);  // ≈ 406 GB of float weights
  CHECK(MoEFFN<float, KappaSwiGLU<float>>::weight_bytes(large) > bytes);  // α and b too
  // The constructor checks what it will hold: a small layer's bytes.
  CHECK(MoEFFN<float>::weight_bytes(moe_config(4, 2, 1, 6, 5)) == 4u * (4 * 3 * 5 * 6 + 3 * 5 * 6 + 5 * 6 + 4));
  if (bytes <= physical_memory_bytes() || overcommit_allowed()) {
    WARN("this machine holds a large-preset layer (or APEX_FFN_ALLOW_OVERCOMMIT=1): nothing to reject");
    return;
  }
  const auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_AS(MoEFFN<float>(large), ConfigError);
  CHECK_THROWS_WITH(MoEFFN<float>(large),
                       Catch::Matchers::StartsWith("MoEFFN: a float MoE layer (d_model 7168, d_ffn 18432, 256 + 4 "
                                                   "experts) needs " +
                                                   detail::bytes_string(bytes) + ", the machine has " +
                                                   detail::bytes_string(physical_memory_bytes()) +
                                                   " of physical memory; set APEX_FFN_ALLOW_OVERCOMMIT=1"));
  using KappaMoE = MoEFFN<float, KappaSwiGLU<float>>;
  CHECK_THROWS_AS(KappaMoE(large), ConfigError);
  CHECK_THROWS_AS(SwiGLU<float>(7168, 18432 * 4096), ConfigError);  // a dense layer too (≈ 1.6 TB)
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  CHECK(seconds < 1.0);
  // The override turns the check off (then only the check is run: building the layer would take the machine).
  ::setenv(kAllowOvercommitEnv, "1", 1);
  CHECK_NOTHROW(check_memory_fit("MoEFFN", "a layer", bytes));
  ::unsetenv(kAllowOvercommitEnv);
  CHECK_THROWS_AS(check_memory_fit("MoEFFN", "a layer", bytes), ConfigError);
}

TEST_CASE("MoE configuration is validated", "[moe][errors]") {
  CHECK_NOTHROW(moe_config().validate());
  CHECK_THROWS_AS(MoEFFN<double>(moe_config(4, 5)), ConfigError);  // K > E
  CHECK_THROWS_WITH(MoEFFN<double>(moe_config(4, 5)), Catch::Contains("n_active"));
  CHECK_THROWS_AS(MoEFFN<double>(moe_config(0, 1)), ConfigError);
  CHECK_THROWS_AS(MoEFFN<double>(moe_config(4, 0)), ConfigError);
  CHECK_THROWS_AS(MoEFFN<double>(moe_config(4, 2, -1)), ConfigError);
  CHECK_THROWS_AS(MoEFFN<double>(moe_config(4, 2, 1, 0)), ConfigError);
  CHECK_THROWS_AS(MoEFFN<double>(moe_config(4, 2, 1, 6, 0)), ConfigError);

  MoEFFN<double> moe(moe_config(), 0);
  CHECK_THROWS_AS(moe.forward(Matrix<double>::Zero(3, 5)), ShapeError);
  Matrix<double> bad = Matrix<double>::Zero(3, 6);
  bad(1, 2) = std::numeric_limits<double>::quiet_NaN();
  CHECK_THROWS_AS(moe.forward(bad), ValueError);
  CHECK_THROWS_AS(moe.balancer().set_bias(RowVector<double>::Zero(3)), ShapeError);
  MoEFFN<double>::Cache cache;
  moe.forward(Matrix<double>::Zero(3, 6), &cache);
  CHECK_THROWS_AS(moe.backward(Matrix<double>::Zero(2, 6), cache), ShapeError);
  CHECK_THROWS_AS(moe.balancer().observe({1, 1, 1}, 1), ShapeError);
  CHECK_THROWS_AS(moe.balancer().observe({1, 1, 1, 1}, 1), ValueError);  // sums to 4, not N·K = 2
}

TEST_CASE("APEX-1 presets and the odd-layer rule", "[moe][config]") {
  const ModelPreset s = ModelPreset::small();
  CHECK(s.d_model == 512);
  CHECK(s.d_ffn == 1376);
  CHECK(s.n_experts == 8);
  CHECK(s.n_active == 2);
  CHECK(s.n_shared == 1);
  const ModelPreset m = ModelPreset::by_name("medium");
  CHECK(m.n_experts == 64);
  CHECK(m.n_active == 4);  // an older table says 8: an erratum (docs/math.md#errata)
  CHECK(m.n_shared == 2);
  CHECK(ModelPreset::large().n_experts == 256);
  CHECK(ModelPreset::tiny().skip_hidden == 16);
  CHECK_NOTHROW(ModelPreset::large().moe().validate());
  CHECK_THROWS_AS(ModelPreset::by_name("huge"), ConfigError);
  CHECK_FALSE(ModelPreset::is_moe_layer(0));
  CHECK(ModelPreset::is_moe_layer(1));
  CHECK_FALSE(ModelPreset::is_moe_layer(2));
  CHECK(ModelPreset::is_moe_layer(35));
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

TEMPLATE_TEST_CASE("MoEConfig and MoEFFN sweep: fields and inputs and caches", "[sweeps][moe]", float, double) {
  using T = TestType;
  const Index d = 6, f = 5, n = 5;
  MoEFFN<T> moe(moe_config(4, 2, 1, d, f), 1);
  moe.set_threads(2);
  typename MoEFFN<T>::Cache cache, other;
  moe.forward(rnd<T>(n, d, 2), &cache);
  moe.forward(rnd<T>(n + 2, d, 3), &other);
  std::vector<Case> cases;

  struct Field {
    const char* field;
    std::function<void(MoEConfig&)> spoil;
  };
  const std::vector<Field> fields = {
      {"d_model", [](MoEConfig& c) { c.d_model = 0; }},
      {"d_model", [](MoEConfig& c) { c.d_model = -3; }},
      {"d_ffn", [](MoEConfig& c) { c.d_ffn = 0; }},
      {"n_experts", [](MoEConfig& c) { c.n_experts = 0; }},
      {"n_experts", [](MoEConfig& c) { c.n_experts = -1; }},
      {"n_active", [](MoEConfig& c) { c.n_active = 0; }},
      {"n_active", [](MoEConfig& c) { c.n_active = 5; }},  // K > E
      {"n_shared", [](MoEConfig& c) { c.n_shared = -1; }},
      {"balancer_alpha", [](MoEConfig& c) { c.balancer_alpha = -0.1; }},
      {"balancer_alpha", [](MoEConfig& c) { c.balancer_alpha = kNaN; }},
      {"balancer_alpha", [](MoEConfig& c) { c.balancer_alpha = kInf; }},
  };
  for (const Field& fl : fields) {
    MoEConfig bad = moe_config(4, 2, 1, d, f);
    fl.spoil(bad);
    cases.push_back({std::string("MoEConfig::validate with a bad ") + fl.field, [=] { bad.validate(); }, "ConfigError",
                     {"MoEConfig", fl.field}});
    cases.push_back({std::string("MoEFFN with a bad ") + fl.field, [=] { (void)MoEFFN<T>(bad); }, "ConfigError",
                     {"MoEFFN", fl.field}});
  }
  cases.push_back({"ModelPreset::by_name(\"huge\")", [] { (void)ModelPreset::by_name("huge"); }, "ConfigError",
                   {"ModelPreset::by_name", "huge"}});

  add_width_cases<T>(cases, "MoEFFN::forward", "x", n, d, [&](const Matrix<T>& x) { moe.forward(x); });
  for (double v : {kNaN, kInf, -kInf})
    cases.push_back({"MoEFFN::forward with " + std::to_string(v) + " in x",
                     [=, &moe] {
                       Matrix<T> x = rnd<T>(n, d, 4);
                       x(2, 3) = T(v);
                       moe.forward(x);
                     },
                     "ValueError", {"not finite"}});
  add_grad_cases<T>(cases, "MoEFFN::backward", "dy", n, d, [&](const Matrix<T>& dy) { moe.backward(dy, cache); });
  cases.push_back({"MoEFFN::backward with the cache of a 7-row batch", [&] { moe.backward(Matrix<T>::Ones(n, d), other); },
                   "ShapeError", {"MoEFFN::backward", "'dy'"}});
  for (std::size_t len : {std::size_t(n - 1), std::size_t(n + 1), std::size_t(0)})
    cases.push_back({"MoEFFN::observe with a mask of " + std::to_string(len),
                     [=, &moe, &cache] { moe.observe(cache, std::vector<bool>(len, true)); }, "ShapeError",
                     {"MoEFFN::observe", "'token_counted'"}});
  run_sweep(cases);
  CHECK(moe.balancer().report().tokens == 0);  // no rejected observe counted anything
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

TEST_CASE("SwiGLU and KappaSwiGLU and MoEFFN backward reject a cache that no forward filled",
          "[sweeps][regression][cache]") {
  // The same defect, before the fix:
  //  - layers/swiglu.hpp SwiGLU::backward and layers/kappa_swiglu.hpp KappaSwiGLU::backward:
  //    work.leftCols(f) of a 0 × 0 work failed an eigen_assert;
  //  - moe/moe_ffn.hpp MoEFFN::backward: plan.count(e) indexed the empty plan.offset (null dereference).
  // Fixed: each backward checks its cache's own shapes (cache.x columns = d,
  // work columns = work_cols(), for MoEFFN the plan against E), raising
  // ShapeError naming 'cache'.
  const Index d = 4;
  const Matrix<double> dy = Matrix<double>::Zero(0, d);
  expect_cache_rejected(
      {
          {"SwiGLU", [&] { SwiGLU<double>(d, 6).backward(dy, SwiGLU<double>::Cache{}); }},
          {"KappaSwiGLU", [&] { KappaSwiGLU<double>(d, 6).backward(dy, KappaSwiGLU<double>::Cache{}); }},
          {"MoEFFN",
           [&] {
             MoEFFN<double> moe(moe_config(4, 2, 1, d, 6));
             moe.set_threads(1);
             moe.backward(dy, MoEFFN<double>::Cache{});
           }},
      },
      "an unfilled cache and an empty batch");
}

TEST_CASE("backward rejects a cache filled by a layer of another shape", "[sweeps][regression][cache]") {
  // Caches are plain structs, so one layer's cache can reach another
  // layer's backward. With the same batch size the dy check passes, and
  // before the fix:
  //  - layers/swiglu.hpp SwiGLU::backward with the cache of a SwiGLU whose d_ffn is
  //    6 (work 3 × 18) in a layer with d_ffn 8 read columns 0–8, 8–16 and
  //    10–18 of that work as G, U and A: no error, wrong gradients;
  //  - moe/moe_ffn.hpp MoEFFN::backward with the cache of an MoE of 4 experts in one
  //    of 6 read plan.offset[5] and [6] past the end, then took blocks of
  //    the sorted buffers at those garbage offsets (an eigen_assert in a
  //    debug build, a heap-buffer-overflow under AddressSanitizer).
  // Fixed: as in the previous test, the cache's shapes are checked against the layer.
  expect(outcome_isolated([] {
           SwiGLU<double> a(4, 6, 1), b(4, 8, 2);
           SwiGLU<double>::Cache c;
           a.forward(Matrix<double>::Ones(3, 4), &c);
           b.backward(Matrix<double>::Ones(3, 4), c);
         }),
         "ShapeError", {"SwiGLU::backward", "cache"});
  MoEFFN<double> a(moe_config(4, 2, 1, 4, 6), 1), b(moe_config(6, 2, 1, 4, 6), 2);
  MoEFFN<double>::Cache c;
  a.forward(Matrix<double>::Ones(3, 4), &c);
  b.set_threads(1);
  expect(outcome_isolated([&] { b.backward(Matrix<double>::Ones(3, 4), c); }), "ShapeError",
         {"MoEFFN::backward", "cache"});
}
