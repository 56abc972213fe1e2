// κ-SwiGLU: reduction to SwiGLU at α = b = 0, gradients by finite differences
// (every parameter, the input and the router-logit path), the ρ scaling, κ
// bounds for extreme inputs, the regulariser, float against double, errors,
// the same inside MoEFFN, and the error sweep of the options, the setters and
// the inputs.
#include <apex/ffn/layers/kappa_swiglu.hpp>
#include <apex/ffn/moe/moe_ffn.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "gradcheck.hpp"
#include "sweep.hpp"

using namespace apex;
using apex::test::check_params;
using apex::test::check_values;
using apex::test::dot_all;
using apex::test::moe_config;
using apex::test::random_matrix;
using apex::test::topk_margin;
using Catch::Matchers::WithinAbs;
using Catch::Matchers::WithinRel;

namespace {

// N = 0 and 1, a handful of rows (the streaming matrix–vector path), more rows
// than detail::kSmallRows (the general product), and a width of 32 whose rows
// are aligned for every SIMD width.
struct Shape {
  Index n, d, f;
};
const Shape kShapes[] = {{0, 4, 3}, {1, 4, 3}, {3, 5, 7}, {13, 6, 10}, {20, 8, 32}};

Vector<double> random_logits(Index n, std::uint64_t seed, double scale) {
  return random_matrix(n, 1, seed, scale);
}

template <class T>
void randomise_kappa(KappaSwiGLU<T>& layer, std::uint64_t seed, double scale) {
  layer.kappa_alpha() = random_matrix(1, layer.d_ffn(), seed, scale).template cast<T>();
  layer.kappa_bias() = random_matrix(1, layer.d_ffn(), seed + 1, scale).template cast<T>();
}

template <class A, class B>
double rel_diff(const A& a, const B& b) {
  const double scale = std::max(a.template cast<double>().norm(), b.template cast<double>().norm());
  return scale == 0 ? 0.0 : (a.template cast<double>() - b.template cast<double>()).norm() / scale;
}

}  // namespace

TEMPLATE_TEST_CASE("kappa-SwiGLU with alpha = b = 0 is SwiGLU", "[kappa]", float, double) {
  using T = TestType;
  for (const Shape s : kShapes) {
    for (const double logit_scale : {0.0, 5.0, 1e4}) {
      INFO("N = " << s.n << ", d = " << s.d << ", f = " << s.f << ", |logit| <= " << logit_scale);
      SwiGLU<T> plain(s.d, s.f, 7);
      KappaSwiGLU<T> kappa(s.d, s.f, 7);  // same seed: same weights, α = b = 0
      const Matrix<T> x = random_matrix(s.n, s.d, 8, 1.5).cast<T>();
      const Vector<T> logit = random_logits(s.n, 9, logit_scale).cast<T>();
      const Matrix<T> r = random_matrix(s.n, s.d, 10).cast<T>();

      typename SwiGLU<T>::Cache pc;
      typename KappaSwiGLU<T>::Cache kc;
      const Matrix<T> yp = plain.forward(x, &pc);
      const Matrix<T> yk = kappa.forward(x, logit, &kc);
      CHECK((kappa.kappa(logit).array() == T(1)).all());  // κ ≡ 1
      const Matrix<T> dxp = plain.backward(r, pc);
      const auto gk = kappa.backward(r, kc);
      // Nothing reaches the router: ∂u/∂ℓ = α·c = 0.
      CHECK((gk.dlogit.array() == T(0)).all());

      const auto pp = plain.params();
      const auto pk = kappa.params();
      REQUIRE(pk.size() == pp.size() + 2);
      if (s.f % 32 == 0) {
        // Both layers run the same operations on the same values: bitwise equal.
        CHECK(yk == yp);
        CHECK(gk.dx == dxp);
        for (std::size_t i = 0; i < pp.size(); ++i) CHECK(pk[i].grad() == pp[i].grad());
      } else {
        // Still the same operations, but Eigen evaluates the unaligned head of
        // a row with std::exp and the rest with its packet exp, and backward
        // evaluates σ into a row buffer of its own where SwiGLU evaluates it
        // inside two expressions whose rows start at different alignments:
        // a few entries may differ in the last bit.
        const double tol = 16 * std::numeric_limits<T>::epsilon();
        CHECK(rel_diff(yk, yp) <= tol);
        CHECK(rel_diff(gk.dx, dxp) <= tol);
        for (std::size_t i = 0; i < pp.size(); ++i) CHECK(rel_diff(pk[i].grad(), pp[i].grad()) <= tol);
      }
      // α and b do get a gradient at 0 (∂κ/∂u = ln U ≠ 0): that is how they leave it.
      if (s.n > 0 && logit_scale > 0) CHECK(kappa.kappa_alpha_grad().norm() > 0);
    }
  }
}

