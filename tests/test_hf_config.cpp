// A Hugging Face model folder's config.json (io/hf_config.hpp): the
// published configs of the five families give the families' presets (the
// published layer shapes of moe/families.hpp), the MoE blocks are the ones
// each family's modelling code makes MoE, and malformed or unsupported
// configs are typed errors naming the key. Then a whole folder — config.json
// and a sharded checkpoint — opens into a layer with no other input.
#include <apex/ffn/io/hf_config.hpp>
#include <apex/ffn/io/name_maps.hpp>
#include <apex/ffn/moe/moe_ffn.hpp>

#include <catch2/catch.hpp>

#include <sys/stat.h>

#include <fstream>
#include <limits>
#include <string>

#include "families.hpp"
#include "fuzz/fuzz_config.hpp"
#include "fuzz/replay.hpp"
#include "gradcheck.hpp"
#include "sweep.hpp"
#include "temp_dir.hpp"
#include "tensor_files.hpp"

using namespace apex;

namespace {

// The MoE keys of each family's published config.json (the model named in
// moe/families.hpp's table), as the Hugging Face hub serves them.
const char* const kHfDeepSeekV3 = R"({"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61,
  "moe_intermediate_size": 2048, "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1,
  "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": true, "scoring_func": "sigmoid",
  "topk_method": "noaux_tc", "first_k_dense_replace": 3, "moe_layer_freq": 1, "rms_norm_eps": 1e-06,
  "intermediate_size": 18432})";
const char* const kHfMixtral = R"({"model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32,
  "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2, "rms_norm_eps": 1e-05})";
const char* const kHfQwen2MoE = R"({"model_type": "qwen2_moe", "hidden_size": 2048, "num_hidden_layers": 24,
  "intermediate_size": 5632, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
  "num_experts": 60, "num_experts_per_tok": 4, "norm_topk_prob": false, "decoder_sparse_step": 1,
  "rms_norm_eps": 1e-06})";
const char* const kHfQwen3MoE = R"({"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48,
  "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
  "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-06})";
const char* const kHfOLMoE = R"({"model_type": "olmoe", "hidden_size": 2048, "num_hidden_layers": 16,
  "intermediate_size": 1024, "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": false,
  "rms_norm_eps": 1e-05})";

HfModelConfig hf_parse(const std::string& text) { return parse_hf_config(text, "test"); }

void check_same_hf_layer(const MoEConfig& got, const MoEConfig& want) {
  CHECK(got.d_model == want.d_model);
  CHECK(got.d_ffn == want.d_ffn);
  CHECK(got.n_experts == want.n_experts);
  CHECK(got.n_active == want.n_active);
  CHECK(got.n_shared == want.n_shared);
  CHECK(got.shared_ffn() == want.shared_ffn());
  CHECK(got.shared_expert_gate == want.shared_expert_gate);
  CHECK(got.routing.scoring == want.routing.scoring);
  CHECK(got.routing.n_groups == want.routing.n_groups);
  CHECK(got.routing.topk_group == want.routing.topk_group);
  CHECK(got.routing.renormalize == want.routing.renormalize);
  CHECK(got.routing.routed_scale == want.routing.routed_scale);
}

}  // namespace

TEST_CASE("the families' published config.json give the families' presets", "[hf_config][families]") {
  const std::pair<MoEFamily, const char*> published[] = {{MoEFamily::DeepSeekV3, kHfDeepSeekV3},
                                                         {MoEFamily::Mixtral, kHfMixtral},
                                                         {MoEFamily::Qwen2MoE, kHfQwen2MoE},
                                                         {MoEFamily::Qwen3MoE, kHfQwen3MoE},
                                                         {MoEFamily::OLMoE, kHfOLMoE}};
  for (const auto& [family, text] : published) {
    INFO(family_name(family));
    const HfModelConfig c = hf_parse(text);
    CHECK(c.family == family);
    check_same_hf_layer(c.moe, family_preset(family));
  }
  const HfModelConfig ds = hf_parse(kHfDeepSeekV3);
  CHECK(ds.n_layers == 61);
  CHECK(ds.rms_eps == 1e-6);
  CHECK(!ds.is_moe_layer(2));  // first_k_dense_replace = 3
  CHECK(ds.is_moe_layer(3));
  CHECK(ds.is_moe_layer(60));
  CHECK(!ds.is_moe_layer(61));
  CHECK(hf_parse(kHfMixtral).rms_eps == 1e-5);
}

