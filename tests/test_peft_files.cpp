// peft adapter files (adapters/peft_files.hpp): library → files → library
// bit for bit for every expert kind and layout, per-expert and tied, fused
// and separate targets; the files peft itself writes (tools/peft_reference.py,
// live: APEX_FFN_PEFT_DIR) loaded and run against peft's outputs and
// autograd gradients, and the library's files for peft to load; every
// refusal with its message, the layers unchanged after a rejected load.
#include <apex/ffn/adapters/peft_files.hpp>
#include <apex/ffn/inference.hpp>
#include <apex/ffn/inference/files/gpt_oss/load.hpp>
#include <apex/ffn/inference/files/checkpoint/load.hpp>
#include <apex/ffn/io/gpt_oss_checkpoint.hpp>
#include <apex/ffn/io/hf_config.hpp>
#include <apex/ffn/io/name_maps.hpp>
#include <apex/ffn/moe/gpt_oss.hpp>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <sys/resource.h>
#include <sys/stat.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include "fixtures.hpp"
#include "gradcheck.hpp"
#include "sweep.hpp"
#include "temp_dir.hpp"

using namespace apex;
namespace st = apex::safetensors;

namespace {

/// Copies of every value `param_values()` lists (adapters, and the router with train_router).
template <class Layer>
std::vector<Matrix<typename Layer::Scalar>> peft_snapshot(Layer& l) {
  std::vector<Matrix<typename Layer::Scalar>> out;
  for (const auto& p : l.param_values()) out.push_back(p.value());
  return out;
}
template <class T>
bool peft_same_bits(const std::vector<Matrix<T>>& a, const std::vector<Matrix<T>>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].rows() != b[i].rows() || a[i].cols() != b[i].cols() ||
        (a[i].size() && std::memcmp(a[i].data(), b[i].data(), std::size_t(a[i].size()) * sizeof(T)) != 0))
      return false;
  return true;
}

/// B of every adapter drawn (B starts at 0, so a file of zeros would prove nothing).
template <class Layer>
void peft_draw_b(Layer& l, std::uint64_t seed) {
  for (auto& p : l.param_values())
    if (p.name.find("lora_B") != std::string::npos)
      p.value() = test::random_matrix(p.rows, p.cols, seed++, 0.5).template cast<typename Layer::Scalar>();
}

LoraOptions peft_opts(Index rank, LoraTargets targets, bool per_expert = true, bool rslora = false) {
  LoraOptions o;
  o.rank = rank;
  o.alpha = 3.5;
  o.rslora = rslora;
  o.targets = targets;
  o.per_expert = per_expert;
  return o;
}
constexpr LoraTargets kFused{false, false, true, true}, kSeparate{true, true, false, true};
constexpr LoraTargets kDownOnly{false, false, false, true}, kGateUpOnly{false, false, true, false};

/// A block of `family`'s shape (its shared experts), d = 6, f = 5, E = 4.
template <class T, class Expert = SwiGLU<T>>
MoEFFN<T, Expert> peft_base(MoEFamily f, std::uint64_t seed) {
  MoEConfig c = test::moe_config(4, 2, 0, 6, 5);
  if (f == MoEFamily::Qwen2MoE) c.n_shared = 1, c.d_shared_ffn = 3, c.shared_expert_gate = true;
  if (f == MoEFamily::DeepSeekV3) c.n_shared = 1, c.d_shared_ffn = 4;
  return MoEFFN<T, Expert>(c, seed);
}
template <class T>
GptOssMoE<T> peft_gpt_oss_base(std::uint64_t seed) {
  return GptOssMoE<T>(gpt_oss_moe(6, 5, 4, 2), seed);
}

/// Saves layer a (decoder layer 3) and loads it into a layer of the same
/// options with other A and zero B: every value bit for bit, the same output.
template <class Base>
void peft_round_trip(const std::function<Base()>& make, const LoraOptions& o, const PeftNames& names,
                     std::uint64_t seed, bool tied_into_untied = false) {
  test::TempDir dir;
  LoraMoE<Base> a(make(), o, Rng(seed));
  peft_draw_b(a, seed + 1);
  LoraOptions ob = o;
  if (tied_into_untied) ob.per_expert = true;
  LoraMoE<Base> b(make(), ob, Rng(seed + 2));
  save_peft_adapter(dir / "adapter", 3, a, names);
  const PeftLoadResult r = load_peft_adapter(dir / "adapter", 3, b, names);
  CHECK(r.config.rank == o.rank);
  CHECK(r.ignored.empty());
  using T = typename LoraMoE<Base>::Scalar;
  const Matrix<T> x = test::rnd<T>(9, a.d_model(), seed + 3);
  CHECK(peft_same_bits<T>({a.forward(x)}, {b.forward(x)}));
  if (!tied_into_untied) {
    CHECK(peft_same_bits(peft_snapshot(a), peft_snapshot(b)));
    return;
  }
  for (Index e = 0; e < a.config().n_experts; ++e)  // every expert holds the tied set
    for (int s = 0; s < kLoraSlots; ++s) {
      CHECK(b.routed_adapters().values(e).slot[std::size_t(s)].a == a.routed_adapters().values(0).slot[std::size_t(s)].a);
      CHECK(b.routed_adapters().values(e).slot[std::size_t(s)].b == a.routed_adapters().values(0).slot[std::size_t(s)].b);
    }
}

}  // namespace

