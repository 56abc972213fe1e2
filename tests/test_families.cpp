// The open MoE families' table (moe/families.hpp): each preset has its
// published shapes and routing, and each family's block reproduces its
// PyTorch reference (the committed tests/data/family_*.safetensors, or a fresh
// set that routing_interop.cmake generates).
#include <apex/ffn/inference.hpp>
#include <apex/ffn/io/name_maps.hpp>
#include <apex/ffn/layers/kappa_swiglu.hpp>
#include <apex/ffn/moe/families.hpp>
#include <apex/ffn/moe/moe_ffn.hpp>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <limits>

#include <unistd.h>

#include "families.hpp"
#include "fixtures.hpp"
#include "gradcheck.hpp"
#include "sweep.hpp"

using namespace apex;

namespace {

namespace fs = std::filesystem;
namespace st = apex::safetensors;

using apex::test::fixture_config;
using apex::test::kFamilies;
using apex::test::read_tensor;

double rel_error(const Matrix<double>& a, const Matrix<double>& b) {
  const double scale = std::max(a.norm(), b.norm());
  return scale > 0 ? (a - b).norm() / scale : 0.0;
}

}  // namespace

TEST_CASE("family presets have their published shapes and routing", "[routing][families]") {
  const MoEConfig ds = deepseek_v3_moe();
  CHECK(ds.d_model == 7168);
  CHECK(ds.n_experts == 256);
  CHECK(ds.n_active == 8);
  CHECK(ds.n_shared == 1);
  CHECK(ds.routing.scoring == Scoring::Sigmoid);
  CHECK(ds.routing.n_groups == 8);
  CHECK(ds.routing.topk_group == 4);
  CHECK(ds.routing.routed_scale == 2.5);
  CHECK(mixtral_8x7b_moe().n_experts == 8);
  CHECK(mixtral_8x7b_moe().n_active == 2);
  CHECK(qwen2_moe_a2_7b_moe().shared_ffn() == 5632);
  CHECK(qwen2_moe_a2_7b_moe().shared_expert_gate);
  CHECK_FALSE(qwen2_moe_a2_7b_moe().routing.renormalize);
  CHECK(qwen3_moe_30b_a3b_moe().routing.renormalize);
  CHECK_FALSE(olmoe_1b_7b_moe().routing.renormalize);
  for (MoEFamily f : kFamilies) {
    INFO(family_name(f));
    CHECK_NOTHROW(family_preset(f).validate());
    CHECK(family_by_name(family_name(f)) == f);
  }
  apex::test::expect(apex::test::outcome([] { family_by_name("llama"); }), "ConfigError", {"llama", "family"});
}

TEST_CASE("each family's block matches its PyTorch reference", "[routing][families][reference]") {
  // The committed fixtures, and a fresh set when routing_interop.cmake made one.
  std::vector<fs::path> dirs{fs::path(__FILE__).parent_path() / "data"};
  if (const char* d = std::getenv("APEX_FFN_FAMILY_DIR")) dirs.emplace_back(d);
  for (const fs::path& data : dirs)
  for (MoEFamily f : kFamilies) {
    const std::string path = (data / ("family_" + std::string(family_name(f)) + ".safetensors")).string();
    INFO(path);
    REQUIRE(fs::exists(path));
    const st::Reader file(path);
    REQUIRE(file.metadata().at("family") == family_name(f));
    const std::string prefix = file.metadata().at("prefix");
    const MoEConfig cfg = fixture_config(f, file);
    MoEFFN<double> moe(cfg, 7);
    LoadOptions lo;
    lo.allow_unexpected = true;  // the test.* and grad.* tensors
    const LoadResult r = load_family_checkpoint(file, moe, f, prefix, lo);
    CHECK(r.missing.empty());
    const Index n = file.at("test.x").shape[0], d = cfg.d_model, k = cfg.n_active;
    const Matrix<double> x = read_tensor(file, "test.x", n, d);
    MoEFFN<double>::Cache cache;
    const Matrix<double> y = moe.forward(x, &cache);
    CHECK(rel_error(y, read_tensor(file, "test.y", n, d)) <= 1e-10);
    const Matrix<double> experts = read_tensor(file, "test.experts", n, k);
    for (Index t = 0; t < n; ++t)
      for (Index j = 0; j < k; ++j) CHECK(cache.routing.experts(t, j) == Index(experts(t, j)));
    const Matrix<double> dx = moe.backward(read_tensor(file, "test.dy", n, d), cache);
    CHECK(rel_error(dx, read_tensor(file, "test.dx", n, d)) <= 1e-10);
    for (const auto& p : family_params(moe, f, prefix)) {
      INFO(p.name);
      CHECK(rel_error(p.grad(), read_tensor(file, "grad." + p.name, p.rows, p.cols)) <= 1e-10);
    }
  }
}
