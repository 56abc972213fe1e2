// Loading the open MoE families' checkpoints (name_maps.hpp, and
// load_packed_moe under a family's names): a loaded checkpoint keeps its
// values — DeepSeek-V3's correction bias outside the balancer's [−1, 1]
// included, so the float and packed layers route alike.
#include <catch2/catch.hpp>

#include <apex/ffn/inference.hpp>
#include <apex/ffn/inference/packed_load.hpp>
#include <apex/ffn/moe.hpp>
#include <apex/ffn/name_maps.hpp>

#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "families.hpp"
#include "fixtures.hpp"
#include "sweep.hpp"
#include "tensor_files.hpp"

using namespace apex;
namespace fs = std::filesystem;

namespace {

const fs::path kData = fs::path(__FILE__).parent_path() / "data";

/// The fixture of family `f`, opened.
safetensors::Reader fixture(MoEFamily f) {
  return safetensors::Reader((kData / ("family_" + std::string(family_name(f)) + ".safetensors")).string());
}

/// The fixture's layer tensors (its test.* and grad.* references dropped).
std::vector<test::TensorData> layer_tensors(MoEFamily f) { return test::read_tensors(fixture(f), {"test.", "grad."}); }

safetensors::Reader reader(const std::vector<unsigned char>& bytes) {
  return safetensors::Reader::from_memory(bytes.data(), bytes.size());
}

}  // namespace

TEST_CASE("DeepSeek-V3: a correction bias outside [-1, 1] loads as stored, float and packed route alike",
          "[families][balancer][regression]") {
  // name_maps.hpp put e_score_correction_bias through LoadBalancer::set_bias,
  // which clamped it into [−1, 1]; load_packed_moe kept the file's values.
  // With the bias at 2 for experts 0–2 and 0.99 for the rest the float layer
  // routed on [1, 1, 1, .99, …] and most top-K entries differed from the
  // packed layer's. The clamp is now a rule of update()'s steps only.
  const MoEFamily f = MoEFamily::DeepSeekV3;
  const safetensors::Reader src = fixture(f);
  const std::string prefix = src.metadata().at("prefix");
  const MoEConfig cfg = test::fixture_config(f, src);
  std::vector<test::TensorData> ts = layer_tensors(f);
  test::TensorData* b = test::find_tensor(ts, prefix + "mlp.gate.e_score_correction_bias");
  REQUIRE(b);
  RowVector<float> want(cfg.n_experts);
  for (Index e = 0; e < cfg.n_experts; ++e) want(e) = float(b->values[std::size_t(e)] = e < 3 ? 2.0 : 0.99);
  const std::vector<unsigned char> bytes = test::write_tensors(ts);

  MoEFFN<float> moe(cfg, 7);
  load_family_checkpoint(reader(bytes), moe, f, prefix);
  CHECK(moe.balancer().bias() == want);
  PackedLoadOptions po;
  po.prefix = prefix;
  po.family = f;
  const auto packed = load_packed_moe<float>(reader(bytes), cfg, po);
  CHECK(packed.bias() == want);

  const Matrix<float> x = test::rnd<float>(64, cfg.d_model, 5, 2.0);
  MoEFFN<float>::Cache fc;
  PackedMoE<float>::Cache pc;
  const Matrix<float> y = moe.forward(x, &fc);
  const Matrix<float> yp = packed.forward(x, &pc);
  Index differ = 0;
  for (Index t = 0; t < x.rows(); ++t)
    for (Index k = 0; k < cfg.n_active; ++k) differ += fc.routing.experts(t, k) != pc.routing.experts(t, k);
  CHECK(differ == 0);
  CHECK((yp - y).norm() <= 1e-6 * y.norm());
  // And the packed copy of the loaded float layer is the loaded packed layer, bit for bit.
  CHECK(PackedMoE<float>::from(moe).forward(x) == yp);
  CHECK_NOTHROW(packed.check_source(moe));
}
