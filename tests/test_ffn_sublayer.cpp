// The FFN sublayer a skip gate guards (layers/ffn_sublayer.hpp) over a dense
// SwiGLU: parameter names, training and inference modes bitwise equal, the
// all-kept and all-skipped limits, FFN work only for kept rows, the
// straight-through gradient against its surrogate and every other gradient
// by finite differences, the compute penalty, bad shapes and caches, and a
// small training run in which the gate learns which tokens need the FFN.
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
using apex::test::gate_config;
using apex::test::random_matrix;
using Catch::Matchers::WithinAbs;
using Catch::Matchers::WithinRel;
using apex::test::Dense;
using apex::test::make_gated;
using apex::test::make_plain;
using apex::test::set_skip_share;
using apex::test::CountingFFN;
using apex::test::bitwise_equal;
using apex::test::check_sublayer_gradients;

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
