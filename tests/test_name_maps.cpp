// The Hugging Face name maps of the open MoE families (io/name_maps.hpp, and
// load_packed_moe under a family's names): a family checkpoint saves and
// loads under the family's names, another family's file and a missing
// correction bias are rejected, a loaded checkpoint keeps its values —
// DeepSeek-V3's correction bias outside the balancer's [−1, 1] included, so
// the float and packed layers route alike — and a rejected load leaves the
// layer as it was, whatever the reason (a missing, misshapen, mistyped or
// unexpected tensor, a NaN bias, another family's file).
#include <apex/ffn/inference.hpp>
#include <apex/ffn/inference/files/checkpoint/load.hpp>
#include <apex/ffn/io/name_maps.hpp>
#include <apex/ffn/layers/kappa_swiglu.hpp>
#include <apex/ffn/moe/families.hpp>
#include <apex/ffn/moe/moe_ffn.hpp>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include <unistd.h>

#include "families.hpp"
#include "fixtures.hpp"
#include "gradcheck.hpp"
#include "sweep.hpp"
#include "temp_dir.hpp"
#include "tensor_files.hpp"

using namespace apex;
using apex::test::random_matrix;
using apex::test::routed_config;

namespace {

namespace fs = std::filesystem;
namespace st = apex::safetensors;

using apex::test::fixture_config;
using apex::test::kFamilies;

}  // namespace

TEST_CASE("family checkpoints save and load under the family's names", "[routing][families][checkpoint]") {
  const fs::path dir = fs::temp_directory_path() / ("apex_routing_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  for (MoEFamily f : kFamilies) {
    INFO(family_name(f));
    MoEConfig cfg = family_preset(f);
    cfg.d_model = 4, cfg.d_ffn = 3, cfg.n_experts = 8, cfg.n_active = 2;
    if (cfg.n_shared) cfg.d_shared_ffn = 5;
    if (f == MoEFamily::DeepSeekV3) cfg.routing.n_groups = 4, cfg.routing.topk_group = 2;
    MoEFFN<double> a(cfg, 1), b(cfg, 2);
    a.balancer().set_bias(random_matrix(1, 8, 3, 0.1));
    const std::string path = (dir / (std::string(family_name(f)) + ".safetensors")).string();
    save_family_checkpoint(path, a, f, "model.layers.3.");
    const st::Reader file(path);
    const std::string block = f == MoEFamily::Mixtral ? "block_sparse_moe." : "mlp.";
    CHECK(file.header().find("model.layers.3." + block + "gate.weight"));
    CHECK(file.header().find("model.layers.3." + block + "experts.7." +
                             (f == MoEFamily::Mixtral ? "w2.weight" : "down_proj.weight")));
    CHECK(bool(file.header().find("model.layers.3.mlp.gate.e_score_correction_bias")) == (f == MoEFamily::DeepSeekV3));
    if (f == MoEFamily::DeepSeekV3) {
      CHECK(file.at("model.layers.3.mlp.gate.e_score_correction_bias").shape == std::vector<std::uint64_t>{8});
      CHECK(file.header().find("model.layers.3.mlp.shared_experts.up_proj.weight"));
    }
    if (f == MoEFamily::Qwen2MoE) {
      CHECK(file.header().find("model.layers.3.mlp.shared_expert.up_proj.weight"));
      CHECK(file.header().find("model.layers.3.mlp.shared_expert_gate.weight"));
    }
    const LoadResult r = load_family_checkpoint(file, b, f, "model.layers.3.");  // strict
    CHECK(r.loaded.size() == a.params().size() + (f == MoEFamily::DeepSeekV3 ? 1 : 0));
    const auto pa = a.params(), pb = b.params();
    for (std::size_t i = 0; i < pa.size(); ++i) CHECK(pa[i].value() == pb[i].value());
    if (f == MoEFamily::DeepSeekV3) CHECK(a.balancer().bias() == b.balancer().bias());
    else CHECK(b.balancer().bias().isZero());
  }
  fs::remove_all(dir);
}