TEST_CASE("kappa-SwiGLU with U = 1 is SwiGLU whatever alpha and b", "[kappa]") {
  const Shape s{13, 6, 32};
  SwiGLU<double> plain(s.d, s.f, 3);
  KappaSwiGLU<double> kappa(s.d, s.f, 3);
  randomise_kappa(kappa, 4, 2.0);
  kappa.set_U(1.0);
  const Matrix<double> x = random_matrix(s.n, s.d, 5, 1.5), r = random_matrix(s.n, s.d, 6);
  const Vector<double> logit = random_logits(s.n, 7, 10.0);
  SwiGLU<double>::Cache pc;
  KappaSwiGLU<double>::Cache kc;
  CHECK(kappa.forward(x, logit, &kc) == plain.forward(x, &pc));
  const auto gk = kappa.backward(r, kc);
  CHECK(gk.dx == plain.backward(r, pc));
  CHECK(gk.dlogit.isZero(0));
  CHECK(kappa.kappa_alpha_grad().isZero(0));
  CHECK(kappa.kappa_bias_grad().isZero(0));
}

TEST_CASE("kappa-SwiGLU gradients match central differences", "[kappa][gradcheck]") {
  struct Config {
    const char* what;
    double U, c;
  };
  const Config configs[] = {{"defaults U = 4, c = 0.3", 4.0, 0.3},
                            {"U = 1.01 (near 1), c = -0.7", 1.01, -0.7},
                            {"U = 20, c = 1.3", 20.0, 1.3}};
  for (const Config cf : configs) {
    for (const Shape s : kShapes) {
      INFO(cf.what << ", N = " << s.n << ", d = " << s.d << ", f = " << s.f);
      KappaOptions opt;
      opt.U = cf.U;
      opt.c = cf.c;
      opt.rho = 1.0;  // the full ∂L/∂ℓ, so finite differences in ℓ can check it
      KappaSwiGLU<double> layer(s.d, s.f, 11, opt);
      randomise_kappa(layer, 12, 1.0);
      Matrix<double> x = random_matrix(s.n, s.d, 13, 1.5);
      Vector<double> logit = random_logits(s.n, 14, 3.0);
      const Matrix<double> r = random_matrix(s.n, s.d, 15);
      auto loss = [&] { return dot_all(layer.forward(x, logit), r); };

      KappaSwiGLU<double>::Cache cache;
      layer.forward(x, logit, &cache);
      const auto g = layer.backward(r, cache);
      REQUIRE(g.dx.rows() == s.n);
      REQUIRE(g.dx.cols() == s.d);
      REQUIRE(g.dlogit.size() == s.n);
      APEX_CHECK_GRADS(check_params(layer.params(), loss), 1e-6);
      APEX_CHECK_GRADS(std::vector{check_values("x", x.data(), g.dx.data(), x.size(), loss)}, 1e-6);
      APEX_CHECK_GRADS(std::vector{check_values("logit", logit.data(), g.dlogit.data(), logit.size(), loss)}, 1e-6);
      if (s.n > 0) {
        for (const auto& p : layer.params()) CHECK(p.grad().norm() > 0);
        CHECK(g.dlogit.norm() > 0);
      }
    }
  }
}

TEST_CASE("rho scales the router-logit gradient linearly and 0 detaches it", "[kappa]") {
  const Shape s{13, 6, 10};
  const Matrix<double> x = random_matrix(s.n, s.d, 21, 1.5), r = random_matrix(s.n, s.d, 22);
  const Vector<double> logit = random_logits(s.n, 23, 3.0);
  auto run = [&](double rho) {
    KappaOptions opt;
    opt.rho = rho;
    KappaSwiGLU<double> layer(s.d, s.f, 24, opt);
    randomise_kappa(layer, 25, 1.0);
    KappaSwiGLU<double>::Cache cache;
    layer.forward(x, logit, &cache);
    auto g = layer.backward(r, cache);
    std::vector<Matrix<double>> all;
    for (const auto& p : layer.params()) all.push_back(p.grad());
    return std::make_pair(g, all);
  };
  const auto [g1, p1] = run(1.0);
  const auto [g01, p01] = run(0.1);  // the default
  const auto [g0, p0] = run(0.0);
  const auto [g3, p3] = run(3.0);
  REQUIRE(g1.dlogit.norm() > 0);
  CHECK((g01.dlogit - 0.1 * g1.dlogit).norm() <= 1e-14 * g1.dlogit.norm());
  CHECK((g3.dlogit - 3.0 * g1.dlogit).norm() <= 1e-14 * g1.dlogit.norm());
  CHECK(g0.dlogit.isZero(0));
  // ρ touches nothing else: the forward value, dx and every parameter gradient are unchanged.
  for (const auto* other : {&g01, &g0, &g3}) CHECK(other->dx == g1.dx);
  for (std::size_t i = 0; i < p1.size(); ++i) {
    CHECK(p01[i] == p1[i]);
    CHECK(p0[i] == p1[i]);
  }
}

