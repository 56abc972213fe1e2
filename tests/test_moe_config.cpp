// MoEConfig (moe/config.hpp): validation of every field, the APEX-1 presets
// and the odd-layer rule, and the sweep of bad fields through MoEConfig and
// MoEFFN, with the layer's inputs and caches.
#include <apex/ffn/layers/kappa_swiglu.hpp>
#include <apex/ffn/moe/moe_ffn.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include "gradcheck.hpp"
#include "sweep.hpp"

using namespace apex;
using apex::test::moe_config;

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