TEST_CASE("config.json keys that change the layer or its MoE blocks", "[hf_config]") {
  // Qwen: decoder_sparse_step 2 makes blocks 1, 3, 5, … MoE; mlp_only_layers makes listed blocks dense.
  const HfModelConfig q = hf_parse(R"({"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 8,
    "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 2,
    "mlp_only_layers": [5]})");
  CHECK(!q.moe.routing.renormalize);  // transformers' default: norm_topk_prob = false
  CHECK(!q.is_moe_layer(0));
  CHECK(q.is_moe_layer(1));
  CHECK(q.is_moe_layer(3));
  CHECK(!q.is_moe_layer(5));
  CHECK(q.is_moe_layer(7));
  // transformers 5 saves Qwen3-MoE's expert count as num_local_experts (its Qwen3MoeConfig.attribute_map).
  CHECK(hf_parse(R"({"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2,
    "moe_intermediate_size": 32, "num_local_experts": 6, "num_experts_per_tok": 2})").moe.n_experts == 6);
  // DeepSeek-V3: two shared experts are one MLP of twice the width; moe_layer_freq 2.
  const HfModelConfig d = hf_parse(R"({"model_type": "deepseek_v3", "hidden_size": 64, "num_hidden_layers": 6,
    "moe_intermediate_size": 16, "n_routed_experts": 16, "num_experts_per_tok": 4, "n_shared_experts": 2,
    "n_group": 4, "topk_group": 2, "routed_scaling_factor": 1.5, "first_k_dense_replace": 1, "moe_layer_freq": 2})");
  CHECK(d.moe.n_shared == 1);
  CHECK(d.moe.shared_ffn() == 32);
  CHECK(d.moe.routing.n_groups == 4);
  CHECK(d.moe.routing.routed_scale == 1.5);
  CHECK(!d.is_moe_layer(0));
  CHECK(!d.is_moe_layer(1));
  CHECK(d.is_moe_layer(2));
  CHECK(d.is_moe_layer(4));
}

