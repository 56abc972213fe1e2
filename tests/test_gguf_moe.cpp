// MoE layers from and to GGUF files (inference/files/gguf/load.hpp,
// inference/files/gguf/save.hpp): every architecture of the table in every
// storage type round-trips to the same bits; the packed layer loaded from a
// file matches the float layer dequantized from the same file within the
// type's error; F16 experts keep their bits in f16 panels; APEX-1's router and fused shared experts
// are written as deepseek2; and every kind of bad file is a typed error that
// leaves the destination as it was.
#include <catch2/catch.hpp>

#include <apex/ffn/inference.hpp>
#include <apex/ffn/inference/files/gguf/load.hpp>
#include <apex/ffn/inference/files/gguf/save.hpp>
#include <apex/ffn/io/gguf.hpp>
#include <apex/ffn/quant/half.hpp>

#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "bits.hpp"
#include "fixtures.hpp"
#include "sweep.hpp"
#include "temp_dir.hpp"

using namespace apex;

namespace {

constexpr Index kD = 256, kF = 256;  // whole Q4_K / Q6_K super-blocks
constexpr Index kBlock = 3;          // the block index written and read

/// One test layer per architecture: llama.cpp's routing of the family at test sizes.
MoEConfig arch_config(MoEFamily fam) {
  MoEConfig c;
  c.d_model = kD, c.d_ffn = kF, c.n_experts = 8, c.n_active = 2;
  c.routing = family_routing(fam);
  if (fam == MoEFamily::Qwen2MoE) c.n_shared = 1, c.d_shared_ffn = 512, c.shared_expert_gate = true;
  if (fam == MoEFamily::DeepSeekV3) {
    c.n_experts = 16, c.routing.n_groups = 4, c.routing.topk_group = 2;
    c.n_shared = 1, c.d_shared_ffn = 512;  // expert_shared_count 2
  }
  return c;
}

MoEFFN<float> arch_layer(MoEFamily fam, std::uint64_t seed) {
  MoEFFN<float> m(arch_config(fam), seed);
  if (fam == MoEFamily::DeepSeekV3) m.balancer().set_bias(test::rnd<float>(1, 16, seed + 7, 0.1));
  return m;
}

const packed::Dtype kTypes[] = {packed::Dtype::f32,  packed::Dtype::bf16, packed::Dtype::f16,  packed::Dtype::q8_0,
                                packed::Dtype::q4_0, packed::Dtype::q4_k, packed::Dtype::q6_k, packed::Dtype::mxfp4};

/// The relative error bound of a type against the float layer (docs/quantized_formats.md, with margin).
double type_bound(packed::Dtype t) {
  switch (t) {
    case packed::Dtype::f32: return 1e-5;
    case packed::Dtype::bf16: return 6e-3;
    case packed::Dtype::f16: return 1e-3;  // 11 significant bits
    case packed::Dtype::q8_0: return 2.5e-2;
    case packed::Dtype::q6_k: return 5e-2;
    case packed::Dtype::q4_k: return 1.5e-1;
    case packed::Dtype::q4_0: return 1.7e-1;
    case packed::Dtype::mxfp4: return 4e-1;
  }
  return 0;
}

GgufSaveOptions at_block(std::optional<MoEFamily> fam = {}) {
  GgufSaveOptions o;
  o.layer = kBlock;
  o.family = fam;
  return o;
}

/// A copy of `src` with edits: `key` may replace or drop a metadata value
/// (return false to drop), `tensor` may drop one (false) or change its type,
/// shape and bytes.
struct Edit {
  std::function<bool(const std::string&, gguf::Value&)> key;
  std::function<bool(gguf::TensorInfo&, std::vector<unsigned char>&)> tensor;
};
void rewrite(const std::string& src, const std::string& dst, const Edit& e) {
  const gguf::File in = gguf::File::open(src);
  gguf::Writer w;
  for (const gguf::Value& v0 : in.metadata()) {
    gguf::Value v = v0;
    const std::string k = v0.key();
    if (k == "general.alignment") continue;
    if (!e.key || e.key(k, v)) w.set(k, v);
  }
  std::vector<std::vector<unsigned char>> keep;
  keep.reserve(in.tensors().size());
  for (const gguf::TensorInfo& t0 : in.tensors()) {
    gguf::TensorInfo t = t0;
    keep.emplace_back(in.data(t0), in.data(t0) + t0.nbytes);
    if (e.tensor && !e.tensor(t, keep.back())) continue;
    w.add_tensor(t.name, t.type, t.ne, keep.back().data(), keep.back().size());
  }
  w.save(dst);
}

/// An exception type as a value, for a lambda that expects it.
template <class T>
struct Is {
  using type = T;
};

std::string blk(const char* name) { return gguf::block_tensor(kBlock, name); }

}  // namespace