TEMPLATE_TEST_CASE("peft files: a round trip is bit for bit for every kind, layout and target choice",
                   "[peft][roundtrip]", double, float) {
  using T = TestType;
  SECTION("SwiGLU under a family's names: fused routed, the shared expert's fused gate_up split in two") {
    for (MoEFamily f : {MoEFamily::Qwen2MoE, MoEFamily::DeepSeekV3, MoEFamily::Qwen3MoE, MoEFamily::Mixtral}) {
      INFO(family_name(f));
      const std::function<MoEFFN<T>()> make = [f] { return peft_base<T>(f, 5); };
      peft_round_trip(make, peft_opts(2, kFused), PeftNames::of(f), 10);
      peft_round_trip(make, peft_opts(3, kFused, false, true), PeftNames::of(f), 20);  // tied, rslora
      peft_round_trip(make, peft_opts(2, kFused, false), PeftNames::of(f), 30, true);  // tied into per-expert
      peft_round_trip(make, peft_opts(1, kDownOnly), PeftNames::of(f), 40);
      peft_round_trip(make, peft_opts(2, kGateUpOnly), PeftNames::of(f), 50);
      LoraOptions sep = peft_opts(2, kFused);
      sep.shared_targets = kSeparate;  // routed fused, shared gate/up apart: peft's usual Qwen2-MoE adapter
      peft_round_trip(make, sep, PeftNames::of(f), 60);
    }
  }
  SECTION("any kind under the library's own names: separate and fused, per expert and tied") {
    const std::function<MoEFFN<T>()> swiglu = [] { return peft_base<T>(MoEFamily::Qwen2MoE, 6); };
    const std::function<MoEFFN<T, KappaSwiGLU<T>>()> kappa = [] { return peft_base<T, KappaSwiGLU<T>>(MoEFamily::DeepSeekV3, 7); };
    const std::function<GptOssMoE<T>()> clamped = [] { return peft_gpt_oss_base<T>(8); };
    for (const LoraTargets& t : {kSeparate, kFused, kDownOnly})
      for (bool per_expert : {true, false}) {
        peft_round_trip(swiglu, peft_opts(2, t, per_expert), PeftNames::apex(), 70);
        peft_round_trip(kappa, peft_opts(2, t, per_expert), PeftNames::apex(), 80);
        peft_round_trip(clamped, peft_opts(2, t, per_expert), PeftNames::apex(), 90);
      }
  }
  SECTION("gpt-oss clamped experts under gpt-oss's names: interleaved gate/up") {
    const std::function<GptOssMoE<T>()> make = [] { return peft_gpt_oss_base<T>(9); };
    for (const LoraTargets& t : {kFused, kGateUpOnly, kDownOnly}) {
      peft_round_trip(make, peft_opts(2, t), PeftNames::gpt_oss(), 100);
      peft_round_trip(make, peft_opts(3, t, false, true), PeftNames::gpt_oss(), 110);
    }
  }
}

TEST_CASE("peft files: packed bases round trip, BF16 rounds, several layers and other layers' tensors",
          "[peft][roundtrip]") {
  test::TempDir dir;
  const LoraOptions o = peft_opts(2, kFused);
  const auto packed = [] {
    return PackedMoE<float, SwiGLU<float>>::from(peft_base<float>(MoEFamily::Qwen2MoE, 4), packed::Dtype::bf16);
  };
  LoraMoE<PackedMoE<float, SwiGLU<float>>> l0(packed(), o, Rng(1)), l1(packed(), o, Rng(2));
  peft_draw_b(l0, 3), peft_draw_b(l1, 4);
  const PeftNames names = PeftNames::of(MoEFamily::Qwen2MoE);
  save_peft_adapter(dir / "two", {peft_layer(0, l0), peft_layer(5, l1)}, names);
  LoraMoE<PackedMoE<float, SwiGLU<float>>> m0(packed(), o, Rng(5)), m1(packed(), o, Rng(6));
  load_peft_adapter(dir / "two", {peft_layer(0, m0), peft_layer(5, m1)}, names);
  CHECK(peft_same_bits(peft_snapshot(l0), peft_snapshot(m0)));
  CHECK(peft_same_bits(peft_snapshot(l1), peft_snapshot(m1)));

  // One of two layers: the other's tensors are unexpected unless allowed, then listed as ignored.
  LoraMoE<PackedMoE<float, SwiGLU<float>>> one(packed(), o, Rng(7));
  const auto before = peft_snapshot(one);
  test::expect(test::outcome([&] { load_peft_adapter(dir / "two", 5, one, names); }), "FormatError",
               {"load_peft_adapter", "unexpected", "model.layers.0.mlp.experts.lora_A.weight", "allow_unexpected"});
  CHECK(peft_same_bits(before, peft_snapshot(one)));
  PeftLoadOptions lo(names);
  lo.allow_unexpected = true;
  const PeftLoadResult r = load_peft_adapter(dir / "two", 5, one, lo);
  CHECK(r.ignored.size() == r.loaded.size());
  CHECK(peft_same_bits(peft_snapshot(l1), peft_snapshot(one)));

  // Saved as BF16: loads as each value rounded to nearest even.
  PeftSaveOptions so(names);
  so.dtype = st::DType::BF16;
  save_peft_adapter(dir / "bf16", 0, l0, so);
  load_peft_adapter(dir / "bf16", 0, m0, names);
  const auto want = peft_snapshot(l0), got = peft_snapshot(m0);
  for (std::size_t i = 0; i < want.size(); ++i)
    for (Index j = 0; j < want[i].size(); ++j)
      CHECK(got[i](j) == st::detail::bf16_to_float(st::detail::float_to_bf16(want[i](j))));
  so.dtype = st::DType::F16;
  test::expect(test::outcome([&] { save_peft_adapter(dir / "f16", 0, l0, so); }), "ValueError",
               {"save_peft_adapter", "F16", "F32, F64 or BF16"});
}

namespace {

/// One tensor of an adapter file in F64, to edit and write back.
struct PeftFileTensor {
  std::string name;
  std::vector<std::uint64_t> shape;
  std::vector<double> v;
};
std::vector<PeftFileTensor> peft_read_file(const std::string& path) {
  const st::Reader f(path);
  std::vector<PeftFileTensor> out;
  for (const auto& t : f.tensors()) {
    out.push_back({t.name, t.shape, std::vector<double>(std::size_t(t.numel()))});
    f.read(t, out.back().v.data());
  }
  return out;
}
void peft_write_file(const std::string& path, const std::vector<PeftFileTensor>& ts) {
  std::vector<st::TensorRef<double>> refs;
  for (const auto& t : ts) refs.push_back({t.name, t.shape, t.v.data()});
  st::save(path, refs, st::DType::F64);
}
/// Edits the adapter file of folder d in place.
void peft_edit_file(const std::string& d, const std::function<void(std::vector<PeftFileTensor>&)>& edit) {
  const std::string path = d + "/" + kPeftWeightsName;
  auto ts = peft_read_file(path);
  edit(ts);
  peft_write_file(path, ts);
}
/// Edits the adapter_config.json of folder d in place.
void peft_edit_config(const std::string& d, const std::function<void(nlohmann::json&)>& edit) {
  const std::string path = d + "/" + kPeftConfigName;
  nlohmann::json j;
  std::ifstream(path) >> j;
  edit(j);
  std::ofstream(path) << j.dump(2);
}
PeftFileTensor& peft_tensor(std::vector<PeftFileTensor>& ts, const std::string& name) {
  for (auto& t : ts)
    if (t.name == name) return t;
  FAIL("no tensor " << name);
  return ts.front();
}

struct PeftBadCase {
  std::string what;
  std::function<void(const std::string&)> edit;  ///< applied to a copy of the good folder
  std::string type;
  std::vector<std::string> names;
};

}  // namespace