TEMPLATE_TEST_CASE("kappa stays in its bounds for extreme inputs", "[kappa][numerics]", float, double) {
  using T = TestType;
  const Index f = 24;
  Vector<T> logit(9);
  logit << T(-1e4), T(-1e3), T(-20), T(-1), T(0), T(1e-30), T(1), T(300), T(1e4);
  for (const double U : {1.0, 1.0 + 1e-6, 1.5, 4.0, 1e3}) {
    INFO("U = " << U);
    KappaOptions opt;
    opt.U = U;
    KappaSwiGLU<T> layer(8, f, 1, opt);
    randomise_kappa(layer, 2, 50.0);
    layer.kappa_alpha()(0) = T(1);  // a unit that saturates at both ends
    layer.kappa_bias()(0) = T(0);
    const Matrix<T> k = layer.kappa(logit);
    CHECK(k.allFinite());
    CHECK(k.minCoeff() >= T(1.0 / U));
    CHECK(k.maxCoeff() <= T(U));
    if (U == 1.0) {
      CHECK((k.array() == T(1)).all());
    } else {
      CHECK_THAT(double(k(8, 0)), WithinRel(U, 1e-6));  // ℓ = 1e4: tanh(3000) = 1
      CHECK_THAT(double(k(0, 0)), WithinRel(1.0 / U, 1e-6));
      CHECK(k(4, 0) == T(1));  // ℓ = 0, b = 0: κ = 1
    }

    // Large gate pre-activations (|z| up to ~1e4) and large logits stay finite
    // through forward and backward.
    const Matrix<T> x = (random_matrix(logit.size(), 8, 3, 1.0) * 3e3).template cast<T>();
    typename KappaSwiGLU<T>::Cache cache;
    const Matrix<T> y = layer.forward(x, logit, &cache);
    CHECK(cache.work.leftCols(f).cwiseAbs().maxCoeff() > T(1e3));
    CHECK(y.allFinite());
    const auto g = layer.backward(Matrix<T>::Ones(logit.size(), 8), cache);
    CHECK(g.dx.allFinite());
    CHECK(g.dlogit.allFinite());
    for (const auto& p : layer.params()) CHECK(p.grad().allFinite());
  }
}

TEMPLATE_TEST_CASE("kappa-SwiGLU stays finite when c*logit overflows", "[kappa][numerics][regression]", float,
                   double) {
  // KappaOptions{c = 1e38} is in range for float, but with a logit of 10,
  // s = c·ℓ overflowed to ∞ and α·s with α = 0 was 0·∞ = NaN, so the output
  // was NaN where κ must be 1. Fixed: s saturates at the largest finite T.
  using T = TestType;
  const double c = std::is_same_v<T, float> ? 1e38 : 1e308;
  KappaOptions opt;
  opt.c = c;
  KappaSwiGLU<T> kappa(6, 8, 1, opt);
  SwiGLU<T> plain(6, 8, 1);
  const Matrix<T> x = random_matrix(5, 6, 2).template cast<T>(), dy = random_matrix(5, 6, 3).template cast<T>();
  Vector<T> logit(5);
  logit << T(10), T(-10), T(1e3), T(0), T(-1);
  // α = b = 0: κ ≡ 1, bitwise SwiGLU, and no gradient reaches ℓ.
  CHECK((kappa.kappa(logit).array() == T(1)).all());
  typename KappaSwiGLU<T>::Cache kc;
  typename SwiGLU<T>::Cache pc;
  CHECK(kappa.forward(x, logit, &kc) == plain.forward(x, &pc));
  const auto g = kappa.backward(dy, kc);
  CHECK(g.dx == plain.backward(dy, pc));
  CHECK(g.dlogit.head(3).isZero());
  for (const auto& p : kappa.params()) CHECK(p.grad().allFinite());
  // α ≠ 0: u = b + α·s saturates and tanh gives ±1, so κ sits at U or 1/U.
  kappa.kappa_alpha().setConstant(T(0.5));
  const Matrix<T> k = kappa.kappa(logit);
  CHECK(k.allFinite());
  CHECK_THAT(double(k(0, 0)), WithinRel(opt.U, 1e-6));
  CHECK_THAT(double(k(1, 0)), WithinRel(1.0 / opt.U, 1e-6));
  CHECK(kappa.forward(x, logit, &kc).allFinite());
  const auto g2 = kappa.backward(dy, kc);
  CHECK(g2.dx.allFinite());
  CHECK(g2.dlogit.allFinite());
}

