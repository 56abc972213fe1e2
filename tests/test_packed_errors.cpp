// What the packed inference layers reject, with typed errors: a stale copy
// (check_source after the source layer changed), bad input to forward,
// options a layer does not support, and misshapen parts to the assembling
// constructors.
#include <catch2/catch.hpp>

#include <apex/ffn/inference.hpp>
#include <apex/ffn/layers/kappa_swiglu.hpp>

#include <limits>
#include <utility>
#include <vector>

#include "fixtures.hpp"
#include "packed_layers.hpp"

using namespace apex;
using apex::packed::bf16;
using apex::test::full_config;
using apex::test::odd_config;
using apex::test::set_bias;
using Catch::Matchers::Message;

TEST_CASE("a packed copy of a changed source is reported stale", "[inference][errors]") {
  MoEFFN<float> moe(odd_config(1), 41);
  const auto p = PackedMoE<bf16>::from(moe);
  CHECK_NOTHROW(p.check_source(moe));
  // An optimiser step: every weight moves.
  for (auto& q : moe.params())
    for (Index i = 0; i < q.size(); ++i) q.value_data[i] *= 1.001f;
  CHECK_THROWS_MATCHES(p.check_source(moe), ValueError,
                       Message("PackedMoE::check_source: the source layer's weights changed since this layer was "
                               "packed (stale copy); rebuild it with PackedMoE::from"));
  CHECK_NOTHROW(PackedMoE<bf16>::from(moe).check_source(moe));
  MoEFFN<float> other(test::moe_config(5, 2, 1, 37, 64), 41);
  CHECK_THROWS_AS(p.check_source(other), ShapeError);
  // The balancing bias counts too: it changes selection.
  MoEFFN<float> biased(odd_config(1), 41);
  const auto q = PackedMoE<float>::from(biased);
  set_bias(biased, 3);
  CHECK_THROWS_AS(q.check_source(biased), ValueError);
  SwiGLU<float> mlp(8, 12, 1);
  const auto d = PackedSwiGLU<float>::from(mlp);
  mlp.w_down() *= 2.0f;
  CHECK_THROWS_AS(d.check_source(mlp), ValueError);
}

TEST_CASE("packed layers reject bad input with typed errors", "[inference][errors]") {
  MoEFFN<float, KappaSwiGLU<float>> moe(odd_config(1), 51);
  auto p = PackedMoE<bf16, KappaSwiGLU<float>>::from(moe);
  CHECK_THROWS_AS(p.forward(test::rnd<float>(2, 36, 1)), ShapeError);
  Matrix<float> x = test::rnd<float>(2, 37, 1);
  x(1, 3) = std::numeric_limits<float>::quiet_NaN();
  CHECK_THROWS_AS(p.forward(x), ValueError);  // non-finite router logits, as the float layer
  if (packed::cpu_supports(packed::Isa::avx512_bf16)) {
    p.set_kernel_options({packed::Isa::avx512_bf16, packed::Bf16Products::paired});
    CHECK_THROWS_MATCHES(p.forward(test::rnd<float>(2, 37, 1)), ConfigError,
                         Message("PackedMoE::forward: bf16_products = paired is not supported for kappa-SwiGLU "
                                 "experts"));
  }
  // The assembling constructor: the shared gate weight and the shared width.
  const MoEConfig gc = full_config(1, 43, Scoring::SoftmaxAll, 0.0);
  const auto g = PackedMoE<float>::from(MoEFFN<float>(gc, 52));
  const auto assemble = [&](const MoEConfig& c, std::vector<packed::PackedExpert> shared, Matrix<float> gate) {
    return PackedMoE<float>(c, g.router().weight(), g.bias(), g.experts(), {}, std::move(shared), std::move(gate));
  };
  CHECK_NOTHROW(assemble(gc, g.shared_experts(), g.shared_gate_weight()));
  CHECK_THROWS_CONTAINING(assemble(gc, g.shared_experts(), Matrix<float>()), ShapeError,
                          "PackedMoE: argument 'shared_gate' has shape [0 x 0], expected [1 x 37]");
  CHECK_THROWS_CONTAINING(assemble(gc, g.shared_experts(), Matrix<float>::Zero(37, 1)), ShapeError, "shared_gate");
  MoEConfig ungated = gc;
  ungated.shared_expert_gate = false;
  CHECK_THROWS_CONTAINING(assemble(ungated, g.shared_experts(), g.shared_gate_weight()), ShapeError,
                          "shared_gate (config.shared_expert_gate is off)");
  MoEConfig narrow = gc;
  narrow.d_shared_ffn = 0;  // the routed width, 53
  CHECK_THROWS_CONTAINING(assemble(narrow, g.shared_experts(), g.shared_gate_weight()), ShapeError,
                          "PackedMoE: argument 'shared' has shape [43 x 37], expected [53 x 37]");
  const auto f = PackedSwiGLU<float>::from(SwiGLU<float>(8, 12, 1));
  // Storage is the type from() and the loaders pack to; assembled weights keep their own
  CHECK(PackedSwiGLU<bf16>(f.weights()).weights().dtypes() == packed::ExpertDtypes(packed::Dtype::f32));
}
