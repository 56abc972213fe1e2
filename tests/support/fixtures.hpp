#pragma once
// Builders and measurements that several test files share: configurations
// with the fields a test varies (the rest at their defaults), seeded random
// inputs in either scalar type, and the routing margin that keeps finite
// differences away from a top-K flip.

#include <apex/ffn/moe/moe_ffn.hpp>
#include <apex/ffn/moe/config.hpp>
#include <apex/ffn/layers/skip_gate.hpp>
#include <apex/ffn/core/types.hpp>

#include <algorithm>
#include <cstdint>
#include <functional>

#include "gradcheck.hpp"

namespace apex::test {

/// random_matrix in the scalar type T: the same values (rounded) for float and double.
template <class T>
Matrix<T> rnd(Index rows, Index cols, std::uint64_t seed, double scale = 1.0) {
  return random_matrix(rows, cols, seed, scale).cast<T>();
}

/// An MoE layer of E routed experts, K active per token, S shared experts,
/// token width d and hidden width f; every other field at its default.
inline MoEConfig moe_config(Index n_experts = 4, Index k = 2, Index n_shared = 1, Index d = 6, Index f = 5) {
  MoEConfig c;
  c.d_model = d;
  c.d_ffn = f;
  c.n_experts = n_experts;
  c.n_active = k;
  c.n_shared = n_shared;
  return c;
}

/// An MoE layer of E routed experts, K active per token and S shared experts
/// (d = 6, f = 5) that routes as `routing` says.
inline MoEConfig routed_config(Index e, Index k, Index shared, const RoutingConfig& routing) {
  MoEConfig cfg;
  cfg.d_model = 6;
  cfg.d_ffn = 5;
  cfg.n_experts = e;
  cfg.n_active = k;
  cfg.n_shared = shared;
  cfg.routing = routing;
  return cfg;
}

/// A skip gate over tokens of width d with `h` hidden units and threshold τ.
inline SkipGateConfig gate_config(Index d, Index h, double tau = 0.15) {
  SkipGateConfig c;
  c.d_model = d;
  c.hidden = h;
  c.threshold = tau;
  return c;
}

/// Smallest gap, over all tokens of x, between the K-th and (K+1)-th biased
/// router score of `moe`: a finite-difference step much smaller than this
/// cannot change which experts a token picks. 1e9 when K = E (no choice).
template <class T, class Expert>
double topk_margin(const MoEFFN<T, Expert>& moe, const Matrix<T>& x) {
  const Index k = moe.config().n_active;
  if (k == moe.config().n_experts) return 1e9;
  Routing<T> r;
  moe.router().route(x, moe.balancer().bias(), false, r);
  double margin = 1e9;
  for (Index t = 0; t < x.rows(); ++t) {
    Eigen::Array<T, 1, Eigen::Dynamic> s = r.logits.row(t).array() + moe.balancer().bias().array();
    std::sort(s.data(), s.data() + s.size(), std::greater<T>());
    margin = std::min(margin, double(s(k - 1) - s(k)));
  }
  return margin;
}

}  // namespace apex::test