TEST_CASE("kappa-SwiGLU regulariser value and gradient", "[kappa][regulariser]") {
  const Index f = 7;
  KappaOptions opt;
  opt.reg_weight = 0.05;
  KappaSwiGLU<double> layer(4, f, 1, opt);
  CHECK(layer.regularizer() == 0.0);  // α = b = 0 at init
  randomise_kappa(layer, 2, 1.5);
  const RowVector<double> a = layer.kappa_alpha(), b = layer.kappa_bias();
  double want = 0;
  for (Index j = 0; j < f; ++j) want += (a(j) * a(j) + b(j) * b(j)) / double(f);
  want *= 0.05;
  CHECK_THAT(layer.regularizer(), WithinRel(want, 1e-14));

  // Gradient against central differences of regularizer(); += onto existing grads.
  layer.zero_grad();
  CHECK(layer.add_regularizer_grad() == layer.regularizer());
  auto loss = [&] { return layer.regularizer(); };
  APEX_CHECK_GRADS(std::vector{check_values("kappa_alpha", layer.kappa_alpha().data(),
                                            layer.kappa_alpha_grad().data(), f, loss)},
                   1e-6);
  APEX_CHECK_GRADS(std::vector{check_values("kappa_bias", layer.kappa_bias().data(),
                                            layer.kappa_bias_grad().data(), f, loss)},
                   1e-6);
  const RowVector<double> once = layer.kappa_alpha_grad();
  CHECK_THAT(layer.add_regularizer_grad(0.25), WithinRel(0.25 * want, 1e-14));
  CHECK((layer.kappa_alpha_grad() - 1.25 * once).norm() <= 1e-14 * once.norm());
  CHECK((layer.params()[0].grad().array() == 0).all());  // weights untouched

  // Default weight 1e-2.
  KappaSwiGLU<double> dflt(4, f, 1);
  dflt.kappa_alpha().setConstant(2.0);
  CHECK_THAT(dflt.regularizer(), WithinRel(1e-2 * 4.0, 1e-14));
}

TEST_CASE("float agrees with double", "[kappa]") {
  KappaSwiGLU<double> ld(32, 48, 9);
  KappaSwiGLU<float> lf(32, 48, 9);
  randomise_kappa(ld, 10, 1.0);
  randomise_kappa(lf, 10, 1.0);
  for (Index n : {1, 5, 40}) {
    const Matrix<double> x = random_matrix(n, 32, 10 + n), r = random_matrix(n, 32, 20 + n);
    const Vector<double> logit = random_logits(n, 30 + n, 4.0);
    KappaSwiGLU<double>::Cache cd;
    KappaSwiGLU<float>::Cache cf;
    const Matrix<double> yd = ld.forward(x, logit, &cd);
    const Matrix<float> yf = lf.forward(x.cast<float>(), logit.cast<float>(), &cf);
    CHECK(rel_diff(yf, yd) <= 1e-5);
    const auto gd = ld.backward(r, cd);
    const auto gf = lf.backward(r.cast<float>(), cf);
    CHECK(rel_diff(gf.dx, gd.dx) <= 1e-5);
    CHECK(rel_diff(gf.dlogit, gd.dlogit) <= 1e-5);
  }
  const auto pd = ld.params();
  const auto pf = lf.params();
  for (std::size_t i = 0; i < pd.size(); ++i) {
    INFO(pd[i].name);
    CHECK(rel_diff(pf[i].grad(), pd[i].grad()) <= 1e-5);
  }
}

TEST_CASE("kappa-SwiGLU parameters and gradient accumulation", "[kappa]") {
  KappaSwiGLU<double> layer(5, 7, 1);
  const auto ps = layer.params();
  REQUIRE(ps.size() == 5);
  const char* names[] = {"w_gate.weight", "w_up.weight", "w_down.weight", "kappa_alpha", "kappa_bias"};
  const Index rows[] = {7, 7, 5, 1, 1}, cols[] = {5, 5, 7, 7, 7};
  for (std::size_t i = 0; i < 5; ++i) {
    CHECK(ps[i].name == names[i]);
    CHECK(ps[i].rows == rows[i]);
    CHECK(ps[i].cols == cols[i]);
  }
  CHECK(layer.kappa_alpha().isZero(0));
  CHECK(layer.kappa_bias().isZero(0));
  CHECK(layer.options().U == 4.0);
  CHECK(layer.options().c == 0.3);
  CHECK(layer.options().rho == 0.1);
  CHECK(layer.options().reg_weight == 1e-2);
  CHECK(layer.work_cols() == 21);  // SwiGLU's [G | U | A]: κ is not stored

  randomise_kappa(layer, 2, 1.0);
  const Matrix<double> x = random_matrix(4, 5, 3), r = random_matrix(4, 5, 4);
  const Vector<double> logit = random_logits(4, 5, 3.0);
  KappaSwiGLU<double>::Cache cache;
  layer.forward(x, logit, &cache);
  const auto g1 = layer.backward(r, cache);
  std::vector<Matrix<double>> once;
  for (const auto& p : layer.params()) once.push_back(p.grad());
  const auto g2 = layer.backward(r, cache);
  CHECK(g2.dx == g1.dx);
  CHECK(g2.dlogit == g1.dlogit);
  for (std::size_t i = 0; i < once.size(); ++i) {
    INFO(names[i]);
    CHECK((layer.params()[i].grad() - 2 * once[i]).norm() <= 1e-14 * once[i].norm());
  }
  layer.zero_grad();
  for (const auto& p : layer.params()) CHECK(p.grad().isZero(0));
  // A ramp step between iterations: the next forward sees the new U.
  CHECK(layer.kappa(logit).maxCoeff() > 2.0);
  layer.set_U(2.0);
  CHECK(layer.kappa(logit).maxCoeff() <= 2.0);
}

