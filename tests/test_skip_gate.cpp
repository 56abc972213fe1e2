// The dynamic skip gate (layers/skip_gate.hpp): configuration, PyTorch
// names, gates open near 0.9 at the start, gradients by finite differences
// with the penalty, bad shapes and non-finite input, and the error sweeps and
// cache regression tests of the gate, the RMSNorm and the FFN sublayer that
// use it.
#include <apex/ffn/layers/ffn_sublayer.hpp>
#include <apex/ffn/layers/kappa_swiglu.hpp>
#include <apex/ffn/layers/multi_token_heads.hpp>
#include <apex/ffn/layers/skip_gate.hpp>
#include <apex/ffn/layers/swiglu.hpp>
#include <apex/ffn/moe/moe_ffn.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "gradcheck.hpp"
#include "sublayers.hpp"
#include "sweep.hpp"

using namespace apex;
using apex::test::check_params;
using apex::test::check_values;
using apex::test::gate_config;
using apex::test::moe_config;
using apex::test::random_matrix;
using Catch::Matchers::WithinAbs;
using apex::test::Dense;

TEST_CASE("SkipGate configuration is validated", "[skip_gate][errors]") {
  CHECK_NOTHROW(SkipGate<double>(gate_config(4, 3, 0.0)));
  CHECK_NOTHROW(SkipGate<double>(gate_config(4, 3, 1.0)));
  CHECK_THROWS_AS(SkipGate<double>(gate_config(4, 3, -0.01)), ConfigError);
  CHECK_THROWS_AS(SkipGate<double>(gate_config(4, 3, 1.01)), ConfigError);
  CHECK_THROWS_AS(SkipGate<double>(gate_config(4, 3, std::nan(""))), ConfigError);
  CHECK_THROWS_WITH(SkipGate<double>(gate_config(4, 3, 1.5)),
                    "SkipGateConfig: threshold must be in [0, 1], got 1.500000");
  CHECK_THROWS_AS(SkipGate<double>(gate_config(0, 3)), ConfigError);
  CHECK_THROWS_AS(SkipGate<double>(gate_config(4, 0)), ConfigError);
  SkipGateConfig c = gate_config(4, 3);
  c.initial_gate = 1.0;
  CHECK_THROWS_AS(SkipGate<double>(c), ConfigError);
  c.initial_gate = 0.0;
  CHECK_THROWS_AS(SkipGate<double>(c), ConfigError);
  c = gate_config(4, 3);
  c.penalty = -1;
  CHECK_THROWS_AS(SkipGate<double>(c), ConfigError);

  SkipGate<float> gate(gate_config(4, 3));
  CHECK(gate.threshold() == 0.15f);
  CHECK_THROWS_AS(gate.set_threshold(-0.5f), ConfigError);
  CHECK_THROWS_AS(gate.set_threshold(2.0f), ConfigError);
  CHECK_THROWS_AS(gate.set_penalty_weight(-1.0f), ConfigError);
  gate.set_threshold(0.4f);
  CHECK(gate.threshold() == 0.4f);
  CHECK(gate.keep(0.4f));
  CHECK_FALSE(gate.keep(0.39f));
}

TEST_CASE("SkipGate parameters carry PyTorch names and shapes", "[skip_gate]") {
  SkipGate<double> gate(gate_config(6, 5));
  const auto p = gate.params();
  REQUIRE(p.size() == 4);
  CHECK(p[0].name == "w1.weight");
  CHECK((p[0].rows == 5 && p[0].cols == 6));
  CHECK(p[1].name == "w1.bias");
  CHECK(p[1].size() == 5);
  CHECK(p[2].name == "w2.weight");
  CHECK((p[2].rows == 1 && p[2].cols == 5));
  CHECK(p[3].name == "w2.bias");
  CHECK(p[3].size() == 1);
  CHECK(parameter_count(p) == 6 * 5 + 5 + 5 + 1);  // reference: d·h + h (+ W₂, b₂)
}

