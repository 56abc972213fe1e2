// gpt-oss's experts on the packed engine, through the expert-kind table
// (inference/engine/kinds/clamped_swiglu.hpp): PackedMoE<Storage, ClampedSwiGLU<float>> on
// every storage type against the float layer (the same routing, the output
// within the type's bound) and against the float layer on the packed
// weights dequantized, the same bits on every kernel path and thread count,
// packed checkpoints and the pack-once file keeping the biases, and the
// errors of the kind's parts.
#include <catch2/catch.hpp>

#include <apex/ffn/inference.hpp>
#include <apex/ffn/inference/files/pack_once/file.hpp>
#include <apex/ffn/inference/files/pack_once/map.hpp>
#include <apex/ffn/inference/files/gpt_oss/load.hpp>
#include <apex/ffn/inference/files/gpt_oss/save.hpp>
#include <apex/ffn/inference/files/checkpoint/load.hpp>
#include <apex/ffn/io/gpt_oss_checkpoint.hpp>
#include <apex/ffn/moe/gpt_oss.hpp>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "fixtures.hpp"
#include "packed_layers.hpp"
#include "sweep.hpp"
#include "temp_dir.hpp"

using namespace apex;
using apex::test::bitwise_equal;
using apex::test::rel;

namespace {

using FloatGptOss = GptOssMoE<float>;

/// A gpt-oss layer with every part the kind adds set: a router logit bias,
/// and expert biases large enough that the gate and up clamps act.
FloatGptOss clamped_layer(Index d, Index f, std::uint64_t seed) {
  FloatGptOss moe(gpt_oss_moe(d, f, 5, 2), seed);
  moe.router().logit_bias() = test::rnd<float>(1, 5, seed + 1, 0.5);
  std::uint64_t s = seed + 2;
  for (auto& e : moe.experts()) {
    e.swiglu().w_gate() *= 4.0f;
    e.swiglu().w_up() *= 4.0f;
    e.b_gate() = test::rnd<float>(1, f, s++, 6.0);
    e.b_up() = test::rnd<float>(1, f, s++, 6.0);
    e.b_down() = test::rnd<float>(1, d, s++, 0.5);
  }
  return moe;
}

/// The float layer whose expert weights are the packed layer's, dequantized.
template <class Packed>
FloatGptOss dequantized_twin(const FloatGptOss& moe, const Packed& p) {
  FloatGptOss twin = moe;
  for (std::size_t e = 0; e < twin.experts().size(); ++e) {
    twin.experts()[e].swiglu().w_gate() = p.experts()[e].w_gate();
    twin.experts()[e].swiglu().w_up() = p.experts()[e].w_up();
    twin.experts()[e].swiglu().w_down() = p.experts()[e].w_down();
  }
  return twin;
}

/// ‖y − y_float‖/‖y_float‖ per type on these layers (float and f16/bf16
/// rounding; the block formats as test_packed_quant.cpp bounds them, their
/// activations quantized too).
double clamped_bound(packed::Dtype t) {
  switch (t) {
    case packed::Dtype::f32: return 1e-5;
    case packed::Dtype::f16: return 2e-3;
    case packed::Dtype::bf16: return 1e-2;
    case packed::Dtype::q8_0: return 0.02;
    case packed::Dtype::q6_k: return 0.045;
    case packed::Dtype::q4_k: return 0.15;
    case packed::Dtype::q4_0: return 0.17;
    default: return 0.40;  // mxfp4
  }
}

template <class Storage>
void check_clamped_storage(const FloatGptOss& moe, const Matrix<float>& x) {
  constexpr packed::Dtype t = packed::dtype_of<Storage>();
  CAPTURE(packed::dtype_name(t));
  auto layer = PackedMoE<Storage, ClampedSwiGLU<float>>::from(moe);
  CHECK_NOTHROW(layer.check_source(moe));
  FloatGptOss::Cache c0;
  typename decltype(layer)::Cache c1;
  const Matrix<float> want = moe.forward(x, &c0);
  const Matrix<float> y = layer.forward(x, &c1);
  CHECK(c1.routing.experts == c0.routing.experts);  // the float layer's routing, logit bias included
  CHECK(bitwise_equal(c1.routing.weights, c0.routing.weights));
  CHECK(rel(y, want) < clamped_bound(t));
  // Against the float layer on the packed weights: only the products' (and
  // the block formats' activation) rounding remains.
  const double twin_err = rel(y, dequantized_twin(moe, layer).forward(x));
  CHECK(twin_err < (packed::WeightType<t>::kQuantized ? 0.02 : 1e-5));
  for (const packed::Isa isa : packed::kAllIsas) {
    if (!packed::cpu_supports(isa)) {
      WARN("kernel path " << packed::isa_name(isa) << " skipped: this CPU does not support it");
      continue;
    }
    for (const int threads : {1, 2}) {
      CAPTURE(packed::isa_name(isa), threads);
      layer.set_kernel_options({isa});
      layer.set_threads(threads);
      CHECK(bitwise_equal(layer.forward(x), y));
    }
  }
  // A bias changed after packing: check_source sees a stale copy.
  FloatGptOss changed = moe;
  changed.experts()[1].b_down()(0) += 1.0f;
  CHECK_THROWS_AS(layer.check_source(changed), ValueError);
}

}  // namespace

