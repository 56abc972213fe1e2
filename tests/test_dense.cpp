// Dense path: RMSNorm and SwiGLU — worked examples, gradients by finite
// differences, float/double agreement, shape errors, and the error sweeps of
// the dense layers (with the NaN propagation of every dense forward).
#include <apex/ffn.hpp>

#include <catch2/catch.hpp>

#include <limits>
#include <type_traits>

#include "gradcheck.hpp"
#include "sweep.hpp"

using namespace apex;
using apex::test::check_params;
using apex::test::check_values;
using apex::test::dot_all;
using apex::test::random_matrix;
using Catch::Matchers::WithinAbs;

TEST_CASE("RMSNorm worked example (docs/math.md#rmsnorm)", "[rmsnorm][reference]") {
  RMSNorm<double> norm(4);
  Matrix<double> x(1, 4);
  x << 2, -1, 0.5, 1.5;
  const Matrix<double> y = norm.forward(x);
  const double want[4] = {1.4606, -0.7303, 0.3651, 1.0954};
  for (int j = 0; j < 4; ++j) CHECK_THAT(y(0, j), WithinAbs(want[j], 5e-5));
}

TEST_CASE("SwiGLU worked example (docs/math.md#swiglu) at its correct values", "[swiglu][reference]") {
  // The reference's W_gate, W_up are d × f (x·W); the library stores the
  // PyTorch layout f × d, hence the transposes.
  Matrix<double> w_gate(4, 3), w_up(4, 3);
  w_gate << 0.5, -0.3, 0.1, 0.2, 0.4, 0.3, -0.1, 0.2, 0.5, 0.4, -0.1, 0.2;
  w_up << 0.2, 0.4, -0.1, 0.1, -0.2, 0.5, 0.3, 0.1, 0.2, -0.2, 0.3, 0.1;
  SwiGLU<double> ffn(4, 3, 0);
  ffn.w_gate() = w_gate.transpose();
  ffn.w_up() = w_up.transpose();
  const Matrix<double> w_down = random_matrix(4, 3, 5);
  ffn.w_down() = w_down;
  Matrix<double> x(1, 4);
  x << 1.0, -0.5, 0.3, 0.8;

  SwiGLU<double>::Cache cache;
  const Matrix<double> y = ffn.forward(x, &cache);
  const auto g = cache.work.leftCols(3), u = cache.work.middleCols(3, 3), a = cache.work.rightCols(3);

  // Erratum (docs/math.md#errata): an older text prints x·W_gate = [0.69, −0.36, 0.31],
  // SiLU = [0.474, −0.163, 0.186], x·W_up = [0.01, 0.39, −0.23] and the
  // product [0.005, −0.064, −0.043]. Only 0.69 is right; e.g. the second gate
  // entry is 1·(−0.3) − 0.5·0.4 + 0.3·0.2 + 0.8·(−0.1) = −0.52, and SiLU(0.69)
  // = 0.4595, not 0.474. The correct values follow.
  const double gate[3] = {0.69, -0.52, 0.26}, act[3] = {0.4595, -0.1939, 0.1468};
  const double up[3] = {0.08, 0.77, -0.21}, prod[3] = {0.0368, -0.1493, -0.0308};
  for (int j = 0; j < 3; ++j) {
    CHECK_THAT(g(0, j), WithinAbs(gate[j], 1e-12));
    CHECK_THAT(silu(g(0, j)), WithinAbs(act[j], 5e-5));
    CHECK_THAT(u(0, j), WithinAbs(up[j], 1e-12));
    CHECK_THAT(a(0, j), WithinAbs(prod[j], 5e-5));
  }
  CHECK_FALSE(std::abs(g(0, 1) - (-0.36)) < 0.01);  // the printed value is wrong
  // Step 5: project back with W_down.
  const Matrix<double> want = a * w_down.transpose();
  for (int j = 0; j < 4; ++j) CHECK_THAT(y(0, j), WithinAbs(want(0, j), 1e-14));
}

namespace {

// Shapes checked: N = 0 and 1, a handful of rows (the streaming matrix–vector
// path) and more rows than detail::kSmallRows (the general product).
struct Shape {
  Index n, d, f;
};
const Shape kShapes[] = {{0, 4, 3}, {1, 4, 3}, {3, 5, 7}, {13, 6, 10}};

}  // namespace

