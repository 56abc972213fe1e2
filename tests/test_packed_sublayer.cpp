// The packed sublayer (pack_sublayer): the same skip decisions as the float
// FFNSublayer it packs, and its output within float or bf16 rounding, for the
// gated MoE sublayer and the ungated dense one.
#include <catch2/catch.hpp>

#include <apex/ffn/inference.hpp>

#include "fixtures.hpp"
#include "packed_layers.hpp"

using namespace apex;
using apex::packed::bf16;
using apex::test::kRowCounts;
using apex::test::odd_config;
using apex::test::rel;

TEST_CASE("packed sublayer: skip decisions identical to the float sublayer", "[inference][skip]") {
  const MoEConfig cfg = odd_config(1);
  FFNSublayer<float, MoEFFN<float>> sub(37, MoEFFN<float>(cfg, 17), SkipGate<float>(test::gate_config(37, 8, 0.9), 3));
  sub.set_mode(SublayerMode::inference);
  const auto pf = pack_sublayer<float>(sub);
  const auto pb = pack_sublayer<bf16>(sub);
  for (Index n : kRowCounts) {
    const Matrix<float> x = test::rnd<float>(n, 37, 600 + n, 3.0);
    FFNSublayer<float, MoEFFN<float>>::Cache c0;
    PackedSublayer<PackedMoE<float>>::Cache c1;
    PackedSublayer<PackedMoE<bf16>>::Cache c2;
    const Matrix<float> y0 = sub.forward(x, &c0);
    const Matrix<float> y1 = pf.forward(x, &c1), y2 = pb.forward(x, &c2);
    INFO("rows " << n << ", kept " << c0.kept.size());
    CHECK(c1.kept == c0.kept);
    CHECK(c2.kept == c0.kept);
    CHECK(rel(y1, y0) <= 1e-6);
    CHECK(rel(y2 - x, y0 - x) <= 3.5e-3);
    if (n == 301) {
      CHECK(c0.kept.size() > 0);  // the threshold splits the batch
      CHECK(c0.kept.size() < 301);
    }
  }
  // The dense sublayer, ungated.
  FFNSublayer<float, SwiGLU<float>> dense(37, SwiGLU<float>(37, 53, 18));
  const auto pd = pack_sublayer<bf16>(dense);
  const Matrix<float> x = test::rnd<float>(7, 37, 19);
  CHECK(rel(pd.forward(x) - x, dense.forward(x) - x) <= 3.5e-3);
}
