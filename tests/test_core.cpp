// Core: activations (the SiLU table of the reference document §12.3, and
// numerical safety), errors, parameters, seeded initialisation, and the library's exception hierarchy.
#include <apex/ffn.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "fixtures.hpp"
#include "sweep.hpp"

using namespace apex;
using Catch::Matchers::WithinAbs;
using Catch::Matchers::WithinRel;

TEST_CASE("SiLU table of reference 12.3", "[core][reference]") {
  // Columns: x, σ(x), SiLU(x) to the document's three decimals.
  const double table[5][3] = {{-3.0, 0.047, -0.1423}, {-1.0, 0.269, -0.269}, {0.0, 0.5, 0.0},
                               {1.0, 0.731, 0.731},    {3.0, 0.953, 2.858}};
  for (const auto& row : table) {
    CHECK_THAT(sigmoid(row[0]), WithinAbs(row[1], 5e-4));
    CHECK_THAT(silu(row[0]), WithinAbs(row[2], 5e-4));
  }
  // Erratum: the document prints SiLU(−3) = −0.143; −3·σ(−3) = −0.14228.
  CHECK_THAT(silu(-3.0), WithinAbs(-0.1423, 5e-5));
  CHECK_FALSE(std::abs(silu(-3.0) - (-0.143)) < 5e-4);
}

TEMPLATE_TEST_CASE("activations stay finite for large arguments", "[core]", float, double) {
  using T = TestType;
  for (T z : {T(-1e4), T(-100), T(-30), T(30), T(100), T(1e4)}) {
    INFO("z = " << z);
    CHECK(std::isfinite(sigmoid(z)));
    CHECK(std::isfinite(silu(z)));
    CHECK(std::isfinite(silu_grad(z)));
    for (T kappa : {T(0.25), T(1), T(4)}) {
      CHECK(std::isfinite(silu_kappa(z, kappa)));
      CHECK(std::isfinite(silu_kappa_grad_z(z, kappa)));
      CHECK(std::isfinite(silu_kappa_grad_kappa(z, kappa)));
    }
  }
  CHECK(sigmoid(T(-1e4)) == T(0));
  CHECK(sigmoid(T(1e4)) == T(1));
  CHECK(silu(T(1e4)) == T(1e4));
  CHECK(silu_grad(T(1e4)) == T(1));
  CHECK(silu_grad(T(-1e4)) == T(0));

  Eigen::Array<T, 1, 6> z;
  z << T(-1e4), T(-88), T(-1), T(0), T(88), T(1e4);
  const Eigen::Array<T, 1, 6> s = array::sigmoid(z);
  CHECK(s.allFinite());
  for (int i = 0; i < 6; ++i) CHECK_THAT(double(s(i)), WithinAbs(double(sigmoid(z(i))), 1e-6));
}

TEST_CASE("activation derivatives match central differences", "[core][gradcheck]") {
  const double h = 1e-6;
  for (double z : {-6.0, -2.5, -0.3, 0.0, 0.7, 2.0, 5.0}) {
    INFO("z = " << z);
    CHECK_THAT(silu_grad(z), WithinAbs((silu(z + h) - silu(z - h)) / (2 * h), 1e-8));
    for (double k : {0.25, 1.0, 2.5, 4.0}) {
      CHECK_THAT(silu_kappa_grad_z(z, k), WithinAbs((silu_kappa(z + h, k) - silu_kappa(z - h, k)) / (2 * h), 1e-8));
      CHECK_THAT(silu_kappa_grad_kappa(z, k),
                 WithinAbs((silu_kappa(z, k + h) - silu_kappa(z, k - h)) / (2 * h), 1e-8));
    }
    CHECK(silu_kappa(z, 1.0) == silu(z));
  }
}

