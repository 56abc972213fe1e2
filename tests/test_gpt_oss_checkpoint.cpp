// gpt-oss checkpoints (io/gpt_oss_checkpoint.hpp) against the fixtures of
// tools/gpt_oss_reference.py (Hugging Face's modelling code in float64): the
// dense fixture's forward, backward, gradients and routing; the MXFP4
// fixture's dequantized weights bit for bit and its forward; a save → load
// round trip (one file and a sharded folder); each malformed file's typed
// error and an unchanged layer; and the gpt-oss config.json reader.
#include <apex/ffn/io/gpt_oss_checkpoint.hpp>
#include <apex/ffn/io/hf_config.hpp>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include "families.hpp"
#include "fuzz/fuzz_gpt_oss.hpp"
#include "fuzz/replay.hpp"
#include "sweep.hpp"
#include "temp_dir.hpp"

using namespace apex;
using apex::test::read_tensor;
namespace st = apex::safetensors;
namespace fs = std::filesystem;

namespace {

const std::string kGptOssPrefix = "model.layers.1.";

std::string gptoss_fixture(const char* name) { return (fs::path(__FILE__).parent_path() / "data" / name).string(); }

/// The layer configuration of a fixture, from its metadata (d, f, E, K).
MoEConfig gptoss_fixture_config(const st::Reader& file) {
  const nlohmann::json j = nlohmann::json::parse(file.metadata().at("config"));
  return gpt_oss_moe(j["d"].get<Index>(), j["f"].get<Index>(), j["E"].get<Index>(), j["K"].get<Index>());
}

/// Every element of tensor `name`, in double.
std::vector<double> gptoss_values(const st::Reader& file, const std::string& name) {
  const st::TensorInfo& t = file.at(name);
  std::vector<double> v(std::size_t(t.numel()));
  file.read(t, v.data());
  return v;
}

double gptoss_rel(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) num += (a[i] - b[i]) * (a[i] - b[i]), den += b[i] * b[i];
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-300);
}

double gptoss_rel(const Matrix<double>& a, const Matrix<double>& b) { return (a - b).norm() / b.norm(); }

template <class T>
bool gptoss_same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

/// A copy of every parameter value, to prove a rejected load changed nothing.
template <class T>
std::vector<std::vector<T>> gptoss_snapshot(GptOssMoE<T>& moe) {
  std::vector<std::vector<T>> out;
  for (const auto& p : moe.param_values()) out.emplace_back(p.value_data, p.value_data + p.size());
  return out;
}

/// One tensor of a file as stored: what a malformed copy is made of.
struct GptOssRaw {
  std::string name;
  st::DType dtype;
  std::vector<std::uint64_t> shape;
  std::vector<unsigned char> bytes;
};

std::vector<GptOssRaw> gptoss_raw(const std::string& path, bool weights_only) {
  const st::Reader file(path);
  std::vector<GptOssRaw> out;
  for (const auto& t : file.tensors()) {
    if (weights_only && t.name.rfind(kGptOssPrefix, 0) != 0) continue;
    GptOssRaw r{t.name, t.dtype, t.shape, std::vector<unsigned char>(std::size_t(t.nbytes()))};
    file.read_bytes(t, r.bytes.data());
    out.push_back(std::move(r));
  }
  return out;
}

void gptoss_write_raw(const std::string& path, const std::vector<GptOssRaw>& tensors) {
  std::vector<st::RawTensor> raw;
  for (const auto& t : tensors) raw.push_back(st::raw_tensor(t.name, t.dtype, t.shape, t.bytes.data()));
  st::save_raw(path, raw);
}

GptOssRaw& gptoss_find(std::vector<GptOssRaw>& tensors, const std::string& short_name) {
  for (auto& t : tensors)
    if (t.name == kGptOssPrefix + short_name) return t;
  FAIL("no tensor " << short_name);
  throw;
}

