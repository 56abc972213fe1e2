// Fused cross-entropy (layers/cross_entropy.hpp): values against a plain
// log-softmax, gradients by finite differences, the gradient written over the
// logits, stability for logits of magnitude 1e4, the ignore index as PyTorch
// applies it, and the error sweep of cross_entropy and softmax_rows.
#include <apex/ffn/layers/cross_entropy.hpp>
#include <apex/ffn/layers/multi_token_heads.hpp>
#include <apex/ffn/layers/speculative.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <vector>

#include "gradcheck.hpp"
#include "mtp_reference.hpp"
#include "sweep.hpp"

using namespace apex;
using apex::test::check_values;
using apex::test::random_matrix;
using Catch::Matchers::WithinAbs;
using Catch::Matchers::WithinRel;
using apex::test::ids;
using apex::test::random_labels;
using apex::test::plain_ce;
using apex::test::plain_correct;

TEST_CASE("cross_entropy matches a plain log-softmax computation", "[mtp][cross_entropy]") {
  const Matrix<double> z = random_matrix(7, 9, 1, 3.0);
  TokenIds y = random_labels(7, 9, 2);
  y(3) = kIgnoreIndex;
  Matrix<double> dz;
  const CrossEntropyStats s = cross_entropy(z, y, &dz, {kIgnoreIndex, 2.5});

  double sum = 0;
  Index right = 0;
  Matrix<double> want = Matrix<double>::Zero(7, 9);
  for (Index t = 0; t < 7; ++t) {
    if (t == 3) continue;
    sum += plain_ce(z, t, y(t));
    right += plain_correct(z, t, y(t)) ? 1 : 0;
    // ∂CE/∂z = softmax − onehot, scaled by grad_scale / count.
    const double norm = z.row(t).array().exp().sum();
    want.row(t) = z.row(t).array().exp() / norm;
    want(t, y(t)) -= 1;
  }
  want *= 2.5 / 6;
  CHECK(s.count == 6);
  CHECK(s.correct == right);
  CHECK_THAT(s.loss, WithinRel(sum / 6, 1e-13));
  CHECK_THAT(s.accuracy(), WithinAbs(double(right) / 6, 1e-15));
  CHECK((dz - want).norm() <= 1e-14);
  CHECK(dz.row(3).isZero());
}

TEST_CASE("cross_entropy gradient matches central differences", "[mtp][cross_entropy][gradcheck]") {
  Matrix<double> z = random_matrix(5, 6, 3, 2.0);
  TokenIds y = random_labels(5, 6, 4);
  y(1) = kIgnoreIndex;
  Matrix<double> dz;
  cross_entropy(z, y, &dz, {kIgnoreIndex, 0.7});
  auto loss = [&] { return 0.7 * cross_entropy(z, y).loss; };
  APEX_CHECK_GRADS(std::vector{check_values("logits", z.data(), dz.data(), z.size(), loss)}, 1e-6);
}

TEST_CASE("cross_entropy may write its gradient over the logits", "[mtp][cross_entropy]") {
  Matrix<double> z = random_matrix(6, 11, 5, 4.0);
  const TokenIds y = random_labels(6, 11, 6);
  Matrix<double> dz;
  const CrossEntropyStats a = cross_entropy(z, y, &dz);
  const CrossEntropyStats b = cross_entropy(z, y, &z);  // in place
  CHECK(a.loss == b.loss);
  CHECK(a.correct == b.correct);
  CHECK(z == dz);
}

TEMPLATE_TEST_CASE("fused cross-entropy is finite for logits of magnitude 1e4", "[mtp][cross_entropy][stability]",
                   float, double) {
  using T = TestType;
  // A naive softmax overflows on these logits: exp(1e4) is inf in float and double.
  REQUIRE(std::isinf(std::exp(T(1e4))));
  Matrix<T> z(3, 4);
  z << T(1e4), T(-1e4), T(9999.5), T(0),  //
      T(-1e4), T(-1e4), T(-1e4), T(-1e4),  //
      T(-5e3), T(1e4), T(3e3), T(-9999);
  const TokenIds y = ids({1, 2, 1});
  Matrix<T> dz;
  const CrossEntropyStats s = cross_entropy(z, y, &dz);
  // Exact: row 0: 2e4 + log(1 + e^{−0.5}); row 1: log 4; row 2: 0 (to 1e-3043).
  const double row0 = 2e4 + std::log1p(std::exp(-0.5)), row1 = std::log(4.0);
  CHECK(std::isfinite(s.loss));
  CHECK_THAT(s.loss, WithinRel((row0 + row1) / 3, 1e-6));
  REQUIRE(dz.allFinite());
  // Each gradient row sums to 0 (softmax sums to 1), entries bounded by 1/count.
  for (Index t = 0; t < 3; ++t) CHECK(std::abs(double(dz.row(t).sum())) <= 1e-6);
  CHECK(dz.cwiseAbs().maxCoeff() <= T(1.0 / 3 + 1e-6));
  CHECK_THAT(double(dz(0, 1)), WithinAbs(-1.0 / 3, 1e-6));
  CHECK_THAT(double(dz(1, 0)), WithinAbs(0.25 / 3, 1e-6));

  // The same logits through the multi-token loss (one head).
  MultiTokenOptions opt;
  opt.num_heads = 1;
  Matrix<T> dmain, dheads;
  const TokenIds labels = ids({1, 2, 1, 3});
  const MultiTokenLoss l = multi_token_loss(z, z, labels, opt, &dmain, &dheads);
  CHECK(std::isfinite(l.total));
  CHECK(dmain.allFinite());
  CHECK(dheads.allFinite());
}

