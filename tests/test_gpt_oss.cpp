// gpt-oss's MoE block on the training layers: the clamped SwiGLU expert with
// biases against its formula, its hand-written backward and the router's
// logit bias against central differences in double (points on both sides
// of the clamps, none at a kink), the block inside MoEFFN and the FFN
// sublayer with the skip gate, the preset, and the options' errors.
#include <apex/ffn/layers/clamped_swiglu.hpp>
#include <apex/ffn/layers/ffn_sublayer.hpp>
#include <apex/ffn/layers/skip_gate.hpp>
#include <apex/ffn/io/name_maps.hpp>
#include <apex/ffn/moe/gpt_oss.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <string>

#include "fixtures.hpp"
#include "gradcheck.hpp"
#include "sublayers.hpp"

using namespace apex;
using apex::test::check_params;
using apex::test::check_values;
using apex::test::dot_all;
using apex::test::random_matrix;
using apex::test::topk_margin;

namespace {

/// The block's formula, one element at a time, in double.
Matrix<double> clamped_reference(const ClampedSwiGLU<double>& e, const Matrix<double>& x) {
  const double alpha = e.options().alpha, lim = e.options().limit;
  const Index f = e.d_ffn();
  Matrix<double> a(x.rows(), f);  // n × f
  for (Index t = 0; t < x.rows(); ++t)
    for (Index j = 0; j < f; ++j) {
      const double g = x.row(t).dot(e.swiglu().w_gate().row(j)) + e.b_gate()(j);
      const double u = x.row(t).dot(e.swiglu().w_up().row(j)) + e.b_up()(j);
      const double gc = std::min(g, lim), uc = std::max(-lim, std::min(u, lim));
      a(t, j) = (uc + 1) * gc / (1 + std::exp(-alpha * gc));
    }
  Matrix<double> y = a * e.swiglu().w_down().transpose();
  y.rowwise() += e.b_down();
  return y;
}

/// Pre-activations G̃, Ũ (n × f each) of expert e on x.
std::pair<Matrix<double>, Matrix<double>> clamped_preacts(const ClampedSwiGLU<double>& e, const Matrix<double>& x) {
  Matrix<double> g = x * e.swiglu().w_gate().transpose(), u = x * e.swiglu().w_up().transpose();
  g.rowwise() += e.b_gate();
  u.rowwise() += e.b_up();
  return {g, u};
}

/// Smallest distance of any G̃ from +L and of any Ũ from ±L: a step much
/// smaller than it never crosses a kink.
double clamp_margin(const ClampedSwiGLU<double>& e, const Matrix<double>& x) {
  const auto [g, u] = clamped_preacts(e, x);
  const double lim = e.options().limit;
  return std::min({(g.array() - lim).abs().minCoeff(), (u.array() - lim).abs().minCoeff(),
                   (u.array() + lim).abs().minCoeff()});
}

/// An expert whose pre-activations straddle the clamps: weights × 3 and
/// biases drawn around ±L, so some G̃ > L, some Ũ > L and some Ũ < −L.
ClampedSwiGLU<double> straddling_expert(Index d, Index f, std::uint64_t seed) {
  ClampedSwiGLU<double> e(d, f, seed);
  e.swiglu().w_gate() *= 3.0;
  e.swiglu().w_up() *= 3.0;
  e.b_gate() = random_matrix(1, f, seed + 1, 4.0).array() + 5.0;  // around L − 2 … L + 9
  for (Index j = 0; j < f; ++j) e.b_up()(j) = (j % 2 ? 7.0 : -7.0) + 3.0 * std::sin(double(j + seed));
  e.b_down() = random_matrix(1, d, seed + 2, 0.5);
  return e;
}

}  // namespace

TEST_CASE("clamped SwiGLU forward equals its formula on both sides of the clamps", "[gpt_oss][clamped]") {
  const Index d = 7, f = 9;
  const ClampedSwiGLU<double> e = straddling_expert(d, f, 11);
  const Matrix<double> x = random_matrix(13, d, 12, 1.0);
  const auto [g, u] = clamped_preacts(e, x);
  CHECK((g.array() > 7.0).count() > 0);   // the gate clamp acts
  CHECK((g.array() < 7.0).count() > 0);
  CHECK((u.array() > 7.0).count() > 0);   // both up clamps act
  CHECK((u.array() < -7.0).count() > 0);
  CHECK(((u.array() > -7.0) && (u.array() < 7.0)).count() > 0);
  CHECK((e.forward(x) - clamped_reference(e, x)).norm() <= 1e-12 * clamped_reference(e, x).norm());

  // Float computes the same function within float rounding.
  ClampedSwiGLU<float> ef(d, f, 11);
  ef.swiglu().w_gate() = e.swiglu().w_gate().cast<float>();
  ef.swiglu().w_up() = e.swiglu().w_up().cast<float>();
  ef.swiglu().w_down() = e.swiglu().w_down().cast<float>();
  ef.b_gate() = e.b_gate().cast<float>(), ef.b_up() = e.b_up().cast<float>(), ef.b_down() = e.b_down().cast<float>();
  const Matrix<double> yf = ef.forward(x.cast<float>()).cast<double>();
  CHECK((yf - e.forward(x)).norm() <= 1e-5 * e.forward(x).norm());
}