void gptoss_erase(std::vector<GptOssRaw>& tensors, const std::string& short_name) {
  for (auto it = tensors.begin(); it != tensors.end(); ++it)
    if (it->name == kGptOssPrefix + short_name) return void(tensors.erase(it));
  FAIL("no tensor " << short_name);
}

}  // namespace

TEST_CASE("gpt-oss checkpoint: the dense fixture matches Hugging Face's block",
          "[gpt_oss][checkpoint][families][reference]") {
  // The committed fixture, and a fresh one when routing_interop.cmake made one.
  std::vector<std::string> paths{gptoss_fixture("family_gpt_oss.safetensors")};
  if (const char* dir = std::getenv("APEX_FFN_FAMILY_DIR"))
    paths.push_back((fs::path(dir) / "family_gpt_oss.safetensors").string());
  for (const std::string& path : paths) {
  INFO(path);
  REQUIRE(fs::exists(path));
  const st::Reader file(path);
  REQUIRE(file.metadata().at("family") == "gpt_oss");
  REQUIRE(file.metadata().at("prefix") == kGptOssPrefix);
  const MoEConfig cfg = gptoss_fixture_config(file);
  GptOssMoE<double> moe(cfg, 7);
  LoadOptions lo;
  lo.allow_unexpected = true;  // the test.* and grad.* tensors
  const LoadResult r = load_gpt_oss_checkpoint(file, moe, kGptOssPrefix, lo);
  CHECK(r.loaded.size() == 6);
  CHECK(r.missing.empty());
  const Index n = Index(file.at("test.x").shape[0]), d = cfg.d_model, k = cfg.n_active;
  const Matrix<double> x = read_tensor(file, "test.x", n, d);
  GptOssMoE<double>::Cache cache;
  const Matrix<double> y = moe.forward(x, &cache);
  CHECK(gptoss_rel(y, read_tensor(file, "test.y", n, d)) <= 1e-10);
  const Matrix<double> experts = read_tensor(file, "test.experts", n, k);
  for (Index t = 0; t < n; ++t)
    for (Index j = 0; j < k; ++j) CHECK(cache.routing.experts(t, j) == Index(experts(t, j)));
  moe.zero_grad();
  const Matrix<double> dx = moe.backward(read_tensor(file, "test.dy", n, d), cache);
  CHECK(gptoss_rel(dx, read_tensor(file, "test.dx", n, d)) <= 1e-10);

  namespace nm = gpt_oss_names;
  const auto g = gpt_oss_fused(moe, true);  // the layer's gradients in Hugging Face's layout
  const std::vector<std::pair<const char*, const std::vector<double>*>> grads{
      {nm::kRouterWeight, &g.router_w}, {nm::kRouterBias, &g.router_b}, {nm::kGateUp, &g.gate_up},
      {nm::kGateUpBias, &g.gate_up_b},  {nm::kDown, &g.down},           {nm::kDownBias, &g.down_b}};
  for (const auto& [name, mine] : grads) {
    INFO(name);
    CHECK(gptoss_rel(*mine, gptoss_values(file, "grad." + kGptOssPrefix + name)) <= 1e-10);
  }
  }
}

