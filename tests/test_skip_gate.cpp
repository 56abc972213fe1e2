// Dynamic skip gate and the FFN sublayer it guards: configuration, mode
// equality, the all-kept and all-skipped limits, the straight-through
// gradient against its surrogate, every other gradient by finite
// differences, the compute penalty, a small training run in which the
// gate learns which tokens need the FFN, and the error sweeps and cache
// regression tests of both.
#include <apex/ffn/layers/ffn_sublayer.hpp>
#include <apex/ffn/layers/kappa_swiglu.hpp>
#include <apex/ffn/moe/moe_ffn.hpp>
#include <apex/ffn/layers/multi_token_heads.hpp>
#include <apex/ffn/layers/skip_gate.hpp>
#include <apex/ffn/layers/swiglu.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "gradcheck.hpp"
#include "sweep.hpp"

using namespace apex;
using apex::test::check_params;
using apex::test::check_values;
using apex::test::dot_all;
using apex::test::gate_config;
using apex::test::moe_config;
using apex::test::random_matrix;
using apex::test::topk_margin;
using Catch::Matchers::WithinAbs;
using Catch::Matchers::WithinRel;

namespace {

template <class T>
using Dense = FFNSublayer<T, SwiGLU<T>>;

template <class T>
Dense<T> make_gated(Index d, Index f, Index h, std::uint64_t seed, double tau = 0.15) {
  return Dense<T>(d, SwiGLU<T>(d, f, seed), SkipGate<T>(gate_config(d, h, tau), seed + 1));
}

template <class T>
Dense<T> make_plain(Index d, Index f, std::uint64_t seed) {
  return Dense<T>(d, SwiGLU<T>(d, f, seed));
}

double logit(double p) { return std::log(p / (1 - p)); }

/// Sets b₂ so that exactly k = round(share·N) tokens of `x` have g < τ (the
/// tokens with the smallest W₂-term), with b₂ halfway between two consecutive
/// logits so every gate sits as far from τ as the data allow. Returns the
/// smallest |s − logit τ| (the logit margin).
template <class T>
double set_skip_share(SkipGate<T>& gate, const Matrix<T>& x, double share) {
  typename SkipGate<T>::Cache c;
  gate.forward(x, &c);
  if (x.rows() == 0) return std::numeric_limits<double>::infinity();
  std::vector<double> s0(std::size_t(x.rows()));
  for (Index t = 0; t < x.rows(); ++t) s0[std::size_t(t)] = double(c.s(t) - gate.b2());
  std::sort(s0.begin(), s0.end());
  const std::size_t k = std::size_t(std::lround(share * double(x.rows())));
  const double lt = logit(double(gate.threshold()));
  double cut;  // the W₂-term value that lands on logit τ
  if (k == 0)
    cut = s0.front() - 2.0;
  else if (k == s0.size())
    cut = s0.back() + 2.0;
  else
    cut = 0.5 * (s0[k - 1] + s0[k]);
  gate.b2() = T(lt - cut);
  double margin = std::numeric_limits<double>::infinity();
  for (double v : s0) margin = std::min(margin, std::abs(v - cut));
  return margin;
}

/// A SwiGLU that counts the rows it is asked to compute, forward and backward.
template <class T>
class CountingFFN {
 public:
  using Scalar = T;
  using Cache = typename SwiGLU<T>::Cache;
  struct Counts {
    Index forward_calls = 0, forward_rows = 0, backward_rows = 0;
  };

  CountingFFN(SwiGLU<T> inner, Counts* counts) : inner_(std::move(inner)), counts_(counts) {}
  Index d_model() const { return inner_.d_model(); }
  Matrix<T> forward(const ConstMatrixRef<T>& x, Cache* cache = nullptr) const {
    ++counts_->forward_calls;
    counts_->forward_rows += x.rows();
    return inner_.forward(x, cache);
  }
  Matrix<T> backward(const ConstMatrixRef<T>& dy, const Cache& cache) {
    counts_->backward_rows += dy.rows();
    return inner_.backward(dy, cache);
  }
  ParamList<T> params() { return inner_.params(); }
  void zero_grad() { inner_.zero_grad(); }

 private:
  SwiGLU<T> inner_;
  Counts* counts_;
};

template <class A, class B>
bool bitwise_equal(const A& a, const B& b) {
  return a.rows() == b.rows() && a.cols() == b.cols() && (a.array() == b.array()).all();
}

}  // namespace

// ---------------------------------------------------------------------------
// SkipGate on its own

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

// ---------------------------------------------------------------------------
// The sublayer with a dense SwiGLU