TEST_CASE("gpt-oss experts on every storage type: the float layer's routing, output within the type's bound",
          "[inference][gpt_oss][quant]") {
  {
    const FloatGptOss odd = clamped_layer(37, 53, 11);  // widths of no block size
    for (Index n : {1, 3, 6, 37}) {
      CAPTURE(n);
      const Matrix<float> x = test::rnd<float>(n, 37, 100 + std::uint64_t(n));
      check_clamped_storage<float>(odd, x);
      check_clamped_storage<packed::bf16>(odd, x);
      check_clamped_storage<packed::f16>(odd, x);
    }
  }
  const FloatGptOss whole = clamped_layer(256, 256, 21);  // whole Q4_K/Q6_K super-blocks
  for (Index n : {1, 6, 37}) {
    CAPTURE(n);
    const Matrix<float> x = test::rnd<float>(n, 256, 200 + std::uint64_t(n));
    check_clamped_storage<packed::q8_0>(whole, x);
    check_clamped_storage<packed::q4_0>(whole, x);
    check_clamped_storage<packed::q4_k>(whole, x);
    check_clamped_storage<packed::q6_k>(whole, x);
    check_clamped_storage<packed::mxfp4>(whole, x);
  }
}

TEST_CASE("gpt-oss packed checkpoints and pack-once files keep the router and expert biases",
          "[inference][gpt_oss][checkpoint]") {
  const FloatGptOss moe = clamped_layer(64, 96, 31);
  const Matrix<float> x = test::rnd<float>(9, 64, 32);
  test::TempDir dir;
  for (const PackedTypes types : {PackedTypes(packed::Dtype::bf16), PackedTypes(packed::Dtype::mxfp4)}) {
    CAPTURE(packed_types_name(types));
    const auto p = PackedMoE<float, ClampedSwiGLU<float>>::from(moe, types);
    const Matrix<float> y = p.forward(x);
    const std::string ckpt = dir / "gpt_oss.safetensors";
    save_packed_moe(ckpt, p);
    const auto back = load_packed_moe<float, ClampedSwiGLU<float>>(ckpt, moe.config());
    CHECK(bitwise_equal(back.forward(x), y));
    CHECK(back.router().logit_bias() == p.router().logit_bias());
    CHECK(back.extras()[2].down == p.extras()[2].down);
    const std::string layout = dir / "gpt_oss.panels";
    save_packed_layout(layout, p);
    const auto mapped = map_packed_moe<float, ClampedSwiGLU<float>>(layout, moe.config());
    CHECK(bitwise_equal(mapped.forward(x), y));
    // A layer of another kind does not map the file.
    CHECK_THROWS_CONTAINING((map_packed_moe<float>(layout, moe.config())), FormatError, "clamped_swiglu experts");
  }
  // A float checkpoint of the training layer quantizes at load, biases read as float.
  const std::string f32 = dir / "gpt_oss_f32.safetensors";
  FloatGptOss copy = moe;
  save_checkpoint(f32, copy.param_values());
  const auto q = load_packed_moe<packed::q8_0, ClampedSwiGLU<float>>(f32, moe.config());
  CHECK(bitwise_equal(q.forward(x), PackedMoE<packed::q8_0, ClampedSwiGLU<float>>::from(moe).forward(x)));
  // A config without the router bias does not take a file with one: the tensor is named.
  MoEConfig no_bias = moe.config();
  no_bias.router_bias = false;
  CHECK_THROWS_CONTAINING((load_packed_moe<float, ClampedSwiGLU<float>>(f32, no_bias)), FormatError,
                          "unexpected 'router.bias'");
  // Nor a SwiGLU layer the experts' biases.
  CHECK_THROWS_CONTAINING((load_packed_moe<float>(f32, no_bias)), FormatError, "unexpected 'experts.0.w_down.bias'");
}