TEST_CASE("family name maps reject another family's checkpoint and a missing correction bias",
          "[routing][families][errors]") {
  const fs::path data = fs::path(__FILE__).parent_path() / "data";
  auto load_as = [&](const char* file_family, MoEFamily as) {
    return [=] {
      const st::Reader file((data / ("family_" + std::string(file_family) + ".safetensors")).string());
      MoEFFN<double> moe(fixture_config(as, file), 1);
      LoadOptions lo;
      lo.allow_unexpected = true;
      load_family_checkpoint(file, moe, as, "model.layers.1.", lo);
    };
  };
  apex::test::run_sweep({
      {"mixtral map on a qwen3 file", load_as("qwen3_moe", MoEFamily::Mixtral), "FormatError",
       {"load_family_checkpoint", "mixtral name map", "another family", "qwen3_moe or olmoe"}},
      {"qwen3 map on a mixtral file", load_as("mixtral", MoEFamily::Qwen3MoE), "FormatError",
       {"qwen3_moe name map", "mixtral's"}},
      {"olmoe map on a deepseek file", load_as("deepseek_v3", MoEFamily::OLMoE), "FormatError",
       {"olmoe name map", "deepseek_v3's"}},
      {"deepseek map on a qwen2 file", load_as("qwen2_moe", MoEFamily::DeepSeekV3), "FormatError",
       {"deepseek_v3 name map", "qwen2_moe's"}},
      {"qwen2 map on an olmoe file", load_as("olmoe", MoEFamily::Qwen2MoE), "FormatError",
       {"qwen2_moe name map", "another family"}},
      {"shared experts that do not fit", [] {
         MoEConfig c = routed_config(8, 2, 2, RoutingConfig{});
         MoEFFN<double> moe(c, 1);
         family_params(moe, MoEFamily::Mixtral);
       }, "ConfigError", {"family_params", "mixtral", "n_shared = 2"}},
  });
  // A DeepSeek-V3 (sigmoid router) file without its e_score_correction_bias.
  const fs::path dir = fs::temp_directory_path() / ("apex_routing_bias_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  MoEConfig c = routed_config(8, 2, 1, family_routing(MoEFamily::DeepSeekV3));
  c.routing.n_groups = 4, c.routing.topk_group = 2;
  MoEFFN<double> moe(c, 1);
  const std::string path = (dir / "no_bias.safetensors").string();
  save_checkpoint(path, family_params(moe, MoEFamily::DeepSeekV3));
  apex::test::expect(apex::test::outcome([&] { load_family_checkpoint(path, moe, MoEFamily::DeepSeekV3); }),
                     "FormatError", {"sigmoid router", "correction bias", "'mlp.gate.e_score_correction_bias'"});
  fs::remove_all(dir);
}

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

/// Every parameter value and the balancing bias of `moe`, as bytes.
std::vector<unsigned char> snapshot(MoEFFN<float>& moe) {
  std::vector<unsigned char> out;
  const auto add = [&](const float* p, Index n) {
    const auto* b = reinterpret_cast<const unsigned char*>(p);
    out.insert(out.end(), b, b + n * Index(sizeof(float)));
  };
  for (const auto& p : moe.param_values()) add(p.value_data, p.size());
  add(moe.balancer().bias().data(), moe.balancer().bias().size());
  return out;
}

}  // namespace