TEST_CASE("peft files: a load refuses a file it cannot read exactly, naming why, and changes nothing",
          "[peft][errors]") {
  namespace fs = std::filesystem;
  test::TempDir dir;
  const PeftNames names = PeftNames::of(MoEFamily::Qwen2MoE);
  LoraOptions o = peft_opts(2, kFused);
  o.shared_targets = kSeparate;
  using Layer = LoraMoE<MoEFFN<double>>;
  Layer src(peft_base<double>(MoEFamily::Qwen2MoE, 1), o, Rng(2));
  peft_draw_b(src, 3);
  save_peft_adapter(dir / "good", 1, src, names);
  const std::string key = "base_model.model.model.layers.1.mlp.";
  const std::string gate_up_a = key + "experts.base_layer.lora_A.weight", down_b = key + "experts.lora_B.weight";
  const auto file_edit = [](std::function<void(std::vector<PeftFileTensor>&)> f) {
    return [f](const std::string& d) { peft_edit_file(d, f); };
  };
  const auto config_edit = [](std::function<void(nlohmann::json&)> f) {
    return [f](const std::string& d) { peft_edit_config(d, f); };
  };
  const std::vector<PeftBadCase> cases = {
      {"a tensor transposed", file_edit([&](auto& ts) { std::swap(peft_tensor(ts, gate_up_a).shape[0], peft_tensor(ts, gate_up_a).shape[1]); }),
       "ShapeError", {"load_peft_adapter", gate_up_a, "[6, 8] in the file, expected [8, 6]"}},
      {"a tensor missing", file_edit([&](auto& ts) { ts.erase(ts.begin() + (&peft_tensor(ts, down_b) - ts.data())); }),
       "FormatError", {"missing", down_b}},
      {"an unexpected tensor in the block",
       file_edit([&](auto& ts) { ts.push_back({key + "shared_expert_gate.lora_A.weight", {2, 6}, std::vector<double>(12, 0.5)}); }),
       "FormatError", {"unexpected", key + "shared_expert_gate.lora_A.weight", "under a given layer's block"}},
      {"another layer's tensor",
       file_edit([&](auto& ts) { ts.push_back({"base_model.model.model.layers.2.mlp.experts.lora_A.weight", {8, 5}, std::vector<double>(40, 0.5)}); }),
       "FormatError", {"unexpected", "layers.2.mlp.experts.lora_A.weight", "allow_unexpected"}},
      {"a NaN", file_edit([&](auto& ts) { peft_tensor(ts, down_b).v[3] = test::kNaN; }), "ValueError", {down_b, "NaN or Inf"}},
      {"an Inf", file_edit([&](auto& ts) { peft_tensor(ts, gate_up_a).v[0] = test::kInf; }), "ValueError", {gate_up_a, "NaN or Inf"}},
      {"r", config_edit([](auto& j) { j["r"] = 3; }), "ConfigError", {"layer 1", "'r' is 3", "LoraOptions::rank 2"}},
      {"lora_alpha", config_edit([](auto& j) { j["lora_alpha"] = 7; }), "ConfigError", {"'lora_alpha' is 7", "LoraOptions::alpha"}},
      {"use_rslora", config_edit([](auto& j) { j["use_rslora"] = true; }), "ConfigError", {"'use_rslora' is true"}},
      {"target_parameters", config_edit([](auto& j) { j["target_parameters"] = {"experts.gate_up_proj"}; }), "ConfigError",
       {"'target_parameters' adapt {gate_up_proj}", "routed adapters are {gate_up_proj, down_proj}"}},
      {"use_dora", config_edit([](auto& j) { j["use_dora"] = true; }), "ConfigError", {"'use_dora'", "DoRA"}},
      {"rank_pattern", config_edit([](auto& j) { j["rank_pattern"] = {{"down_proj", 4}}; }), "ConfigError", {"'rank_pattern'"}},
      {"alpha_pattern", config_edit([](auto& j) { j["alpha_pattern"] = {{"down_proj", 4}}; }), "ConfigError", {"'alpha_pattern'"}},
      {"bias", config_edit([](auto& j) { j["bias"] = "all"; }), "ConfigError", {"'bias'"}},
      {"lora_bias", config_edit([](auto& j) { j["lora_bias"] = true; }), "ConfigError", {"'lora_bias'"}},
      {"modules_to_save", config_edit([](auto& j) { j["modules_to_save"] = {"lm_head"}; }), "ConfigError", {"'modules_to_save'"}},
      {"peft_type", config_edit([](auto& j) { j["peft_type"] = "IA3"; }), "ConfigError", {"'peft_type'", "IA3"}},
      {"init_lora_weights", config_edit([](auto& j) { j["init_lora_weights"] = "pissa"; }), "ConfigError",
       {"'init_lora_weights'", "pissa", "base weights"}},
      {"a feature this library does not know", config_edit([](auto& j) { j["use_bdlora"] = {{"nblocks", 2}}; }),
       "ConfigError", {"'use_bdlora'", "does not read"}},
      {"no r", config_edit([](auto& j) { j.erase("r"); }), "FormatError", {"adapter_config.json has no 'r'"}},
      {"r not an integer", config_edit([](auto& j) { j["r"] = 2.5; }), "ConfigError", {"'r' is 2.5"}},
      {"not JSON", [](const std::string& d) { std::ofstream(d + "/adapter_config.json") << "{\"r\": "; }, "FormatError",
       {"adapter_config.json", "not valid JSON"}},
      // nlohmann/json ends its input at a NUL: the key after it went unread and the file loaded as plain LoRA
      {"a NUL byte, then more JSON", [](const std::string& d) {
         std::ofstream(d + "/adapter_config.json", std::ios::app) << '\0' << "{\"use_dora\": true}"; },
       "FormatError", {"adapter_config.json", "not valid JSON", "NUL byte"}},
      {"not an object", [](const std::string& d) { std::ofstream(d + "/adapter_config.json") << "[2]"; }, "FormatError",
       {"adapter_config.json", "not a JSON object"}},
      {"nested 100000 deep", [](const std::string& d) { std::ofstream(d + "/adapter_config.json") << std::string(100000, '['); },
       "FormatError", {"adapter_config.json", "deeper than"}},
      {"r beyond any rank", config_edit([](auto& j) { j["r"] = std::int64_t(1) << 40; }), "ConfigError", {"'r' is 1099511627776"}},
      {"r 0", config_edit([](auto& j) { j["r"] = 0; }), "ConfigError", {"'r' is 0"}},
      {"lora_alpha a string", config_edit([](auto& j) { j["lora_alpha"] = "4"; }), "FormatError", {"'lora_alpha' is not a number"}},
      {"target_parameters a number", config_edit([](auto& j) { j["target_parameters"] = 3; }), "FormatError",
       {"'target_parameters' is not a list"}},
      {"the config a FIFO", [](const std::string& d) {
         fs::remove(d + "/adapter_config.json");
         REQUIRE(::mkfifo((d + "/adapter_config.json").c_str(), 0600) == 0); },
       "FormatError", {"adapter_config.json", "not a regular file"}},
      {"the tensors a FIFO", [](const std::string& d) {
         fs::remove(d + "/adapter_model.safetensors");
         REQUIRE(::mkfifo((d + "/adapter_model.safetensors").c_str(), 0600) == 0); },
       "FormatError", {"adapter_model.safetensors", "not a regular file"}},
      {"the tensors /dev/zero", [](const std::string& d) {
         fs::remove(d + "/adapter_model.safetensors");
         fs::create_symlink("/dev/zero", d + "/adapter_model.safetensors"); },
       "FormatError", {"adapter_model.safetensors", "not a regular file"}},
      {"no config", [](const std::string& d) { fs::remove(d + "/adapter_config.json"); }, "FormatError",
       {"adapter_config.json"}},
  };
  Layer dst(peft_base<double>(MoEFamily::Qwen2MoE, 1), o, Rng(4));
  peft_draw_b(dst, 5);
  const auto before = peft_snapshot(dst);
  SECTION("each edit of a good file") {
    int n = 0;
    for (const auto& c : cases) {
      INFO("case: " << c.what);
      const std::string d = dir / ("case" + std::to_string(n++));
      fs::copy(dir / "good", d);
      c.edit(d);
      test::expect(test::outcome([&] { load_peft_adapter(d, 1, dst, names); }), c.type, c.names);
      CHECK(peft_same_bits(before, peft_snapshot(dst)));
    }
  }
  SECTION("a dtype no float converts from") {
    const std::string d = dir / "i32";
    fs::create_directories(d);
    fs::copy(dir / "good/adapter_config.json", d + "/adapter_config.json");
    const auto ts = peft_read_file(dir / "good/adapter_model.safetensors");
    std::vector<std::vector<std::int32_t>> ints;
    std::vector<st::RawTensor> raw;
    for (const auto& t : ts) {
      ints.emplace_back(t.v.size(), 1);
      raw.push_back(st::raw_tensor(t.name, t.name == down_b ? st::DType::I32 : st::DType::F64, t.shape,
                                   t.name == down_b ? static_cast<const void*>(ints.back().data()) : t.v.data()));
    }
    st::save_raw(d + "/adapter_model.safetensors", raw);
    test::expect(test::outcome([&] { load_peft_adapter(d, 1, dst, names); }), "FormatError",
                 {down_b + " (I32)", "F16, BF16, F32 or F64"});
    CHECK(peft_same_bits(before, peft_snapshot(dst)));
  }
  SECTION("values the layer holds once must have one value in the file") {
    LoraOptions tied = o;
    tied.per_expert = false;
    Layer t(peft_base<double>(MoEFamily::Qwen2MoE, 1), tied, Rng(6));
    const auto t_before = peft_snapshot(t);
    test::expect(test::outcome([&] { load_peft_adapter(dir / "good", 1, t, names); }), "ConfigError",
                 {gate_up_a, "tied (LoraOptions::per_expert = false)"});
    CHECK(peft_same_bits(t_before, peft_snapshot(t)));
    LoraOptions fused = o;
    fused.shared_targets.reset();  // the shared expert's gate and up as one gate_up: one A
    Layer f(peft_base<double>(MoEFamily::Qwen2MoE, 1), fused, Rng(7));
    const auto f_before = peft_snapshot(f);
    test::expect(test::outcome([&] { load_peft_adapter(dir / "good", 1, f, names); }), "ConfigError",
                 {key + "shared_expert.up_proj.lora_A.weight", "gate and up projections' lora_A must be equal"});
    CHECK(peft_same_bits(f_before, peft_snapshot(f)));
  }
  SECTION("a value beyond float loads into a double layer and is refused by a float layer") {
    const std::string d = dir / "big";
    fs::copy(dir / "good", d);
    peft_edit_file(d, [&](auto& ts) { peft_tensor(ts, down_b).v[0] = 1e300; });
    LoraMoE<MoEFFN<float>> fl(peft_base<float>(MoEFamily::Qwen2MoE, 1), o, Rng(8));
    const auto fl_before = peft_snapshot(fl);
    test::expect(test::outcome([&] { load_peft_adapter(d, 1, fl, names); }), "ValueError", {down_b, "NaN or Inf"});
    CHECK(peft_same_bits(fl_before, peft_snapshot(fl)));
    load_peft_adapter(d, 1, dst, names);
    CHECK(peft_tensors(dst, 1, names)[3].second(0, 0) == 1e300);
  }
  SECTION("layers the file's layout does not hold") {
    test::expect(test::outcome([&] { load_peft_adapter(dir / "good", 1, dst, PeftNames::gpt_oss()); }), "ConfigError",
                 {"layer 1", "gpt_oss layout holds clamped SwiGLU experts", "SwiGLU"});
    test::expect(test::outcome([&] { load_peft_adapter(dir / "good", 1, dst, PeftNames::of(MoEFamily::Mixtral)); }),
                 "ConfigError", {"layer 1", "mixtral"});
    test::expect(test::outcome([&] { load_peft_adapter(dir / "good", {peft_layer(1, dst), peft_layer(1, src)}, names); }),
                 "ConfigError", {"layer index 1 is given twice"});
    CHECK(peft_same_bits(before, peft_snapshot(dst)));
  }
  SECTION("one layer given for two decoder layers") {
    // load_peft_adapter (adapters/peft_load.hpp) committed each layer's
    // stage in turn, so a layer given twice ended with the later index's
    // adapters, silently. Fixed: refused before anything is read.
    LoraMoE<MoEFFN<double>> other(peft_base<double>(MoEFamily::Qwen2MoE, 1), o, Rng(9));
    peft_draw_b(other, 10);
    save_peft_adapter(dir / "two", {peft_layer(1, src), peft_layer(2, other)}, names);
    test::expect(test::outcome([&] { load_peft_adapter(dir / "two", {peft_layer(1, dst), peft_layer(2, dst)}, names); }),
                 "ConfigError", {"load_peft_adapter", "layer 2 is the same LoraMoE as a layer given before it"});
    CHECK(peft_same_bits(before, peft_snapshot(dst)));
  }
}