TEST_CASE("gguf_moe: every architecture round-trips in every storage type to the same bits", "[gguf_moe]") {
  test::TempDir dir;
  const Matrix<float> x = test::rnd<float>(9, kD, 5);
  std::uint64_t seed = 10;
  for (MoEFamily fam : kAllFamilies) {
    const MoEFFN<float> moe = arch_layer(fam, seed++);
    for (packed::Dtype t : kTypes) {
      INFO(family_name(fam) << " in " << packed::dtype_name(t));
      const auto layer = PackedMoE<float>::from(moe, t);
      const std::string path = dir / "layer.gguf";
      save_gguf_moe(path, layer, at_block(fam));
      const gguf::File file = gguf::File::open(path);
      CHECK(file.architecture() == gguf::architecture_of(fam).name);
      const auto loaded = load_gguf_moe(file, kBlock);
      CHECK(loaded.types() == layer.types());
      const MoEConfig& a = loaded.config();
      const MoEConfig& b = layer.config();
      CHECK(a.n_experts == b.n_experts);
      CHECK(a.n_shared == b.n_shared);
      CHECK(a.shared_ffn() == b.shared_ffn());
      CHECK(a.routing.scoring == b.routing.scoring);
      CHECK(a.routing.renormalize == b.routing.renormalize);
      CHECK(a.routing.n_groups == b.routing.n_groups);
      CHECK(a.routing.routed_scale == b.routing.routed_scale);
      CHECK(test::same_bits(loaded.bias(), layer.bias()));
      CHECK(test::same_bits(loaded.forward(x), layer.forward(x)));
    }
  }
}

TEST_CASE("gguf_moe: the packed layer matches the float layer dequantized from the same file", "[gguf_moe]") {
  test::TempDir dir;
  const Matrix<float> x = test::rnd<float>(13, kD, 6);
  std::uint64_t seed = 30;
  for (MoEFamily fam : kAllFamilies) {
    const MoEFFN<float> moe = arch_layer(fam, seed++);
    for (packed::Dtype t : kTypes) {
      INFO(family_name(fam) << " in " << packed::dtype_name(t));
      const std::string path = dir / "layer.gguf";
      save_gguf_moe(path, moe, t, at_block());
      const gguf::File file = gguf::File::open(path);
      const auto packed = load_gguf_moe(file, kBlock);
      const auto fl = load_gguf_moe_float<float>(file, kBlock);
      const auto dbl = load_gguf_moe_float<double>(file, kBlock);
      const Matrix<float> y = packed.forward(x), y_float = fl.forward(x);
      const Matrix<double> y_double = dbl.forward(x.cast<double>());
      // The packed layer of the dequantized weights, packed again in the type.
      const Matrix<float> y_repacked = PackedMoE<float>::from(fl, t).forward(x);
      const auto rel = [](const Matrix<double>& a, const Matrix<double>& b) { return (a - b).norm() / b.norm(); };
      CHECK(rel(y.cast<double>(), y_double) < type_bound(t));
      CHECK(rel(y_repacked.cast<double>(), y_double) < type_bound(t));
      CHECK(rel(y_float.cast<double>(), y_double) < 1e-5);
      // The f32 file holds the float layer's own weights: its output.
      if (t == packed::Dtype::f32) CHECK(rel(y.cast<double>(), moe.forward(x).cast<double>()) < 1e-5);
    }
  }
}

