// Dense path: RMSNorm and SwiGLU — worked examples, gradients by finite
// differences, float/double agreement, shape errors.
#include <apex/ffn.hpp>

#include <catch2/catch.hpp>

#include "gradcheck.hpp"

using namespace apex;
using apex::test::check_params;
using apex::test::check_values;
using apex::test::dot_all;
using apex::test::random_matrix;
using Catch::Matchers::WithinAbs;

TEST_CASE("RMSNorm worked example of the SPEC", "[rmsnorm][reference]") {
  RMSNorm<double> norm(4);
  Matrix<double> x(1, 4);
  x << 2, -1, 0.5, 1.5;
  const Matrix<double> y = norm.forward(x);
  const double want[4] = {1.4606, -0.7303, 0.3651, 1.0954};
  for (int j = 0; j < 4; ++j) CHECK_THAT(y(0, j), WithinAbs(want[j], 5e-5));
}

TEST_CASE("SwiGLU example of reference 12.5 at its correct values", "[swiglu][reference]") {
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

  // Erratum (SPEC): the document prints x·W_gate = [0.69, −0.36, 0.31],
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
