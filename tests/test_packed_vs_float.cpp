// Packed inference layers (docs/inference.md) against the float layers they
// are packed from: PackedMoE with SwiGLU and κ-SwiGLU experts, float and bf16
// storage (bf16 the float layer on bf16-rounded experts, bit for bit), gated
// shared experts of their own width and capacity drops, and PackedSwiGLU.
#include <catch2/catch.hpp>

#include <apex/ffn/inference.hpp>
#include <apex/ffn/layers/kappa_swiglu.hpp>

#include <cstdint>
#include <cstring>
#include <cstddef>

#include "fixtures.hpp"
#include "packed_layers.hpp"

using namespace apex;
using apex::packed::bf16;
using apex::test::bitwise_equal;
using apex::test::full_config;
using apex::test::kRowCounts;
using apex::test::odd_config;
using apex::test::perturb_kappa;
using apex::test::rel;
using apex::test::round_experts;
using apex::test::set_bias;

namespace {

/// Packed float and bf16 layers of `moe` against it, for every row count of
/// kRowCounts and every kernel path the CPU has: selection, routing weights,
/// capacity drops and shared gate bit for bit the float layer's; output
/// within float rounding (1e-6 relative; measured ≤ 2.6e-7); bf16 bit for
/// bit the packed float layer on the bf16-rounded experts (which a wrong
/// rounding fails), and within the weight rounding of the float layer
/// (5.5e-3, 1.5× the largest measured). Returns the number of drops the float layer made.
template <class Expert>
std::size_t check_against_float(const MoEFFN<float, Expert>& moe, std::uint64_t seed) {
  MoEFFN<float, Expert> rounded = moe;
  round_experts(rounded);
  auto pf = PackedMoE<float, Expert>::from(moe);
  auto pb = PackedMoE<bf16, Expert>::from(moe);
  const auto pr = PackedMoE<float, Expert>::from(rounded);
  std::size_t drops = 0;
  for (Index n : kRowCounts) {
    const Matrix<float> x = test::rnd<float>(n, moe.d_model(), seed + std::uint64_t(n), 2.0);
    typename MoEFFN<float, Expert>::Cache c0;
    const Matrix<float> y0 = moe.forward(x, &c0);
    const Matrix<float> yr = pr.forward(x);
    drops += c0.dropped.size();
    CHECK(c0.shared_gate.size() == n);
    for (packed::Isa isa : packed::kAllIsas) {
      if (!packed::cpu_supports(isa)) continue;
      INFO("rows " << n << ", path " << packed::isa_name(isa) << ", float layer dropped " << c0.dropped.size());
      pf.set_kernel_options({isa, packed::Bf16Products::widened});
      pb.set_kernel_options({isa, packed::Bf16Products::widened});
      typename PackedMoE<float, Expert>::Cache c1;
      typename PackedMoE<bf16, Expert>::Cache c2;
      const Matrix<float> y1 = pf.forward(x, &c1), y2 = pb.forward(x, &c2);
      CHECK(c1.routing.experts == c0.routing.experts);
      CHECK(c2.routing.experts == c0.routing.experts);
      CHECK(bitwise_equal(c1.routing.weights, c0.routing.weights));
      CHECK(c1.dropped == c0.dropped);
      CHECK(c2.dropped == c0.dropped);
      CHECK(bitwise_equal(c1.kept_weights, c0.kept_weights));
      CHECK(bitwise_equal(c1.shared_gate, c0.shared_gate));
      CHECK(bitwise_equal(c2.shared_gate, c0.shared_gate));
      CHECK(rel(y1, y0) <= 1e-6);
      CHECK(bitwise_equal(y2, yr));
      // measured 2.6e-3 – 3.7e-3 (3 rows: few terms, the widest spread)
      if (n > 0) CHECK(rel(y2, y0) <= 5.5e-3);
    }
    pf.set_kernel_options({});
    pb.set_kernel_options({});
    pb.set_threads(1);
    const Matrix<float> y1t = pb.forward(x);
    pb.set_threads(2);
    CHECK(bitwise_equal(pb.forward(x), y1t));
  }
  return drops;
}

}  // namespace

TEST_CASE("packed float MoE equals the float layer with the same expert choice", "[inference]") {
  for (Index shared : {0, 1, 2}) {
    MoEFFN<float> moe(odd_config(shared), 11);
    set_bias(moe, 5);
    const auto p = PackedMoE<float>::from(moe);
    for (Index n : kRowCounts) {
      const Matrix<float> x = test::rnd<float>(n, 37, 100 + n);
      MoEFFN<float>::Cache c0;
      PackedMoE<float>::Cache c1;
      const Matrix<float> y0 = moe.forward(x, &c0), y1 = p.forward(x, &c1);
      INFO("shared " << shared << ", rows " << n);
      CHECK(c1.routing.experts == c0.routing.experts);
      CHECK(bitwise_equal(c1.routing.weights, c0.routing.weights));
      CHECK(rel(y1, y0) <= 1e-6);
    }
  }
}

TEST_CASE("packed bf16 MoE: the float layer on bf16-rounded experts, bit for bit", "[inference][bf16]") {
  MoEFFN<float> moe(odd_config(1), 12);
  set_bias(moe, 6);
  MoEFFN<float> rounded = moe;
  round_experts(rounded);
  const auto b = PackedMoE<bf16>::from(moe);
  const auto f = PackedMoE<float>::from(rounded);
  for (Index n : kRowCounts) {
    const Matrix<float> x = test::rnd<float>(n, 37, 200 + n);
    const Matrix<float> yb = b.forward(x), y0 = moe.forward(x);
    INFO("rows " << n);
    // Widened bf16 products are the float kernel on the rounded weights:
    // a truncating or double rounding changes bits here.
    CHECK(bitwise_equal(yb, f.forward(x)));
    CHECK(rel(yb, rounded.forward(x)) <= 1e-6);
    // Against the float weights: the weight rounding alone (2⁻⁹ relative).
    if (n >= 3) {
      CHECK(rel(yb, y0) <= 3.5e-3);
      CHECK(rel(yb, y0) >= 5e-4);  // a bf16 layer that silently kept float weights fails here
    }
  }
}