TEST_CASE("malformed and unsupported config.json are typed errors naming the key", "[hf_config][errors]") {
  const std::string qwen = R"("model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2,
    "moe_intermediate_size": 32, "num_experts_per_tok": 2)";
  auto bad = [](std::string text) { return [text] { (void)parse_hf_config(text, "cfg"); }; };
  std::string deep(200, '[');
  apex::test::run_sweep({
      {"a missing key", bad("{" + qwen + "}"), "FormatError", {"cfg", "no 'num_experts'"}},
      {"a count that is a string", bad("{" + qwen + R"(, "num_experts": "8"})"), "FormatError", {"'num_experts'", "integer"}},
      {"a negative count", bad("{" + qwen + R"(, "num_experts": -8})"), "FormatError", {"'num_experts'"}},
      {"a flag that is a number", bad("{" + qwen + R"(, "num_experts": 8, "norm_topk_prob": 1})"), "FormatError",
       {"'norm_topk_prob'", "true or false"}},
      {"K above E", bad("{" + qwen + R"(, "num_experts": 1})"), "ConfigError", {"cfg"}},
      {"another model type", bad(R"({"model_type": "llama", "hidden_size": 64})"), "ConfigError",
       {"unknown MoE family 'llama'"}},
      {"DeepSeek-V3 scored by softmax", bad(R"({"model_type": "deepseek_v3", "hidden_size": 64, "num_hidden_layers": 2,
         "moe_intermediate_size": 16, "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
         "scoring_func": "softmax"})"), "ConfigError", {"'scoring_func'", "sigmoid"}},
      {"Qwen2-MoE without its shared expert", bad(R"({"model_type": "qwen2_moe", "hidden_size": 64,
         "num_hidden_layers": 2, "moe_intermediate_size": 16, "num_experts": 8, "num_experts_per_tok": 2,
         "shared_expert_intermediate_size": 0})"), "ConfigError", {"'shared_expert_intermediate_size'"}},
      {"not JSON", bad("{\"model_type\": "), "FormatError", {"not valid JSON"}},
      {"not an object", bad("[1, 2]"), "FormatError", {"not a JSON object"}},
      {"a repeated key", bad(R"({"hidden_size": 1, "hidden_size": 2})"), "FormatError", {"repeats the key"}},
      {"deep nesting", bad(R"({"x": )" + deep), "FormatError", {"nests arrays or objects deeper"}},
  });
  // Files: a FIFO and a folder without config.json, refused without blocking.
  apex::test::TempDir dir;
  const std::string fifo = (dir.path / "config.json").string();
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  apex::test::expect(apex::test::outcome([&] { (void)read_hf_config(dir.path.string()); }), "FormatError",
                     {"read_hf_config", "not a regular file"});
  apex::test::TempDir empty;
  apex::test::expect(apex::test::outcome([&] { (void)read_hf_config(empty.path.string()); }), "FormatError",
                     {"read_hf_config", "cannot open"});
}