TEST_CASE("FFNSublayer parameters are named norm ffn and skip_gate", "[skip_gate][sublayer]") {
  auto gated = make_gated<double>(6, 10, 4, 1);
  std::vector<std::string> names;
  for (const auto& p : gated.params()) names.push_back(p.name);
  const std::vector<std::string> want = {"norm.weight",          "ffn.w_gate.weight",    "ffn.w_up.weight",
                                         "ffn.w_down.weight",    "skip_gate.w1.weight",  "skip_gate.w1.bias",
                                         "skip_gate.w2.weight",  "skip_gate.w2.bias"};
  CHECK(names == want);
  auto plain = make_plain<double>(6, 10, 1);
  CHECK(plain.params().size() == 4);
  CHECK_FALSE(plain.gated());
  CHECK(plain.skip_gate() == nullptr);
  CHECK(gated.skip_gate() != nullptr);
}

TEMPLATE_TEST_CASE("training and inference modes give bitwise equal outputs", "[skip_gate][sublayer]", float,
                   double) {
  using T = TestType;
  const Index d = 16, f = 40, h = 8;
  for (Index n : {1, 5, 13, 64}) {
    for (double share : {0.0, 0.3, 0.5, 1.0}) {
      INFO("N = " << n << ", skip share " << share);
      auto layer = make_gated<T>(d, f, h, 31);
      const Matrix<T> x = random_matrix(n, d, 32 + n, 1.5).cast<T>();
      set_skip_share(*layer.skip_gate(), x, share);
      const Index want_skipped = Index(std::lround(share * double(n)));

      typename Dense<T>::Cache train_cache, infer_cache;
      const Matrix<T> y_train = layer.forward(x, SublayerMode::training, &train_cache);
      const Matrix<T> y_infer = layer.forward(x, SublayerMode::inference, &infer_cache);
      const Matrix<T> y_nocache = layer.forward(x);
      CHECK(bitwise_equal(y_train, y_infer));
      CHECK(bitwise_equal(y_train, y_nocache));
      CHECK(train_cache.mode == SublayerMode::training);
      CHECK(infer_cache.mode == SublayerMode::inference);
      CHECK(train_cache.skipped() == want_skipped);
      CHECK(infer_cache.skipped() == want_skipped);
      CHECK(train_cache.kept == infer_cache.kept);
      CHECK_THAT(train_cache.skip_rate(), WithinAbs(double(want_skipped) / double(n), 1e-15));
      CHECK(train_cache.penalty == infer_cache.penalty);
      // Skipped rows are x itself, kept rows differ from it.
      const auto keep = train_cache.keep_mask();
      for (Index t = 0; t < n; ++t) {
        if (keep[std::size_t(t)])
          CHECK_FALSE(bitwise_equal(y_train.row(t), x.row(t)));
        else
          CHECK(bitwise_equal(y_train.row(t), x.row(t)));
      }
      layer.set_mode(SublayerMode::inference);
      CHECK(bitwise_equal(layer.forward(x), y_train));
    }
  }
}

TEMPLATE_TEST_CASE("all kept equals the plain sublayer bitwise", "[skip_gate][sublayer]", float, double) {
  using T = TestType;
  const Index d = 12, f = 20, h = 6, n = 17;
  auto gated = make_gated<T>(d, f, h, 41);
  auto plain = make_plain<T>(d, f, 41);  // the same FFN weights (seed 41)
  plain.norm().gain() = RowVector<T>::LinSpaced(d, T(0.5), T(1.5));
  gated.norm().gain() = plain.norm().gain();
  const Matrix<T> x = random_matrix(n, d, 42, 2.0).cast<T>();
  const Matrix<T> dy = random_matrix(n, d, 43).cast<T>();
  set_skip_share(*gated.skip_gate(), x, 0.0);

  typename Dense<T>::Cache gc, pc;
  const Matrix<T> yg = gated.forward(x, SublayerMode::training, &gc);
  const Matrix<T> yp = plain.forward(x, &pc);
  REQUIRE(gc.skipped() == 0);
  CHECK(bitwise_equal(yg, yp));
  CHECK(bitwise_equal(gated.forward(x, SublayerMode::inference, nullptr), yp));
  CHECK(bitwise_equal(plain.forward(x, SublayerMode::inference, nullptr), yp));
  CHECK(pc.skip_rate() == 0.0);
  CHECK(pc.penalty == T(0));

  gated.backward(dy, gc);
  plain.backward(dy, pc);
  const auto gp = gated.params(), pp = plain.params();
  for (std::size_t i = 0; i < pp.size(); ++i) {
    INFO(pp[i].name);
    CHECK(gp[i].name == pp[i].name);
    CHECK(bitwise_equal(gp[i].grad(), pp[i].grad()));
  }
  // τ = 0 keeps every token whatever g is.
  gated.skip_gate()->set_threshold(T(0));
  gated.skip_gate()->b2() = T(-80);
  CHECK(bitwise_equal(gated.forward(x, SublayerMode::inference, nullptr), yp));
}