TEST_CASE("gguf_moe: mixed types, the sublayer with ffn_norm, APEX-1 as deepseek2", "[gguf_moe]") {
  test::TempDir dir;
  const Matrix<float> x = test::rnd<float>(7, kD, 8);
  const std::string path = dir / "layer.gguf";
  SECTION("Q4_K_M-style: routed q4_k/q6_k, shared q8_0") {
    const MoEFFN<float> moe = arch_layer(MoEFamily::Qwen2MoE, 3);
    const PackedTypes types({packed::Dtype::q4_k, packed::Dtype::q6_k}, packed::Dtype::q8_0);
    const auto layer = PackedMoE<float>::from(moe, types);
    save_gguf_moe(path, layer, at_block());
    const gguf::File file = gguf::File::open(path);
    CHECK(file.tensor(blk("ffn_down_exps.weight")).type == gguf::TensorType::Q6_K);
    CHECK(file.tensor(blk("ffn_up_shexp.weight")).type == gguf::TensorType::Q8_0);
    const auto loaded = load_gguf_moe(file, kBlock);
    CHECK(loaded.types() == types);
    CHECK(test::same_bits(loaded.forward(x), layer.forward(x)));
  }
  SECTION("the sublayer: RMSNorm gain and epsilon from ffn_norm and the metadata") {
    FFNSublayer<float, MoEFFN<float>> sub(kD, arch_layer(MoEFamily::Qwen3MoE, 4));
    sub.norm().gain() = test::rnd<float>(1, kD, 9, 0.2).array() + 1.0f;
    const auto packed = pack_sublayer<packed::q8_0>(sub);
    save_gguf_sublayer(path, packed, at_block());
    const gguf::File file = gguf::File::open(path);
    const auto loaded = load_gguf_sublayer(file, kBlock);
    CHECK(loaded.norm().eps() == packed.norm().eps());
    CHECK(test::same_bits(loaded.forward(x), packed.forward(x)));
  }
  SECTION("APEX-1's router: deepseek2 with expert_gating_func 3, exact while the bias is zero") {
    MoEConfig c = ModelPreset::tiny().moe();  // d 64, f 128, E 4, K 2, S 1, softmax over the selected
    const MoEFFN<float> moe(c, 11);
    const auto layer = PackedMoE<float>::from(moe);
    save_gguf_moe(path, layer, at_block());
    const gguf::File file = gguf::File::open(path);
    CHECK(file.architecture() == "deepseek2");
    CHECK(file.get<std::uint32_t>("deepseek2.expert_gating_func") == 3);
    const Matrix<float> xt = test::rnd<float>(7, 64, 12);
    CHECK(test::same_bits(load_gguf_moe(file, kBlock).forward(xt), layer.forward(xt)));
    MoEFFN<float> biased(c, 11);
    biased.balancer().set_bias(test::rnd<float>(1, 4, 13));
    CHECK_THROWS_AS(save_gguf_moe(path, biased), ConfigError);
    biased.set_weights_from_unbiased(true);  // then llama.cpp's softmax-weight rule is exact
    save_gguf_moe(path, biased, packed::Dtype::f32, at_block());
    CHECK(test::same_bits(load_gguf_moe(gguf::File::open(path), kBlock).forward(xt),
                          PackedMoE<float>::from(biased).forward(xt)));
  }
  SECTION("shared experts are written as one MLP of whole d_ffn, zero-padded: the same function") {
    MoEConfig c = ModelPreset::tiny().moe();  // d_ffn 128
    c.n_shared = 2;
    for (Index fs : {Index(128), Index(96)})  // 2 x 128 = 2 d_ffn; 2 x 96 = 192, padded to 256
      for (packed::Dtype t : {packed::Dtype::f32, packed::Dtype::q8_0}) {
        INFO("d_shared_ffn " << fs << " in " << packed::dtype_name(t));
        c.d_shared_ffn = fs;
        const MoEFFN<float> moe(c, 14);
        const auto layer = PackedMoE<float>::from(moe, t);
        save_gguf_moe(path, layer, at_block());
        const gguf::File file = gguf::File::open(path);
        CHECK(file.get<std::uint32_t>("deepseek2.expert_shared_count") == 2);
        const auto loaded = load_gguf_moe(file, kBlock);
        CHECK(loaded.config().n_shared == 1);
        CHECK(loaded.config().shared_ffn() == 2 * c.d_ffn);
        const Matrix<float> xt = test::rnd<float>(7, 64, 15);
        const Matrix<float> y = loaded.forward(xt), want = layer.forward(xt);
        CHECK((y - want).norm() <= 1e-5 * want.norm());
      }
  }
  SECTION("what llama.cpp cannot express is refused before a byte is written") {
    MoEConfig c = arch_config(MoEFamily::Qwen3MoE);
    c.routing.capacity_factor = 1.25;
    CHECK_THROWS_AS(save_gguf_moe(path, MoEFFN<float>(c, 1)), ConfigError);
    CHECK_THROWS_AS(save_gguf_moe(path, MoEFFN<float>(arch_config(MoEFamily::OLMoE), 1), packed::Dtype::f32,
                                  at_block(MoEFamily::Qwen3MoE)),
                    ConfigError);  // qwen3moe renormalises, OLMoE does not
    CHECK(dir.entries() == 0);
  }
}