TEST_CASE("gpt-oss packed layer: the kind's parts are checked", "[inference][gpt_oss][errors]") {
  const FloatGptOss moe = clamped_layer(32, 32, 41);
  auto p = PackedMoE<float, ClampedSwiGLU<float>>::from(moe);
  std::vector<packed::PackedExpert> experts = p.experts();
  std::vector<ClampedBiases> extras = p.extras();
  extras.pop_back();
  CHECK_THROWS_CONTAINING((PackedMoE<float, ClampedSwiGLU<float>>(moe.config(), p.router().weight(), p.bias(), experts,
                                                                   extras, {})),
                          ShapeError, "4 clamped_swiglu expert parts, expected 5");
  extras = p.extras();
  extras[0].down.resize(31);
  CHECK_THROWS_CONTAINING((PackedMoE<float, ClampedSwiGLU<float>>(moe.config(), p.router().weight(), p.bias(), experts,
                                                                   extras, {})),
                          ShapeError, "extras.w_down.bias");
  extras = p.extras();
  extras[0].options.limit = -1.0;
  CHECK_THROWS_CONTAINING((PackedMoE<float, ClampedSwiGLU<float>>(moe.config(), p.router().weight(), p.bias(), experts,
                                                                   extras, {})),
                          ConfigError, "limit must be finite and > 0");
  const RowVector<float> before = p.router().logit_bias();
  RowVector<float> bad = before;
  bad(1) = std::numeric_limits<float>::quiet_NaN();
  CHECK_THROWS_AS(p.set_logit_bias(bad), ValueError);
  CHECK_THROWS_AS(p.set_logit_bias(RowVector<float>(4)), ShapeError);
  CHECK(p.router().logit_bias() == before);  // rejected: unchanged
  auto plain = PackedMoE<float>::from(MoEFFN<float>(test::moe_config(5, 2, 0, 32, 32), 1));
  CHECK_THROWS_CONTAINING(plain.set_logit_bias(before), ConfigError, "router_bias is off");
  auto b16 = PackedMoE<packed::bf16, ClampedSwiGLU<float>>::from(moe);
  b16.set_kernel_options({packed::kDefaultIsa, packed::Bf16Products::paired});
  CHECK_THROWS_CONTAINING(b16.forward(test::rnd<float>(2, 32, 42)), ConfigError,
                          "paired is not supported for clamped-SwiGLU experts");
}

namespace {
std::string packed_gptoss_fixture(const char* name) {
  return (std::filesystem::path(__FILE__).parent_path() / "data" / name).string();
}
/// A fixture tensor as a float matrix of `rows` rows.
Matrix<float> packed_gptoss_tensor(const safetensors::Reader& file, const std::string& name, Index rows) {
  const safetensors::TensorInfo& t = file.at(name);
  Matrix<float> m(rows, Index(t.numel()) / rows);
  file.read(t, m.data());
  return m;
}
}  // namespace

TEST_CASE("gpt-oss's published MXFP4 experts load into MXFP4 panels as shipped", "[inference][gpt_oss][mxfp4]") {
  const std::string path = packed_gptoss_fixture("family_gpt_oss_mxfp4.safetensors");
  const safetensors::Reader file(path);
  const MoEConfig cfg = gpt_oss_moe(64, 32, 4, 2);
  PackedLoadOptions o;
  o.prefix = "model.layers.1.";
  o.allow_unexpected = true;  // the fixture's test.* tensors
  const auto p = load_packed_gpt_oss<packed::mxfp4>(path, cfg, o);
  CHECK(p.types() == PackedTypes(packed::Dtype::mxfp4));
  // The panels' weights are the checkpoint's, exactly (as its dequantized tensors: E × d × 2f, E × f × d).
  const Matrix<float> gu = packed_gptoss_tensor(file, "test.gate_up_proj", 4 * 64);
  const Matrix<float> dn = packed_gptoss_tensor(file, "test.down_proj", 4 * 32);
  for (Index e = 0; e < 4; ++e) {
    const Matrix<float> g = p.experts()[std::size_t(e)].w_gate(), u = p.experts()[std::size_t(e)].w_up();
    const Matrix<float> w = p.experts()[std::size_t(e)].w_down();
    for (Index i = 0; i < 64; ++i)
      for (Index j = 0; j < 32; ++j) {
        CHECK(g(j, i) == gu(e * 64 + i, 2 * j));  // == : −0 and 0 are one value
        CHECK(u(j, i) == gu(e * 64 + i, 2 * j + 1));
        CHECK(w(i, j) == dn(e * 32 + j, i));
      }
  }
  // Against the float layer the Hugging Face loader gives on the same file, and the fixture's output.
  GptOssMoE<float> moe(cfg, 0);
  LoadOptions lo;
  lo.allow_unexpected = true;
  load_gpt_oss_checkpoint(path, moe, o.prefix, lo);
  const Matrix<float> x = packed_gptoss_tensor(file, "test.x", 3), want = packed_gptoss_tensor(file, "test.y", 3);
  GptOssMoE<float>::Cache c0;
  decltype(p)::Cache c1;
  const Matrix<float> y = p.forward(x, &c1);
  CHECK(c1.routing.experts == (moe.forward(x, &c0), c0.routing.experts));
  CHECK(rel(y, moe.forward(x)) < 0.02);  // the activations' Q8_0 rounding alone
  CHECK(rel(y, want) < 0.02);
  // Into bf16 panels: FP4 values times powers of two are exact in bf16.
  PackedLoadOptions ob = o;
  ob.types = PackedTypes(packed::Dtype::bf16);
  const auto b = load_packed_gpt_oss<packed::mxfp4>(path, cfg, ob);
  CHECK(rel(b.forward(x), moe.forward(x)) < 1e-5);
}