TEST_CASE("all skipped returns x exactly and does no FFN work at inference", "[skip_gate][sublayer]") {
  const Index d = 8, f = 24, n = 11;
  CountingFFN<double>::Counts counts;
  FFNSublayer<double, CountingFFN<double>> layer(d, CountingFFN<double>(SwiGLU<double>(d, f, 5), &counts),
                                                 SkipGate<double>(gate_config(d, 4), 6));
  layer.skip_gate()->b2() = -40;  // g ≈ 4e-18 < τ for every token
  const Matrix<double> x = random_matrix(n, d, 7, 2.0);

  // Inference, with and without a cache: y is x, bit for bit, and the FFN never runs.
  FFNSublayer<double, CountingFFN<double>>::Cache ic;
  CHECK(bitwise_equal(layer.forward(x, SublayerMode::inference, nullptr), x));
  CHECK(bitwise_equal(layer.forward(x, SublayerMode::inference, &ic), x));
  CHECK(ic.skip_rate() == 1.0);
  CHECK_FALSE(ic.ffn_ran);
  CHECK(counts.forward_calls == 0);
  CHECK(counts.forward_rows == 0);

  // Training computes F for every token (the STE needs it) but backpropagates
  // through the FFN for none.
  FFNSublayer<double, CountingFFN<double>>::Cache tc;
  CHECK(bitwise_equal(layer.forward(x, SublayerMode::training, &tc), x));
  CHECK(counts.forward_rows == n);
  const Matrix<double> dy = random_matrix(n, d, 8);
  layer.backward(dy, tc);
  CHECK(counts.backward_rows == 0);
  for (const auto& p : layer.params()) {
    INFO(p.name);
    if (p.name.rfind("skip_gate.", 0) == 0)
      CHECK(p.grad().norm() > 0);  // the STE still teaches the gate
    else
      CHECK(p.grad().isZero(0));
  }
}

TEST_CASE("inference computes the FFN only for kept rows", "[skip_gate][sublayer]") {
  const Index d = 8, f = 24, n = 20;
  CountingFFN<double>::Counts counts;
  FFNSublayer<double, CountingFFN<double>> layer(d, CountingFFN<double>(SwiGLU<double>(d, f, 5), &counts),
                                                 SkipGate<double>(gate_config(d, 4), 6));
  const Matrix<double> x = random_matrix(n, d, 9, 2.0);
  set_skip_share(*layer.skip_gate(), x, 0.35);  // 7 of 20 skipped

  FFNSublayer<double, CountingFFN<double>>::Cache ic, tc;
  layer.forward(x, SublayerMode::inference, &ic);
  CHECK(ic.skipped() == 7);
  CHECK(counts.forward_calls == 1);
  CHECK(counts.forward_rows == 13);
  counts = {};
  layer.forward(x);  // training mode without a cache: no backward possible, computes as inference
  CHECK(counts.forward_rows == 13);
  counts = {};
  layer.forward(x, SublayerMode::training, &tc);
  CHECK(counts.forward_rows == n);
  layer.backward(random_matrix(n, d, 10), tc);
  CHECK(counts.backward_rows == 13);
  CHECK_THROWS_AS(layer.backward(random_matrix(n, d, 10), ic), ValueError);
}

namespace {

/// The experts every token chose, for an MoE cache; nothing for a dense FFN.
template <class C>
auto routing_key(const C& c, int) -> decltype(c.routing.experts, std::vector<Index>()) {
  return std::vector<Index>(c.routing.experts.data(), c.routing.experts.data() + c.routing.experts.size());
}
template <class C>
std::vector<Index> routing_key(const C&, long) {
  return {};
}

/// Gradient checks of a gated sublayer at a point where every gate is at
/// least `margin` (in logit) from τ, so no decision flips under ±ε.
template <class Layer>
void check_sublayer_gradients(Layer& layer, Matrix<double> x, const Matrix<double>& r) {
  using Cache = typename Layer::Cache;
  const Index n = x.rows();
  auto& gate = *layer.skip_gate();

  Cache cache;
  layer.zero_grad();
  const Matrix<double> y = layer.forward(x, SublayerMode::training, &cache);
  const Matrix<double> dx = layer.backward(r, cache);
  const std::vector<bool> m0 = cache.keep_mask();
  const Vector<double> g0 = cache.gate.g;

  // The STE's surrogate: y = x + (m₀ + g − g₀)·F, with m₀ and g₀ frozen at
  // the point. Its gradient is what backward computes, for every parameter
  // and the input; its value at the point is the layer's.
  using FFNCache = typename Layer::FFNType::Cache;
  std::vector<Index> routing0;
  {
    FFNCache fc;
    layer.ffn().forward(layer.norm().forward(x), &fc);
    routing0 = routing_key(fc, 0);
  }
  Index flips = 0;  // keep decisions or top-K choices that changed under ±ε
  auto surrogate = [&] {
    FFNCache fc;
    const Matrix<double> f = layer.ffn().forward(layer.norm().forward(x), &fc);
    if (routing_key(fc, 0) != routing0) ++flips;
    const Vector<double> g = gate.forward(x);
    for (Index t = 0; t < n; ++t)
      if (gate.keep(g(t)) != m0[std::size_t(t)]) ++flips;
    Matrix<double> ys = x;
    for (Index t = 0; t < n; ++t) ys.row(t) += ((m0[std::size_t(t)] ? 1.0 : 0.0) + g(t) - g0(t)) * f.row(t);
    return dot_all(ys, r) + gate.penalty_value(g);
  };
  CHECK_THAT(surrogate(), WithinAbs(dot_all(y, r) + cache.penalty, 1e-12));
  APEX_CHECK_GRADS(check_params(layer.params(), surrogate), 1e-6);
  APEX_CHECK_GRADS(std::vector{check_values("x", x.data(), dx.data(), x.size(), surrogate)}, 1e-6);

  // The real layer (hard mask) for everything the STE does not touch: its
  // finite differences must match backward for the norm and FFN weights, and
  // for the input once the gate's path is taken out of dx.
  auto real = [&] {
    Cache c;
    const Matrix<double> yr = layer.forward(x, SublayerMode::training, &c);
    if (c.keep_mask() != m0) ++flips;
    return dot_all(yr, r);
  };
  ParamList<double> not_gate;
  for (const auto& p : layer.params())
    if (p.name.rfind("skip_gate.", 0) != 0) not_gate.push_back(p);
  APEX_CHECK_GRADS(check_params(not_gate, real), 1e-6);
  Layer probe = layer;  // a copy, to read the gate's share of dx without touching layer's gradients
  Cache pc;
  probe.forward(x, SublayerMode::training, &pc);
  const Vector<double> dg = (r.array() * pc.f.array()).rowwise().sum().matrix();
  const Matrix<double> dx_gate = probe.skip_gate()->backward(dg, pc.gate);
  const Matrix<double> dx_real = dx - dx_gate;
  APEX_CHECK_GRADS(std::vector{check_values("x (hard mask)", x.data(), dx_real.data(), x.size(), real)}, 1e-6);
  CHECK(flips == 0);
  if (n > 0) CHECK(dx_gate.norm() > 0);
}

}  // namespace

