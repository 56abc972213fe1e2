// MoEFFN: router (reference §13.5), load balancer (§14.5), grouped dispatch
// against the tutorial's plain per-expert loop, gradients by finite
// differences, determinism across runs and thread counts, balancing.
#include <apex/ffn/moe.hpp>

#include <catch2/catch.hpp>

#include <algorithm>

#include "gradcheck.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

using namespace apex;
using apex::test::check_params;
using apex::test::check_values;
using apex::test::dot_all;
using apex::test::random_matrix;
using Catch::Matchers::WithinAbs;

namespace {

MoEConfig small_config(Index n_experts = 4, Index k = 2, Index n_shared = 1, Index d = 6, Index f = 5) {
  MoEConfig c;
  c.d_model = d;
  c.d_ffn = f;
  c.n_experts = n_experts;
  c.n_active = k;
  c.n_shared = n_shared;
  return c;
}

// The tutorial's dispatch, written plainly: for each expert, scan all tokens
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

// Smallest gap between the K-th and (K+1)-th biased score over all tokens.
template <class T, class Expert>
double topk_margin(const MoEFFN<T, Expert>& moe, const Matrix<T>& x) {
  Routing<T> r;
  moe.router().route(x, moe.balancer().bias(), false, r);
  const Index k = moe.config().n_active;
  if (k == moe.config().n_experts) return 1e9;
  double margin = 1e9;
  for (Index t = 0; t < x.rows(); ++t) {
    Eigen::Array<T, 1, Eigen::Dynamic> s = r.logits.row(t).array() + moe.balancer().bias().array();
    std::sort(s.data(), s.data() + s.size(), std::greater<T>());
    margin = std::min(margin, double(s(k - 1) - s(k)));
  }
  return margin;
}

}  // namespace

TEST_CASE("router example of reference 13.5", "[moe][router][reference]") {
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

TEST_CASE("load balancer step of reference 14.5", "[moe][balancer][reference]") {
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
    MoEFFN<double> moe(small_config(cs.experts, cs.k, cs.shared, 8, 12), 3);
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
  MoEFFN<double> moe(small_config(4, 1, 1), 5);
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
  MoEFFN<double> moe(small_config(6, 2, 1, 8, 12), 11);
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
    MoEConfig cfg = small_config(cs.experts, cs.k, cs.shared);
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
  MoEFFN<float> moe(small_config(3, 2, 2), 0);
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
  MoEFFN<float> moe(small_config(6, 2, 1, 32, 48), 8);
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
  MoEConfig cfg = small_config(8, 2, 0, 16, 8);
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
  MoEFFN<double> moe(small_config(4, 2, 0), 1);
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

TEST_CASE("MoE configuration is validated", "[moe][errors]") {
  CHECK_NOTHROW(small_config().validate());
  CHECK_THROWS_AS(MoEFFN<double>(small_config(4, 5)), ConfigError);  // K > E
  CHECK_THROWS_WITH(MoEFFN<double>(small_config(4, 5)), Catch::Contains("n_active"));
  CHECK_THROWS_AS(MoEFFN<double>(small_config(0, 1)), ConfigError);
  CHECK_THROWS_AS(MoEFFN<double>(small_config(4, 0)), ConfigError);
  CHECK_THROWS_AS(MoEFFN<double>(small_config(4, 2, -1)), ConfigError);
  CHECK_THROWS_AS(MoEFFN<double>(small_config(4, 2, 1, 0)), ConfigError);
  CHECK_THROWS_AS(MoEFFN<double>(small_config(4, 2, 1, 6, 0)), ConfigError);

  MoEFFN<double> moe(small_config(), 0);
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
  CHECK(m.n_active == 4);  // the reference's §13.3 table says 8: an erratum
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