TEST_CASE("peft files: a failed save leaves the folder's previous adapter as it was, both files",
          "[peft][errors][regression]") {
  // save_peft_adapter (adapters/peft_save.hpp) replaced the tensors, then
  // wrote the config: a config that could not be written left the new
  // tensors beside the old config (an adapter of another r that loads as
  // neither), and a base_model_name_or_path that is not UTF-8 escaped as
  // nlohmann's type_error after the tensors were replaced. Fixed: the
  // config's text is made (ValueError) before anything is written, and
  // both files are written whole before either replaces the old one
  // (io::write_files_atomic).
  namespace fs = std::filesystem;
  test::TempDir dir;
  const PeftNames names = PeftNames::of(MoEFamily::Qwen3MoE);
  using Layer = LoraMoE<MoEFFN<double>>;
  Layer saved(peft_base<double>(MoEFamily::Qwen3MoE, 1), peft_opts(2, kFused), Rng(2));
  peft_draw_b(saved, 3);
  const std::string d = dir / "adapter";
  save_peft_adapter(d, 0, saved, names);
  const auto bytes = [](const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  };
  const std::string tensors = bytes(d + "/" + kPeftWeightsName), config = bytes(d + "/" + kPeftConfigName);
  LoraOptions other = peft_opts(3, kFused);  // another r: the files of the two saves do not mix
  other.alpha = 5;
  Layer next(peft_base<double>(MoEFamily::Qwen3MoE, 1), other, Rng(4));
  peft_draw_b(next, 5);
  PeftSaveOptions so(names);
  std::string got;
  SECTION("a base_model_name_or_path that is not UTF-8") {
    so.base_model_name_or_path = "org/\xff\xfe";
    got = test::outcome([&] { save_peft_adapter(d, 0, next, so); });
    test::expect(got, "ValueError", {"save_peft_adapter", "not valid UTF-8"});
  }
  SECTION("the config cannot be written, the tensors could (file size limit)") {
    so.base_model_name_or_path = std::string(64 * 1024, 'm');  // the config far larger than the tensors
    // RLIMIT_FSIZE fails write() with EFBIG, as a full disk with ENOSPC; SIGXFSZ would end the process.
    struct rlimit limit {};
    REQUIRE(::getrlimit(RLIMIT_FSIZE, &limit) == 0);
    auto* old_handler = std::signal(SIGXFSZ, SIG_IGN);
    struct rlimit small = limit;
    small.rlim_cur = 16 * 1024;
    REQUIRE(::setrlimit(RLIMIT_FSIZE, &small) == 0);
    got = test::outcome([&] { save_peft_adapter(d, 0, next, so); });
    ::setrlimit(RLIMIT_FSIZE, &limit);
    std::signal(SIGXFSZ, old_handler);
    test::expect(got, "FormatError", {"cannot write", kPeftConfigName});
  }
  // A value the load refuses (ValueError) was saved without complaint, so a
  // diverged run's save replaced the last good adapter by one that never
  // loads. Fixed: the save checks the load's rule, on the values as stored.
  const auto set_b = [&](double x) {  // the first B's (0, 1): element 4 of its stacked lora_B
    for (auto& p : next.param_values())
      if (p.name.find("lora_B") != std::string::npos) return void(p.value()(0, 1) = x);
  };
  SECTION("an adapter holding NaN (a diverged run)") {
    set_b(std::numeric_limits<double>::quiet_NaN());
    got = test::outcome([&] { save_peft_adapter(d, 0, next, so); });
    test::expect(got, "ValueError", {"save_peft_adapter", "lora_B.weight", "contains NaN or Inf: NaN at element 4 (row 0, column 4)"});
  }
  SECTION("an adapter holding Inf, saved as BF16") {
    set_b(-std::numeric_limits<double>::infinity());
    so.dtype = st::DType::BF16;
    got = test::outcome([&] { save_peft_adapter(d, 0, next, so); });
    test::expect(got, "ValueError", {"save_peft_adapter", "lora_B.weight", "-Inf at element 4", "as BF16 stores it"});
  }
  SECTION("a double beyond float's range, saved as F32") {
    set_b(1e39);
    so.dtype = st::DType::F32;
    got = test::outcome([&] { save_peft_adapter(d, 0, next, so); });
    test::expect(got, "ValueError", {"save_peft_adapter", "lora_B.weight", "1e+39 (+Inf) at element 4", "as F32 stores it"});
  }
  SECTION("a value within float's range but not bf16's, saved as BF16") {
    set_b(3.4e38);  // bf16's largest is 3.3895e38: rounds to +Inf
    so.dtype = st::DType::BF16;
    got = test::outcome([&] { save_peft_adapter(d, 0, next, so); });
    test::expect(got, "ValueError", {"save_peft_adapter", "lora_B.weight", "3.4e+38 (+Inf) at element 4", "as BF16 stores it"});
  }
  CHECK(bytes(d + "/" + kPeftWeightsName) == tensors);
  CHECK(bytes(d + "/" + kPeftConfigName) == config);
  CHECK(std::distance(fs::directory_iterator(d), fs::directory_iterator()) == 2);  // no temporary file left
  Layer back(peft_base<double>(MoEFamily::Qwen3MoE, 1), peft_opts(2, kFused), Rng(6));
  load_peft_adapter(d, 0, back, names);
  CHECK(peft_same_bits(peft_snapshot(saved), peft_snapshot(back)));
}