TEST_CASE("straight-through and all other gradients match finite differences", "[skip_gate][sublayer][gradcheck]") {
  struct Case {
    Index n;
    double share;
  };
  const Index d = 6, f = 10, h = 5;
  for (const Case c : {Case{0, 0.0}, Case{1, 0.0}, Case{1, 1.0}, Case{4, 0.5}, Case{13, 0.4}, Case{13, 1.0}}) {
    INFO("N = " << c.n << ", skip share " << c.share);
    auto layer = make_gated<double>(d, f, h, 51);
    layer.norm().gain() = random_matrix(1, d, 52) + RowVector<double>::Ones(d);
    layer.skip_gate()->w2() *= 4.0;  // gates spread over (0, 1): σ′ is not uniform
    layer.skip_gate()->set_penalty_weight(0.05);
    const Matrix<double> x = random_matrix(c.n, d, 53, 2.0);
    const Matrix<double> r = random_matrix(c.n, d, 54);
    const double margin = set_skip_share(*layer.skip_gate(), x, c.share);
    if (c.n > 0) REQUIRE(margin > 1e-3);  // far beyond the ε = 1e-5 perturbation
    check_sublayer_gradients(layer, x, r);
  }
}

TEST_CASE("compute penalty value and gradient", "[skip_gate][sublayer]") {
  const Index d = 6, n = 9;
  auto layer = make_gated<double>(d, 10, 5, 61);
  layer.skip_gate()->set_penalty_weight(0.2);
  const Matrix<double> x = random_matrix(n, d, 62, 2.0);
  set_skip_share(*layer.skip_gate(), x, 0.4);
  Dense<double>::Cache cache;
  layer.forward(x, SublayerMode::training, &cache);
  const Vector<double>& g = cache.gate.g;
  CHECK_THAT(cache.penalty, WithinRel(0.2 * g.mean(), 1e-14));
  // With ∂L/∂y = 0 only the penalty teaches the gate: ∂(λ·mean g)/∂b₂ = λ·mean(σ′).
  layer.backward(Matrix<double>::Zero(n, d), cache);
  const double want = 0.2 * (g.array() * (1.0 - g.array())).mean();
  CHECK_THAT(layer.params().back().grad()(0, 0), WithinRel(want, 1e-12));
  for (const auto& p : layer.params())
    if (p.name.rfind("skip_gate.", 0) != 0) CHECK(p.grad().isZero(0));
  // λ = 0: no penalty, no gradient.
  layer.zero_grad();
  layer.skip_gate()->set_penalty_weight(0);
  layer.forward(x, SublayerMode::training, &cache);
  CHECK(cache.penalty == 0.0);
  layer.backward(Matrix<double>::Zero(n, d), cache);
  for (const auto& p : layer.params()) CHECK(p.grad().isZero(0));
}

