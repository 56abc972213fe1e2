#pragma once
// Builders and checks that the skip-gate, FFN-sublayer and MoE-sublayer tests
// share: gated and plain dense sublayers, a gate bias that skips a chosen
// share of tokens with the widest margin, an FFN that counts the rows it
// computes, bitwise comparison, and the gradient check of a gated sublayer
// against the straight-through surrogate (and the hard mask where the
// surrogate does not reach).

#include <apex/ffn/layers/ffn_sublayer.hpp>
#include <apex/ffn/layers/skip_gate.hpp>
#include <apex/ffn/layers/swiglu.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "fixtures.hpp"
#include "gradcheck.hpp"

namespace apex::test {

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

inline double logit(double p) { return std::log(p / (1 - p)); }

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
  CHECK_THAT(surrogate(), Catch::Matchers::WithinAbs(dot_all(y, r) + cache.penalty, 1e-12));
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

}  // namespace apex::test