TEST_CASE("clamped SwiGLU gradients match central differences near the clamp limits", "[gpt_oss][clamped][gradcheck]") {
  const Index d = 6, f = 8;
  for (std::uint64_t seed : {21u, 31u}) {
    INFO("seed " << seed);
    ClampedSwiGLU<double> e = straddling_expert(d, f, seed);
    Matrix<double> x;
    for (std::uint64_t s = seed + 100;; ++s) {  // no pre-activation within 1e-3 of a kink
      x = random_matrix(9, d, s, 1.0);
      if (clamp_margin(e, x) > 1e-3) break;
    }
    const auto [g, u] = clamped_preacts(e, x);
    const auto near = [](const Matrix<double>& m, double at) { return ((m.array() - at).abs() < 1.0).count(); };
    CHECK(near(g, 7.0) > 0);  // points within 1 of each limit, on either side of it
    CHECK(near(u, 7.0) + near(u, -7.0) > 0);
    const Matrix<double> r = random_matrix(9, d, seed + 3);
    auto loss = [&] { return dot_all(e.forward(x), r); };
    ClampedSwiGLU<double>::Cache cache;
    e.zero_grad();
    e.forward(x, &cache);
    const Matrix<double> dx = e.backward(r, cache);
    APEX_CHECK_GRADS(check_params(e.params(), loss), 1e-7);
    APEX_CHECK_GRADS(std::vector{check_values("x", x.data(), dx.data(), x.size(), loss)}, 1e-7);
    // A clamped unit passes no gradient to its bias: columns with every G̃ > L.
    for (Index j = 0; j < f; ++j)
      if ((g.col(j).array() > 7.0).all()) CHECK(e.b_gate_grad()(j) == 0.0);
  }
}

TEST_CASE("clamped SwiGLU parameters, accumulation and options", "[gpt_oss][clamped]") {
  ClampedSwiGLU<double> e(4, 3, 5);
  const auto ps = e.params();
  REQUIRE(ps.size() == 6);
  CHECK(ps[0].name == "w_gate.weight");
  CHECK(ps[3].name == "w_gate.bias");
  CHECK(ps[4].name == "w_up.bias");
  CHECK(ps[5].name == "w_down.bias");
  CHECK(ps[3].rows == 1);
  CHECK(ps[3].cols == 3);
  CHECK(ps[5].cols == 4);
  CHECK(e.b_gate().isZero(0));  // biases start at 0
  const Matrix<double> x = random_matrix(3, 4, 6), r = random_matrix(3, 4, 7);
  ClampedSwiGLU<double>::Cache c;
  e.forward(x, &c);
  e.backward(r, c);
  const RowVector<double> once = e.b_down_grad();
  e.backward(r, c);
  CHECK((e.b_down_grad() - 2 * once).norm() <= 1e-15);  // gradients accumulate
  CHECK((once - r.colwise().sum()).norm() <= 1e-15);     // ∂L/∂b_down = Σ_rows dy
  e.zero_grad();
  CHECK(e.b_down_grad().isZero(0));

  CHECK_THROWS_WITH(ClampedSwiGLU<double>(4, 3, 0, ClampedSwiGLUOptions{0.0, 7.0}),
                    Catch::Contains("ClampedSwiGLU") && Catch::Contains("alpha must be finite and > 0"));
  CHECK_THROWS_AS(ClampedSwiGLU<double>(4, 3, 0, ClampedSwiGLUOptions{1.7, std::nan("")}), ConfigError);
  CHECK_THROWS_WITH(ClampedSwiGLU<float>(4, 3, 0, ClampedSwiGLUOptions{1.7, 1e39}),
                    Catch::Contains("limit must lie within the range"));
  const ClampedSwiGLUOptions before = e.options();
  CHECK_THROWS_AS(e.set_options({-1.0, 7.0}), ConfigError);
  CHECK(e.options().alpha == before.alpha);  // a rejected change leaves the options
  CHECK_THROWS_AS(e.forward(Matrix<double>(2, 5)), ShapeError);
}

TEST_CASE("gpt-oss presets have the published shapes", "[gpt_oss][families]") {
  const MoEConfig c20 = gpt_oss_20b_moe(), c120 = gpt_oss_120b_moe();
  CHECK(c20.d_model == 2880);
  CHECK(c20.d_ffn == 2880);
  CHECK(c20.n_experts == 32);
  CHECK(c20.n_active == 4);
  CHECK(c20.n_shared == 0);
  CHECK(c20.router_bias);
  CHECK(c20.routing.is_default());  // top-K of the logits, softmax over the K
  CHECK(c120.n_experts == 128);
  CHECK_NOTHROW(c120.validate());
}