TEST_CASE("peft files: a save refuses what peft's files cannot express", "[peft][errors]") {
  test::TempDir dir;
  const auto expect_refused = [&](const std::function<void()>& save, const std::vector<std::string>& names) {
    test::expect(test::outcome(save), "ConfigError", names);
    CHECK(dir.entries() == 0);  // nothing written
  };
  LoraMoE<MoEFFN<double>> sep(peft_base<double>(MoEFamily::Qwen3MoE, 1), peft_opts(2, kSeparate), Rng(2));
  expect_refused([&] { save_peft_adapter(dir / "a", 0, sep, PeftNames::of(MoEFamily::Qwen3MoE)); },
                 {"save_peft_adapter", "layer 0", "targets.gate / targets.up", "fused gate_up_proj", "PeftNames::apex()"});
  LoraMoE<MoEFFN<double, KappaSwiGLU<double>>> kappa(peft_base<double, KappaSwiGLU<double>>(MoEFamily::Qwen3MoE, 1),
                                                       peft_opts(2, kFused), Rng(3));
  expect_refused([&] { save_peft_adapter(dir / "a", 0, kappa, PeftNames::of(MoEFamily::Qwen3MoE)); },
                 {"qwen3_moe layout holds SwiGLU experts", "kappa-SwiGLU", "PeftNames::apex()"});
  LoraOptions router = peft_opts(2, kFused);
  router.train_router = true;
  LoraMoE<MoEFFN<double>> trained(peft_base<double>(MoEFamily::Qwen3MoE, 1), router, Rng(4));
  expect_refused([&] { save_peft_adapter(dir / "a", 0, trained, PeftNames::of(MoEFamily::Qwen3MoE)); },
                 {"train_router", "save_checkpoint"});
  LoraMoE<MoEFFN<double>> r2(peft_base<double>(MoEFamily::Qwen3MoE, 1), peft_opts(2, kFused), Rng(5));
  LoraMoE<MoEFFN<double>> r3(peft_base<double>(MoEFamily::Qwen3MoE, 1), peft_opts(3, kFused), Rng(6));
  expect_refused([&] { save_peft_adapter(dir / "a", {peft_layer(0, r2), peft_layer(1, r3)}, PeftNames::of(MoEFamily::Qwen3MoE)); },
                 {"layer 1", "r, alpha or rslora differ from layer 0", "rank_pattern"});
  LoraMoE<MoEFFN<double>> shared(peft_base<double>(MoEFamily::Qwen2MoE, 1), peft_opts(2, kFused), Rng(7));
  expect_refused([&] { save_peft_adapter(dir / "a", 0, shared, PeftNames::of(MoEFamily::Qwen3MoE)); },
                 {"qwen3_moe", "no shared experts"});
  expect_refused([&] { save_peft_adapter(dir / "a", -1, r2, PeftNames::of(MoEFamily::Qwen3MoE)); },
                 {"layer index -1 is negative"});
  PeftNames bare = PeftNames::apex();
  bare.layers = "";
  expect_refused([&] { save_peft_adapter(dir / "a", {peft_layer(0, r2), peft_layer(1, r2)}, bare); },
                 {"PeftNames::layers is empty", "one block, not 2 layers"});
}