TEST_CASE("config.json values a layer cannot compute with are ConfigErrors naming the key", "[hf_config][regression]") {
  // io/hf_config.hpp multiplied n_shared_experts by moe_intermediate_size as
  // Index (signed overflow, undefined; in practice a wrapped width) and took
  // rms_norm_eps -1 or 0 and routed_scaling_factor 1e39 (+inf in float) as
  // they were. The product is checked_product's, the floats positive_float_or's.
  auto deepseek = [](const std::string& shared, const std::string& width, const std::string& extra) {
    return R"({"model_type": "deepseek_v3", "hidden_size": 64, "num_hidden_layers": 2, "moe_intermediate_size": )" +
           width + R"(, "n_routed_experts": 16, "num_experts_per_tok": 4, "n_shared_experts": )" + shared +
           R"(, "n_group": 4, "topk_group": 2)" + extra + "}";
  };
  auto bad = [](std::string text) { return [text] { (void)parse_hf_config(text, "cfg"); }; };
  const std::string p40 = "1099511627776", p24 = "16777216";  // 2^40, 2^24
  const std::vector<std::string> shared_keys = {"cfg", "n_shared_experts x moe_intermediate_size",
                                                "does not fit in a 64-bit index"};
  const std::vector<std::string> positive = {"must be finite, > 0 and a positive float"};
  auto with = [](std::vector<std::string> a, std::vector<std::string> b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  apex::test::run_sweep({
      {"2^40 shared experts of width 2^40", bad(deepseek(p40, p40, "")), "ConfigError", shared_keys},
      {"2^24 shared experts of width 2^40", bad(deepseek(p24, p40, "")), "ConfigError", shared_keys},
      {"rms_norm_eps -1", bad(deepseek("1", "16", R"(, "rms_norm_eps": -1)")), "ConfigError",
       with({"cfg", "'rms_norm_eps'", "got -1"}, positive)},
      {"rms_norm_eps 0", bad(deepseek("1", "16", R"(, "rms_norm_eps": 0)")), "ConfigError",
       with({"'rms_norm_eps'", "got 0"}, positive)},
      {"rms_norm_eps 1e-50 (0 in float)", bad(deepseek("1", "16", R"(, "rms_norm_eps": 1e-50)")), "ConfigError",
       with({"'rms_norm_eps'", "got 1e-50"}, positive)},
      {"routed_scaling_factor 1e39", bad(deepseek("1", "16", R"(, "routed_scaling_factor": 1e39)")), "ConfigError",
       with({"'routed_scaling_factor'", "got 1e+39", "3.40282e+38"}, positive)},
      {"routed_scaling_factor -2", bad(deepseek("1", "16", R"(, "routed_scaling_factor": -2)")), "ConfigError",
       with({"'routed_scaling_factor'", "got -2"}, positive)},
  });
  // The largest float itself is a float, and 2^20 experts of width 2^40 fit.
  const HfModelConfig edge =
      hf_parse(deepseek(std::to_string(1 << 20), p40, R"(, "routed_scaling_factor": 3.4028234663852886e38)"));
  CHECK(edge.moe.shared_ffn() == (Index(1) << 60));
  CHECK(edge.moe.routing.routed_scale == double(std::numeric_limits<float>::max()));
}

TEST_CASE("a Hugging Face folder opens from its config.json and shards alone", "[hf_config][sharded]") {
  // The fixtures' Qwen3-MoE layer, with a config.json written from its shapes.
  const auto kData = std::filesystem::path(__FILE__).parent_path() / "data";
  const safetensors::Reader src((kData / "family_qwen3_moe.safetensors").string());
  const MoEConfig want = apex::test::fixture_config(MoEFamily::Qwen3MoE, src);
  const std::string prefix = src.metadata().at("prefix");  // "model.layers.N."
  const Index block = std::stol(prefix.substr(std::string("model.layers.").size()));
  apex::test::TempDir dir;
  std::ofstream(dir.path / "config.json")
      << R"({"model_type": "qwen3_moe", "hidden_size": )" << want.d_model << R"(, "num_hidden_layers": )"
      << block + 1 << R"(, "moe_intermediate_size": )" << want.d_ffn << R"(, "num_experts": )" << want.n_experts
      << R"(, "num_experts_per_tok": )" << want.n_active << R"(, "norm_topk_prob": true})";
  const auto layer = apex::test::write_tensors(apex::test::read_tensors(src, {"test.", "grad."}));
  apex::test::write_sharded(safetensors::Reader::from_memory(layer.data(), layer.size()), dir.path, 2);

  const HfModelConfig cfg = read_hf_config(dir.path.string());
  REQUIRE(cfg.is_moe_layer(block));
  check_same_hf_layer(cfg.moe, want);
  MoEFFN<double> got(cfg.moe, 1), ref(want, 2);
  load_family_checkpoint(dir.path.string(), got, cfg.family, prefix);
  LoadOptions fixture_file;
  fixture_file.allow_unexpected = true;  // its test.* and grad.* references
  load_family_checkpoint(src, ref, MoEFamily::Qwen3MoE, prefix, fixture_file);
  const Matrix<double> x = apex::test::random_matrix(5, want.d_model, 3, 1.0);
  CHECK(got.forward(x) == ref.forward(x));
}

TEST_CASE("config.json fuzz corpus and regression inputs replay safely", "[hf_config][fuzz]") {
  // Each input of tests/fuzz/corpus_config/ and regressions_config/ through
  // the fuzz target's own body (fuzz_config.hpp), in a forked child, so an
  // input that crashed a reader fails its case, not the run: it gives a
  // configuration the float layers accept or throws an apex::Error.
  namespace fs = std::filesystem;
  const std::size_t files = fuzz::for_each_committed_input(
      fs::path(__FILE__).parent_path(), {"fuzz/corpus_config", "fuzz/regressions_config"},
      [](const fs::path& path, const std::string& bytes) {
        INFO(path.string());
        const std::string got = apex::test::outcome_isolated(
            [&] { fuzz::exercise_config(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size()); });
        INFO(got);
        CHECK((got == "returned" || got.rfind("FormatError: ", 0) == 0 || got.rfind("ConfigError: ", 0) == 0));
      });
  CHECK(files >= 7);
}