TEST_CASE("FFNSublayer rejects bad shapes and mismatched parts", "[skip_gate][sublayer][errors]") {
  auto layer = make_gated<double>(4, 6, 3, 1);
  CHECK_THROWS_WITH(layer.forward(Matrix<double>::Zero(2, 5)),
                    "FFNSublayer::forward: argument 'x' has shape [2 x 5], expected [* x 4]");
  Dense<double>::Cache cache;
  layer.forward(Matrix<double>::Ones(3, 4), SublayerMode::training, &cache);
  CHECK_THROWS_AS(layer.backward(Matrix<double>::Zero(2, 4), cache), ShapeError);
  CHECK_THROWS_AS(Dense<double>(5, SwiGLU<double>(4, 6)), ConfigError);
  CHECK_THROWS_AS(Dense<double>(4, SwiGLU<double>(4, 6), SkipGate<double>(gate_config(5, 3))), ConfigError);
  Matrix<double> bad = Matrix<double>::Ones(2, 4);
  bad(0, 0) = std::nan("");
  CHECK_THROWS_AS(layer.forward(bad), ValueError);
}

TEST_CASE("FFNSublayer backward and observe reject a cache of a sublayer of another kind",
          "[skip_gate][sublayer][errors][regression]") {
  // Before the fix an ungated backward accepted the cache of a gated
  // sublayer that had skipped tokens: it read cache.kept as if every token
  // had gone through the FFN and returned gradients for a computation it did
  // not do (and an MoE observe counted them).
  const Index d = 4, n = 6;
  auto gated = make_gated<double>(d, 6, 3, 1);
  auto plain = make_plain<double>(d, 6, 1);
  Matrix<double> x = apex::test::random_matrix(n, d, 5);
  const Matrix<double> dy = Matrix<double>::Ones(n, d);

  Dense<double>::Cache from_gated;
  gated.skip_gate()->set_threshold(0.0);
  gated.forward(x, SublayerMode::training, &from_gated);
  REQUIRE(from_gated.skipped() == 0);
  CHECK_THROWS_WITH(plain.backward(dy, from_gated),
                    Catch::Matchers::Contains("FFNSublayer::backward: argument 'cache' was filled by a gated sublayer"));
  gated.skip_gate()->set_threshold(1.0);  // every token skipped
  gated.forward(x, SublayerMode::training, &from_gated);
  REQUIRE(from_gated.skipped() == n);
  CHECK_THROWS_AS(plain.backward(dy, from_gated), ValueError);

  Dense<double>::Cache from_plain;
  plain.forward(x, SublayerMode::training, &from_plain);
  CHECK_THROWS_WITH(gated.backward(dy, from_plain),
                    Catch::Matchers::Contains("was filled by an ungated sublayer, expected one of a gated sublayer"));

  // A cache whose kept list was edited: not ascending, or not every token
  // for an ungated sublayer.
  Dense<double>::Cache edited = from_plain;
  std::swap(edited.kept[0], edited.kept[1]);
  CHECK_THROWS_WITH(plain.backward(dy, edited), Catch::Matchers::Contains("'cache.kept'"));
  edited = from_plain;
  edited.kept.pop_back();
  CHECK_THROWS_WITH(plain.backward(dy, edited), Catch::Matchers::Contains("expected all of them"));

  // The same check guards observe on an MoE sublayer.
  MoEConfig cfg;
  cfg.d_model = d;
  cfg.d_ffn = 5;
  cfg.n_experts = 4;
  cfg.n_active = 2;
  using MoESub = FFNSublayer<double, MoEFFN<double>>;
  MoESub moe_plain(d, MoEFFN<double>(cfg, 3));
  MoESub moe_gated(d, MoEFFN<double>(cfg, 3), SkipGate<double>(gate_config(d, 3), 4));
  moe_gated.skip_gate()->set_threshold(1.0);
  MoESub::Cache c;
  moe_gated.forward(x, SublayerMode::inference, &c);
  CHECK_THROWS_WITH(moe_plain.observe(c), Catch::Matchers::Contains("FFNSublayer::observe"));
  CHECK(moe_plain.ffn().balancer().update().tokens == 0);
}