TEST_CASE("the U ramp", "[kappa]") {
  CHECK(kappa_ramp(-3.0) == 1.0);
  CHECK(kappa_ramp(0.0) == 1.0);
  CHECK(kappa_ramp(0.5) == 2.5);
  CHECK(kappa_ramp(1.0) == 4.0);
  CHECK(kappa_ramp(7.0) == 4.0);
  CHECK(kappa_ramp(0.25, 9.0) == 3.0);
}

TEST_CASE("a trained SwiGLU converts to kappa-SwiGLU unchanged", "[kappa]") {
  SwiGLU<double> plain(6, 32, 4);
  plain.w_down() *= 3.0;  // "trained": no longer the seed's weights
  KappaSwiGLU<double> kappa(plain);
  const Matrix<double> x = random_matrix(9, 6, 5);
  CHECK(kappa.forward(x, random_logits(9, 6, 2.0)) == plain.forward(x));
}

TEST_CASE("kappa-SwiGLU rejects bad options and inputs", "[kappa][errors]") {
  auto with = [](double U, double c, double rho, double w) {
    KappaOptions o;
    o.U = U;
    o.c = c;
    o.rho = rho;
    o.reg_weight = w;
    return o;
  };
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  CHECK_THROWS_AS(KappaSwiGLU<double>(4, 3, 0, with(0.999, 0.3, 0.1, 0.01)), ConfigError);
  CHECK_THROWS_AS(KappaSwiGLU<double>(4, 3, 0, with(nan, 0.3, 0.1, 0.01)), ConfigError);
  CHECK_THROWS_AS(KappaSwiGLU<double>(4, 3, 0, with(inf, 0.3, 0.1, 0.01)), ConfigError);
  CHECK_THROWS_AS(KappaSwiGLU<double>(4, 3, 0, with(4, inf, 0.1, 0.01)), ConfigError);
  CHECK_THROWS_AS(KappaSwiGLU<double>(4, 3, 0, with(4, 0.3, -0.1, 0.01)), ConfigError);
  CHECK_THROWS_AS(KappaSwiGLU<double>(4, 3, 0, with(4, 0.3, 0.1, -1)), ConfigError);
  CHECK_NOTHROW(KappaSwiGLU<double>(4, 3, 0, with(1, -2, 0, 0)));
  CHECK_THROWS_AS(KappaSwiGLU<double>(0, 3), ConfigError);
  CHECK_THROWS_AS(KappaSwiGLU<double>(4, 0), ConfigError);

  KappaSwiGLU<double> layer(4, 6, 0);
  CHECK_THROWS_AS(layer.set_U(0.5), ConfigError);
  CHECK_THROWS_WITH(layer.set_U(0.5), "KappaSwiGLU::set_options: U must be finite and >= 1, got 0.500000");
  CHECK(layer.U() == 4.0);  // a rejected change changes nothing
  layer.set_U(1.0);
  CHECK(layer.U() == 1.0);

  const Vector<double> logit3 = Vector<double>::Zero(3);
  CHECK_THROWS_AS(layer.forward(Matrix<double>::Zero(3, 5), logit3), ShapeError);
  CHECK_THROWS_WITH(layer.forward(Matrix<double>::Zero(3, 4), Vector<double>::Zero(2)),
                    "KappaSwiGLU::forward: argument 'logit' has shape [2 x 1], expected [3 x 1]");
  Vector<double> bad = logit3;
  bad(1) = nan;
  CHECK_THROWS_AS(layer.forward(Matrix<double>::Zero(3, 4), bad), ValueError);
  bad(1) = inf;
  CHECK_THROWS_AS(layer.forward(Matrix<double>::Zero(3, 4), bad), ValueError);
  KappaSwiGLU<double>::Cache cache;
  layer.forward(Matrix<double>::Zero(3, 4), logit3, &cache);
  CHECK_THROWS_AS(layer.backward(Matrix<double>::Zero(2, 4), cache), ShapeError);
}

// ---------------------------------------------------------------------------
// Inside MoEFFN

