// gpt-oss MoE blocks from and to GGUF files (io/gguf_architectures.hpp's
// `gpt-oss` row, inference/files/gguf/load.hpp, save.hpp): a GptOssMoE
// round-trips in every storage type to the same bits, with llama.cpp's
// names, shapes and split gate/up tensors; the packed layer matches the
// float layer read from the same file within the type's error; the sublayer
// reads post_attention_norm; bad files and the wrong expert type are typed
// errors; and blocks written by gguf-py's own writer (tests/gguf_moe_reference.py)
// give llama.cpp's OPENAI_MOE output.
#include <catch2/catch.hpp>

#include <apex/ffn/inference.hpp>
#include <apex/ffn/inference/files/gguf/load.hpp>
#include <apex/ffn/inference/files/gguf/save.hpp>
#include <apex/ffn/io/gguf.hpp>
#include <apex/ffn/moe/gpt_oss.hpp>

#include <cstdlib>
#include <fstream>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "bits.hpp"
#include "fixtures.hpp"
#include "temp_dir.hpp"

using namespace apex;

namespace {

constexpr Index kOssD = 256, kOssF = 256, kOssE = 8, kOssK = 2;  // whole Q4_K / Q6_K super-blocks
constexpr Index kOssBlock = 2;

using OssPacked = PackedMoE<float, ClampedSwiGLU<float>>;

/// A gpt-oss layer with non-zero biases everywhere, weights large enough
/// that some units hit the clamps.
GptOssMoE<float> oss_layer(std::uint64_t seed) {
  GptOssMoE<float> m(gpt_oss_moe(kOssD, kOssF, kOssE, kOssK), seed);
  m.router().logit_bias() = test::rnd<float>(1, kOssE, seed + 1, 0.5);
  std::uint64_t s = seed + 2;
  for (auto& e : m.experts()) {
    e.b_gate() = test::rnd<float>(1, kOssF, s++, 0.5);
    e.b_up() = test::rnd<float>(1, kOssF, s++, 0.5);
    e.b_down() = test::rnd<float>(1, kOssD, s++, 0.1);
  }
  return m;
}

const packed::Dtype kOssTypes[] = {packed::Dtype::f32,  packed::Dtype::bf16, packed::Dtype::f16,  packed::Dtype::q8_0,
                                   packed::Dtype::q4_0, packed::Dtype::q4_k, packed::Dtype::q6_k, packed::Dtype::mxfp4};

/// The packed layer's error against the float layer of the same file's weights.
double oss_bound(packed::Dtype t) {
  switch (t) {
    case packed::Dtype::f32: return 1e-5;
    case packed::Dtype::bf16: return 6e-3;
    case packed::Dtype::f16: return 1e-3;
    case packed::Dtype::q8_0: return 2.5e-2;
    case packed::Dtype::q6_k: return 5e-2;
    case packed::Dtype::q4_k: return 1.5e-1;
    case packed::Dtype::q4_0: return 1.7e-1;
    case packed::Dtype::mxfp4: return 4e-1;
  }
  return 0;
}

GgufSaveOptions oss_at_block() {
  GgufSaveOptions o;
  o.layer = kOssBlock;
  return o;
}

std::string oss_blk(const char* name) { return gguf::block_tensor(kOssBlock, name); }

std::vector<std::uint64_t> oss_ne(const gguf::TensorInfo& t) {
  std::vector<std::uint64_t> ne(t.ne.begin(), t.ne.end());
  while (ne.size() > 1 && ne.back() == 1) ne.pop_back();
  return ne;
}

/// A copy of `src` whose tensors `edit` may drop (false) or change.
void oss_rewrite(const std::string& src, const std::string& dst,
                 const std::function<bool(gguf::TensorInfo&, std::vector<unsigned char>&)>& edit) {
  const gguf::File in = gguf::File::open(src);
  gguf::Writer w;
  for (const gguf::Value& v : in.metadata())
    if (v.key() != "general.alignment") w.set(v.key(), v);
  std::vector<std::vector<unsigned char>> keep;
  keep.reserve(in.tensors().size());
  for (const gguf::TensorInfo& t0 : in.tensors()) {
    gguf::TensorInfo t = t0;
    keep.emplace_back(in.data(t0), in.data(t0) + t0.nbytes);
    if (!edit(t, keep.back())) continue;
    w.add_tensor(t.name, t.type, t.ne, keep.back().data(), keep.back().size());
  }
  w.save(dst);
}

/// Every tensor's bytes, by name.
std::vector<std::pair<std::string, std::vector<unsigned char>>> oss_tensor_bytes(const gguf::File& f) {
  std::vector<std::pair<std::string, std::vector<unsigned char>>> out;
  for (const gguf::TensorInfo& t : f.tensors()) out.emplace_back(t.name, std::vector<unsigned char>(f.data(t), f.data(t) + t.nbytes));
  return out;
}

}  // namespace