TEMPLATE_TEST_CASE("SkipGate starts with every gate open near 0.9", "[skip_gate]", float, double) {
  using T = TestType;
  // The `small` preset: d = 512, h = 64.
  SkipGate<T> gate(gate_config(512, 64), 3);
  CHECK_THAT(double(gate.b2()), WithinAbs(std::log(9.0), 1e-6));
  const Matrix<T> x = (random_matrix(300, 512, 4, 1.7)).cast<T>();  // unit-variance features
  const Vector<T> g = gate.forward(x);
  CHECK(g.minCoeff() > T(0.8));
  CHECK(g.maxCoeff() < T(0.97));
  CHECK_THAT(double(g.mean()), WithinAbs(0.9, 0.03));
  CHECK(g.minCoeff() >= gate.threshold());
}

TEST_CASE("SkipGate gradients match central differences including the penalty", "[skip_gate][gradcheck]") {
  for (Index n : {0, 1, 3, 13}) {
    INFO("N = " << n);
    SkipGateConfig cfg = gate_config(5, 7);
    cfg.penalty = 0.3;
    SkipGate<double> gate(cfg, 8);
    gate.w2() *= 4.0;  // spread the gates over (0, 1) so σ′ varies
    gate.b2() = 0.2;
    Matrix<double> x = random_matrix(n, 5, 9, 2.0);
    const Vector<double> r = random_matrix(n, 1, 10);
    auto loss = [&] {
      const Vector<double> g = gate.forward(x);
      return r.dot(g) + gate.penalty_value(g);
    };
    SkipGate<double>::Cache cache;
    const Vector<double> g = gate.forward(x, &cache);
    CHECK_THAT(cache.penalty, WithinAbs(n > 0 ? 0.3 * g.mean() : 0.0, 1e-15));
    const Matrix<double> dx = gate.backward(r, cache);
    REQUIRE(dx.rows() == n);
    APEX_CHECK_GRADS(check_params(gate.params(), loss), 1e-6);
    APEX_CHECK_GRADS(std::vector{check_values("x", x.data(), dx.data(), x.size(), loss)}, 1e-6);
  }
}

TEST_CASE("SkipGate rejects bad shapes and non-finite input", "[skip_gate][errors]") {
  SkipGate<double> gate(gate_config(4, 3));
  CHECK_THROWS_WITH(gate.forward(Matrix<double>::Zero(2, 5)),
                    "SkipGate::forward: argument 'x' has shape [2 x 5], expected [* x 4]");
  Matrix<double> x = Matrix<double>::Ones(2, 4);
  x(1, 2) = std::nan("");
  CHECK_THROWS_AS(gate.forward(x), ValueError);
  x(1, 2) = std::numeric_limits<double>::infinity();
  CHECK_THROWS_AS(gate.forward(x), ValueError);
  SkipGate<double>::Cache cache;
  gate.forward(Matrix<double>::Ones(3, 4), &cache);
  CHECK_THROWS_AS(gate.backward(Vector<double>::Zero(2), cache), ShapeError);
}

// ---- error handling (sweeps) ----
using namespace apex::test;  // the sweep machinery of support/sweep.hpp