TEST_CASE("gguf_moe: save options that no F32 or uint32 key holds are refused naming the option",
          "[gguf_moe][regression]") {
  // inference/files/gguf/save.hpp wrote options.rms_eps as float(NaN) (and
  // 1e39 as +inf, undefined as a conversion); check_options refuses them.
  test::TempDir dir;
  const std::string path = (dir.path / "eps.gguf").string();
  const MoEFFN<float> layer(arch_config(MoEFamily::Qwen3MoE), 3);
  auto save_with = [&](double eps, Index block) {
    GgufSaveOptions o = at_block();
    o.rms_eps = eps, o.layer = block;
    return test::outcome([&] { save_gguf_moe(path, layer, packed::Dtype::f32, o); });
  };
  const char* positive = "must be finite, > 0 and a positive float";
  test::expect(save_with(std::numeric_limits<double>::quiet_NaN(), kBlock), "ConfigError",
               {"save_gguf_moe", "options.rms_eps", positive, "got nan"});
  test::expect(save_with(1e39, kBlock), "ConfigError", {"options.rms_eps", positive, "got 1e+39"});
  test::expect(save_with(0.0, kBlock), "ConfigError", {"options.rms_eps", "got 0"});
  test::expect(save_with(-1e-6, kBlock), "ConfigError", {"options.rms_eps", "got -1e-06"});
  test::expect(save_with(1e-6, -1), "ConfigError", {"options.layer", "got -1"});
  test::expect(save_with(1e-6, Index(1) << 32), "ConfigError", {"options.layer", "uint32", "got 4294967296"});
  CHECK(dir.entries() == 0);
  CHECK(save_with(1e-6, kBlock) == "returned");  // the ordinary options still save
  CHECK(dir.entries() == 1);
}

TEST_CASE("gguf_moe: F16 experts load into f16 panels with the file's bits", "[gguf_moe]") {
  test::TempDir dir;
  const MoEFFN<float> moe = arch_layer(MoEFamily::Mixtral, 21);
  save_gguf_moe(dir / "f32.gguf", moe, packed::Dtype::f32, at_block());
  Edit to_f16;
  to_f16.tensor = [](gguf::TensorInfo& t, std::vector<unsigned char>& bytes) {
    if (t.name.find("_exps") == std::string::npos) return true;
    std::vector<unsigned char> h(bytes.size() / 2);
    for (std::size_t i = 0; i < h.size() / 2; ++i) {
      float v;
      std::memcpy(&v, bytes.data() + 4 * i, 4);
      const std::uint16_t b = quant::fp32_to_fp16(v);
      std::memcpy(h.data() + 2 * i, &b, 2);
    }
    bytes = std::move(h);
    t.type = gguf::TensorType::F16;
    return true;
  };
  rewrite(dir / "f32.gguf", dir / "f16.gguf", to_f16);
  const gguf::File file = gguf::File::open(dir / "f16.gguf");
  const auto packed = load_gguf_moe(file, kBlock);
  CHECK(packed.types() == PackedTypes(packed::Dtype::f16));
  const auto fl = load_gguf_moe_float<float>(file, kBlock);
  // The packed weights are the F16 values, exactly.
  const auto& e = packed.experts()[5];
  CHECK(test::same_bits(e.w_gate(), fl.experts()[5].w_gate()));
  CHECK(test::same_bits(e.w_down(), fl.experts()[5].w_down()));
  const float w = moe.experts()[5].w_up()(3, 7);
  CHECK(e.w_up()(3, 7) == quant::fp16_to_fp32(quant::fp32_to_fp16(w)));
}