TEST_CASE("the gate learns to keep tokens the FFN helps and with the penalty to skip the rest",
          "[skip_gate][sublayer][training]") {
  // Two kinds of token, told apart by feature 0 (+1.5 or −1.5). For "hard"
  // tokens the target is x + T(RMSNorm(x)) for a fixed teacher SwiGLU T; for
  // "easy" tokens the target is x itself, so any FFN output only hurts them.
  const Index d = 8, f = 16, h = 8, batch = 64;
  SwiGLU<double> teacher(d, f, 71);
  teacher.w_down() *= 3.0;
  RMSNorm<double> teacher_norm(d);
  auto make_batch = [&](Rng& rng, Matrix<double>& x, Matrix<double>& target, std::vector<bool>& hard) {
    x.resize(batch, d);
    hard.assign(std::size_t(batch), false);
    for (Index t = 0; t < batch; ++t) {
      hard[std::size_t(t)] = rng.uniform() < 0.5;
      for (Index j = 1; j < d; ++j) x(t, j) = rng.normal();
      x(t, 0) = hard[std::size_t(t)] ? 1.5 : -1.5;
    }
    target = x;
    const Matrix<double> tx = teacher.forward(teacher_norm.forward(x));
    for (Index t = 0; t < batch; ++t)
      if (hard[std::size_t(t)]) target.row(t) += tx.row(t);
  };

  // Adam (β₁ 0.9, β₂ 0.999), written out over params().
  struct Adam {
    std::vector<Matrix<double>> m, v;
    int step = 0;
    void update(const ParamList<double>& ps, double lr) {
      if (m.empty())
        for (const auto& p : ps) {
          m.push_back(Matrix<double>::Zero(p.rows, p.cols));
          v.push_back(Matrix<double>::Zero(p.rows, p.cols));
        }
      ++step;
      const double c1 = 1 - std::pow(0.9, step), c2 = 1 - std::pow(0.999, step);
      for (std::size_t i = 0; i < ps.size(); ++i) {
        m[i] = 0.9 * m[i] + 0.1 * ps[i].grad();
        v[i] = 0.999 * v[i] + 0.001 * ps[i].grad().cwiseAbs2();
        ps[i].value().array() -= lr * (m[i].array() / c1) / ((v[i].array() / c2).sqrt() + 1e-8);
      }
    }
  };

  struct Outcome {
    double hard_kept, easy_skipped, hard_gate, easy_gate, hard_loss_start, hard_loss_end, hard_loss_skipped;
  };
  auto train = [&](double lambda) {
    auto layer = make_gated<double>(d, f, h, 72);
    layer.skip_gate()->set_penalty_weight(lambda);
    Rng rng(73);
    Adam adam;
    Matrix<double> x, target;
    std::vector<bool> hard;
    // Held-out evaluation batch.
    Rng eval_rng(74);
    Matrix<double> ex, etarget;
    std::vector<bool> ehard;
    make_batch(eval_rng, ex, etarget, ehard);
    auto evaluate = [&](Outcome& o, double& loss_hard) {
      Dense<double>::Cache c;
      const Matrix<double> y = layer.forward(ex, SublayerMode::inference, &c);
      const auto keep = c.keep_mask();
      double nh = 0, ne = 0, kh = 0, se = 0, gh = 0, ge = 0, lh = 0, ls = 0;
      for (Index t = 0; t < batch; ++t) {
        const std::size_t i = std::size_t(t);
        if (ehard[i]) {
          ++nh;
          kh += keep[i];
          gh += c.gate.g(t);
          lh += 0.5 * (y.row(t) - etarget.row(t)).squaredNorm();
          ls += 0.5 * (ex.row(t) - etarget.row(t)).squaredNorm();
        } else {
          ++ne;
          se += !keep[i];
          ge += c.gate.g(t);
        }
      }
      o.hard_kept = kh / nh;
      o.easy_skipped = se / ne;
      o.hard_gate = gh / nh;
      o.easy_gate = ge / ne;
      o.hard_loss_skipped = ls / nh;
      loss_hard = lh / nh;
    };
    Outcome o{};
    evaluate(o, o.hard_loss_start);
    REQUIRE(o.hard_kept == 1.0);  // gates start open
    REQUIRE(o.easy_skipped == 0.0);
    for (int step = 0; step < 1500; ++step) {
      make_batch(rng, x, target, hard);
      Dense<double>::Cache c;
      layer.zero_grad();
      const Matrix<double> y = layer.forward(x, SublayerMode::training, &c);
      // L = (1/2N)·Σ_t ‖y_t − target_t‖² + λ·mean(g)   (the penalty's gradient is added by backward)
      layer.backward((y - target) / double(batch), c);
      adam.update(layer.params(), 3e-3);
    }
    evaluate(o, o.hard_loss_end);
    return o;
  };

  const Outcome with = train(0.005);
  INFO("with penalty: hard kept " << with.hard_kept << " (mean g " << with.hard_gate << "), easy skipped "
                                  << with.easy_skipped << " (mean g " << with.easy_gate << "), hard loss "
                                  << with.hard_loss_start << " -> " << with.hard_loss_end
                                  << " (skipping them: " << with.hard_loss_skipped << ")");
  const Outcome without = train(0.0);
  INFO("without penalty: hard kept " << without.hard_kept << " (mean g " << without.hard_gate
                                     << "), easy skipped " << without.easy_skipped << " (mean g "
                                     << without.easy_gate << "), hard loss " << without.hard_loss_end);
  CHECK(with.hard_kept >= 0.9);
  CHECK(with.easy_skipped >= 0.95);
  CHECK(with.hard_gate > 0.15);
  CHECK(with.easy_gate < 0.05);
  CHECK(with.hard_loss_end < 0.1 * with.hard_loss_start);
  CHECK(with.hard_loss_end < 0.1 * with.hard_loss_skipped);
  // The straight-through gradient alone keeps the tokens the FFN helps (for
  // the easy ones, ∂L/∂g = ‖F‖²/N > 0 while kept: it closes them too, here).
  CHECK(without.hard_kept >= 0.9);
  // The penalty pulls every gate towards τ: it trades margin for compute.
  CHECK(with.hard_gate < without.hard_gate);
}

