#pragma once
// What the tests of the packed inference layers (test_packed_*.cpp) share:
// the layer shapes they run (odd sizes, and every part of the packed MoE's
// forward at once), the row counts, the changes that make a float layer
// worth comparing against (κ ≠ 1, a balancing bias, bf16-rounded experts),
// the comparisons, and an in-memory safetensors reader.

#include <apex/ffn/inference.hpp>
#include <apex/ffn/io/checkpoint.hpp>
#include <apex/ffn/layers/kappa_swiglu.hpp>

#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "fixtures.hpp"

/// The exception's type, and its message containing `text`.
#define CHECK_THROWS_CONTAINING(expr, Type, text)          \
  do {                                                      \
    CHECK_THROWS_AS(expr, Type);                            \
    CHECK_THROWS_WITH(expr, Catch::Matchers::Contains(text)); \
  } while (false)

namespace apex::test {

/// ‖a − b‖ / ‖b‖ (0 for two empty matrices).
inline double rel(const Matrix<float>& a, const Matrix<float>& b) {
  const double n = b.cast<double>().norm();
  const double e = (a.cast<double>() - b.cast<double>()).norm();
  return n > 0 ? e / n : e;
}

inline bool bitwise_equal(const Matrix<float>& a, const Matrix<float>& b) {
  return a.rows() == b.rows() && a.cols() == b.cols() &&
         (a.size() == 0 || std::memcmp(a.data(), b.data(), std::size_t(a.size()) * sizeof(float)) == 0);
}

/// Rounds every routed and shared expert weight of `moe` to bf16 (router,
/// κ parameters and shared gate kept: the packed layers keep them float).
template <class Expert>
void round_experts(MoEFFN<float, Expert>& moe) {
  for (auto& p : moe.param_values()) {
    if (p.name.rfind("router.", 0) == 0 || p.name.find("kappa_") != std::string::npos ||
        p.name == "shared_expert_gate.weight")
      continue;
    for (Index i = 0; i < p.size(); ++i) p.value_data[i] = packed::round_to_bf16(p.value_data[i]);
  }
}

/// κ parameters away from 0, so κ ≠ 1 and varies per token and unit.
inline void perturb_kappa(MoEFFN<float, KappaSwiGLU<float>>& moe, std::uint64_t seed) {
  for (std::size_t e = 0; e < moe.experts().size(); ++e) {
    auto& x = moe.experts()[e];
    x.kappa_alpha() = test::rnd<float>(1, x.d_ffn(), seed + 2 * e, 2.0);
    x.kappa_bias() = test::rnd<float>(1, x.d_ffn(), seed + 2 * e + 1, 1.0);
  }
}

/// A balancing bias away from 0, so selection differs from the raw logits'.
template <class Expert>
void set_bias(MoEFFN<float, Expert>& moe, std::uint64_t seed) {
  moe.balancer().set_bias(test::rnd<float>(1, moe.config().n_experts, seed, 0.3));
}

inline safetensors::Reader reader(const std::vector<unsigned char>& bytes) {
  return safetensors::Reader::from_memory(bytes.data(), bytes.size());
}

/// Odd sizes on purpose: d, f not multiples of any vector width.
inline MoEConfig odd_config(Index n_shared = 1) { return test::moe_config(5, 2, n_shared, 37, 53); }

inline constexpr Index kRowCounts[] = {0, 1, 3, 33, 301};  // empty, decode, small block, blocked, several tiles

/// Everything of docs/routing.md the packed layer computes beyond plain
/// routing, at once: S shared experts of an odd width f_s ≠ f (and ≠ d, so a
/// transposed shared matrix cannot pass), Qwen2-MoE's shared gate, a capacity
/// factor φ that drops (φ < 1 drops at every batch of ≥ 3 tokens here), and
/// `scoring` (sigmoid: 2 groups, 1 kept, routed scale 1.5).
inline MoEConfig full_config(Index n_shared, Index d_shared, Scoring scoring, double capacity) {
  MoEConfig c = test::moe_config(6, 2, n_shared, 37, 53);
  c.d_shared_ffn = d_shared;
  c.shared_expert_gate = true;
  c.routing.scoring = scoring;
  if (scoring == Scoring::Sigmoid) {
    c.routing.n_groups = 2;
    c.routing.topk_group = 1;
    c.routing.routed_scale = 1.5;
  }
  c.routing.capacity_factor = capacity;
  return c;
}

}  // namespace apex::test