TEST_CASE("gpt-oss checkpoint: the MXFP4 experts dequantize exactly", "[gpt_oss][checkpoint][mxfp4]") {
  const st::Reader file(gptoss_fixture("family_gpt_oss_mxfp4.safetensors"));
  REQUIRE(file.metadata().at("experts_format") == "mxfp4");
  const MoEConfig cfg = gptoss_fixture_config(file);
  LoadOptions lo;
  lo.allow_unexpected = true;
  const Index n = Index(file.at("test.x").shape[0]), d = cfg.d_model, k = cfg.n_active;
  const Matrix<double> x = read_tensor(file, "test.x", n, d), y_ref = read_tensor(file, "test.y", n, d);
  const Matrix<double> experts = read_tensor(file, "test.experts", n, k);

  GptOssMoE<double> moe(cfg, 3);
  const LoadResult r = load_gpt_oss_checkpoint(file, moe, kGptOssPrefix, lo);
  CHECK(r.loaded.size() == 8);  // 4 dense + 2 × (blocks, scales)
  const auto h = gpt_oss_fused(moe);
  CHECK(gptoss_same_bits(h.gate_up, gptoss_values(file, "test.gate_up_proj")));
  CHECK(gptoss_same_bits(h.down, gptoss_values(file, "test.down_proj")));
  std::size_t negative_zeros = 0;
  for (double v : h.gate_up) negative_zeros += v == 0 && std::signbit(v);
  CHECK(negative_zeros > 0);  // code 8 kept its sign
  GptOssMoE<double>::Cache cache;
  CHECK(gptoss_rel(moe.forward(x, &cache), y_ref) <= 1e-10);
  for (Index t = 0; t < n; ++t)
    for (Index j = 0; j < k; ++j) CHECK(cache.routing.experts(t, j) == Index(experts(t, j)));

  GptOssMoE<float> moef(cfg, 3);
  load_gpt_oss_checkpoint(file, moef, kGptOssPrefix, lo);
  const auto hf = gpt_oss_fused(moef);
  std::vector<float> want(h.gate_up.begin(), h.gate_up.end());  // exact in float: small significands
  CHECK(gptoss_same_bits(hf.gate_up, want));
  want.assign(h.down.begin(), h.down.end());
  CHECK(gptoss_same_bits(hf.down, want));
  // float rounding of sums of d = 64 products of weights up to 48: within 1e-5 of the norm
  CHECK(gptoss_rel(Matrix<double>(moef.forward(x.cast<float>()).cast<double>()), y_ref) <= 1e-5);
}

TEST_CASE("gpt-oss checkpoint: save then load is bit for bit, in one file and sharded", "[gpt_oss][checkpoint]") {
  const std::string fixture = gptoss_fixture("family_gpt_oss.safetensors");
  const st::Reader file(fixture);
  const MoEConfig cfg = gptoss_fixture_config(file);
  LoadOptions lo;
  lo.allow_unexpected = true;
  GptOssMoE<double> a(cfg, 7);
  load_gpt_oss_checkpoint(file, a, kGptOssPrefix, lo);
  apex::test::TempDir dir;
  const std::string path = dir / "model-00001-of-00001.safetensors";
  save_gpt_oss_checkpoint(path, a, kGptOssPrefix);

  // The saved tensors are the fixture's inputs, byte for byte, under the same names, dtypes and shapes.
  const std::vector<GptOssRaw> saved = gptoss_raw(path, false), given = gptoss_raw(fixture, true);
  REQUIRE(saved.size() == 6);
  REQUIRE(given.size() == 6);
  for (const auto& s : saved) {
    INFO(s.name);
    bool found = false;
    for (const auto& g : given) {
      if (g.name != s.name) continue;
      found = true;
      CHECK(g.dtype == s.dtype);
      CHECK(g.shape == s.shape);
      CHECK(g.bytes == s.bytes);
    }
    CHECK(found);
  }
  CHECK(st::Reader(path).metadata().at("format") == "pt");

  GptOssMoE<double> b(cfg, 99);
  load_gpt_oss_checkpoint(path, b, kGptOssPrefix);  // strict: only the block's tensors
  const auto va = gptoss_snapshot(a), vb = gptoss_snapshot(b);
  REQUIRE(va.size() == vb.size());
  for (std::size_t i = 0; i < va.size(); ++i) CHECK(gptoss_same_bits(va[i], vb[i]));

  // A Hugging Face sharded folder: the index names the six tensors and another layer's.
  const std::string other = dir / "model-00002-of-00002.safetensors";
  const double one = 1.0;
  st::save_raw(other, {st::raw_tensor("model.layers.2.mlp.router.bias", st::DType::F64, {1}, &one)});
  ShardIndex index;
  for (const auto& s : saved) index.weight_map[s.name] = "model-00001-of-00001.safetensors";
  index.weight_map["model.layers.2.mlp.router.bias"] = "model-00002-of-00002.safetensors";
  write_shard_index(dir / kShardIndexName, index);
  GptOssMoE<double> c(cfg, 98);
  const LoadResult r = load_gpt_oss_checkpoint(dir.path.string(), c, kGptOssPrefix);
  CHECK(r.loaded.size() == 6);
  const auto vc = gptoss_snapshot(c);
  for (std::size_t i = 0; i < va.size(); ++i) CHECK(gptoss_same_bits(va[i], vc[i]));

  // The index places a tensor in a shard that lacks it.
  index.weight_map[kGptOssPrefix + "mlp.experts.extra"] = "model-00002-of-00002.safetensors";
  write_shard_index(dir / kShardIndexName, index);
  GptOssMoE<double> e(cfg, 97);
  const auto before = gptoss_snapshot(e);
  apex::test::expect(apex::test::outcome([&] { load_gpt_oss_checkpoint(dir.path.string(), e, kGptOssPrefix); }),
                     "FormatError", {"mlp.experts.extra", "model-00002-of-00002.safetensors"});
  CHECK(gptoss_snapshot(e) == before);
}