TEST_CASE("gpt-oss dense Hugging Face experts load packed, and bad configs and files are refused",
          "[inference][gpt_oss][errors]") {
  const std::string path = packed_gptoss_fixture("family_gpt_oss.safetensors");
  const safetensors::Reader file(path);
  const MoEConfig cfg = gpt_oss_moe(4, 3, 6, 2);
  PackedLoadOptions o;
  o.prefix = "model.layers.1.";
  o.allow_unexpected = true;  // the fixture's test.* tensors
  const auto p = load_packed_gpt_oss<float>(path, cfg, o);
  const Matrix<float> x = packed_gptoss_tensor(file, "test.x", 5), want = packed_gptoss_tensor(file, "test.y", 5);
  CHECK(rel(p.forward(x), want) < 1e-5);
  CHECK_THROWS_CONTAINING(load_packed_gpt_oss<float>(path, cfg, [&] { auto q = o; q.allow_unexpected = false; return q; }()),
                          FormatError, "unexpected");
  MoEConfig no_bias = cfg;
  no_bias.router_bias = false;
  CHECK_THROWS_CONTAINING(load_packed_gpt_oss<float>(path, no_bias, o), ConfigError, "router_bias");
  CHECK_THROWS_CONTAINING(load_packed_gpt_oss<float>(path, gpt_oss_moe(4, 5, 6, 2), o), ShapeError,
                          "mlp.experts.gate_up_proj");
  CHECK_THROWS_CONTAINING(load_packed_gpt_oss<packed::q8_0>(path, cfg, o), ConfigError, "q8_0");  // d = 4: no whole block
  PackedLoadOptions fam = o;
  fam.family = MoEFamily::Mixtral;
  CHECK_THROWS_CONTAINING(load_packed_gpt_oss<float>(path, cfg, fam), ConfigError, "options.family");
}

TEST_CASE("gpt-oss packed layers save under Hugging Face's names: MXFP4 as published, byte for byte",
          "[inference][gpt_oss][mxfp4][checkpoint]") {
  const std::string path = packed_gptoss_fixture("family_gpt_oss_mxfp4.safetensors");
  const safetensors::Reader fixture(path);
  const MoEConfig cfg = gpt_oss_moe(64, 32, 4, 2);
  PackedLoadOptions o;
  o.prefix = "model.layers.1.";
  o.allow_unexpected = true;
  const auto p = load_packed_gpt_oss<packed::mxfp4>(path, cfg, o);
  test::TempDir dir;
  const std::string saved = dir / "gpt_oss_mxfp4.safetensors";
  save_packed_gpt_oss(saved, p, o.prefix);
  const safetensors::Reader back(saved);
  CHECK(back.tensors().size() == 8);
  for (const auto& t : back.tensors()) {  // every tensor the fixture's bytes: blocks, scales, biases, router
    INFO(t.name);
    const safetensors::TensorInfo& want = fixture.at(t.name);
    REQUIRE(t.dtype == want.dtype);
    REQUIRE(t.shape == want.shape);
    std::vector<unsigned char> a(t.nbytes()), b(want.nbytes());
    back.read_bytes(t, a.data());
    fixture.read_bytes(want, b.data());
    CHECK(a == b);
  }
  // Other types are saved dense with the packed values; the float loader and the packed loader read them back.
  const auto b16 = PackedMoE<packed::bf16, ClampedSwiGLU<float>>::from(clamped_layer(32, 64, 51));
  const std::string dense = dir / "gpt_oss_bf16.safetensors";
  save_packed_gpt_oss(dense, b16, "model.layers.0.");
  PackedLoadOptions od;
  od.prefix = "model.layers.0.";
  const auto again = load_packed_gpt_oss<packed::bf16>(dense, b16.config(), od);
  const Matrix<float> x = test::rnd<float>(7, 32, 52);
  CHECK(bitwise_equal(again.forward(x), b16.forward(x)));
  GptOssMoE<float> moe(b16.config(), 0);
  load_gpt_oss_checkpoint(dense, moe, "model.layers.0.");
  CHECK(rel(moe.forward(x), b16.forward(x)) < 1e-5);
  // A clamped layer without the router's bias is no gpt-oss block: refused, nothing written.
  const auto plain = PackedMoE<float, ClampedSwiGLU<float>>::from(
      MoEFFN<float, ClampedSwiGLU<float>>(test::moe_config(4, 2, 0, 32, 32), 1));
  CHECK_THROWS_CONTAINING(save_packed_gpt_oss(dir / "x.safetensors", plain), ConfigError, "router_bias");
  CHECK(!std::filesystem::exists(dir / "x.safetensors"));
}