TEST_CASE("MoE of kappa-SwiGLU experts with alpha = b = 0 equals the SwiGLU MoE", "[kappa][moe]") {
  for (const Index f : {5, 32}) {
    INFO("f = " << f);
    const MoEConfig cfg = moe_config(4, 2, 1, 6, f);
    MoEFFN<double> plain(cfg, 31);
    MoEFFN<double, KappaSwiGLU<double>> kappa(cfg, 31);  // same seed: same router and weights
    const Matrix<double> x = random_matrix(17, 6, 32, 1.5), r = random_matrix(17, 6, 33);
    MoEFFN<double>::Cache pc;
    MoEFFN<double, KappaSwiGLU<double>>::Cache kc;
    const Matrix<double> yp = plain.forward(x, &pc), yk = kappa.forward(x, &kc);
    const Matrix<double> dxp = plain.backward(r, pc), dxk = kappa.backward(r, kc);
    const auto pp = plain.params();
    const auto pk = kappa.params();
    // The κ MoE lists kappa_alpha and kappa_bias after each expert's weights.
    REQUIRE(pk.size() == pp.size() + 2 * std::size_t(cfg.n_experts));
    const double tol = f % 32 == 0 ? 0.0 : 1e-14;  // see "is SwiGLU" above for the odd width
    CHECK(rel_diff(yk, yp) <= tol);
    CHECK(rel_diff(dxk, dxp) <= tol);
    std::size_t j = 0;
    for (const auto& p : pk) {
      if (p.name.find("kappa_") != std::string::npos) continue;
      INFO(p.name);
      REQUIRE(p.name == pp[j].name);
      CHECK(rel_diff(p.grad(), pp[j].grad()) <= tol);
      ++j;
    }
  }
}

TEST_CASE("MoE of kappa-SwiGLU experts: gradients match central differences", "[kappa][moe][gradcheck]") {
  struct Case {
    const char* what;
    Index n, experts, k, shared;
    bool unbiased;
    double rho;
  };
  const Case cases[] = {{"N = 5 biased weights rho = 1", 5, 4, 2, 1, false, 1.0},
                        {"N = 12 unbiased weights rho = 0.1", 12, 5, 2, 2, true, 0.1},
                        {"N = 9 rho = 0 (router detached from kappa)", 9, 4, 2, 0, false, 0.0},
                        {"K = E", 4, 3, 3, 1, false, 1.0},
                        {"N = 1", 1, 4, 2, 1, false, 1.0},
                        {"N = 0", 0, 4, 2, 1, false, 1.0}};
  for (const Case& cs : cases) {
    INFO(cs.what);
    MoEConfig cfg = moe_config(cs.experts, cs.k, cs.shared);
    cfg.weights_from_unbiased = cs.unbiased;
    MoEFFN<double, KappaSwiGLU<double>> moe(cfg, 41);
    moe.balancer().set_bias(random_matrix(1, cs.experts, 42, 0.3));
    std::uint64_t seed = 43;
    for (auto& e : moe.experts()) {
      randomise_kappa(e, seed += 2, 1.0);
      KappaOptions opt = e.options();
      opt.rho = cs.rho;
      opt.c = 1.5;  // router logits here are O(1): a larger c makes κ vary visibly
      e.set_options(opt);
    }
    Matrix<double> x;
    for (std::uint64_t s = 100;; ++s) {
      x = random_matrix(cs.n, 6, s, 1.5);
      if (topk_margin(moe, x) > 1e-2) break;
    }
    const Matrix<double> r = random_matrix(cs.n, 6, 44);

    if (cs.rho == 1.0) {
      // ρ = 1: the analytic gradient is the true gradient, router included.
      auto loss = [&] { return dot_all(moe.forward(x), r); };
      MoEFFN<double, KappaSwiGLU<double>>::Cache cache;
      moe.forward(x, &cache);
      const Matrix<double> dx = moe.backward(r, cache);
      APEX_CHECK_GRADS(check_params(moe.params(), loss), 1e-6);
      APEX_CHECK_GRADS(std::vector{check_values("x", x.data(), dx.data(), x.size(), loss)}, 1e-6);
      if (cs.n > 0) CHECK(moe.router().weight_grad().norm() > 0);
    } else {
      // ρ < 1 is a deliberate surrogate. Its router and input gradients are
      // (1 − ρ)·G_detached + ρ·G_full, where G_detached is what the MoE gets
      // when ℓ reaches κ as a constant (ρ = 0) and G_full is the true gradient
      // (ρ = 1); both of those are checked here.
      auto grads = [&](double rho) {
        for (auto& e : moe.experts()) {
          KappaOptions opt = e.options();
          opt.rho = rho;
          e.set_options(opt);
        }
        moe.zero_grad();
        MoEFFN<double, KappaSwiGLU<double>>::Cache cache;
        moe.forward(x, &cache);
        Matrix<double> dx = moe.backward(r, cache);
        return std::make_pair(dx, Matrix<double>(moe.router().weight_grad()));
      };
      const auto [dx0, wr0] = grads(0.0);
      const auto [dx1, wr1] = grads(1.0);
      const auto [dxr, wrr] = grads(cs.rho);
      CHECK(rel_diff(dxr, (1 - cs.rho) * dx0 + cs.rho * dx1) <= 1e-13);
      CHECK(rel_diff(wrr, (1 - cs.rho) * wr0 + cs.rho * wr1) <= 1e-13);
      if (cs.n > 0) CHECK(rel_diff(dx0, dx1) > 1e-6);  // the κ path really contributes

      // ρ = 0: the gradient of a loss in which κ sees ℓ as a constant. Freeze
      // every token's κ-logit at its current value and differentiate the rest.
      MoEFFN<double, KappaSwiGLU<double>>::Cache frozen;
      moe.forward(x, &frozen);
      const Matrix<double> logits0 = frozen.routing.logits;
      auto loss_detached = [&] {
        // y = Σ_s shared + Σ_k g_k(ℓ(x))·Expert_e(x; ℓ0): recompute from the pieces.
        MoEFFN<double, KappaSwiGLU<double>>::Cache c;
        moe.forward(x, &c);
        Matrix<double> y = Matrix<double>::Zero(x.rows(), 6);
        for (auto& s : moe.shared_experts()) y += s.forward(x);
        for (Index t = 0; t < x.rows(); ++t)
          for (Index k = 0; k < cfg.n_active; ++k) {
            const Index e = c.routing.experts(t, k);
            Vector<double> l0(1);
            l0(0) = logits0(t, e);
            y.row(t) += c.routing.weights(t, k) * moe.experts()[e].forward(x.row(t), l0);
          }
        return dot_all(y, r);
      };
      for (auto& e : moe.experts()) {
        KappaOptions opt = e.options();
        opt.rho = 0.0;
        e.set_options(opt);
      }
      moe.zero_grad();
      MoEFFN<double, KappaSwiGLU<double>>::Cache cache;
      moe.forward(x, &cache);
      const Matrix<double> dx = moe.backward(r, cache);
      const auto all = moe.params();
      const ParamList<double> router_only(all.begin(), all.begin() + 1);
      REQUIRE(router_only[0].name == "router.weight");
      APEX_CHECK_GRADS(check_params(router_only, loss_detached), 1e-6);
      APEX_CHECK_GRADS(std::vector{check_values("x", x.data(), dx.data(), x.size(), loss_detached)}, 1e-6);
    }
  }
}