TEST_CASE("SwiGLU gradients match central differences", "[swiglu][gradcheck]") {
  for (const Shape s : kShapes) {
    INFO("N = " << s.n << ", d = " << s.d << ", f = " << s.f);
    SwiGLU<double> ffn(s.d, s.f, 11);
    Matrix<double> x = random_matrix(s.n, s.d, 12, 1.5);
    const Matrix<double> r = random_matrix(s.n, s.d, 13);
    auto loss = [&] { return dot_all(ffn.forward(x), r); };

    SwiGLU<double>::Cache cache;
    ffn.forward(x, &cache);
    const Matrix<double> dx = ffn.backward(r, cache);
    REQUIRE(dx.rows() == s.n);
    REQUIRE(dx.cols() == s.d);
    APEX_CHECK_GRADS(check_params(ffn.params(), loss), 1e-6);
    APEX_CHECK_GRADS(std::vector{check_values("x", x.data(), dx.data(), x.size(), loss)}, 1e-6);
    if (s.n > 0) {
      for (const auto& p : ffn.params()) CHECK(p.grad().norm() > 0);
    }
  }
}

TEST_CASE("RMSNorm gradients match central differences", "[rmsnorm][gradcheck]") {
  for (const Shape s : kShapes) {
    INFO("N = " << s.n << ", d = " << s.d);
    RMSNorm<double> norm(s.d);
    norm.gain() = random_matrix(1, s.d, 21) + RowVector<double>::Ones(s.d);
    Matrix<double> x = random_matrix(s.n, s.d, 22, 2.0);
    const Matrix<double> r = random_matrix(s.n, s.d, 23);
    auto loss = [&] { return dot_all(norm.forward(x), r); };

    RMSNorm<double>::Cache cache;
    norm.forward(x, &cache);
    const Matrix<double> dx = norm.backward(r, cache);
    APEX_CHECK_GRADS(check_params(norm.params(), loss), 1e-6);
    APEX_CHECK_GRADS(std::vector{check_values("x", x.data(), dx.data(), x.size(), loss)}, 1e-6);
  }
}

TEMPLATE_TEST_CASE("RMSNorm of rows whose mean square overflows equals the scaled-down row",
                   "[rmsnorm][regression]", float, double) {
  // RMSNorm is scale-invariant up to ε: y(c·x) = y(x), ∂L/∂x at c·x = (∂L/∂x at x)/c.
  // Before the scaled fallback, a finite row with mean(x²) beyond the type's
  // range (float: |x| ≳ 1.8e19) normalised to 0 and had a 0 gradient.
  using T = TestType;
  const T c = std::is_same<T, float>::value ? T(1e20) : T(1e200);
  const Index d = 37;
  const Matrix<T> x = random_matrix(3, d, 17).cast<T>();
  Matrix<T> big = x;
  big.row(1) *= c;  // only row 1 overflows; rows 0 and 2 take the plain path
  RMSNorm<T> norm(d);
  norm.gain() = random_matrix(1, d, 18).cast<T>();
  typename RMSNorm<T>::Cache cx, cb;
  const Matrix<T> y = norm.forward(x, &cx);
  const Matrix<T> y_big = norm.forward(big, &cb);
  REQUIRE(y_big.allFinite());
  CHECK(y_big.row(0) == y.row(0));
  CHECK(y_big.row(2) == y.row(2));
  // ε/mean(x²) ≈ 1e-6 relative at this scale of x: the rows differ by about that.
  CHECK((y_big.row(1) - y.row(1)).norm() <= T(1e-5) * y.row(1).norm());
  const Matrix<T> dy = random_matrix(3, d, 19).cast<T>();
  const Matrix<T> dx = norm.backward(dy, cx);
  const Matrix<T> dx_big = norm.backward(dy, cb);
  REQUIRE(dx_big.allFinite());
  CHECK((dx_big.row(1) * c - dx.row(1)).norm() <= T(1e-4) * dx.row(1).norm());
  // An infinite entry still propagates: the row is NaN, as in every layer.
  big(2, 3) = std::numeric_limits<T>::infinity();
  CHECK(norm.forward(big).row(2).hasNaN());
}