TEST_CASE("gguf_moe: llama's feed_forward_length may be a per-block array", "[gguf_moe]") {
  test::TempDir dir;
  const MoEFFN<float> moe = arch_layer(MoEFamily::Mixtral, 22);
  const auto layer = PackedMoE<float>::from(moe, packed::Dtype::q4_0);
  save_gguf_moe(dir / "scalar.gguf", layer, at_block(MoEFamily::Mixtral));  // unnamed, it would be qwen3moe
  Edit e;
  e.key = [](const std::string& k, gguf::Value& v) {
    if (k == "llama.feed_forward_length") v = gguf::Value::array_of(std::vector<std::uint32_t>{14336, 0, 7, kF});
    return true;
  };
  rewrite(dir / "scalar.gguf", dir / "array.gguf", e);
  const gguf::File file = gguf::File::open(dir / "array.gguf");
  REQUIRE(file.at("llama.feed_forward_length").type() == gguf::ValueType::array);
  const Matrix<float> x = test::rnd<float>(4, kD, 23);
  CHECK(test::same_bits(load_gguf_moe(file, kBlock).forward(x), layer.forward(x)));
  CHECK_THROWS_AS(load_gguf_moe(file, 1), ConfigError);  // block 1 has width 0
  CHECK_THROWS_AS(load_gguf_moe(file, 2), FormatError);  // block 2 has no tensors
}