TEST_CASE("DeepSeek-V3: a correction bias outside [-1, 1] loads as stored, float and packed route alike",
          "[families][balancer][regression]") {
  // io/name_maps.hpp put e_score_correction_bias through LoadBalancer::set_bias,
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

namespace {

/// One way to spoil a family file, and the error it must give.
struct Spoil {
  std::string what;
  std::vector<test::TensorData> tensors;
  std::string type;
  std::vector<std::string> names;  ///< substrings of the message
};

/// The ways to spoil family f's layer tensors `ts` (names under `prefix`).
std::vector<Spoil> spoils(MoEFamily f, const std::vector<test::TensorData>& ts, const std::string& prefix) {
  const std::string block = prefix + (f == MoEFamily::Mixtral ? "block_sparse_moe." : "mlp.");
  const std::string down = block + "experts.1." + (f == MoEFamily::Mixtral ? "w2.weight" : "down_proj.weight");
  std::vector<Spoil> out;
  out.push_back({"router weight missing", test::without(ts, block + "gate.weight"), "FormatError", {"missing"}});
  out.push_back({"an expert's down projection missing", test::without(ts, down), "FormatError", {"missing", down}});
  auto t = ts;
  std::swap(test::find_tensor(t, down)->shape[0], test::find_tensor(t, down)->shape[1]);
  out.push_back({"an expert's down projection transposed", t, "ShapeError", {"shape mismatch", down}});
  t = ts;
  test::find_tensor(t, down)->dtype = "I64";
  out.push_back({"an expert's down projection of dtype I64", t, "FormatError", {down, "I64"}});
  t = ts;
  t.push_back({block + "extra.weight", {2}, {1.0, 2.0}});
  out.push_back({"an unexpected tensor under the prefix", t, "FormatError", {"unexpected", "extra.weight"}});
  if (f != MoEFamily::DeepSeekV3) return out;
  const std::string bias = block + "gate.e_score_correction_bias";
  for (double v : {test::kNaN, test::kInf, -test::kInf}) {
    t = ts;
    test::find_tensor(t, bias)->values.back() = v;
    out.push_back({"the correction bias holding " + std::to_string(v), t, "ValueError", {bias, "NaN or Inf"}});
  }
  t = ts;
  test::find_tensor(t, bias)->values.push_back(0.5);
  test::find_tensor(t, bias)->shape[0] += 1;
  out.push_back({"the correction bias one entry too long", t, "ShapeError", {bias}});
  out.push_back({"the correction bias missing", test::without(ts, bias), "FormatError", {"correction bias"}});
  return out;
}

}  // namespace

TEST_CASE("a rejected family load leaves the layer as it was", "[families][checkpoint][sweeps]") {
  // Before, load_family_checkpoint wrote every weight and then had
  // LoadBalancer::set_bias reject a NaN correction bias: a half-loaded layer.
  for (MoEFamily f : test::kFamilies) {
    const safetensors::Reader src = fixture(f);
    const std::string prefix = src.metadata().at("prefix");
    const MoEConfig cfg = test::fixture_config(f, src);
    const std::vector<test::TensorData> ts = layer_tensors(f);
    {
      MoEFFN<float> moe(cfg, 3);
      REQUIRE_NOTHROW(load_family_checkpoint(reader(test::write_tensors(ts)), moe, f, prefix));  // strict
    }
    for (const Spoil& s : spoils(f, ts, prefix)) {
      INFO(family_name(f) << ": " << s.what);
      const std::vector<unsigned char> bytes = test::write_tensors(s.tensors);
      MoEFFN<float> moe(cfg, 11);
      moe.balancer().set_bias(test::rnd<float>(1, cfg.n_experts, 12, 0.5));
      const std::vector<unsigned char> before = snapshot(moe);
      test::expect(test::outcome([&] { load_family_checkpoint(reader(bytes), moe, f, prefix); }), s.type,
                   s.names);
      CHECK(snapshot(moe) == before);
      // The packed loader under the family's names rejects the same file,
      // before it packs any expert.
      PackedLoadOptions po;
      po.prefix = prefix;
      po.family = f;
      const auto log = std::make_shared<test::LoggingSource::Log>();
      const safetensors::Reader logged = test::logged_reader(bytes, log);
      test::expect(test::outcome([&] { (void)load_packed_moe<float>(logged, cfg, po); }), s.type, s.names);
      for (const std::string& name : test::tensors_read(logged, *log)) {
        INFO("read " << name);
        CHECK(name.find("experts") == std::string::npos);
      }
    }
  }
}

TEST_CASE("family checkpoints load from Hugging Face sharded folders", "[families][checkpoint][sharded]") {
  // How the families publish their models: shards and model.safetensors.index.json.
  for (MoEFamily f : test::kFamilies) {
    INFO(family_name(f));
    const safetensors::Reader src = fixture(f);
    const std::string prefix = src.metadata().at("prefix");
    const MoEConfig cfg = test::fixture_config(f, src);
    const std::vector<unsigned char> layer = test::write_tensors(layer_tensors(f));
    MoEFFN<float> want(cfg, 3), got(cfg, 4);
    REQUIRE_NOTHROW(load_family_checkpoint(reader(layer), want, f, prefix));
    test::TempDir dir;
    const std::string index = test::write_sharded(reader(layer), dir.path, 3);
    const LoadResult r = load_family_checkpoint(dir.path.string(), got, f, prefix);  // the folder, strict
    CHECK(r.missing.empty());
    CHECK(snapshot(got) == snapshot(want));
    MoEFFN<float> again(cfg, 5);
    load_family_checkpoint(index, again, f, prefix);  // the index file
    CHECK(snapshot(again) == snapshot(want));
  }
}

TEST_CASE("a rejected sharded family load leaves the layer as it was", "[families][checkpoint][sharded][sweeps]") {
  for (MoEFamily f : test::kFamilies) {
    const safetensors::Reader src = fixture(f);
    const std::string prefix = src.metadata().at("prefix");
    const MoEConfig cfg = test::fixture_config(f, src);
    const std::vector<test::TensorData> ts = layer_tensors(f);
    for (const Spoil& s : spoils(f, ts, prefix)) {
      INFO(family_name(f) << ": " << s.what);
      test::TempDir dir;
      test::write_sharded(reader(test::write_tensors(s.tensors)), dir.path, 2);
      MoEFFN<float> moe(cfg, 11);
      moe.balancer().set_bias(test::rnd<float>(1, cfg.n_experts, 12, 0.5));
      const std::vector<unsigned char> before = snapshot(moe);
      // The messages differ from a one-file load where the index speaks
      // ("the index does not name" for a missing tensor); the type does not.
      test::expect(test::outcome([&] { load_family_checkpoint(dir.path.string(), moe, f, prefix); }), s.type, {});
      CHECK(snapshot(moe) == before);
    }
  }
  // Another family's folder.
  const safetensors::Reader mixtral = fixture(MoEFamily::Mixtral);
  test::TempDir dir;
  test::write_sharded(reader(test::write_tensors(layer_tensors(MoEFamily::Mixtral))), dir.path, 2);
  MoEFFN<float> moe(test::fixture_config(MoEFamily::Qwen3MoE, mixtral), 1);
  LoadOptions lo;
  lo.allow_unexpected = true;
  test::expect(test::outcome([&] {
                 load_family_checkpoint(dir.path.string(), moe, MoEFamily::Qwen3MoE, mixtral.metadata().at("prefix"), lo);
               }),
               "FormatError", {"model.safetensors.index.json", "qwen3_moe name map", "mixtral's"});
}