TEST_CASE("gradients accumulate with += and zero_grad clears them", "[swiglu][rmsnorm]") {
  SwiGLU<double> ffn(5, 7, 1);
  const Matrix<double> x = random_matrix(4, 5, 2), r = random_matrix(4, 5, 3);
  SwiGLU<double>::Cache cache;
  ffn.forward(x, &cache);
  ffn.backward(r, cache);
  const Matrix<double> once = ffn.params()[0].grad();
  ffn.backward(r, cache);
  CHECK((ffn.params()[0].grad() - 2 * once).norm() <= 1e-12 * once.norm());
  ffn.zero_grad();
  for (const auto& p : ffn.params()) CHECK(p.grad().isZero());

  RMSNorm<double> norm(5);
  RMSNorm<double>::Cache nc;
  norm.forward(x, &nc);
  norm.backward(r, nc);
  const RowVector<double> g1 = norm.gain_grad();
  norm.backward(r, nc);
  CHECK((norm.gain_grad() - 2 * g1).norm() <= 1e-12 * g1.norm());
}

TEST_CASE("SwiGLU and RMSNorm in float agree with double", "[swiglu][rmsnorm]") {
  SwiGLU<double> fd(32, 48, 9);
  SwiGLU<float> ff(32, 48, 9);
  RMSNorm<double> nd(32);
  RMSNorm<float> nf(32);
  for (Index n : {1, 5, 40}) {
    const Matrix<double> x = random_matrix(n, 32, 10 + n);
    const Matrix<double> r = random_matrix(n, 32, 20 + n);
    SwiGLU<double>::Cache cd;
    SwiGLU<float>::Cache cf;
    const Matrix<double> yd = fd.forward(nd.forward(x), &cd);
    const Matrix<float> yf = ff.forward(nf.forward(x.cast<float>()), &cf);
    CHECK((yf.cast<double>() - yd).norm() <= 1e-5 * yd.norm());
    const Matrix<double> dxd = fd.backward(r, cd);
    const Matrix<float> dxf = ff.backward(r.cast<float>(), cf);
    CHECK((dxf.cast<double>() - dxd).norm() <= 1e-5 * dxd.norm());
  }
  for (int k = 0; k < 3; ++k) {
    const Matrix<double> gd = fd.params()[k].grad();
    const Matrix<double> gf = ff.params()[k].grad().cast<double>();
    CHECK((gf - gd).norm() <= 1e-5 * gd.norm());
  }
}

TEST_CASE("bad shapes and configurations raise typed exceptions", "[swiglu][rmsnorm][errors]") {
  SwiGLU<double> ffn(4, 6, 0);
  CHECK_THROWS_AS(ffn.forward(Matrix<double>::Zero(2, 5)), ShapeError);
  CHECK_THROWS_WITH(ffn.forward(Matrix<double>::Zero(2, 5)),
                    "SwiGLU::forward: argument 'x' has shape [2 x 5], expected [* x 4]");
  SwiGLU<double>::Cache cache;
  ffn.forward(Matrix<double>::Zero(3, 4), &cache);
  CHECK_THROWS_AS(ffn.backward(Matrix<double>::Zero(2, 4), cache), ShapeError);
  CHECK_THROWS_AS(SwiGLU<double>(0, 6), ConfigError);
  CHECK_THROWS_AS(SwiGLU<double>(4, 0), ConfigError);
  CHECK_THROWS_AS(SwiGLU<double>(4, -3), ConfigError);

  RMSNorm<double> norm(4);
  CHECK_THROWS_AS(norm.forward(Matrix<double>::Zero(1, 3)), ShapeError);
  RMSNorm<double>::Cache nc;
  norm.forward(Matrix<double>::Ones(2, 4), &nc);
  CHECK_THROWS_AS(norm.backward(Matrix<double>::Zero(2, 3), nc), ShapeError);
  CHECK_THROWS_AS(RMSNorm<double>(0), ConfigError);
  CHECK_THROWS_AS(RMSNorm<double>(4, -1.0), ConfigError);
}