TEST_CASE("gguf_moe: bad files are typed errors that leave the destination unchanged", "[gguf_moe]") {
  test::TempDir dir;
  const std::string good = dir / "good.gguf", bad = dir / "bad.gguf";
  save_gguf_moe(good, arch_layer(MoEFamily::DeepSeekV3, 40), packed::Dtype::q8_0, at_block());
  const Matrix<float> x = test::rnd<float>(5, kD, 41);
  auto layer = load_gguf_moe(gguf::File::open(good), kBlock);
  const Matrix<float> before = layer.forward(x);
  const auto expect = [&](const Edit& e, auto tag, const char* text, Index block = kBlock) {
    rewrite(good, bad, e);
    using E = typename decltype(tag)::type;
    const gguf::File file = gguf::File::open(bad);
    CHECK_THROWS_AS(layer = load_gguf_moe(file, block), E);
    CHECK_THROWS_WITH(load_gguf_moe(file, block), Catch::Matchers::Contains(text));
    CHECK_THROWS_AS(load_gguf_moe_float<double>(file, block), E);
    CHECK(test::same_bits(layer.forward(x), before));
  };
  const auto set_key = [](const char* key, gguf::Value v) {
    Edit e;
    e.key = [key, v](const std::string& k, gguf::Value& out) {
      if (k == key) out = v;
      return true;
    };
    return e;
  };
  const auto drop_tensor = [](std::string name) {
    Edit e;
    e.tensor = [name](gguf::TensorInfo& t, std::vector<unsigned char>&) { return t.name != name; };
    return e;
  };
  SECTION("an architecture not in the table") {
    expect(set_key("general.architecture", gguf::Value::of("gpt2")), Is<ConfigError>{}, "'gpt2'");
  }
  SECTION("a missing tensor") {
    expect(drop_tensor(blk("ffn_up_exps.weight")), Is<FormatError>{}, "blk.3.ffn_up_exps.weight");
  }
  SECTION("a missing key") {
    Edit e;
    e.key = [](const std::string& k, gguf::Value&) { return k != "deepseek2.expert_used_count"; };
    expect(e, Is<FormatError>{}, "deepseek2.expert_used_count");
  }
  SECTION("a key of the wrong type") {
    expect(set_key("deepseek2.expert_count", gguf::Value::of("16")), Is<FormatError>{}, "expert_count");
  }
  SECTION("sizes past the index range, before anything is allocated") {
    // Both loaders (expect runs load_gguf_moe_float<double> too) read the
    // counts before the tensors: a count past 2^40, or a shared width
    // count × d_ffn past int64, is a ConfigError naming it, not a wrapped size.
    expect(set_key("deepseek2.expert_count", gguf::Value::of(std::uint64_t(1) << 41)), Is<ConfigError>{},
           "'deepseek2.expert_count' = 2199023255552 is too large for a layer");
    Edit wide;
    wide.key = [](const std::string& k, gguf::Value& out) {
      if (k == "deepseek2.expert_shared_count" || k == "deepseek2.expert_feed_forward_length")
        out = gguf::Value::of(std::uint64_t(1) << 39);
      return true;
    };
    expect(wide, Is<ConfigError>{}, "shared width");
  }
  SECTION("metadata that disagrees with the tensors: a wrong shape") {
    expect(set_key("deepseek2.expert_count", gguf::Value::of(std::uint32_t(8))), Is<ShapeError>{},
           "blk.3.ffn_gate_inp.weight is [256, 16], the metadata implies [256, 8]");
  }
  SECTION("a tensor type without storage") {
    Edit e;
    e.tensor = [](gguf::TensorInfo& t, std::vector<unsigned char>&) {
      if (t.name == gguf::block_tensor(kBlock, "ffn_gate_inp.weight")) t.type = gguf::TensorType::I32;
      return true;
    };
    expect(e, Is<FormatError>{}, "i32");
  }
  SECTION("a gating function the library lacks") {
    expect(set_key("deepseek2.expert_gating_func", gguf::Value::of(std::uint32_t(7))), Is<ConfigError>{},
           "expert_gating_func");
  }
  SECTION("a leading dense block, and a block past the end") {
    expect(set_key("deepseek2.leading_dense_block_count", gguf::Value::of(std::uint32_t(4))), Is<ConfigError>{},
           "dense FFN block");
    expect(Edit{}, Is<ConfigError>{}, "does not exist", 9);
  }
  SECTION("a non-finite router weight") {
    Edit e;
    e.tensor = [](gguf::TensorInfo& t, std::vector<unsigned char>& b) {
      if (t.name == gguf::block_tensor(kBlock, "ffn_gate_inp.weight")) {
        const float nan = std::numeric_limits<float>::quiet_NaN();
        std::memcpy(b.data() + 40, &nan, 4);
      }
      return true;
    };
    expect(e, Is<ValueError>{}, "NaN");
  }
  SECTION("gate and up of different types") {
    const std::string f32 = dir / "f32.gguf";
    save_gguf_moe(f32, arch_layer(MoEFamily::DeepSeekV3, 40), packed::Dtype::f32, at_block());
    Edit e;
    e.tensor = [](gguf::TensorInfo& t, std::vector<unsigned char>& bytes) {
      if (t.name != gguf::block_tensor(kBlock, "ffn_up_exps.weight")) return true;
      std::vector<unsigned char> h(bytes.size() / 2);  // the same weights as BF16
      for (std::size_t i = 0; i < h.size() / 2; ++i) {
        float v;
        std::memcpy(&v, bytes.data() + 4 * i, 4);
        const std::uint16_t b = packed::bf16_bits(v);
        std::memcpy(h.data() + 2 * i, &b, 2);
      }
      bytes = std::move(h);
      t.type = gguf::TensorType::BF16;
      return true;
    };
    rewrite(f32, bad, e);
    const gguf::File file = gguf::File::open(bad);
    CHECK_THROWS_AS(layer = load_gguf_moe(file, kBlock), ConfigError);
    CHECK_THROWS_WITH(load_gguf_moe(file, kBlock), Catch::Matchers::Contains("gate and up share one packed panel"));
    CHECK(test::same_bits(layer.forward(x), before));
  }
  SECTION("the sublayer without its norm") {
    rewrite(good, bad, Edit{});
    CHECK_THROWS_AS(load_gguf_sublayer(gguf::File::open(bad), kBlock), FormatError);
  }
}