TEST_CASE("gguf_gpt_oss: a gpt-oss layer round-trips in every storage type to the same bits", "[gguf_gpt_oss]") {
  test::TempDir dir;
  const Matrix<float> x = test::rnd<float>(9, kOssD, 5, 3.0);
  const GptOssMoE<float> moe = oss_layer(40);
  for (packed::Dtype t : kOssTypes) {
    INFO(packed::dtype_name(t));
    const OssPacked layer = OssPacked::from(moe, t);
    const std::string path = dir / "oss.gguf", again = dir / "oss2.gguf";
    save_gguf_moe(path, layer, oss_at_block());
    const gguf::File file = gguf::File::open(path);
    CHECK(file.architecture() == "gpt-oss");
    CHECK(file.get<std::uint64_t>("gpt-oss.expert_feed_forward_length") == std::uint64_t(kOssF));
    const std::uint64_t d = kOssD, f = kOssF, e = kOssE;
    CHECK(oss_ne(file.tensor(oss_blk("ffn_gate_inp.bias"))) == std::vector<std::uint64_t>{e});
    CHECK(oss_ne(file.tensor(oss_blk("ffn_gate_exps.weight"))) == std::vector<std::uint64_t>{d, f, e});
    CHECK(oss_ne(file.tensor(oss_blk("ffn_up_exps.weight"))) == std::vector<std::uint64_t>{d, f, e});
    CHECK(oss_ne(file.tensor(oss_blk("ffn_gate_exps.bias"))) == std::vector<std::uint64_t>{f, e});
    CHECK(oss_ne(file.tensor(oss_blk("ffn_up_exps.bias"))) == std::vector<std::uint64_t>{f, e});
    CHECK(oss_ne(file.tensor(oss_blk("ffn_down_exps.bias"))) == std::vector<std::uint64_t>{d, e});
    CHECK(file.tensor(oss_blk("ffn_gate_exps.bias")).type == gguf::TensorType::F32);
    CHECK_FALSE(file.find_tensor(oss_blk("exp_probs_b.bias")));
    const OssPacked loaded = load_gguf_moe<float, ClampedSwiGLU<float>>(file, kOssBlock);
    CHECK(loaded.types() == layer.types());
    CHECK(loaded.config().router_bias);
    CHECK(loaded.config().routing.scoring == Scoring::SoftmaxSelected);
    CHECK(test::same_bits(loaded.router().logit_bias(), layer.router().logit_bias()));
    for (Index i = 0; i < kOssE; ++i) {
      const ClampedBiases &a = loaded.extras()[std::size_t(i)], &b = layer.extras()[std::size_t(i)];
      CHECK(test::same_bits(a.gate, b.gate));
      CHECK(test::same_bits(a.up, b.up));
      CHECK(test::same_bits(a.down, b.down));
      CHECK(a.options.alpha == b.options.alpha);
      CHECK(a.options.limit == b.options.limit);
    }
    CHECK(test::same_bits(loaded.forward(x), layer.forward(x)));
    // Written again from the loaded layer: every tensor's bytes unchanged.
    save_gguf_moe(again, loaded, oss_at_block());
    CHECK(oss_tensor_bytes(gguf::File::open(again)) == oss_tensor_bytes(file));
  }
}