TEST_CASE("bf16 error bound fails on a truncating rounding", "[inference][bf16]") {
  // The test above would catch a truncating conversion: here the float layer
  // on truncated weights against the bf16 layer differs far beyond rounding.
  MoEFFN<float> moe(odd_config(1), 13);
  MoEFFN<float> truncated = moe;
  for (auto& p : truncated.param_values()) {
    if (p.name.rfind("router.", 0) == 0) continue;
    for (Index i = 0; i < p.size(); ++i) {
      std::uint32_t u;
      std::memcpy(&u, p.value_data + i, 4);
      u &= 0xFFFF0000u;
      std::memcpy(p.value_data + i, &u, 4);
    }
  }
  const Matrix<float> x = test::rnd<float>(33, 37, 7);
  CHECK(rel(PackedMoE<bf16>::from(moe).forward(x), truncated.forward(x)) > 1e-4);
}

TEST_CASE("packed kappa-SwiGLU MoE equals the float layer", "[inference][kappa]") {
  MoEFFN<float, KappaSwiGLU<float>> moe(odd_config(1), 14);
  perturb_kappa(moe, 30);
  set_bias(moe, 7);
  MoEFFN<float, KappaSwiGLU<float>> rounded = moe;
  round_experts(rounded);
  const auto pf = PackedMoE<float, KappaSwiGLU<float>>::from(moe);
  const auto pb = PackedMoE<bf16, KappaSwiGLU<float>>::from(moe);
  for (Index n : kRowCounts) {
    const Matrix<float> x = test::rnd<float>(n, 37, 300 + n, 2.0);
    MoEFFN<float, KappaSwiGLU<float>>::Cache c0;
    PackedMoE<float, KappaSwiGLU<float>>::Cache c1;
    const Matrix<float> y0 = moe.forward(x, &c0);
    INFO("rows " << n);
    CHECK(rel(pf.forward(x, &c1), y0) <= 1e-6);
    CHECK(c1.routing.experts == c0.routing.experts);
    CHECK(rel(pb.forward(x), rounded.forward(x)) <= 1e-6);
    if (n >= 3) CHECK(rel(pb.forward(x), y0) <= 3.5e-3);
  }
  // κ ≠ 1 matters: the same weights with α = b = 0 give another output.
  MoEFFN<float, KappaSwiGLU<float>> plain = moe;
  perturb_kappa(plain, 99);
  const Matrix<float> x = test::rnd<float>(9, 37, 8, 2.0);
  CHECK(rel(pf.forward(x), plain.forward(x)) > 1e-3);
}

TEST_CASE("packed MoE: gated shared experts of their own width and capacity drops, as the float layer",
          "[inference][shared][capacity]") {
  SECTION("SwiGLU experts, softmax over all, two gated shared experts of width 43, phi = 0.75") {
    MoEFFN<float> moe(full_config(2, 43, Scoring::SoftmaxAll, 0.75), 61);
    set_bias(moe, 62);
    CHECK(check_against_float(moe, 600) > 0);  // real drops
  }
  SECTION("kappa-SwiGLU experts, sigmoid scoring with groups, one gated shared expert of width 37, phi = 1") {
    MoEFFN<float, KappaSwiGLU<float>> moe(full_config(1, 37, Scoring::Sigmoid, 1.0), 63);
    perturb_kappa(moe, 64);
    set_bias(moe, 65);
    CHECK(check_against_float(moe, 700) > 0);
  }
  SECTION("the gate and the drops change the output") {
    // What the checks above would miss if the packed layer skipped them.
    const MoEConfig cfg = full_config(1, 43, Scoring::SoftmaxAll, 0.75);
    MoEFFN<float> moe(cfg, 66);
    MoEConfig plain = cfg;
    plain.shared_expert_gate = false;
    plain.routing.capacity_factor = 0;
    MoEFFN<float> ungated(plain, 66);  // the same seed: the same experts and router
    for (std::size_t i = 0; i < ungated.params().size(); ++i)
      CHECK(ungated.params()[i].value() == moe.params()[i].value());
    const Matrix<float> x = test::rnd<float>(33, 37, 67, 2.0);
    CHECK(rel(PackedMoE<float>::from(moe).forward(x), ungated.forward(x)) > 1e-2);
  }
}

TEST_CASE("PackedSwiGLU equals SwiGLU", "[inference]") {
  SwiGLU<float> mlp(37, 53, 16);
  const auto pf = PackedSwiGLU<float>::from(mlp);
  auto pb = PackedSwiGLU<bf16>::from(mlp);
  for (Index n : kRowCounts) {
    const Matrix<float> x = test::rnd<float>(n, 37, 500 + n);
    const Matrix<float> y0 = mlp.forward(x);
    INFO("rows " << n);
    CHECK(rel(pf.forward(x), y0) <= 1e-6);
    if (n >= 3) CHECK(rel(pb.forward(x), y0) <= 3.5e-3);
    pb.set_threads(1);
    const Matrix<float> y1 = pb.forward(x);
    pb.set_threads(2);
    CHECK(bitwise_equal(pb.forward(x), y1));
  }
  Matrix<float> x = test::rnd<float>(5, 37, 9);
  const Matrix<float> y = pf.forward(x);
  pf.forward_into(x, x);  // in place
  CHECK(bitwise_equal(x, y));
}
