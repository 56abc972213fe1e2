// The MoE pipeline of MoEFFN (moe/moe_ffn.hpp): grouped dispatch against a
// plain per-expert loop, the edge cases of the expert blocks, forward_into,
// sigmoid-gated shared experts, gradients by finite differences, state_dict
// names, determinism across runs and thread counts, lazily allocated
// gradients, the memory-fit and index-limit checks, and the regression tests
// of caches that no forward or another layer filled.
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
using apex::test::expect;
using apex::test::outcome_isolated;
using apex::test::moe_config;
using apex::test::random_matrix;
using apex::test::topk_margin;
using apex::test::routed_config;

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

// ---- error handling (sweeps) ----
using namespace apex::test;  // the sweep machinery of support/sweep.hpp

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