TEST_CASE("gguf_gpt_oss: the packed layer matches the float GptOssMoE read from the same file", "[gguf_gpt_oss]") {
  test::TempDir dir;
  const Matrix<float> x = test::rnd<float>(13, kOssD, 6, 3.0);
  const GptOssMoE<float> moe = oss_layer(60);
  const auto rel = [](const Matrix<double>& a, const Matrix<double>& b) { return (a - b).norm() / b.norm(); };
  for (packed::Dtype t : kOssTypes) {
    INFO(packed::dtype_name(t));
    const std::string path = dir / "oss.gguf";
    save_gguf_moe(path, moe, t, oss_at_block());  // the float layer, packed in t
    const gguf::File file = gguf::File::open(path);
    const OssPacked packed = load_gguf_moe<float, ClampedSwiGLU<float>>(file, kOssBlock);
    const GptOssMoE<double> dbl = load_gguf_moe_float<double, ClampedSwiGLU<double>>(file, kOssBlock);
    const GptOssMoE<float> fl = load_gguf_moe_float<float, ClampedSwiGLU<float>>(file, kOssBlock);
    CHECK(dbl.config().router_bias);
    CHECK(dbl.experts()[0].options().limit == 7.0);
    const Matrix<double> y_double = dbl.forward(x.cast<double>());
    CHECK(rel(packed.forward(x).cast<double>(), y_double) < oss_bound(t));
    CHECK(rel(fl.forward(x).cast<double>(), y_double) < 1e-5);
    CHECK(test::same_bits(fl.router().logit_bias(), moe.router().logit_bias()));
    CHECK(test::same_bits(fl.experts()[3].b_up(), moe.experts()[3].b_up()));
    if (t == packed::Dtype::f32) CHECK(rel(moe.forward(x).cast<double>(), y_double) < 1e-5);
  }
}

TEST_CASE("gguf_gpt_oss: the sublayer reads and writes post_attention_norm", "[gguf_gpt_oss]") {
  test::TempDir dir;
  const Matrix<float> x = test::rnd<float>(7, kOssD, 8, 3.0);
  FFNSublayer<float, GptOssMoE<float>> sub(kOssD, oss_layer(80));
  sub.norm().gain() = test::rnd<float>(1, kOssD, 9, 0.2).array() + 1.0f;
  const auto packed = pack_sublayer<packed::q8_0>(sub);
  const std::string path = dir / "oss.gguf";
  save_gguf_sublayer(path, packed, oss_at_block());
  const gguf::File file = gguf::File::open(path);
  CHECK(file.find_tensor(oss_blk("post_attention_norm.weight")));
  CHECK_FALSE(file.find_tensor(oss_blk("ffn_norm.weight")));
  const auto loaded = load_gguf_sublayer<float, ClampedSwiGLU<float>>(file, kOssBlock);
  CHECK(loaded.norm().eps() == packed.norm().eps());
  CHECK(test::same_bits(loaded.forward(x), packed.forward(x)));
}