// ---------------------------------------------------------------------------
// The sublayer with an MoE layer (SwiGLU and κ-SwiGLU experts)

namespace {

template <class T, class Expert = SwiGLU<T>>
using MoESublayer = FFNSublayer<T, MoEFFN<T, Expert>>;

template <class T, class Expert = SwiGLU<T>>
MoESublayer<T, Expert> make_moe_sublayer(const MoEConfig& cfg, Index h, std::uint64_t seed) {
  return MoESublayer<T, Expert>(cfg.d_model, MoEFFN<T, Expert>(cfg, seed), SkipGate<T>(gate_config(cfg.d_model, h), seed + 1));
}

/// Per-expert assignment counts of the tokens `rows` of x, routed directly.
template <class Layer>
std::vector<Index> expert_counts(const Layer& layer, const Matrix<double>& x, const std::vector<Index>& rows) {
  const auto& moe = layer.ffn();
  Routing<double> r;
  moe.router().route(layer.norm().forward(x), moe.balancer().bias(), moe.config().weights_from_unbiased, r);
  std::vector<Index> counts(std::size_t(moe.config().n_experts), 0);
  for (Index t : rows)
    for (Index k = 0; k < moe.config().n_active; ++k) ++counts[std::size_t(r.experts(t, k))];
  return counts;
}

}  // namespace

TEMPLATE_TEST_CASE("MoE sublayer modes give bitwise equal outputs", "[skip_gate][sublayer][moe]", float, double) {
  using T = TestType;
  const MoEConfig cfg = moe_config(6, 2, 1, 16, 12);
  for (Index n : {1, 7, 40, 300}) {
    for (double share : {0.0, 0.3, 0.6, 1.0}) {
      INFO("N = " << n << ", skip share " << share);
      auto layer = make_moe_sublayer<T>(cfg, 8, 81);
      auto kappa = make_moe_sublayer<T, KappaSwiGLU<T>>(cfg, 8, 81);
      for (auto& e : kappa.ffn().experts()) {
        e.kappa_alpha() = random_matrix(1, cfg.d_ffn, 82, 1.0).cast<T>();
        e.kappa_bias() = random_matrix(1, cfg.d_ffn, 83, 1.0).cast<T>();
      }
      const Matrix<T> x = random_matrix(n, cfg.d_model, 84 + n, 1.5).cast<T>();
      set_skip_share(*layer.skip_gate(), x, share);
      set_skip_share(*kappa.skip_gate(), x, share);

      typename MoESublayer<T>::Cache tc, ic;
      const Matrix<T> yt = layer.forward(x, SublayerMode::training, &tc);
      CHECK(bitwise_equal(yt, layer.forward(x, SublayerMode::inference, &ic)));
      CHECK(bitwise_equal(yt, layer.forward(x, SublayerMode::inference, nullptr)));
      CHECK(tc.skipped() == Index(std::lround(share * double(n))));
      CHECK(ic.kept == tc.kept);

      typename MoESublayer<T, KappaSwiGLU<T>>::Cache ktc;
      const Matrix<T> kt = kappa.forward(x, SublayerMode::training, &ktc);
      CHECK(bitwise_equal(kt, kappa.forward(x, SublayerMode::inference, nullptr)));
      if (tc.skipped() < n) CHECK_FALSE(bitwise_equal(kt, yt));  // κ ≠ 1 changes the kept rows
    }
  }
}

TEST_CASE("MoE sublayer with every token kept equals the plain MoE sublayer bitwise", "[skip_gate][sublayer][moe]") {
  const MoEConfig cfg = moe_config(5, 2, 1, 12, 10);
  auto gated = make_moe_sublayer<double>(cfg, 6, 91);
  MoESublayer<double> plain(cfg.d_model, MoEFFN<double>(cfg, 91));
  const Matrix<double> x = random_matrix(33, cfg.d_model, 92, 1.5);
  const Matrix<double> dy = random_matrix(33, cfg.d_model, 93);
  set_skip_share(*gated.skip_gate(), x, 0.0);
  MoESublayer<double>::Cache gc, pc;
  CHECK(bitwise_equal(gated.forward(x, SublayerMode::training, &gc), plain.forward(x, SublayerMode::training, &pc)));
  gated.backward(dy, gc);
  plain.backward(dy, pc);
  const auto gp = gated.params(), pp = plain.params();
  REQUIRE(gp.size() == pp.size() + 4);
  for (std::size_t i = 0; i < pp.size(); ++i) {
    INFO(pp[i].name);
    CHECK(gp[i].name == pp[i].name);
    CHECK(bitwise_equal(gp[i].grad(), pp[i].grad()));
  }
  CHECK(gp[1].name == "ffn.router.weight");
}