TEST_CASE("shape errors name the function, the argument and both shapes", "[core][errors]") {
  try {
    detail::check_shape("SwiGLU::forward", "x", 2, 5, detail::kAny, 4);
    FAIL("no exception");
  } catch (const ShapeError& e) {
    CHECK(std::string(e.what()) == "SwiGLU::forward: argument 'x' has shape [2 x 5], expected [* x 4]");
  }
  CHECK_NOTHROW(detail::check_shape("f", "x", 2, 4, detail::kAny, 4));
  CHECK_THROWS_AS(detail::require_config(false, "f", "bad"), ConfigError);
  // Every library exception is an apex::Error and a std::runtime_error.
  CHECK_THROWS_AS(detail::require_config(false, "f", "bad"), Error);
  CHECK_THROWS_AS(detail::require_config(false, "f", "bad"), std::runtime_error);
}

TEST_CASE("seeded initialisation is reproducible and bounded", "[core]") {
  Rng a(42), b(42), c(43);
  for (int i = 0; i < 100; ++i) CHECK(a.uniform() == b.uniform());
  CHECK(Rng(42).uniform() != c.uniform());
  Matrix<double> w(64, 100);
  Rng r(7);
  init_linear(w, r);
  CHECK(w.cwiseAbs().maxCoeff() <= 0.1);
  CHECK(w.cwiseAbs().maxCoeff() > 0.09);
  CHECK(std::abs(w.mean()) < 0.01);
  // Same seed, same weights, whatever the scalar type.
  SwiGLU<float> f1(8, 12, 3);
  SwiGLU<double> d1(8, 12, 3);
  CHECK((f1.w_gate_up().cast<double>() - d1.w_gate_up()).cwiseAbs().maxCoeff() < 1e-7);
}

TEST_CASE("params() views the layer's storage", "[core]") {
  SwiGLU<double> ffn(4, 6, 1);
  auto ps = ffn.params();
  REQUIRE(ps.size() == 3);
  CHECK(ps[0].name == "w_gate.weight");
  CHECK(ps[1].name == "w_up.weight");
  CHECK(ps[2].name == "w_down.weight");
  CHECK(ps[0].rows == 6);
  CHECK(ps[0].cols == 4);
  CHECK(ps[2].rows == 4);
  CHECK(ps[2].cols == 6);
  CHECK(parameter_count(ps) == 3 * 4 * 6);
  ps[1].value()(2, 3) = 9.0;
  CHECK(ffn.w_up()(2, 3) == 9.0);
  ps[0].grad().setOnes();
  ffn.zero_grad();
  CHECK(ps[0].grad().isZero());
}

// ---- lazily allocated gradients (core/param.hpp) ----

namespace {

bool bitwise_equal(const Eigen::Map<Matrix<double>>& a, const Eigen::Map<Matrix<double>>& b) {
  return a.rows() == b.rows() && a.cols() == b.cols() &&
         std::memcmp(a.data(), b.data(), std::size_t(a.size()) * sizeof(double)) == 0;
}

/// The lazy-gradient contract for one layer type. `make()` builds a layer
/// (the same weights every call); `step(layer, backward)` runs a forward
/// with a cache and, if `backward`, a backward of fixed upstream gradients.
template <class Make, class Step>
void check_lazy_gradients(const Make& make, const Step& step) {
  {  // construction, param_values() and forward allocate nothing; backward does
    auto layer = make();
    CHECK_FALSE(layer.has_gradients());
    const auto values = layer.param_values();
    REQUIRE_FALSE(values.empty());
    for (const auto& p : values) {
      CHECK_FALSE(p.has_grad());
      CHECK_THROWS_AS(p.grad(), NoGradientError);
    }
    step(layer, false);
    CHECK_FALSE(layer.has_gradients());
    step(layer, true);
    CHECK(layer.has_gradients());
  }
  {  // zero_grad() allocates them, zeroed
    auto layer = make();
    layer.zero_grad();
    CHECK(layer.has_gradients());
    for (const auto& p : layer.params()) CHECK(p.grad().isZero());
  }
  {  // params() allocates them, zeroed, at pointers that stay valid through backward
    auto layer = make();
    const auto ps = layer.params();
    CHECK(layer.has_gradients());
    const auto values = layer.param_values();
    REQUIRE(values.size() == ps.size());
    for (std::size_t i = 0; i < ps.size(); ++i) {
      CHECK(ps[i].has_grad());
      CHECK(ps[i].grad().isZero());
      CHECK(values[i].name == ps[i].name);
      CHECK(values[i].value_data == ps[i].value_data);
      CHECK_FALSE(values[i].has_grad());
    }
    step(layer, true);
    const auto again = layer.params();
    double norm = 0;
    for (std::size_t i = 0; i < ps.size(); ++i) {
      CHECK(again[i].grad_data == ps[i].grad_data);
      norm += ps[i].grad().norm();
    }
    CHECK(norm > 0);
  }
  {  // lazily allocated gradients equal eagerly allocated ones bitwise, and accumulate
    auto lazy = make();
    auto eager = make();
    eager.zero_grad();
    step(lazy, true);
    step(eager, true);
    step(lazy, true);
    step(eager, true);
    const auto a = lazy.params(), b = eager.params();
    REQUIRE(a.size() == b.size());
    for (std::size_t i = 0; i < a.size(); ++i) {
      INFO(a[i].name);
      CHECK(bitwise_equal(a[i].grad(), b[i].grad()));
    }
  }
}

const Matrix<double> kX = test::rnd<double>(5, 6, 71);
const Matrix<double> kDy = test::rnd<double>(5, 6, 72);

}  // namespace