TEST_CASE("gguf_gpt_oss: missing or misshapen biases, non-finite biases, the wrong expert type", "[gguf_gpt_oss]") {
  test::TempDir dir;
  const std::string good = dir / "good.gguf", bad = dir / "bad.gguf", plain = dir / "plain.gguf";
  save_gguf_moe(good, oss_layer(90), packed::Dtype::q8_0, oss_at_block());
  const auto load = [&](const std::string& p) { return load_gguf_moe<float, ClampedSwiGLU<float>>(gguf::File::open(p), kOssBlock); };
  const auto load_float = [&](const std::string& p) {
    return load_gguf_moe_float<float, ClampedSwiGLU<float>>(gguf::File::open(p), kOssBlock);
  };
  for (const char* name : {"ffn_gate_inp.bias", "ffn_gate_exps.bias", "ffn_up_exps.bias", "ffn_down_exps.bias"}) {
    INFO(name);
    SECTION(std::string("missing ") + name) {
      oss_rewrite(good, bad, [&](gguf::TensorInfo& t, std::vector<unsigned char>&) { return t.name != oss_blk(name); });
      CHECK_THROWS_WITH(load(bad), Catch::Contains("has no tensor") && Catch::Contains(oss_blk(name)));
      CHECK_THROWS_AS(load_float(bad), FormatError);
    }
  }
  SECTION("a bias of the wrong shape") {
    oss_rewrite(good, bad, [&](gguf::TensorInfo& t, std::vector<unsigned char>&) {
      if (t.name == oss_blk("ffn_down_exps.bias")) t.ne = {std::uint64_t(kOssD / 2), std::uint64_t(2 * kOssE)};
      return true;
    });
    CHECK_THROWS_WITH(load(bad), Catch::Contains("ffn_down_exps.bias") && Catch::Contains("[128, 16]"));
    CHECK_THROWS_AS(load_float(bad), ShapeError);
  }
  SECTION("a NaN bias") {
    oss_rewrite(good, bad, [&](gguf::TensorInfo& t, std::vector<unsigned char>& b) {
      const float nan = std::numeric_limits<float>::quiet_NaN();
      if (t.name == oss_blk("ffn_up_exps.bias")) std::memcpy(b.data() + 4 * 17, &nan, 4);
      return true;
    });
    CHECK_THROWS_AS(load(bad), ValueError);
    CHECK_THROWS_AS(load_float(bad), ValueError);
  }
  SECTION("a gpt-oss file into a SwiGLU layer, and a SwiGLU file into a gpt-oss layer") {
    const gguf::File file = gguf::File::open(good);
    CHECK_THROWS_WITH(load_gguf_moe(file, kOssBlock), Catch::Contains("'gpt-oss' has clamped-SwiGLU (with biases) experts") &&
                                                          Catch::Contains("asked for has SwiGLU experts"));
    CHECK_THROWS_AS(load_gguf_moe_float<double>(file, kOssBlock), ConfigError);
    CHECK_THROWS_AS(load_gguf_sublayer(file, kOssBlock), ConfigError);
    MoEConfig c = gpt_oss_moe(kOssD, kOssF, kOssE, kOssK);
    c.router_bias = false, c.routing.scoring = Scoring::SoftmaxAll;
    save_gguf_moe(plain, MoEFFN<float>(c, 3), packed::Dtype::f32, oss_at_block());
    const gguf::File swiglu = gguf::File::open(plain);
    CHECK(swiglu.architecture() == "qwen3moe");
    CHECK_THROWS_WITH(load(plain), Catch::Contains("'qwen3moe' has SwiGLU experts") && Catch::Contains("clamped-SwiGLU"));
    CHECK_THROWS_AS(load_float(plain), ConfigError);
  }
}

TEST_CASE("gguf_gpt_oss: layers llama.cpp's gpt-oss cannot hold are refused before writing", "[gguf_gpt_oss]") {
  test::TempDir dir;
  const std::string path = dir / "oss.gguf";
  SECTION("a clamp limit other than llama.cpp's 7") {
    GptOssMoE<float> m = oss_layer(100);
    ClampedSwiGLUOptions o;
    o.limit = 5.0;
    m.experts()[2].set_options(o);
    CHECK_THROWS_WITH(save_gguf_moe(path, m), Catch::Contains("limit") && Catch::Contains("expert 2"));
  }
  SECTION("a balancing bias, which gpt-oss has no tensor for") {
    GptOssMoE<float> m = oss_layer(101);
    m.balancer().set_bias(test::rnd<float>(1, kOssE, 4, 0.1));
    CHECK_THROWS_AS(save_gguf_moe(path, m), ConfigError);
  }
  SECTION("softmax over all experts") {
    MoEConfig c = gpt_oss_moe(kOssD, kOssF, kOssE, kOssK);
    c.routing.scoring = Scoring::SoftmaxAll;
    CHECK_THROWS_WITH(save_gguf_moe(path, GptOssMoE<float>(c, 5)), Catch::Contains("softmax_all"));
  }
  SECTION("a family's architecture for clamped experts, and a router bias on SwiGLU experts") {
    GgufSaveOptions o = oss_at_block();
    o.family = MoEFamily::Qwen3MoE;
    CHECK_THROWS_WITH(save_gguf_moe(path, oss_layer(102), packed::Dtype::f32, o), Catch::Contains("clamped-SwiGLU"));
    MoEConfig c = gpt_oss_moe(kOssD, kOssF, kOssE, kOssK);
    c.routing.scoring = Scoring::SoftmaxAll;
    CHECK_THROWS_WITH(save_gguf_moe(path, MoEFFN<float>(c, 6)), Catch::Contains("logit bias"));
  }
  CHECK_FALSE(std::ifstream(path).good());
  SECTION("a layer without a router bias writes zeros") {
    MoEConfig c = gpt_oss_moe(kOssD, kOssF, kOssE, kOssK);
    c.router_bias = false;
    const GptOssMoE<float> m(c, 7);
    save_gguf_moe(path, m);
    const auto loaded = load_gguf_moe<float, ClampedSwiGLU<float>>(gguf::File::open(path), 0);
    CHECK((loaded.router().logit_bias().array() == 0.0f).all());
    const Matrix<float> x = test::rnd<float>(5, kOssD, 9);
    CHECK(test::same_bits(loaded.forward(x), OssPacked::from(m).forward(x)));
  }
}