TEST_CASE("MoE sublayer gradients match finite differences", "[skip_gate][sublayer][moe][gradcheck]") {
  struct Case {
    const char* what;
    Index n;
    double share;
    bool kappa;
  };
  const MoEConfig cfg = moe_config(4, 2, 1, 6, 5);
  for (const Case c : {Case{"SwiGLU experts N = 9", 9, 0.4, false}, Case{"SwiGLU experts N = 1 kept", 1, 0.0, false},
                       Case{"SwiGLU experts all skipped", 5, 1.0, false},
                       Case{"kappa-SwiGLU experts N = 9", 9, 0.4, true}}) {
    INFO(c.what);
    auto run = [&](auto& layer) {
      layer.ffn().set_threads(1);  // thousands of tiny forwards: a thread team would only add overhead
      layer.norm().gain() = random_matrix(1, cfg.d_model, 101) + RowVector<double>::Ones(cfg.d_model);
      layer.ffn().balancer().set_bias(random_matrix(1, cfg.n_experts, 102, 0.3));
      layer.skip_gate()->w2() *= 4.0;
      layer.skip_gate()->set_penalty_weight(0.05);
      // An input whose top-K choices and keep decisions both have a clear margin.
      Matrix<double> x;
      double margin = 0;
      for (std::uint64_t seed = 200;; ++seed) {
        x = random_matrix(c.n, cfg.d_model, seed, 1.5);
        if (topk_margin(layer.ffn(), layer.norm().forward(x)) <= 1e-2) continue;  // the router sees RMSNorm(x)
        margin = set_skip_share(*layer.skip_gate(), x, c.share);
        if (margin > 1e-3) break;
      }
      const Matrix<double> r = random_matrix(c.n, cfg.d_model, 103);
      check_sublayer_gradients(layer, x, r);
      for (const auto& p : layer.params()) {
        INFO(p.name);
        if (p.name.find("experts.") != std::string::npos || p.name == "ffn.router.weight")
          CHECK((c.share == 1.0 ? p.grad().isZero(0) : true));  // all skipped: nothing reaches the MoE
      }
    };
    if (c.kappa) {
      auto layer = make_moe_sublayer<double, KappaSwiGLU<double>>(cfg, 4, 104);
      for (auto& e : layer.ffn().experts()) {
        KappaOptions o = e.options();
        o.rho = 1.0;  // the full ∂L/∂ℓ through κ, so finite differences can check it
        e.set_options(o);
        e.kappa_alpha() = random_matrix(1, cfg.d_ffn, 105, 1.0);
        e.kappa_bias() = random_matrix(1, cfg.d_ffn, 106, 1.0);
      }
      run(layer);
    } else {
      auto layer = make_moe_sublayer<double>(cfg, 4, 104);
      run(layer);
    }
  }
}

TEST_CASE("the MoE balancer counts only kept tokens in both modes", "[skip_gate][sublayer][moe][balancer]") {
  const MoEConfig cfg = moe_config(5, 2, 1, 10, 8);
  auto layer = make_moe_sublayer<double>(cfg, 6, 111);
  const Index n = 50;
  const Matrix<double> x = random_matrix(n, cfg.d_model, 112, 1.5);
  set_skip_share(*layer.skip_gate(), x, 0.4);

  for (SublayerMode mode : {SublayerMode::training, SublayerMode::inference}) {
    INFO((mode == SublayerMode::training ? "training" : "inference"));
    MoESublayer<double>::Cache cache;
    layer.forward(x, mode, &cache);
    REQUIRE(cache.skipped() == 20);
    layer.observe(cache);
    const LoadReport rep = layer.ffn().balancer().update();
    CHECK(rep.tokens == 30);
    CHECK(rep.counts == expert_counts(layer, x, cache.kept));
    std::vector<Index> all(static_cast<std::size_t>(n));
    for (Index t = 0; t < n; ++t) all[std::size_t(t)] = t;
    CHECK(rep.counts != expert_counts(layer, x, all));  // counting every token would differ
  }

  // Every token skipped: nothing was routed, nothing is counted.
  set_skip_share(*layer.skip_gate(), x, 1.0);
  for (SublayerMode mode : {SublayerMode::training, SublayerMode::inference}) {
    MoESublayer<double>::Cache cache;
    layer.forward(x, mode, &cache);
    layer.observe(cache);
    CHECK(layer.ffn().balancer().report().tokens == 0);
  }

  // The ungated sublayer counts every token.
  MoESublayer<double> plain(cfg.d_model, MoEFFN<double>(cfg, 111));
  MoESublayer<double>::Cache pc;
  plain.forward(x, &pc);
  plain.observe(pc);
  CHECK(plain.ffn().balancer().report().tokens == n);
  static_assert(!detail::sublayer::has_observe<SwiGLU<double>>::value, "dense FFNs have no balancer");
  static_assert(detail::sublayer::has_observe<MoEFFN<double>>::value, "MoE layers have one");
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