// ---- error handling (sweeps) ----
using namespace apex::test;  // the sweep machinery of support/sweep.hpp

TEMPLATE_TEST_CASE("cross_entropy and softmax_rows sweep", "[sweeps][cross_entropy]", float, double) {
  using T = TestType;
  const Index n = 4, v = 5;
  const Matrix<T> logits = rnd<T>(n, v, 1);
  TokenIds targets(n);
  targets << 0, 4, kIgnoreIndex, 2;
  std::vector<Case> cases;
  for (Index len : {n - 1, n + 1, Index(0)})
    cases.push_back({"cross_entropy with " + std::to_string(len) + " targets",
                     [=] { cross_entropy(logits, TokenIds::Zero(len)); }, "ShapeError",
                     {"cross_entropy", "'targets'", shape(len, 1)}});
  for (Index id : {v, Index(-1), kIgnoreIndex - 1, Index(1) << 40})
    cases.push_back({"cross_entropy with target " + std::to_string(id),
                     [=] {
                       TokenIds t = targets;
                       t(1) = id;
                       cross_entropy(logits, t);
                     },
                     "ValueError", {"cross_entropy", "'targets'", std::to_string(id), "position 1"}});
  for (double s : {kNaN, kInf})
    cases.push_back({"cross_entropy with grad_scale " + std::to_string(s),
                     [=] {
                       CrossEntropyOptions o;
                       o.grad_scale = s;
                       Matrix<T> g;
                       cross_entropy(logits, targets, &g, o);
                     },
                     "ConfigError", {"cross_entropy", "grad_scale"}});
  for (double bad : {kNaN, kInf, -kInf})
    for (bool with_grad : {false, true})
      cases.push_back({"cross_entropy with " + std::to_string(bad) + " in a row with a target",
                       [=] {
                         Matrix<T> z = logits;
                         z(3, 1) = T(bad);
                         Matrix<T> g;
                         cross_entropy(z, targets, with_grad ? &g : nullptr);
                       },
                       "ValueError", {"cross_entropy", "logits", "row 3", "NaN or Inf"}});
  cases.push_back({"softmax_rows with NaN", [=] {
                     Matrix<T> z = logits;
                     z(0, 0) = T(kNaN);
                     softmax_rows(z);
                   },
                   "ValueError", {"softmax_rows", "'logits'"}});
  run_sweep(cases);

  // A row without a target is never read: NaN there is harmless.
  Matrix<T> z = logits;
  z(2, 0) = T(kNaN);
  Matrix<T> g;
  const CrossEntropyStats s = cross_entropy(z, targets, &g);
  CHECK(s.count == 3);
  CHECK(std::isfinite(s.loss));
  CHECK(g.allFinite());
  CHECK(g.row(2).isZero(0));
}

TEST_CASE("cross_entropy drops targets equal to an in-vocabulary ignore index as PyTorch does",
          "[sweeps][regression][cross_entropy]") {
  // layers/cross_entropy.hpp: CrossEntropyOptions::ignore_index may be a real token
  // id (PyTorch allows it, e.g. a padding id), while multi_token_loss rejects
  // one (ConfigError). The difference is documented on both option structs
  // and in docs/error_model.md; this test pins what cross_entropy does with
  // it: targets equal to the ignore index contribute neither loss nor
  // gradient, the mean divides by the number of other targets, and the id
  // stays a class of the softmax of the other rows.
  const Index v = 5;
  const Matrix<double> z = random_matrix(4, v, 21);
  CrossEntropyOptions o;
  o.ignore_index = 3;
  o.grad_scale = 0.5;
  TokenIds t(4);
  t << 3, 1, 3, 0;
  Matrix<double> g;
  const CrossEntropyStats got = cross_entropy(z, t, &g, o);

  // Reference: the same loss over rows 1 and 3 alone, with the default ignore index.
  Matrix<double> z_kept(2, v);
  z_kept << z.row(1), z.row(3);
  TokenIds t_kept(2);
  t_kept << 1, 0;
  CrossEntropyOptions o_ref;
  o_ref.grad_scale = 0.5;
  Matrix<double> g_ref;
  const CrossEntropyStats ref = cross_entropy(z_kept, t_kept, &g_ref, o_ref);
  CHECK(got.count == 2);
  CHECK(got.loss == ref.loss);  // same rows in the same order: bitwise equal
  CHECK(got.correct == ref.correct);
  REQUIRE(g.rows() == 4);
  CHECK(g.row(0).isZero(0));
  CHECK(g.row(2).isZero(0));
  CHECK(g.row(1) == g_ref.row(0));
  CHECK(g.row(3) == g_ref.row(1));
  CHECK(g(1, 3) > 0);  // token 3 is still a class: softmax mass, positive gradient
  // The loss of the kept rows, by hand: mean of lse(z) − z_y over the two rows.
  const auto lse = [&](Index r) { return std::log(z.row(r).array().exp().sum()); };
  CHECK_THAT(got.loss, Catch::Matchers::WithinRel(0.5 * ((lse(1) - z(1, 1)) + (lse(3) - z(3, 0))), 1e-12));

  // Every target ignored: no loss, no gradient, no division by zero.
  const CrossEntropyStats none = cross_entropy(z, TokenIds::Constant(4, 3), &g, o);
  CHECK(none.count == 0);
  CHECK(none.loss == 0);
  CHECK(g.isZero(0));

  // multi_token_loss keeps its stricter contract for the same option.
  MultiTokenOptions mo;
  mo.num_heads = 0;
  mo.ignore_index = 3;
  expect(outcome([&] { multi_token_loss(z, Matrix<double>(4, 0), t, mo); }), "ConfigError",
         {"multi_token_loss", "ignore_index"});
}
