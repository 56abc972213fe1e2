// The FFN sublayer over an MoE layer (FFNSublayer<T, MoEFFN<T>>): its
// training and inference modes bitwise equal, every token kept equal to the
// plain MoE sublayer, gradients by finite differences (skip decisions and
// top-K choices held away from a flip), and the balancer counting only the
// kept tokens in both modes.
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
using apex::test::moe_config;
using apex::test::random_matrix;
using apex::test::topk_margin;
using apex::test::set_skip_share;
using apex::test::bitwise_equal;
using apex::test::check_sublayer_gradients;

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