TEST_CASE("the router's logit bias enters the logits and gets its gradient", "[gpt_oss][router][gradcheck]") {
  const MoEConfig plain = test::moe_config(5, 2, 0, 6, 4);
  CHECK(MoEFFN<double>(plain, 1).params()[0].name == "router.weight");
  CHECK(MoEFFN<double>(plain, 1).params()[1].name != "router.bias");
  CHECK(MoEFFN<double>(plain, 1).router().logit_bias().size() == 0);

  const MoEConfig cfg = gpt_oss_moe(6, 4, 5, 2);
  GptOssMoE<double> moe(cfg, 41);
  // The bias draws nothing: the weights equal a bias-free layer's of the same seed.
  CHECK(moe.router().weight() == MoEFFN<double, ClampedSwiGLU<double>>(plain, 41).router().weight());
  moe.router().logit_bias() = random_matrix(1, 5, 42, 0.5);
  for (auto& e : moe.experts()) {
    e.b_gate() = random_matrix(1, 4, 43, 3.0);
    e.b_up() = random_matrix(1, 4, 44, 3.0);
    e.b_down() = random_matrix(1, 6, 45, 0.5);
  }
  const auto ps = moe.params();
  REQUIRE(ps[1].name == "router.bias");
  CHECK(ps[2].name == "experts.0.w_gate.weight");
  CHECK(ps[5].name == "experts.0.w_gate.bias");

  Matrix<double> x;
  for (std::uint64_t s = 50;; ++s) {
    x = random_matrix(7, 6, s, 1.5);
    bool clear = topk_margin(moe, x) > 1e-2;
    for (const auto& e : moe.experts()) clear = clear && clamp_margin(e, x) > 1e-3;
    if (clear) break;
  }
  Routing<double> routing;
  moe.router().route(x, moe.balancer().bias(), false, routing);
  Matrix<double> logits = x * moe.router().weight().transpose();
  logits.rowwise() += moe.router().logit_bias();
  CHECK((routing.logits - logits).norm() <= 1e-14);

  const Matrix<double> r = random_matrix(7, 6, 51);
  auto loss = [&] { return dot_all(moe.forward(x), r); };
  GptOssMoE<double>::Cache cache;
  moe.zero_grad();
  moe.forward(x, &cache);
  const Matrix<double> dx = moe.backward(r, cache);
  APEX_CHECK_GRADS(check_params(moe.params(), loss), 1e-6);
  APEX_CHECK_GRADS(std::vector{check_values("x", x.data(), dx.data(), x.size(), loss)}, 1e-6);
  CHECK(moe.router().logit_bias_grad().norm() > 0);
  // Softmax over the selected: shifting every logit by one constant changes nothing, so Σ_e ∂L/∂b_r = 0.
  CHECK(std::abs(moe.router().logit_bias_grad().sum()) <= 1e-12);
}

TEST_CASE("gpt-oss experts in the FFN sublayer with the skip gate: gradients", "[gpt_oss][sublayer][gradcheck]") {
  const MoEConfig cfg = gpt_oss_moe(6, 5, 4, 2);
  FFNSublayer<double, GptOssMoE<double>> layer(cfg.d_model, GptOssMoE<double>(cfg, 61),
                                                SkipGate<double>(test::gate_config(cfg.d_model, 4), 62));
  layer.ffn().set_threads(1);
  layer.ffn().router().logit_bias() = random_matrix(1, cfg.n_experts, 63, 0.5);
  for (auto& e : layer.ffn().experts()) {
    e.b_gate() = random_matrix(1, cfg.d_ffn, 64, 2.0);
    e.b_up() = random_matrix(1, cfg.d_ffn, 65, 2.0);
    e.b_down() = random_matrix(1, cfg.d_model, 66, 0.5);
  }
  layer.skip_gate()->w2() *= 4.0;
  Matrix<double> x;
  for (std::uint64_t s = 300;; ++s) {
    x = random_matrix(9, cfg.d_model, s, 1.5);
    if (topk_margin(layer.ffn(), layer.norm().forward(x)) <= 1e-2) continue;
    if (test::set_skip_share(*layer.skip_gate(), x, 0.4) > 1e-3) break;
  }
  test::check_sublayer_gradients(layer, x, random_matrix(9, cfg.d_model, 67));
  bool bias_named = false;
  for (const auto& p : layer.params()) bias_named = bias_named || p.name == "ffn.router.bias";
  CHECK(bias_named);
}

TEST_CASE("the other families' name maps refuse a router bias", "[gpt_oss][families]") {
  MoEConfig c = test::moe_config(8, 2, 0, 6, 4);
  c.router_bias = true;
  MoEFFN<double> moe(c, 3);
  CHECK_THROWS_WITH(family_params(moe, MoEFamily::Qwen3MoE), Catch::Contains("the qwen3_moe router has no bias"));
  CHECK_THROWS_AS(family_param_values(moe, MoEFamily::Mixtral), ConfigError);
}