TEST_CASE("MoE helpers set U and add the layer-wide regulariser", "[kappa][moe][regulariser]") {
  MoEFFN<double, KappaSwiGLU<double>> moe(moe_config(3, 2, 1), 1);
  set_kappa_U(moe, 2.5);
  for (const auto& e : moe.experts()) CHECK(e.U() == 2.5);
  CHECK_THROWS_AS(set_kappa_U(moe, 0.5), ConfigError);

  double sum_sq = 0;
  Index count = 0;
  std::uint64_t seed = 3;
  for (auto& e : moe.experts()) {
    randomise_kappa(e, seed += 2, 1.0);
    sum_sq += e.kappa_alpha().squaredNorm() + e.kappa_bias().squaredNorm();
    count += e.d_ffn();
  }
  moe.zero_grad();
  // w·(mean(b²) + mean(α²)) with the means over all E×f entries of the layer.
  const double value = add_kappa_regularizer_grad(moe);
  CHECK_THAT(value, WithinRel(1e-2 * sum_sq / double(count), 1e-13));
  for (auto& e : moe.experts()) {
    const RowVector<double> want = 2e-2 * e.kappa_alpha() / double(count);
    CHECK((e.kappa_alpha_grad() - want).norm() <= 1e-15);
  }
}

// ---- error handling (sweeps) ----
using namespace apex::test;  // the sweep machinery of support/sweep.hpp
using Catch::Matchers::Equals;
using Catch::Matchers::StartsWith;