TEMPLATE_TEST_CASE("SkipGate and FFNSublayer sweep: configurations and inputs and caches", "[sweeps][skip_gate]",
                   float, double) {
  using T = TestType;
  const Index d = 6, h = 4, f = 8, n = 5;
  SkipGate<T> gate(gate_config(d, h), 1);
  typename SkipGate<T>::Cache gcache, gother;
  gate.forward(rnd<T>(n, d, 2), &gcache);
  gate.forward(rnd<T>(n + 2, d, 3), &gother);
  std::vector<Case> cases;

  struct Field {
    const char* field;
    std::function<void(SkipGateConfig&)> spoil;
  };
  const std::vector<Field> fields = {
      {"d_model", [](SkipGateConfig& c) { c.d_model = 0; }},
      {"hidden", [](SkipGateConfig& c) { c.hidden = 0; }},
      {"hidden", [](SkipGateConfig& c) { c.hidden = -2; }},
      {"threshold", [](SkipGateConfig& c) { c.threshold = -0.01; }},
      {"threshold", [](SkipGateConfig& c) { c.threshold = 1.01; }},
      {"threshold", [](SkipGateConfig& c) { c.threshold = kNaN; }},
      {"initial_gate", [](SkipGateConfig& c) { c.initial_gate = 0; }},
      {"initial_gate", [](SkipGateConfig& c) { c.initial_gate = 1; }},
      {"initial_gate", [](SkipGateConfig& c) { c.initial_gate = kNaN; }},
      {"penalty", [](SkipGateConfig& c) { c.penalty = -1; }},
      {"penalty", [](SkipGateConfig& c) { c.penalty = kNaN; }},
      {"penalty", [](SkipGateConfig& c) { c.penalty = kInf; }},
  };
  for (const Field& fl : fields) {
    SkipGateConfig bad = gate_config(d, h);
    fl.spoil(bad);
    cases.push_back({std::string("SkipGate with a bad ") + fl.field, [=] { (void)SkipGate<T>(bad); }, "ConfigError",
                     {"SkipGateConfig", fl.field}});
  }
  for (double tau : {-0.01, 1.01, kNaN, kInf})
    cases.push_back({"SkipGate::set_threshold(" + std::to_string(tau) + ")", [=, &gate] { gate.set_threshold(T(tau)); },
                     "ConfigError", {"SkipGate::set_threshold", "threshold"}});
  for (double lambda : {-1.0, kNaN, kInf})
    cases.push_back({"SkipGate::set_penalty_weight(" + std::to_string(lambda) + ")",
                     [=, &gate] { gate.set_penalty_weight(T(lambda)); }, "ConfigError",
                     {"SkipGate::set_penalty_weight", "penalty"}});
  add_width_cases<T>(cases, "SkipGate::forward", "x", n, d, [&](const Matrix<T>& x) { gate.forward(x); });
  for (double v : {kNaN, kInf, -kInf})
    cases.push_back({"SkipGate::forward with " + std::to_string(v),
                     [=, &gate] {
                       Matrix<T> x = rnd<T>(n, d, 4);
                       x(4, 5) = T(v);
                       gate.forward(x);
                     },
                     "ValueError", {"SkipGate::forward", "'x'", "NaN or Inf"}});
  for (Index len : {n - 1, n + 1, Index(0)})
    cases.push_back({"SkipGate::backward with " + std::to_string(len) + " gradients for " + std::to_string(n) + " rows",
                     [=, &gate, &gcache] { gate.backward(Vector<T>::Ones(len), gcache); }, "ShapeError",
                     {"SkipGate::backward", "'dg'", shape(len, 1)}});
  cases.push_back({"SkipGate::backward with the cache of a 7-row batch",
                   [&] { gate.backward(Vector<T>::Ones(n), gother); }, "ShapeError", {"SkipGate::backward", "'dg'"}});

  // The sublayer.
  using Dense = FFNSublayer<T, SwiGLU<T>>;
  using MoE = FFNSublayer<T, MoEFFN<T>>;
  cases.push_back({"FFNSublayer with an FFN of another width", [=] { (void)Dense(d, SwiGLU<T>(d + 1, f)); }, "ConfigError",
                   {"FFNSublayer", "FFN d_model"}});
  cases.push_back({"FFNSublayer with a gate of another width",
                   [=] { (void)Dense(d, SwiGLU<T>(d, f), SkipGate<T>(gate_config(d - 1, h))); }, "ConfigError",
                   {"FFNSublayer", "skip gate d_model"}});
  cases.push_back({"FFNSublayer(0, …)", [=] { (void)Dense(0, SwiGLU<T>(d, f)); }, "ConfigError", {"d_model"}});
  Dense gated(d, SwiGLU<T>(d, f, 5), SkipGate<T>(gate_config(d, h), 6));
  const Dense plain(d, SwiGLU<T>(d, f, 5));
  MoE moe_plain(d, MoEFFN<T>(moe_config(4, 2, 1, d, f), 7));
  typename Dense::Cache train, infer, other;
  gated.forward(rnd<T>(n, d, 8), SublayerMode::training, &train);
  gated.forward(rnd<T>(n, d, 8), SublayerMode::inference, &infer);
  gated.forward(rnd<T>(n + 2, d, 9), SublayerMode::training, &other);
  add_width_cases<T>(cases, "FFNSublayer::forward", "x", n, d, [&](const Matrix<T>& x) { gated.forward(x); });
  add_grad_cases<T>(cases, "FFNSublayer::backward", "dy", n, d, [&](const Matrix<T>& dy) { gated.backward(dy, train); });
  cases.push_back({"FFNSublayer::backward with the cache of a 7-row batch",
                   [&] { gated.backward(Matrix<T>::Ones(n, d), other); }, "ShapeError", {"FFNSublayer::backward", "'dy'"}});
  cases.push_back({"FFNSublayer::backward with an inference-mode cache",
                   [&] { gated.backward(Matrix<T>::Ones(n, d), infer); }, "ValueError",
                   {"FFNSublayer::backward", "'cache'", "inference"}});
  Matrix<T> nan_x = rnd<T>(n, d, 10);
  nan_x(2, 2) = T(kNaN);
  cases.push_back({"gated FFNSublayer::forward with NaN", [&] { gated.forward(nan_x); }, "ValueError",
                   {"SkipGate::forward", "'x'"}});
  cases.push_back({"ungated MoE FFNSublayer::forward with NaN", [&] { moe_plain.forward(nan_x); }, "ValueError",
                   {"not finite"}});
  run_sweep(cases);

  CHECK(gate.threshold() == T(0.15));  // rejected setters changed nothing
  CHECK(gate.penalty_weight() == T(0));
  // The ungated dense sublayer propagates instead (checked row by row in the NaN test).
  CHECK(plain.forward(nan_x).row(2).hasNaN());
}