TEST_CASE("gpt-oss MXFP4 blocks beyond float are refused by the packed loader as by the float loader",
          "[inference][gpt_oss][mxfp4][regression]") {
  // inference/files/gpt_oss/load.hpp refused E8M0 code 255 only: a block of
  // scale 254 and FP4 6.0 (6·2^127, beyond float) loaded into MXFP4 panels
  // and gave non-finite outputs, while the float loader refused it. Both
  // now run io/gpt_oss_layout.hpp's gpt_oss_block.
  const MoEConfig cfg = gpt_oss_moe(32, 32, 2, 1);
  const auto packed =
      PackedMoE<packed::mxfp4, ClampedSwiGLU<float>>::from(GptOssMoE<float>(cfg, 41), packed::Dtype::mxfp4);
  test::TempDir dir;
  const std::string path = (dir.path / "oss.safetensors").string();
  // Block [1, 3, 0] of gate_up (expert 1, output row 3, input block 0): scale `scale`, every code `code`.
  const auto write_with = [&](std::uint8_t scale, std::uint8_t code) {
    save_packed_gpt_oss(path, packed);
    const safetensors::Reader file(path);
    const auto& blocks = file.at("mlp.experts.gate_up_proj_blocks");  // E × 2f × 1 × 16
    const auto& scales = file.at("mlp.experts.gate_up_proj_scales");  // E × 2f × 1
    const std::uint64_t block = 1 * 64 + 3, base = file.header().data_offset();
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(std::streamoff(base + scales.begin + block));
    f.put(char(scale));
    f.seekp(std::streamoff(base + blocks.begin + block * 16));
    for (int j = 0; j < 16; ++j) f.put(char(code | code << 4));
  };
  const auto packed_load = [&](packed::Dtype t) {
    PackedLoadOptions o;
    o.types = PackedTypes(t);
    return test::outcome([&] { (void)load_packed_gpt_oss<packed::mxfp4>(path, cfg, o); });
  };
  const auto float_load = [&] {
    GptOssMoE<float> moe(cfg, 0);
    return test::outcome([&] { load_gpt_oss_checkpoint(path, moe); });
  };
  const std::vector<std::string> names = {"tensor 'mlp.experts.gate_up_proj_scales' holds E8M0 code 254",
                                          "at [1, 3, 0]", "would not be finite"};
  write_with(254, 7);  // FP4 code 7 is 6.0: 6·2^127
  test::expect(packed_load(packed::Dtype::mxfp4), "ValueError", names);
  test::expect(packed_load(packed::Dtype::bf16), "ValueError", names);
  test::expect(float_load(), "ValueError", names);
  write_with(254, 0x3);  // FP4 1.5: 1.5·2^127, the largest finite value at 254
  CHECK(packed_load(packed::Dtype::mxfp4) == "returned");
  CHECK(float_load() == "returned");
  write_with(253, 5);  // FP4 3.0: 3·2^126
  CHECK(packed_load(packed::Dtype::mxfp4) == "returned");
  write_with(253, 6);  // FP4 4.0: 4·2^126 = 2^128
  test::expect(packed_load(packed::Dtype::mxfp4), "ValueError", {"E8M0 code 253", "at [1, 3, 0]"});
  write_with(255, 0);  // NaN in OCP MX, whatever the codes
  test::expect(packed_load(packed::Dtype::mxfp4), "ValueError", {"E8M0 code 255 (NaN)", "at [1, 3, 0]"});
  test::expect(float_load(), "ValueError", {"E8M0 code 255 (NaN)", "at [1, 3, 0]"});
}