TEST_CASE("Param::grad of a values-only view throws NoGradientError", "[core][lazy]") {
  RowVector<double> v = RowVector<double>::Ones(3);
  const Param<double> p = detail::make_value_param<double>("bias", v);
  CHECK_FALSE(p.has_grad());
  CHECK_THROWS_AS(p.grad(), NoGradientError);
  CHECK_THROWS_WITH(p.grad(), Catch::Matchers::Contains("Param::grad: 'bias' is a values-only view"));
  CHECK_THROWS_AS(zero_grad(ParamList<double>{p}), NoGradientError);
  CHECK(p.value()(0, 2) == 1.0);  // the values are there
}

TEST_CASE("SwiGLU allocates its gradients lazily", "[core][lazy]") {
  check_lazy_gradients([] { return SwiGLU<double>(6, 10, 3); },
                       [](SwiGLU<double>& l, bool bwd) {
                         SwiGLU<double>::Cache c;
                         l.forward(kX, &c);
                         if (bwd) l.backward(kDy, c);
                       });
}

TEST_CASE("RMSNorm allocates its gradient lazily", "[core][lazy]") {
  check_lazy_gradients([] { return RMSNorm<double>(6); },
                       [](RMSNorm<double>& l, bool bwd) {
                         RMSNorm<double>::Cache c;
                         l.forward(kX, &c);
                         if (bwd) l.backward(kDy, c);
                       });
}

TEST_CASE("Router allocates its gradient lazily", "[core][lazy]") {
  check_lazy_gradients(
      [] {
        Rng rng(5);
        return Router<double>(6, 4, 2, rng);
      },
      [](Router<double>& l, bool bwd) {
        Routing<double> r;
        l.route(kX, RowVector<double>::Zero(4), false, r);
        if (bwd) l.backward(kX, r, test::rnd<double>(5, 2, 73));
      });
}

TEST_CASE("SkipGate allocates its gradients lazily", "[core][lazy]") {
  check_lazy_gradients([] { return SkipGate<double>(test::gate_config(6, 8, 0.5), 4); },
                       [](SkipGate<double>& l, bool bwd) {
                         SkipGate<double>::Cache c;
                         l.forward(kX, &c);
                         if (bwd) l.backward(Vector<double>::LinSpaced(5, -1.0, 1.0), c);
                       });
}

TEST_CASE("KappaSwiGLU allocates its gradients (and its SwiGLU's) lazily", "[core][lazy]") {
  const auto make = [] {
    KappaSwiGLU<double> k(6, 10, 3);
    k.kappa_alpha() = test::rnd<double>(1, 10, 74);
    return k;
  };
  check_lazy_gradients(make, [](KappaSwiGLU<double>& l, bool bwd) {
    KappaSwiGLU<double>::Cache c;
    l.forward(kX, Vector<double>::LinSpaced(5, -2.0, 2.0), &c);
    if (bwd) l.backward(kDy, c);
  });
  auto k = make();
  CHECK_FALSE(k.swiglu().has_gradients());
  k.add_regularizer_grad();  // writes into α's and b's gradients: allocates them
  CHECK(k.has_gradients());
  CHECK(k.swiglu().has_gradients());
}