TEST_CASE("RMSNorm and SkipGate and FFNSublayer backward reject a cache that no forward filled",
          "[sweeps][regression][cache]") {
  // Before the fix:
  //  - layers/rms_norm.hpp RMSNorm::backward: dy (0 × d) ⊙ cache.x_hat (0 × 0) failed an eigen_assert;
  //  - layers/skip_gate.hpp SkipGate::backward: w2_grad_ += dsᵀ·a with a 0 × 0 `a` failed an eigen_assert;
  //  - layers/ffn_sublayer.hpp FFNSublayer::backward (gated): dy ⊙ cache.f (0 × 0) failed an eigen_assert.
  const Index d = 4;
  const Matrix<double> dy = Matrix<double>::Zero(0, d);
  expect_cache_rejected(
      {
          {"RMSNorm", [&] { RMSNorm<double>(d).backward(dy, RMSNorm<double>::Cache{}); }},
          {"SkipGate",
           [&] { SkipGate<double>(gate_config(d, 3)).backward(Vector<double>(0), SkipGate<double>::Cache{}); }},
          {"FFNSublayer",
           [&] {
             FFNSublayer<double, SwiGLU<double>> s(d, SwiGLU<double>(d, 6), SkipGate<double>(gate_config(d, 3)));
             s.backward(dy, FFNSublayer<double, SwiGLU<double>>::Cache{});
           }},
          {"MultiTokenHeads",
           [&] { MultiTokenHeads<double>(d, 5).backward(Matrix<double>(0, 20), MultiTokenHeads<double>::Cache{}); }},
      },
      "an unfilled cache and an empty batch");

  // The cache of a layer of another shape, same batch: caught by the same checks.
  expect_cache_rejected(
      {
          {"RMSNorm",
           [] {
             RMSNorm<double>::Cache c;
             RMSNorm<double>(5).forward(Matrix<double>::Ones(3, 5), &c);
             RMSNorm<double>(4).backward(Matrix<double>::Ones(3, 4), c);
           }},
          {"SkipGate",
           [] {
             SkipGate<double>::Cache c;
             SkipGate<double>(gate_config(4, 5)).forward(Matrix<double>::Ones(3, 4), &c);
             SkipGate<double>(gate_config(4, 3)).backward(Vector<double>::Ones(3), c);
           }},
          {"FFNSublayer",
           [] {
             // An ungated sublayer's cache has no F: a gated backward must not read it.
             using Sub = FFNSublayer<double, SwiGLU<double>>;
             Sub::Cache c;
             Sub(4, SwiGLU<double>(4, 6)).forward(Matrix<double>::Ones(3, 4), &c);
             Sub(4, SwiGLU<double>(4, 6), SkipGate<double>(gate_config(4, 3))).backward(Matrix<double>::Ones(3, 4), c);
           }},
          {"FFNSublayer",
           [] {
             using Sub = FFNSublayer<double, SwiGLU<double>>;
             Sub::Cache c;
             Sub s(4, SwiGLU<double>(4, 6), SkipGate<double>(gate_config(4, 3)));
             s.forward(Matrix<double>::Ones(3, 4), &c);
             c.kept.back() = 3;  // a kept index past the batch would address a row dy does not have
             s.backward(Matrix<double>::Ones(3, 4), c);
           }},
      },
      "the cache of a layer of another shape");
}