TEST_CASE("peft files: adapter_config.json as peft writes it, and the options of a layer that fits",
          "[peft][config]") {
  // peft 0.21.2's file for LoraConfig(r=2, lora_alpha=4, target_parameters=[...]) on a Qwen3-MoE model.
  const std::string peft_text = R"({
  "alora_invocation_tokens": null, "alpha_pattern": {}, "arrow_config": null,
  "auto_mapping": {"base_model_class": "Qwen3MoeForCausalLM",
                   "parent_library": "transformers.models.qwen3_moe.modeling_qwen3_moe"},
  "base_model_name_or_path": null, "bias": "none", "corda_config": null, "ensure_weight_tying": false,
  "eva_config": null, "exclude_modules": null, "fan_in_fan_out": false, "inference_mode": true,
  "init_lora_weights": true, "kasa_config": null, "layer_replication": null, "layers_pattern": null,
  "layers_to_transform": null, "loftq_config": {}, "lora_alpha": 4, "lora_bias": false, "lora_dropout": 0.0,
  "lora_ga_config": null, "megatron_config": null, "megatron_core": "megatron.core", "modules_to_save": null,
  "monteclora_config": null, "peft_type": "LORA", "peft_version": "0.21.2", "qalora_group_size": 16, "r": 2,
  "rank_pattern": {}, "revision": null, "target_modules": [],
  "target_parameters": ["experts.down_proj", "experts.gate_up_proj"], "task_type": null,
  "trainable_token_indices": null, "use_bdlora": null, "use_dora": false, "use_qalora": false,
  "use_rslora": false, "velora_config": null})";
  const PeftAdapterConfig c = parse_peft_config(peft_text, "test");
  CHECK(c.rank == 2);
  CHECK(c.alpha == 4);
  CHECK(!c.rslora);
  CHECK(c.scale() == 2);
  CHECK(c.target_parameters == std::vector<std::string>{"experts.down_proj", "experts.gate_up_proj"});
  CHECK(c.target_modules.empty());
  const PeftAdapterConfig back = parse_peft_config(peft_config_text(c), "test");
  CHECK((back.rank == c.rank && back.alpha == c.alpha && back.target_parameters == c.target_parameters));
  CHECK(parse_peft_config(R"({"peft_type": "LORA", "r": 4, "target_modules": ".*\\.w_up", "lora_dropout": 0.1})", "t")
            .target_modules_regex == ".*\\.w_up");

  test::TempDir dir;
  LoraOptions o = peft_opts(3, kFused, true, true);
  o.shared_targets = kSeparate;
  LoraMoE<MoEFFN<double>> l(peft_base<double>(MoEFamily::DeepSeekV3, 1), o, Rng(2));
  save_peft_adapter(dir / "a", 4, l, PeftNames::of(MoEFamily::DeepSeekV3));
  const LoraOptions got = peft_lora_options(dir / "a", 4, PeftNames::of(MoEFamily::DeepSeekV3));
  CHECK((got.rank == 3 && got.alpha == 3.5 && got.rslora && got.per_expert && !got.train_router));
  CHECK((got.targets.gate_up && got.targets.down && !got.targets.gate && !got.targets.up));
  REQUIRE(got.shared_targets);
  CHECK((got.shared_targets->gate && got.shared_targets->up && got.shared_targets->down && got.shared_experts));
  test::expect(test::outcome([&] { peft_lora_options(dir / "a", 5, PeftNames::of(MoEFamily::DeepSeekV3)); }),
               "ConfigError", {"layer 5", "adapts none of the routed experts' projections"});
  const nlohmann::json j = nlohmann::json::parse(std::ifstream(dir / "a/adapter_config.json"));
  CHECK(j["target_parameters"] == nlohmann::json({"model.layers.4.mlp.shared_experts.gate_proj.weight",
                                                  "model.layers.4.mlp.shared_experts.up_proj.weight",
                                                  "model.layers.4.mlp.shared_experts.down_proj.weight",
                                                  "model.layers.4.mlp.experts.gate_up_proj",
                                                  "model.layers.4.mlp.experts.down_proj"}));
  LoraMoE<MoEFFN<double, KappaSwiGLU<double>>> k(peft_base<double, KappaSwiGLU<double>>(MoEFamily::DeepSeekV3, 1),
                                                   peft_opts(2, kFused), Rng(3));
  save_peft_adapter(dir / "k", 2, k, PeftNames::apex());
  const nlohmann::json jk = nlohmann::json::parse(std::ifstream(dir / "k/adapter_config.json"));
  CHECK(jk["target_modules"] == "model\\.layers\\.2\\.mlp\\.(experts\\.[0-9]+\\.(w_gate|w_up|w_down)|"
                                "shared_experts\\.[0-9]+\\.(w_gate|w_up|w_down))");
  CHECK(st::Reader(dir / "k/adapter_model.safetensors").header().find(
            "base_model.model.model.layers.2.mlp.experts.3.w_up.lora_B.weight") != nullptr);
}