TEMPLATE_TEST_CASE("KappaSwiGLU sweep: options and setters and inputs", "[sweeps][kappa]", float, double) {
  using T = TestType;
  const Index d = 6, f = 8, n = 5;
  KappaSwiGLU<T> layer(d, f, 1);
  const Vector<T> logit = rnd<T>(n, 1, 2);
  typename KappaSwiGLU<T>::Cache cache, other;
  layer.forward(rnd<T>(n, d, 3), logit, &cache);
  layer.forward(rnd<T>(n + 2, d, 4), rnd<T>(n + 2, 1, 5), &other);
  std::vector<Case> cases;

  struct Option {
    const char* field;
    std::function<void(KappaOptions&)> spoil;
  };
  const std::vector<Option> options = {
      {"U must", [](KappaOptions& o) { o.U = 0.999; }},   {"U must", [](KappaOptions& o) { o.U = 0; }},
      {"U must", [](KappaOptions& o) { o.U = -4; }},      {"U must", [](KappaOptions& o) { o.U = kNaN; }},
      {"U must", [](KappaOptions& o) { o.U = kInf; }},    {"c must", [](KappaOptions& o) { o.c = kNaN; }},
      {"c must", [](KappaOptions& o) { o.c = -kInf; }},   {"rho must", [](KappaOptions& o) { o.rho = -0.1; }},
      {"rho must", [](KappaOptions& o) { o.rho = kNaN; }}, {"rho must", [](KappaOptions& o) { o.rho = kInf; }},
      {"reg_weight must", [](KappaOptions& o) { o.reg_weight = -1e-2; }},
      {"reg_weight must", [](KappaOptions& o) { o.reg_weight = kNaN; }},
  };
  for (const Option& op : options) {
    KappaOptions bad;
    op.spoil(bad);
    cases.push_back({std::string("KappaSwiGLU with ") + op.field, [=] { (void)KappaSwiGLU<T>(d, f, 0, bad); },
                     "ConfigError", {"KappaSwiGLU", op.field}});
    cases.push_back({std::string("KappaSwiGLU::set_options with ") + op.field, [=, &layer] { layer.set_options(bad); },
                     "ConfigError", {"KappaSwiGLU::set_options", op.field}});
  }
  for (double u : {0.5, 0.0, -1.0, kNaN, kInf})
    cases.push_back({"KappaSwiGLU::set_U(" + std::to_string(u) + ")", [=, &layer] { layer.set_U(u); }, "ConfigError",
                     {"KappaSwiGLU::set_options", "U must"}});
  cases.push_back({"KappaSwiGLU(0, f)", [=] { (void)KappaSwiGLU<T>(0, f); }, "ConfigError", {"d_model"}});
  cases.push_back({"KappaSwiGLU(d, 0)", [=] { (void)KappaSwiGLU<T>(d, 0); }, "ConfigError", {"d_ffn"}});

  add_width_cases<T>(cases, "KappaSwiGLU::forward", "x", n, d, [&](const Matrix<T>& x) { layer.forward(x, logit); });
  for (Index len : {n - 1, n + 1, Index(0)})
    cases.push_back({"KappaSwiGLU::forward with " + std::to_string(len) + " logits for " + std::to_string(n) + " rows",
                     [=, &layer] { layer.forward(Matrix<T>::Ones(n, d), Vector<T>::Zero(len)); }, "ShapeError",
                     {"KappaSwiGLU::forward", "'logit'", shape(len, 1)}});
  for (double v : {kNaN, kInf, -kInf})
    cases.push_back({"KappaSwiGLU::forward with logit " + std::to_string(v),
                     [=, &layer] {
                       Vector<T> l = Vector<T>::Zero(n);
                       l(1) = T(v);
                       layer.forward(Matrix<T>::Ones(n, d), l);
                     },
                     "ValueError", {"KappaSwiGLU::forward", "'logit'", "NaN or Inf"}});
  add_grad_cases<T>(cases, "KappaSwiGLU::backward", "dy", n, d, [&](const Matrix<T>& dy) { layer.backward(dy, cache); });
  cases.push_back({"KappaSwiGLU::backward with the cache of a 7-row batch",
                   [&] { layer.backward(Matrix<T>::Ones(n, d), other); }, "ShapeError", {"KappaSwiGLU::backward", "'dy'"}});

  // Inside an MoE layer.
  MoEFFN<T, KappaSwiGLU<T>> moe(moe_config(4, 2, 1, d, f), 6);
  cases.push_back({"set_kappa_U(moe, 0.5)", [&] { set_kappa_U(moe, 0.5); }, "ConfigError", {"U must"}});
  cases.push_back({"kappa MoE forward with NaN", [&] {
                     Matrix<T> x = rnd<T>(n, d, 7);
                     x(0, 0) = T(kNaN);
                     moe.forward(x);
                   },
                   "ValueError", {"not finite"}});
  add_width_cases<T>(cases, "MoEFFN::forward", "x", n, d, [&](const Matrix<T>& x) { moe.forward(x); });
  run_sweep(cases);

  // Rejected options change nothing.
  CHECK(layer.U() == 4.0);
  CHECK(layer.options().rho == 0.1);
  for (const auto& ex : moe.experts()) CHECK(ex.U() == 4.0);
}

TEST_CASE("KappaSwiGLU of float rejects options beyond the range of float", "[sweeps][regression][kappa]") {
  // layers/kappa_swiglu.hpp: KappaOptions::validate checked U and c for finiteness
  // as doubles; KappaSwiGLU<float> converts them with T(opt_.c), T(opt_.U).
  // c = 1e39 is finite as a double but inf as a float, so s = c·ℓ was inf
  // (NaN for ℓ = 0), u = b + α·s = 0·inf = NaN and the output NaN for a
  // finite input. Fixed: the constructor and set_options also require the
  // options to lie within the range of T.
  const std::string got = outcome([] {
    KappaOptions o;
    o.c = 1e39;
    const KappaSwiGLU<float> layer(4, 6, 0, o);
    const Matrix<float> y = layer.forward(Matrix<float>::Ones(2, 4), Vector<float>::Zero(2));
    if (!y.allFinite()) throw std::runtime_error("NaN output from a finite input");
  });
  CHECK_THAT(got, Equals("returned") || StartsWith("ConfigError: "));
}