TEST_CASE("default FFN width is 8d/3 rounded up to a multiple of 32", "[swiglu]") {
  CHECK(default_ffn_width(512) == 1376);  // the `small` preset
  CHECK(default_ffn_width(96) == 256);
  CHECK(default_ffn_width(1) == 32);
}

// ---- error handling (sweeps) ----
using namespace apex::test;  // the sweep machinery of support/sweep.hpp

TEMPLATE_TEST_CASE("RMSNorm sweep: widths and eps and gradient shapes", "[sweeps][rmsnorm]", float, double) {
  using T = TestType;
  const Index d = 6, n = 5;
  RMSNorm<T> norm(d);
  typename RMSNorm<T>::Cache cache, other;
  norm.forward(rnd<T>(n, d, 1), &cache);
  norm.forward(rnd<T>(n + 2, d, 2), &other);
  std::vector<Case> cases;
  for (Index w : {Index(0), Index(-1)})
    cases.push_back({"RMSNorm(" + std::to_string(w) + ")", [=] { (void)RMSNorm<T>(w); }, "ConfigError",
                     {"RMSNorm", "d_model", std::to_string(w)}});
  for (double eps : {-1e-6, 0.0, kNaN, kInf})
    cases.push_back({"RMSNorm eps " + std::to_string(eps), [=] { (void)RMSNorm<T>(d, T(eps)); }, "ConfigError",
                     {"RMSNorm", "eps"}});
  add_width_cases<T>(cases, "RMSNorm::forward", "x", n, d, [&](const Matrix<T>& x) { norm.forward(x); });
  add_grad_cases<T>(cases, "RMSNorm::backward", "dy", n, d, [&](const Matrix<T>& dy) { norm.backward(dy, cache); });
  cases.push_back({"RMSNorm::backward with the cache of a 7-row batch",
                   [&] { norm.backward(Matrix<T>::Ones(n, d), other); }, "ShapeError", {"RMSNorm::backward", "'dy'"}});
  run_sweep(cases);
}

TEMPLATE_TEST_CASE("SwiGLU sweep: widths and gradient shapes", "[sweeps][swiglu]", float, double) {
  using T = TestType;
  const Index d = 6, f = 10, n = 5;
  SwiGLU<T> ffn(d, f, 1);
  typename SwiGLU<T>::Cache cache, other;
  ffn.forward(rnd<T>(n, d, 1), &cache);
  ffn.forward(rnd<T>(n + 2, d, 2), &other);
  std::vector<Case> cases;
  const std::pair<Index, Index> bad_sizes[] = {{0, 6}, {-1, 6}, {4, 0}, {4, -3}};
  for (const auto& [dm, df] : bad_sizes)
    cases.push_back({"SwiGLU(" + std::to_string(dm) + ", " + std::to_string(df) + ")", [=] { (void)SwiGLU<T>(dm, df); },
                     "ConfigError", {"SwiGLU", dm <= 0 ? "d_model" : "d_ffn"}});
  add_width_cases<T>(cases, "SwiGLU::forward", "x", n, d, [&](const Matrix<T>& x) { ffn.forward(x); });
  add_grad_cases<T>(cases, "SwiGLU::backward", "dy", n, d, [&](const Matrix<T>& dy) { ffn.backward(dy, cache); });
  cases.push_back({"SwiGLU::backward with the cache of a 7-row batch", [&] { ffn.backward(Matrix<T>::Ones(n, d), other); },
                   "ShapeError", {"SwiGLU::backward", "'dy'"}});
  run_sweep(cases);
}