namespace {

template <class T>
Matrix<T> oss_read_raw(const std::string& path, Index rows, Index cols) {
  Matrix<T> m(rows, cols);
  std::ifstream in(path, std::ios::binary);
  REQUIRE(in.good());
  in.read(reinterpret_cast<char*>(m.data()), std::streamsize(sizeof(T) * std::size_t(m.size())));
  REQUIRE(in.gcount() == std::streamsize(sizeof(T) * std::size_t(m.size())));
  return m;
}

/// The packed layer's error against the reference of its own weights: the
/// activations' quantization only. Measured (gguf_moe_reference.py's seeds):
/// F32, F16, BF16 5e-7; Q8_0, Q4_0, MXFP4 1.0e-2 to 1.1e-2; Q6_K 1.6e-2;
/// Q4_K 2.8e-2 (random codes: a wider spread of weights than a quantizer's).
double oss_python_bound(const std::string& type) {
  if (type == "F32" || type == "F16" || type == "BF16") return 1e-5;
  if (type == "Q4_K" || type == "Q6_K") return 4e-2;
  return 2e-2;
}

}  // namespace

TEST_CASE("gguf_gpt_oss: blocks written by gguf-py give llama.cpp's OPENAI_MOE output", "[gguf_gpt_oss][python]") {
  const char* dir = std::getenv("APEX_FFN_GGUF_PY_DIR");
  if (!dir) {
    WARN("SKIP: APEX_FFN_GGUF_PY_DIR is not set (tests/gguf_moe_interop.cmake sets it when PyPI gguf is installed)");
    return;
  }
  constexpr Index kN = 7, kD = 256, kBlock = 1;
  for (const char* type : {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q6_K", "MXFP4"}) {
    INFO(type);
    const std::string base = std::string(dir) + "/gpt-oss_" + type;
    const gguf::File file = gguf::File::open(base + ".gguf");
    const Matrix<float> x = oss_read_raw<float>(base + ".x", kN, kD);
    const Matrix<double> y = oss_read_raw<double>(base + ".y", kN, kD);
    const auto packed = load_gguf_moe<float, ClampedSwiGLU<float>>(file, kBlock);
    const auto dbl = load_gguf_moe_float<double, ClampedSwiGLU<double>>(file, kBlock);
    const auto sub = load_gguf_sublayer<float, ClampedSwiGLU<float>>(file, kBlock);
    CHECK(sub.norm().eps() == Approx(1e-5f));
    const double e_packed = (packed.forward(x).cast<double>() - y).norm() / y.norm();
    const double e_double = (dbl.forward(x.cast<double>()) - y).norm() / y.norm();
    CHECK(e_double < 1e-9);
    CHECK(e_packed < oss_python_bound(type));
    CHECK_THROWS_AS(load_gguf_moe(file, kBlock), ConfigError);
  }
}