TEST_CASE("MultiTokenHeads allocates its gradients lazily", "[core][lazy]") {
  check_lazy_gradients([] { return MultiTokenHeads<double>(6, 11, MultiTokenOptions{}, 2); },
                       [](MultiTokenHeads<double>& l, bool bwd) {
                         MultiTokenHeads<double>::Cache c;
                         l.forward(kX, &c);
                         if (bwd) l.backward(test::rnd<double>(5, 4 * 11, 75), c);
                       });
  MultiTokenHeads<double> heads(6, 11, MultiTokenOptions{}, 2);
  CHECK_THROWS_AS(heads.weight_grad(0), NoGradientError);
}

TEST_CASE("FFNSublayer allocates its parts' gradients lazily", "[core][lazy]") {
  using Sub = FFNSublayer<double, SwiGLU<double>>;
  const auto make = [] { return Sub(6, SwiGLU<double>(6, 10, 3), SkipGate<double>(test::gate_config(6, 8, 0.0), 4)); };
  check_lazy_gradients(make,
                       [](Sub& l, bool bwd) {
                         Sub::Cache c;
                         l.forward(kX, &c);
                         if (bwd) l.backward(kDy, c);
                       });
  Sub sub(6, SwiGLU<double>(6, 10, 3), SkipGate<double>(test::gate_config(6, 8, 0.0), 4));
  sub.allocate_gradients();
  CHECK(sub.norm().has_gradients());
  CHECK(sub.ffn().has_gradients());
  CHECK(sub.skip_gate()->has_gradients());
}

TEST_CASE("Gradients that do not fit beside the weights are a ConfigError naming the bytes", "[core][lazy][memory]") {
  const std::uint64_t phys = physical_memory_bytes();
  REQUIRE(phys > 0);
  const char* saved = std::getenv(kAllowOvercommitEnv);
  const std::string saved_value = saved ? saved : "";
  ::unsetenv(kAllowOvercommitEnv);
  CHECK_NOTHROW(check_gradient_fit("X", "a layer", phys / 2, phys / 2));
  CHECK_THROWS_AS(check_gradient_fit("X", "a layer", phys / 2, phys / 2 + 1), ConfigError);
  CHECK_THROWS_WITH(check_gradient_fit("X", "a layer", phys / 2, phys / 2 + 1),
                       Catch::Matchers::StartsWith("X: a layer with its gradients needs ") &&
                           Catch::Matchers::Contains("of physical memory; set APEX_FFN_ALLOW_OVERCOMMIT=1 to allocate "
                                                     "them anyway"));
  // A sum past 2^64 used to wrap to a small total that fit (regression).
  const std::uint64_t huge = std::numeric_limits<std::uint64_t>::max() - 7;
  CHECK_THROWS_WITH(check_gradient_fit("X", "a layer", huge, 64),
                    Catch::Matchers::Contains("X: a layer with its gradients needs") &&
                        Catch::Matchers::Contains("does not fit in 64 bits"));
  ::setenv(kAllowOvercommitEnv, "1", 1);
  CHECK_NOTHROW(check_gradient_fit("X", "a layer", phys / 2, phys / 2 + 1));
  if (saved) ::setenv(kAllowOvercommitEnv, saved_value.c_str(), 1);
  else ::unsetenv(kAllowOvercommitEnv);
}

TEST_CASE("KappaSwiGLU::weight_bytes adds its parts in checked arithmetic", "[core][memory]") {
  // The SwiGLU's bytes plus α and b; at d_ffn near the index limit the
  // products are refused before any sum is formed.
  CHECK(KappaSwiGLU<float>::weight_bytes("K", 4, 8) == SwiGLU<float>::weight_bytes("K", 4, 8) + 2 * 8 * sizeof(float));
  const Index big = std::numeric_limits<Index>::max() / 8;
  CHECK_THROWS_AS(KappaSwiGLU<double>::weight_bytes("K", 1, big), ConfigError);
}

// ---- error handling (sweeps) ----
using namespace apex::test;  // the sweep machinery of support/sweep.hpp