TEMPLATE_TEST_CASE("dense layers propagate NaN and Inf to their own rows only", "[sweeps][nan]", float, double) {
  using T = TestType;
  const Index d = 6, f = 10;
  const RMSNorm<T> norm(d);
  const SwiGLU<T> ffn(d, f, 3);
  KappaSwiGLU<T> kappa(d, f, 4);
  kappa.kappa_alpha() = rnd<T>(1, f, 5);
  kappa.kappa_bias() = rnd<T>(1, f, 6);
  const FFNSublayer<T, SwiGLU<T>> sublayer(d, SwiGLU<T>(d, f, 7));
  const MultiTokenHeads<T> heads(d, 9, MultiTokenOptions{}, 8);
  // 5 rows take the matrix–vector path of linear_nt, 12 the matrix product.
  for (Index n : {Index(5), Index(12)}) {
    check_nan_stays_in_its_row<T>(n, d, [&](const Matrix<T>& x) { return norm.forward(x); });
    check_nan_stays_in_its_row<T>(n, d, [&](const Matrix<T>& x) { return ffn.forward(x); });
    const Vector<T> logit = rnd<T>(n, 1, 9);
    check_nan_stays_in_its_row<T>(n, d, [&](const Matrix<T>& x) { return kappa.forward(x, logit); });
    check_nan_stays_in_its_row<T>(n, d, [&](const Matrix<T>& x) { return sublayer.forward(x); });
    check_nan_stays_in_its_row<T>(n, d, [&](const Matrix<T>& x) { return heads.forward(x); });
  }
}

TEST_CASE("the block interface of SwiGLU and kappa-SwiGLU computes what forward does", "[sweeps][block]") {
  // Block calls are unchecked by contract (MoEFFN sizes every buffer); with
  // correct buffers they must agree with the checked entry points bitwise.
  const Index d = 6, f = 10, n = 7;
  SwiGLU<double> ffn(d, f, 1);
  KappaSwiGLU<double> kappa(d, f, 2);
  kappa.kappa_alpha() = random_matrix(1, f, 3);
  kappa.kappa_bias() = random_matrix(1, f, 4);
  const Matrix<double> x = random_matrix(n, d, 5), dy = random_matrix(n, d, 6);
  const Vector<double> logit = random_matrix(n, 1, 7);

  SwiGLU<double>::Cache c;
  const Matrix<double> y = ffn.forward(x, &c);
  Matrix<double> work(n, ffn.work_cols()), yb(n, d), dxb(n, d);
  ffn.forward_block(x, work, yb);
  CHECK(yb == y);
  CHECK(work == c.work);
  const Matrix<double> dx = ffn.backward(dy, c);
  ffn.backward_block(x, work, dy, dxb);
  CHECK(dxb == dx);

  KappaSwiGLU<double>::Cache kc;
  const Matrix<double> ky = kappa.forward(x, logit, &kc);
  Matrix<double> kwork(n, kappa.work_cols()), kyb(n, d), kdxb(n, d);
  Vector<double> kdl(n);
  kappa.forward_block(x, logit, kwork, kyb);
  CHECK(kyb == ky);
  const auto kg = kappa.backward(dy, kc);
  kappa.backward_block(x, logit, kwork, dy, kdxb, kdl);
  CHECK(kdxb == kg.dx);
  CHECK(kdl == kg.dlogit);
}

TEMPLATE_TEST_CASE("RMSNorm never turns a finite input into NaN", "[sweeps][regression][rmsnorm]", float, double) {
  // layers/rms_norm.hpp: eps = 0 was accepted ("eps must be finite and >= 0"); an
  // all-zero row then gave r = 1/sqrt(0) = inf and x̂ = 0·inf = NaN, so a
  // valid configuration turned a finite input into NaN. Fixed: eps must be
  // > 0 (ConfigError), and any positive eps, even the smallest subnormal,
  // keeps a zero row finite in forward and backward.
  using T = TestType;
  expect(outcome([] { (void)RMSNorm<T>(4, T(0)); }), "ConfigError", {"RMSNorm", "eps"});
  expect(outcome([] { (void)RMSNorm<T>(4, -T(0)); }), "ConfigError", {"RMSNorm", "eps"});
  for (T eps : {std::numeric_limits<T>::denorm_min(), std::numeric_limits<T>::min(), T(1e-6)}) {
    INFO("eps " << eps);
    RMSNorm<T> norm(4, eps);
    typename RMSNorm<T>::Cache cache;
    Matrix<T> x = Matrix<T>::Zero(3, 4);
    x.row(1).setOnes();
    const Matrix<T> y = norm.forward(x, &cache);
    CHECK(y.allFinite());
    CHECK(y.row(0).isZero(0));
    CHECK(norm.backward(Matrix<T>::Ones(3, 4), cache).allFinite());
  }
}