TEST_CASE("gpt-oss checkpoint: a save refuses values its load refuses and leaves the previous file",
          "[gpt_oss][checkpoint][errors][regression]") {
  // save_gpt_oss_checkpoint wrote a layer holding NaN (a diverged run), or a
  // double beyond float's range saved as F32, over the previous file, and
  // load_gpt_oss_checkpoint refuses both (ValueError). Fixed: the save
  // applies the load's rule to the values as stored, before any file.
  const st::Reader file(gptoss_fixture("family_gpt_oss.safetensors"));
  const MoEConfig cfg = gptoss_fixture_config(file);
  LoadOptions lo;
  lo.allow_unexpected = true;
  GptOssMoE<double> a(cfg, 7), b(cfg, 8);
  load_gpt_oss_checkpoint(file, a, kGptOssPrefix, lo);
  apex::test::TempDir dir;
  const std::string path = dir / "model.safetensors";
  save_gpt_oss_checkpoint(path, a, kGptOssPrefix);
  const auto bytes = [](const std::string& p) {
    std::ifstream f(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  };
  const std::string before = bytes(path);
  const auto set_router = [&](double x) {
    for (auto& p : a.param_values())
      if (p.name == "router.weight") p.value()(0, 1) = x;
  };
  SaveOptions so;
  std::string want;
  SECTION("NaN in the router") {
    set_router(std::numeric_limits<double>::quiet_NaN());
    want = "mlp.router.weight' contains NaN or Inf: NaN at element 1 (as F64 stores it";
  }
  SECTION("a double beyond float's range, saved as F32") {
    set_router(1e39);
    so.dtype = st::DType::F32;
    want = "mlp.router.weight' contains NaN or Inf: 1e+39 (+Inf) at element 1 (as F32 stores it";
  }
  CHECK_THROWS_AS(save_gpt_oss_checkpoint(path, a, kGptOssPrefix, so), ValueError);
  CHECK_THROWS_WITH(save_gpt_oss_checkpoint(path, a, kGptOssPrefix, so),
                    Catch::Matchers::Contains("save_gpt_oss_checkpoint: tensor '") && Catch::Matchers::Contains(want));
  CHECK(bytes(path) == before);  // the previous file, whole
  CHECK(dir.entries() == 1);     // and no temporary file left
  load_gpt_oss_checkpoint(path, b, kGptOssPrefix);
}

TEST_CASE("gpt-oss checkpoint: malformed files give typed errors and change nothing", "[gpt_oss][checkpoint][errors]") {
  const std::string dense = gptoss_fixture("family_gpt_oss.safetensors");
  const std::string mxfp4 = gptoss_fixture("family_gpt_oss_mxfp4.safetensors");
  const MoEConfig cfg = gptoss_fixture_config(st::Reader(dense));
  const MoEConfig cfg4 = gptoss_fixture_config(st::Reader(mxfp4));
  apex::test::TempDir dir;
  int n = 0;
  // Writes `tensors` and loads them into a fresh layer of `c`; the outcome, with the layer checked unchanged.
  auto attempt = [&](const std::vector<GptOssRaw>& tensors, const MoEConfig& c, bool allow_unexpected = false) {
    const std::string path = dir / ("bad" + std::to_string(n++) + ".safetensors");
    gptoss_write_raw(path, tensors);
    GptOssMoE<double> moe(c, 5);
    const auto before = gptoss_snapshot(moe);
    LoadOptions lo;
    lo.allow_unexpected = allow_unexpected;
    const std::string got = apex::test::outcome([&] { load_gpt_oss_checkpoint(path, moe, kGptOssPrefix, lo); });
    if (got != "returned") CHECK(gptoss_snapshot(moe) == before);  // a rejected load wrote nothing
    return got;
  };
  using apex::test::expect;
  const auto base = gptoss_raw(dense, true), base4 = gptoss_raw(mxfp4, true);
  CHECK(attempt(base, cfg) == "returned");
  CHECK(attempt(base4, cfg4) == "returned");

  SECTION("a missing tensor") {
    auto t = base;
    gptoss_erase(t, "mlp.experts.down_proj_bias");
    expect(attempt(t, cfg), "FormatError", {"missing", "mlp.experts.down_proj_bias"});
    t = base4;
    gptoss_erase(t, "mlp.experts.down_proj_scales");
    expect(attempt(t, cfg4), "FormatError", {"mlp.experts.down_proj_scales", "MXFP4"});
  }
  SECTION("both the dense and the MXFP4 form") {
    auto t = base4;
    GptOssRaw extra{kGptOssPrefix + "mlp.experts.gate_up_proj", st::DType::F64, {4, 64, 64},
                    std::vector<unsigned char>(4 * 64 * 64 * 8)};
    t.push_back(extra);
    expect(attempt(t, cfg4), "FormatError", {"mlp.experts.gate_up_proj", "both", "_blocks"});
  }
  SECTION("a wrong shape names the tensor, the shape found and the shape wanted") {
    auto t = base;
    gptoss_find(t, "mlp.router.weight").shape = {4, 6};
    expect(attempt(t, cfg), "ShapeError", {"mlp.router.weight", "[4, 6]", "[6, 4]"});
    t = base4;
    gptoss_find(t, "mlp.experts.down_proj_scales").shape = {4, 32, 2};
    gptoss_find(t, "mlp.experts.down_proj_scales").bytes.resize(4 * 32 * 2);
    expect(attempt(t, cfg4), "ShapeError", {"mlp.experts.down_proj_scales", "[4, 32, 2]", "[4, 64, 1]"});
  }
  SECTION("a wrong dtype") {
    auto t = base;
    gptoss_find(t, "mlp.experts.gate_up_proj_bias").dtype = st::DType::I64;
    expect(attempt(t, cfg), "FormatError", {"mlp.experts.gate_up_proj_bias", "I64"});
    t = base4;
    gptoss_find(t, "mlp.experts.gate_up_proj_blocks").dtype = st::DType::I8;
    expect(attempt(t, cfg4), "FormatError", {"mlp.experts.gate_up_proj_blocks", "I8", "U8"});
  }
  SECTION("MXFP4 needs widths that are multiples of 32") {
    auto t = base;  // d = 4: the gate_up blocks would hold 32 inputs each
    gptoss_erase(t, "mlp.experts.gate_up_proj");
    t.push_back({kGptOssPrefix + "mlp.experts.gate_up_proj_blocks", st::DType::U8, {6, 6, 1, 16},
                 std::vector<unsigned char>(6 * 6 * 16)});
    t.push_back({kGptOssPrefix + "mlp.experts.gate_up_proj_scales", st::DType::U8, {6, 6, 1},
                 std::vector<unsigned char>(6 * 6, 127)});
    expect(attempt(t, cfg), "ShapeError", {"mlp.experts.gate_up_proj_blocks", "multiple of 32"});
  }
  SECTION("NaN, Inf and the NaN scale") {
    auto t = base;
    const double nan = std::numeric_limits<double>::quiet_NaN();
    std::memcpy(gptoss_find(t, "mlp.experts.down_proj").bytes.data() + 8 * 5, &nan, 8);
    expect(attempt(t, cfg), "ValueError", {"mlp.experts.down_proj", "NaN"});
    t = base;
    const double inf = std::numeric_limits<double>::infinity();
    std::memcpy(gptoss_find(t, "mlp.router.bias").bytes.data(), &inf, 8);
    expect(attempt(t, cfg), "ValueError", {"mlp.router.bias", "Inf"});
    t = base4;
    gptoss_find(t, "mlp.experts.gate_up_proj_scales").bytes[7] = 0xFF;
    expect(attempt(t, cfg4), "ValueError", {"mlp.experts.gate_up_proj_scales", "255"});
  }
  SECTION("an unexpected tensor under the prefix, unless allowed") {
    auto t = base;
    t.push_back({kGptOssPrefix + "mlp.experts.extra", st::DType::F64, {1}, std::vector<unsigned char>(8)});
    expect(attempt(t, cfg), "FormatError", {"unexpected", "mlp.experts.extra"});
    CHECK(attempt(t, cfg, true) == "returned");
  }
  SECTION("a layer that is not a gpt-oss block") {
    MoEConfig no_bias = cfg;
    no_bias.router_bias = false;
    expect(attempt(base, no_bias), "ConfigError", {"router_bias"});
    MoEConfig shared = cfg;
    shared.n_shared = 1;
    shared.d_shared_ffn = cfg.d_ffn;
    expect(attempt(base, shared), "ConfigError", {"shared"});
    GptOssMoE<double> moe(no_bias, 1);
    expect(apex::test::outcome([&] { save_gpt_oss_checkpoint(dir / "x.safetensors", moe); }), "ConfigError",
           {"save_gpt_oss_checkpoint", "router_bias"});
  }
}

TEST_CASE("gpt-oss config.json: the published 20b and 120b configs", "[gpt_oss][hf_config]") {
  auto config_text = [](int experts, int layers, const std::string& extra) {
    return "{\"architectures\": [\"GptOssForCausalLM\"], \"model_type\": \"gpt_oss\", \"hidden_size\": 2880, "
           "\"intermediate_size\": 2880, \"num_local_experts\": " + std::to_string(experts) +
           ", \"num_experts_per_tok\": 4, \"experts_per_token\": 4, \"num_hidden_layers\": " + std::to_string(layers) +
           ", \"rms_norm_eps\": 1e-05, \"swiglu_limit\": 7.0, \"num_attention_heads\": 64, \"head_dim\": 64, "
           "\"sliding_window\": 128, \"vocab_size\": 201088" + extra + "}";
  };
  apex::test::TempDir dir;
  auto write = [&](const std::string& text) {
    std::ofstream(dir / "config.json") << text;
    return dir.path.string();
  };
  const GptOssModelConfig small = read_gpt_oss_config(write(config_text(32, 24, "")));
  const MoEConfig want20 = gpt_oss_20b_moe();
  CHECK(small.moe.d_model == want20.d_model);
  CHECK(small.moe.d_ffn == want20.d_ffn);
  CHECK(small.moe.n_experts == 32);
  CHECK(small.moe.n_active == 4);
  CHECK(small.moe.router_bias);
  CHECK(small.moe.n_shared == 0);
  CHECK(small.n_layers == 24);
  CHECK(small.rms_eps == 1e-5);
  CHECK(small.experts.alpha == 1.702);
  CHECK(small.experts.limit == 7.0);
  CHECK(read_gpt_oss_config(dir / "config.json").moe.n_experts == 32);  // the file itself, not its folder
  const GptOssModelConfig large = read_gpt_oss_config(write(config_text(128, 36, ", \"swiglu_alpha\": 1.5")));
  CHECK(large.moe.n_experts == gpt_oss_120b_moe().n_experts);
  CHECK(large.n_layers == 36);
  CHECK(large.experts.alpha == 1.5);
  CHECK_NOTHROW(large.moe.validate());  // a block of it could be built (25 GB in double: not here)

  using apex::test::expect;
  using apex::test::outcome;
  expect(outcome([&] { read_hf_config(dir.path.string()); }), "ConfigError", {"gpt_oss", "read_gpt_oss_config"});
  expect(outcome([&] { parse_gpt_oss_config("{\"model_type\": \"mixtral\"}", "t"); }), "ConfigError",
         {"mixtral", "read_hf_config"});
  expect(outcome([&] { parse_gpt_oss_config("{\"model_type\": \"gpt_oss\", \"hidden_size\": 8}", "t"); }),
         "FormatError", {"intermediate_size"});
  expect(outcome([&] { read_gpt_oss_config(write(config_text(32, 24, ", \"swiglu_alpha\": -1"))); }), "ConfigError",
         {"alpha"});
  expect(outcome([&] { read_gpt_oss_config(write("{\"model_type\": \"gpt_oss\", \"hidden_size\": 8, "
                                                 "\"intermediate_size\": 8, \"num_local_experts\": 2, "
                                                 "\"num_experts_per_tok\": 3, \"num_hidden_layers\": 1}")); }),
         "ConfigError", {"read_gpt_oss_config"});
  // Regression: swiglu_alpha 1e39 (+inf in float) and rms_norm_eps -5 were
  // read as they were (io/hf_config.hpp's positive_float_or refuses them).
  const std::string positive = "must be finite, > 0 and a positive float";
  expect(outcome([&] { read_gpt_oss_config(write(config_text(32, 24, ", \"swiglu_alpha\": 1e39"))); }), "ConfigError",
         {"read_gpt_oss_config", "'swiglu_alpha'", positive, "got 1e+39"});
  std::string eps_minus_5 = config_text(32, 24, "");
  eps_minus_5.replace(eps_minus_5.find("\"rms_norm_eps\": 1e-05"), 21, "\"rms_norm_eps\": -5");
  expect(outcome([&] { parse_gpt_oss_config(eps_minus_5, "t"); }), "ConfigError",
         {"'rms_norm_eps'", positive, "got -5"});
  std::string limit_0 = config_text(32, 24, "");
  limit_0.replace(limit_0.find("\"swiglu_limit\": 7.0"), 19, "\"swiglu_limit\": 0");
  expect(outcome([&] { parse_gpt_oss_config(limit_0, "t"); }), "ConfigError", {"'swiglu_limit'", positive, "got 0"});
}

TEST_CASE("gpt-oss checkpoint fuzz corpus and regression inputs replay safely", "[gpt_oss][checkpoint][fuzz]") {
  // Each input of tests/fuzz/corpus_gpt_oss/ and regressions_gpt_oss/
  // through the fuzz target's own body (fuzz_gpt_oss.hpp), in this process
  // (a forward opens OpenMP teams, which a forked child cannot): it loads
  // (finite weights, a forward runs) or throws an apex::Error that leaves
  // the layer as it was. The seeds are valid checkpoints and load.
  namespace fs = std::filesystem;
  const std::size_t files = fuzz::for_each_committed_input(
      fs::path(__FILE__).parent_path(), {"fuzz/corpus_gpt_oss", "fuzz/regressions_gpt_oss"},
      [](const fs::path& path, const std::string& bytes) {
        INFO(path.string());
        bool accepted = false;
        const auto* data = reinterpret_cast<const std::uint8_t*>(bytes.data());
        const std::string got = apex::test::outcome([&] { accepted = fuzz::exercise_gpt_oss(data, bytes.size()); });
        INFO(got);
        const bool typed = got.rfind("FormatError: ", 0) == 0 || got.rfind("ConfigError: ", 0) == 0 ||
                           got.rfind("ShapeError: ", 0) == 0 || got.rfind("ValueError: ", 0) == 0;
        CHECK((got == "returned" || typed));
        if (path.parent_path().filename() == "corpus_gpt_oss") CHECK((got == "returned" && accepted));
      });
  CHECK(files >= 2);
}