static_assert(std::is_base_of<Error, ShapeError>::value && std::is_base_of<Error, ConfigError>::value &&
                  std::is_base_of<Error, ValueError>::value && std::is_base_of<Error, FormatError>::value &&
                  std::is_base_of<Error, NoGradientError>::value,
              "every library exception derives from apex::Error");
static_assert(std::is_base_of<std::runtime_error, Error>::value, "apex::Error is a std::runtime_error");

TEST_CASE("Rng::index rejects an empty range", "[sweeps][regression][init]") {
  // core/init.hpp, Rng::index(n) computes `… % n`: n = 0 was an integer division
  // by zero (SIGFPE on x86, undefined behaviour). Fixed: ValueError unless n ≥ 1.
  expect(outcome_isolated([] {
           Rng rng(1);
           volatile std::uint64_t sink = rng.index(0);  // used, so the division is not optimised away
           (void)sink;
         }),
         "ValueError", {"Rng::index"});
  Rng rng(1);
  CHECK(rng.index(1) == 0);
}

// ---- sizes near the Index limit ----
// Every size product a constructor computes goes through
// detail::checked_product, so a configuration whose element count does not
// fit in a 64-bit index is a ConfigError naming the product — before any
// allocation. Before, these products overflowed a signed integer (undefined
// behaviour; the asan preset's UBSan aborts on it) and MultiTokenHeads'
// num_heads·vocab wrapped to 0, building a layer with no weights.

TEST_CASE("checked_product names the product that does not fit", "[core][sizes]") {
  CHECK(detail::checked_product("f", "a x b", {3, 4}) == 12);
  CHECK(detail::checked_product("f", "a x b", {0, std::numeric_limits<Index>::max(), 8}) == 0);
  CHECK(detail::checked_product("f", "a x b", {std::numeric_limits<Index>::max(), 1}) ==
        std::numeric_limits<Index>::max());
  CHECK_THROWS_MATCHES(detail::checked_product("Layer", "rows x cols", {Index(1) << 32, Index(1) << 31}),
                       ConfigError,
                       Catch::Matchers::Message("Layer: rows x cols = 4294967296 x 2147483648 does not fit in a "
                                                "64-bit index"));
  CHECK_THROWS_AS(detail::checked_product("f", "a", {-1, 2}), ConfigError);
  CHECK(detail::checked_sum("f", "a + b", 2, 3) == 5);
  CHECK_THROWS_AS(detail::checked_sum("f", "a + b", std::numeric_limits<Index>::max(), 1), ConfigError);
}

TEST_CASE("skip-gate and multi-token constructors reject sizes whose products overflow an index",
          "[core][sizes][regression]") {
  // The MoE-side layers (SwiGLU, kappa-SwiGLU, Router, MoEFFN, LoadBalancer,
  // default_ffn_width) have the same test in test_moe_pipeline.cpp.
  const Index big = Index(1) << 62;  // 2^62: any factor ≥ 2 beside it overflows
  const Index half = Index(1) << 32;
  struct Probe {
    const char* what;
    std::function<void()> make;
    const char* names;  ///< a substring the message must contain
  };
  const std::vector<Probe> probes = {
      {"SkipGate(d 2^62, hidden 4)",
       [&] {
         SkipGateConfig c;
         c.d_model = big;
         c.hidden = 4;
         SkipGate<float> g(c);
       },
       "hidden x d_model"},
      {"MultiTokenHeads(d 2^32, vocab 2^32)", [&] { MultiTokenHeads<float> h(half, half); },
       "num_heads x vocab x d_model"},
      {"MultiTokenHeads(d 4, vocab 2^62): num_heads x vocab wrapped to 0",
       [&] {
         MultiTokenOptions o;
         o.num_heads = 4;
         MultiTokenHeads<float> h(4, big, o);
       },
       "num_heads x vocab"},
  };
  for (const Probe& p : probes) {
    INFO(p.what);
    try {
      p.make();
      FAIL_CHECK("no exception");
    } catch (const ConfigError& e) {
      CHECK_THAT(e.what(), Catch::Matchers::Contains(p.names));
    }
  }
}