namespace {

// The families of tools/peft_reference.py's fixtures: DIR/<family>/{model, adapter, adapter_bf16, io.safetensors},
// and "apex", the library's own block in PyTorch (DIR/apex/base.safetensors), adapted alone.
const char* const kPeftFixtureFamilies[] = {"qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "deepseek_v3", "gpt_oss", "apex"};

PeftNames peft_fixture_names(const std::string& family) {
  if (family == "gpt_oss") return PeftNames::gpt_oss();
  if (family != "apex") return PeftNames::of(family_by_name(family));
  PeftNames n = PeftNames::apex();
  n.layers = n.block = "";  // the block alone: base_model.model.experts.{e}.w_gate…
  return n;
}
Index peft_fixture_layers(const std::string& family) { return family == "apex" ? 1 : 2; }
std::string peft_layer_prefix(Index L) { return "model.layers." + std::to_string(L) + "."; }

/// Decoder layer L's MoE block of the fixture model (transformers' save_pretrained, F64).
template <class T>
MoEFFN<T> peft_fixture_block(const std::string& root, Index L) {
  const HfModelConfig hc = read_hf_config(root + "/model");
  MoEFFN<T> moe(hc.moe, 1);
  LoadOptions lo;
  lo.allow_unexpected = true;  // the other layers, attention, embeddings
  load_family_checkpoint(root + "/model/model.safetensors", moe, hc.family, peft_layer_prefix(L), lo);
  return moe;
}
template <class T>
GptOssMoE<T> peft_fixture_gpt_oss(const std::string& root, Index L) {
  const GptOssModelConfig gc = read_gpt_oss_config(root + "/model");
  GptOssMoE<T> moe(gc.moe, 1);
  for (auto& e : moe.experts()) e.set_options(gc.experts);
  LoadOptions lo;
  lo.allow_unexpected = true;
  load_gpt_oss_checkpoint(root + "/model/model.safetensors", moe, peft_layer_prefix(L), lo);
  return moe;
}
/// The library's block of the "apex" fixture (tools/torch_reference.py's state_dict).
template <class T>
MoEFFN<T> peft_fixture_apex(const std::string& root) {
  const st::Reader file(root + "/base.safetensors");
  const auto j = nlohmann::json::parse(file.metadata().at("apex.config"));
  MoEFFN<T> moe(test::moe_config(j["n_experts"].get<Index>(), j["n_active"].get<Index>(), j["n_shared"].get<Index>(),
                                 j["d_model"].get<Index>(), j["d_ffn"].get<Index>()),
                1);
  load_checkpoint(file, moe.param_values());
  return moe;
}
/// The same block packed in f32, read from the file by the packed loaders.
PackedMoE<float, SwiGLU<float>> peft_fixture_packed(const std::string& root, Index L) {
  const HfModelConfig hc = read_hf_config(root + "/model");
  PackedLoadOptions po;
  po.prefix = peft_layer_prefix(L), po.family = hc.family, po.allow_unexpected = true;
  return load_packed_moe<float>(root + "/model/model.safetensors", hc.moe, po);
}
PackedMoE<float, ClampedSwiGLU<float>> peft_fixture_packed_gpt_oss(const std::string& root, Index L) {
  const GptOssModelConfig gc = read_gpt_oss_config(root + "/model");
  PackedLoadOptions po;
  po.prefix = peft_layer_prefix(L), po.expert_options.of<ClampedSwiGLU<float>>() = gc.experts, po.allow_unexpected = true;
  return load_packed_gpt_oss<float>(root + "/model/model.safetensors", gc.moe, po);
}

template <class T>
double peft_rel(const Matrix<T>& a, const Matrix<double>& b) {
  const double n = b.norm(), e = (a.template cast<double>() - b).norm();
  return n > 0 ? e / n : e;
}

/// Largest norm-wise relative error, over the fixture's layers, of y, ∂L/∂x and the adapters' gradients.
struct PeftAgreement {
  double y = 0, dx = 0, grads = 0;
};

/// Loads the fixture's `adapter` folder into LoraMoE layers over make(L)
/// and compares one step with torch's (io.safetensors).
template <class Base>
PeftAgreement peft_against_torch(const std::string& root, const std::function<Base(Index)>& make,
                                 const PeftNames& names, Index n_layers) {
  using T = typename LoraMoE<Base>::Scalar;
  const std::string adapter = root + "/adapter";
  std::vector<std::unique_ptr<LoraMoE<Base>>> layers;
  std::vector<PeftLayerRef<Base>> refs;
  for (Index L = 0; L < n_layers; ++L) {
    layers.push_back(std::make_unique<LoraMoE<Base>>(make(L), peft_lora_options(adapter, L, names), Rng(9)));
    refs.push_back(peft_layer(L, *layers.back()));
  }
  const PeftLoadResult loaded = load_peft_adapter(adapter, refs, names);
  CHECK(loaded.ignored.empty());
  const st::Reader io(root + "/io.safetensors");
  const Matrix<T> x = io.matrix<double>("x").cast<T>(), r = io.matrix<double>("r").cast<T>();
  PeftAgreement a;
  for (Index L = 0; L < n_layers; ++L) {
    LoraMoE<Base>& l = *layers[std::size_t(L)];
    typename LoraMoE<Base>::Cache cache;
    l.zero_grad();
    const Matrix<T> y = l.forward(x, &cache);
    const Matrix<T> dx = l.backward(r, cache);
    a.y = std::max(a.y, peft_rel(y, io.matrix<double>("y." + std::to_string(L))));
    a.dx = std::max(a.dx, peft_rel(dx, io.matrix<double>("dx." + std::to_string(L))));
    for (const auto& [name, g] : peft_tensors(l, L, names, true)) {
      INFO(name);
      a.grads = std::max(a.grads, peft_rel(g, io.matrix<double>("grad." + name)));
    }
  }
  return a;
}

/// The BF16 adapter peft saved: each value the F64 one to bf16 precision, and a bf16 value exactly.
template <class Base>
void peft_check_bf16(const std::string& root, const std::function<Base(Index)>& make, const PeftNames& names) {
  LoraMoE<Base> wide(make(0), peft_lora_options(root + "/adapter", 0, names), Rng(1));
  LoraMoE<Base> narrow(make(0), peft_lora_options(root + "/adapter_bf16", 0, names), Rng(2));
  PeftLoadOptions lo(names);
  lo.allow_unexpected = true;  // layer 1
  load_peft_adapter(root + "/adapter", 0, wide, lo);
  load_peft_adapter(root + "/adapter_bf16", 0, narrow, lo);
  const auto w = peft_tensors(wide, 0, names), n = peft_tensors(narrow, 0, names);
  REQUIRE(w.size() == n.size());
  for (std::size_t i = 0; i < w.size(); ++i)
    for (Index j = 0; j < w[i].second.size(); ++j) {
      const double v = double(n[i].second(j));
      CHECK(double(st::detail::bf16_to_float(st::detail::float_to_bf16(float(v)))) == v);
      CHECK(std::abs(v - double(w[i].second(j))) <= std::abs(double(w[i].second(j))) * 0x1p-8);
    }
}

}  // namespace

TEST_CASE("peft files: adapters peft saved give peft's outputs and autograd gradients", "[peft][import]") {
  const char* dir = std::getenv("APEX_FFN_PEFT_DIR");
  if (!dir) {
    WARN("SKIP: APEX_FFN_PEFT_DIR is not set (tests/peft_interop.cmake sets it when torch, transformers and peft "
         "are installed)");
    return;
  }
  for (const std::string family : kPeftFixtureFamilies) {
    INFO(family);
    const std::string root = std::string(dir) + "/" + family;
    const PeftNames names = peft_fixture_names(family);
    const Index n = peft_fixture_layers(family);
    PeftAgreement d, f;
    if (family == "gpt_oss") {
      d = peft_against_torch<GptOssMoE<double>>(root, [&](Index L) { return peft_fixture_gpt_oss<double>(root, L); },
                                                names, n);
      f = peft_against_torch<PackedMoE<float, ClampedSwiGLU<float>>>(
          root, [&](Index L) { return peft_fixture_packed_gpt_oss(root, L); }, names, n);
      peft_check_bf16<GptOssMoE<double>>(root, [&](Index L) { return peft_fixture_gpt_oss<double>(root, L); }, names);
    } else if (family == "apex") {
      d = peft_against_torch<MoEFFN<double>>(root, [&](Index) { return peft_fixture_apex<double>(root); }, names, n);
      f = peft_against_torch<PackedMoE<float, SwiGLU<float>>>(
          root, [&](Index) { return PackedMoE<float, SwiGLU<float>>::from(peft_fixture_apex<float>(root), packed::Dtype::f32); },
          names, n);
      peft_check_bf16<MoEFFN<double>>(root, [&](Index) { return peft_fixture_apex<double>(root); }, names);
    } else {
      d = peft_against_torch<MoEFFN<double>>(root, [&](Index L) { return peft_fixture_block<double>(root, L); }, names, n);
      f = peft_against_torch<PackedMoE<float, SwiGLU<float>>>(root, [&](Index L) { return peft_fixture_packed(root, L); },
                                                              names, n);
      peft_check_bf16<MoEFFN<double>>(root, [&](Index L) { return peft_fixture_block<double>(root, L); }, names);
    }
    std::printf("peft %-12s double: y %.2e dx %.2e grads %.2e | packed f32: y %.2e dx %.2e grads %.2e\n",
                family.c_str(), d.y, d.dx, d.grads, f.y, f.dx, f.grads);
    CHECK(d.y <= 1e-10);
    CHECK(d.dx <= 1e-10);
    CHECK(d.grads <= 1e-10);
    CHECK(f.y <= 1e-5);
    CHECK(f.dx <= 1e-5);
    CHECK(f.grads <= 1e-5);
  }
}

namespace {

/// Layers 0 and 1 over make(L) with adapters as `o` says (B drawn), saved to
/// root/from_apex/adapter with their outputs on the fixture's x in
/// root/from_apex/io.safetensors, for tools/peft_reference.py check.
template <class Base>
void peft_export(const std::string& root, const std::function<Base(Index)>& make, const LoraOptions& o,
                 const PeftNames& names, Index n_layers = 2) {
  std::vector<std::unique_ptr<LoraMoE<Base>>> layers;
  std::vector<PeftLayerRef<Base>> refs;
  for (Index L = 0; L < n_layers; ++L) {
    layers.push_back(std::make_unique<LoraMoE<Base>>(make(L), o, Rng(21 + L)));
    peft_draw_b(*layers.back(), 23 + L);
    refs.push_back(peft_layer(L, *layers.back()));
  }
  PeftSaveOptions so(names);
  so.base_model_name_or_path = root + (n_layers > 1 ? "/model" : "/base.safetensors");
  so.task_type = n_layers > 1 ? "CAUSAL_LM" : "";
  const std::string out = root + "/from_apex";
  save_peft_adapter(out + "/adapter", refs, so);
  using RowMajor = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  std::vector<RowMajor> keep{st::Reader(root + "/io.safetensors").matrix<double>("x")};
  keep.reserve(std::size_t(n_layers) + 1);
  const std::vector<std::uint64_t> shape{std::uint64_t(keep[0].rows()), std::uint64_t(keep[0].cols())};
  std::vector<st::TensorRef<double>> io{{"x", shape, keep[0].data()}};
  for (Index L = 0; L < n_layers; ++L) {
    keep.emplace_back(layers[std::size_t(L)]->forward(keep[0]));
    io.push_back({"y." + std::to_string(L), shape, keep.back().data()});
  }
  st::save(out + "/io.safetensors", io, st::DType::F64);
  LoraMoE<Base> back(make(0), o, Rng(25));  // and the library reads its own file back
  PeftLoadOptions lo(names);
  lo.allow_unexpected = true;
  load_peft_adapter(out + "/adapter", 0, back, lo);
  CHECK(peft_same_bits(peft_snapshot(*layers[0]), peft_snapshot(back)));
}

}  // namespace

TEST_CASE("peft files: adapters the library saved, for peft to load", "[peft][export]") {
  const char* dir = std::getenv("APEX_FFN_PEFT_DIR");
  if (!dir) {
    WARN("SKIP: APEX_FFN_PEFT_DIR is not set (tests/peft_interop.cmake sets it when torch, transformers and peft "
         "are installed)");
    return;
  }
  for (const std::string family : kPeftFixtureFamilies) {
    INFO(family);
    const std::string root = std::string(dir) + "/" + family;
    const PeftNames names = peft_fixture_names(family);
    const auto block = [&](Index L) { return peft_fixture_block<double>(root, L); };
    if (family == "qwen3_moe") peft_export<MoEFFN<double>>(root, block, peft_opts(2, kFused, false), names);  // tied
    if (family == "qwen2_moe") peft_export<MoEFFN<double>>(root, block, peft_opts(2, kFused), names);  // shared A twice
    if (family == "olmoe") peft_export<MoEFFN<double>>(root, block, peft_opts(3, kDownOnly, true, true), names);
    if (family == "mixtral") peft_export<MoEFFN<double>>(root, block, peft_opts(2, kGateUpOnly), names);
    if (family == "deepseek_v3") {
      LoraOptions o = peft_opts(2, kFused);
      o.shared_targets = kSeparate;
      peft_export<MoEFFN<double>>(root, block, o, names);
    }
    if (family == "gpt_oss")
      peft_export<GptOssMoE<double>>(root, [&](Index L) { return peft_fixture_gpt_oss<double>(root, L); },
                                     peft_opts(2, kFused, true, true), names);
    if (family == "apex")  // tied and fused: every expert's w_gate and w_up get the one A
      peft_export<MoEFFN<double>>(root, [&](Index) { return peft_fixture_apex<double>(root); },
                                  peft_opts(2, kFused, false), names, 1);
  }
}