TEST_CASE("gguf_moe: expert blocks whose values would not be finite are refused, naming the expert and block",
          "[gguf_moe][regression]") {
  // load_gguf_moe moved every expert block into panels as it was: an MXFP4
  // block of exponent 254 with code ±4 (4·2^126 = 2^128) or a Q8_0 block of
  // fp16 scale Inf gave a layer whose outputs were Inf or NaN. The blocks are
  // checked as they move (the scale-range rule, docs/quantized_formats.md).
  test::TempDir dir;
  const std::string good = dir / "good.gguf", bad = dir / "bad.gguf";
  const MoEFFN<float> moe = arch_layer(MoEFamily::Qwen3MoE, 44);
  // Block 2 of row 0 of expert 1's gate (ne [d, f, E]: rows e·f …), set by `edit`.
  const auto edited = [&](packed::Dtype t, std::size_t block_bytes, const std::function<void(unsigned char*)>& edit) {
    save_gguf_moe(good, moe, t, at_block());
    Edit e;
    e.tensor = [&](gguf::TensorInfo& info, std::vector<unsigned char>& bytes) {
      if (info.name == blk("ffn_gate_exps.weight"))
        edit(bytes.data() + (1 * kF) * (kD / 32) * block_bytes + 2 * block_bytes);
      return true;
    };
    rewrite(good, bad, e);
    return test::outcome([&] { (void)load_gguf_moe(gguf::File::open(bad), kBlock); });
  };
  const auto mxfp4 = [](std::uint8_t e, std::uint8_t code) {
    return [e, code](unsigned char* b) {
      b[0] = e;
      std::memset(b + 1, 0, 16);          // codes 0 …
      b[1 + 9] = std::uint8_t(8 + code);  // … but one weight −v
    };
  };
  // load_gguf_moe_float decoded such a block to Inf weights (ggml's
  // dequantizer does not refuse it); the decoder refuses it the same way,
  // naming the tensor, its row (expert 1's gate row 0: row kF) and block.
  const auto as_float = [&] { return test::outcome([&] { (void)load_gguf_moe_float(gguf::File::open(bad), kBlock); }); };
  const std::string row = "tensor '" + blk("ffn_gate_exps.weight") + "' row " + std::to_string(kF) + ": block 2 of a ";
  CHECK(edited(packed::Dtype::mxfp4, 17, mxfp4(254, 3)) == "returned");  // 3·2^126: finite
  CHECK(as_float() == "returned");
  test::expect(edited(packed::Dtype::mxfp4, 17, mxfp4(254, 4)), "ValueError",
               {"load_gguf_moe(",
                "expert 1: PackedExpert::from_file_rows: gate row 0: block 2 of a mxfp4 row: its E8M0 "
                "exponent e = 254",
                "overflows float"});
  test::expect(as_float(), "ValueError",
               {"load_gguf_moe_float(", row + "mxfp4 row: its E8M0 exponent e = 254", "overflows float"});
  test::expect(edited(packed::Dtype::mxfp4, 17, mxfp4(255, 2)), "ValueError", {"expert 1", "e = 255"});
  test::expect(as_float(), "ValueError", {row + "mxfp4 row", "e = 255"});
  const auto q8_scale = [](std::uint16_t bits) { return [bits](unsigned char* b) { std::memcpy(b, &bits, 2); }; };
  CHECK(edited(packed::Dtype::q8_0, 34, q8_scale(0x7BFF)) == "returned");
  CHECK(as_float() == "returned");
  test::expect(
      edited(packed::Dtype::q8_0, 34, q8_scale(0x7C00)), "ValueError",
      {"expert 1: PackedExpert::from_file_rows: gate row 0: block 2 of a q8_0 row: its scale d = inf in fp16"});
  test::expect(as_float(), "ValueError",
               {"load_gguf_moe_float(", row + "q8_0 row: its scale d = inf in fp16", "would not be finite"});
  (void)edited(packed::Dtype::q8_0, 34, q8_scale(0x7E00));  // NaN
  test::expect(as_float(), "ValueError", {row + "q8_0 row: its scale d = nan in fp16"});
  // The float layer the caller holds is left as it was.
  MoEFFN<float> dst = moe;
  const Matrix<float> x = test::rnd<float>(3, kD, 5);
  const Matrix<float> before = dst.forward(x);
  CHECK_THROWS_AS(dst = load_gguf_moe_float(gguf::File::open(bad), kBlock), ValueError);
  CHECK(test::same_bits(dst.forward(x), before));
}
