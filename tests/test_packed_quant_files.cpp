// Quantized checkpoints (inference/files/checkpoint/save.hpp): a PackedMoE saved with
// its experts in their storage types loads back with the same bits — every
// type, mixed types, κ experts, the sublayer loader — without re-quantizing;
// a U8 tensor's bytes are ggml's blocks of the float weights; and a file
// whose types are missing, unknown, misshapen or not what the options ask
// for is a typed error naming the tensor, raised before any expert is read,
// that leaves the destination layer as it was.
#include <catch2/catch.hpp>

#include <apex/ffn/inference.hpp>
#include <apex/ffn/inference/files/checkpoint/load.hpp>
#include <apex/ffn/inference/files/checkpoint/save.hpp>
#include <apex/ffn/io/checkpoint.hpp>
#include <apex/ffn/layers/kappa_swiglu.hpp>
#include <apex/ffn/quant/formats.hpp>

#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bits.hpp"
#include "fixtures.hpp"
#include "packed_layers.hpp"
#include "sweep.hpp"
#include "temp_dir.hpp"
#include "tensor_files.hpp"

using namespace apex;
using apex::test::bitwise_equal;
using Dt = apex::packed::Dtype;

namespace {

/// Widths that are whole Q4_K/Q6_K super-blocks, shared experts of their
/// own width and a shared gate.
MoEConfig block_config() {
  MoEConfig c = test::moe_config(4, 2, 1, 256, 256);
  c.d_shared_ffn = 512;
  c.shared_expert_gate = true;
  return c;
}

template <class Layer>
std::vector<unsigned char> file_of(const Layer& layer) {
  safetensors::VectorSink sink;
  write_packed_moe(sink, layer);
  return sink.bytes;
}

/// An expert's three matrices in file form, concatenated.
std::vector<std::byte> rows_of(const packed::PackedExpert& e) {
  const std::size_t gu = std::size_t(e.d_ffn() * e.gate_up().row_bytes()), dn = std::size_t(e.d_model() * e.down().row_bytes());
  std::vector<std::byte> out(2 * gu + dn);
  e.file_rows(out.data(), out.data() + gu, out.data() + 2 * gu);
  return out;
}

/// Same types, same file rows of every expert, same output.
template <class A, class B>
void check_same(const A& a, const B& b, const Matrix<float>& x) {
  CHECK(a.types() == b.types());
  REQUIRE(a.experts().size() == b.experts().size());
  for (std::size_t e = 0; e < a.experts().size(); ++e) CHECK(rows_of(a.experts()[e]) == rows_of(b.experts()[e]));
  REQUIRE(a.shared_experts().size() == b.shared_experts().size());
  for (std::size_t s = 0; s < a.shared_experts().size(); ++s)
    CHECK(rows_of(a.shared_experts()[s]) == rows_of(b.shared_experts()[s]));
  CHECK(bitwise_equal(a.forward(x), b.forward(x)));
}

/// from(moe, types) → file → load_packed_moe<Storage>: the same layer.
template <class Storage, class Expert>
void round_trip(const MoEFFN<float, Expert>& moe, const PackedTypes& types) {
  CAPTURE(packed_types_name(types));
  const auto layer = PackedMoE<Storage, Expert>::from(moe, types);
  const auto bytes = file_of(layer);
  const auto loaded = load_packed_moe<Storage, Expert>(test::reader(bytes), moe.config());
  check_same(layer, loaded, test::rnd<float>(13, moe.config().d_model, 41, 1.0));
  // a second save writes the same bytes: nothing was re-quantized
  CHECK(file_of(loaded) == bytes);
  // no float weights to compare a source with
  CHECK_THROWS_AS(loaded.check_source(moe), ValueError);
}

/// ggml's rows of `w` (row-major [out, in]) in type t, concatenated.
std::vector<unsigned char> ggml_rows(Dt t, const Matrix<float>& w) {
  std::vector<unsigned char> out;
  const auto rows = [&](auto block, auto quantize) {
    using B = decltype(block);
    std::vector<B> blocks(std::size_t(w.cols()) / (t == Dt::q4_k || t == Dt::q6_k ? quant::kQKK : quant::kQK));
    for (Index r = 0; r < w.rows(); ++r) {
      quantize(w.row(r).data(), blocks.data(), w.cols());
      const auto* p = reinterpret_cast<const unsigned char*>(blocks.data());
      out.insert(out.end(), p, p + blocks.size() * sizeof(B));
    }
  };
  switch (t) {
    case Dt::q8_0: rows(quant::BlockQ8_0{}, quant::quantize_row_q8_0); break;
    case Dt::q4_0: rows(quant::BlockQ4_0{}, quant::quantize_row_q4_0); break;
    case Dt::q4_k: rows(quant::BlockQ4_K{}, quant::quantize_row_q4_k); break;
    case Dt::q6_k: rows(quant::BlockQ6_K{}, quant::quantize_row_q6_k); break;
    case Dt::mxfp4: rows(quant::BlockMXFP4{}, quant::quantize_row_mxfp4); break;
    default: FAIL("not a block format");
  }
  return out;
}

std::vector<unsigned char> tensor_bytes(const safetensors::Reader& file, const std::string& name) {
  const auto& t = file.at(name);
  std::vector<unsigned char> out(std::size_t(t.nbytes()));
  file.read_bytes(t, out.data());
  return out;
}

/// A good layer's tensors and metadata, spoiled by `edit`, as a file.
template <class Layer>
std::vector<unsigned char> spoiled(const Layer& layer,
                                   const std::function<void(std::vector<safetensors::RawTensor>&, safetensors::Metadata&)>& edit) {
  safetensors::Metadata meta;
  auto tensors = detail::inference::packed_moe_tensors(layer, meta);
  edit(tensors, meta);
  safetensors::VectorSink sink;
  safetensors::write_raw(sink, tensors, meta);
  return sink.bytes;
}

safetensors::RawTensor* raw_named(std::vector<safetensors::RawTensor>& ts, const std::string& name) {
  for (auto& t : ts)
    if (t.name == name) return &t;
  FAIL("no tensor " << name);
  return nullptr;
}

/// `t` reshaped to U8 [rows, cols] of zeros (the bytes the new shape needs).
void reshape(safetensors::RawTensor& t, std::uint64_t rows, std::uint64_t cols) {
  t.dtype = safetensors::DType::U8;
  t.shape = {rows, cols};
  t.bytes = [n = rows * cols](safetensors::ByteSink& s) { s.write(std::vector<unsigned char>(n).data(), n); };
}

}  // namespace

TEST_CASE("quantized checkpoints round trip every storage type with the same bits", "[inference][quant][checkpoint]") {
  MoEFFN<float> moe(block_config(), 51);
  test::set_bias(moe, 52);
  round_trip<packed::q8_0>(moe, Dt::q8_0);
  round_trip<packed::q4_0>(moe, Dt::q4_0);
  round_trip<packed::q4_k>(moe, Dt::q4_k);
  round_trip<packed::q6_k>(moe, Dt::q6_k);
  round_trip<packed::mxfp4>(moe, Dt::mxfp4);
  // float types, at odd widths (bf16 panels pad a row to an even length; the file does not)
  MoEFFN<float> odd(test::moe_config(4, 2, 1, 6, 5), 53);
  round_trip<float>(odd, Dt::f32);
  round_trip<packed::bf16>(odd, Dt::bf16);
  round_trip<float>(odd, PackedTypes{{Dt::bf16, Dt::f32}, Dt::bf16});
  // f16 has no safetensors dtype the codec converts: its rows are stored as U8, typed in the metadata
  round_trip<packed::f16>(odd, Dt::f16);
  round_trip<float>(moe, PackedTypes{{Dt::f16, Dt::q8_0}, Dt::f16});
}

TEST_CASE("quantized checkpoints: mixed types, kappa experts, and types from the file",
          "[inference][quant][checkpoint]") {
  MoEFFN<float> moe(block_config(), 54);
  test::set_bias(moe, 55);
  round_trip<packed::q4_k>(moe, PackedTypes{{Dt::q4_k, Dt::q6_k}, Dt::q8_0});
  round_trip<packed::q4_k>(moe, PackedTypes{{Dt::bf16, Dt::mxfp4}, {Dt::q4_0, Dt::f32}});
  MoEFFN<float, KappaSwiGLU<float>> kappa(block_config(), 56);
  test::perturb_kappa(kappa, 57);
  round_trip<packed::q8_0>(kappa, PackedTypes{{Dt::q8_0, Dt::q6_k}, Dt::q4_k});
  // the file's types whatever the layer's Storage, and options.types may say the same
  const PackedTypes types{{Dt::q4_k, Dt::q6_k}, Dt::q8_0};
  const auto layer = PackedMoE<packed::q4_k>::from(moe, types);
  const auto bytes = file_of(layer);
  const Matrix<float> x = test::rnd<float>(7, 256, 58, 1.0);
  check_same(layer, load_packed_moe<float>(test::reader(bytes), moe.config()), x);
  PackedLoadOptions o;
  o.types = types;
  check_same(layer, load_packed_moe<packed::bf16>(test::reader(bytes), moe.config(), o), x);
  // through a file on disk, atomically saved
  test::TempDir dir;
  const std::string path = dir / "moe.q4k.safetensors";
  save_packed_moe(path, layer);
  check_same(layer, load_packed_moe<packed::q4_k>(path, moe.config()), x);
}

TEST_CASE("a quantized checkpoint's U8 tensors are ggml's blocks of the float weights, its metadata their types",
          "[inference][quant][checkpoint]") {
  MoEFFN<float> moe(block_config(), 59);
  const PackedTypes types{{Dt::q4_k, Dt::q6_k}, {Dt::q8_0, Dt::mxfp4}};
  const auto bytes = file_of(PackedMoE<packed::q4_k>::from(moe, types));
  const auto file = test::reader(bytes);
  CHECK(file.metadata().at("apex.quant.version") == "1");
  for (Index e = 0; e < 4; ++e) {
    const std::string q = "experts." + std::to_string(e) + ".";
    const SwiGLU<float>& m = moe.experts()[std::size_t(e)];
    CHECK(file.metadata().at("apex.quant." + q + "w_gate.weight") == "q4_k");
    CHECK(file.metadata().at("apex.quant." + q + "w_down.weight") == "q6_k");
    CHECK(file.at(q + "w_up.weight").dtype == safetensors::DType::U8);
    CHECK(file.at(q + "w_up.weight").shape == std::vector<std::uint64_t>{256, 256 / 256 * 144});
    CHECK(tensor_bytes(file, q + "w_gate.weight") == ggml_rows(Dt::q4_k, m.w_gate()));
    CHECK(tensor_bytes(file, q + "w_up.weight") == ggml_rows(Dt::q4_k, m.w_up()));
    CHECK(tensor_bytes(file, q + "w_down.weight") == ggml_rows(Dt::q6_k, m.w_down()));
  }
  const SwiGLU<float>& s = moe.shared_experts().front();
  CHECK(tensor_bytes(file, "shared_experts.0.w_gate.weight") == ggml_rows(Dt::q8_0, s.w_gate()));
  CHECK(tensor_bytes(file, "shared_experts.0.w_down.weight") == ggml_rows(Dt::mxfp4, s.w_down()));
  CHECK(file.at("shared_experts.0.w_down.weight").shape == std::vector<std::uint64_t>{256, 512 / 32 * 17});
  // the float tensors under the library's names, F32
  for (const char* n : {"router.weight", "expert_bias", "shared_expert_gate.weight"}) {
    CHECK(file.at(n).dtype == safetensors::DType::F32);
    CHECK(file.metadata().count(std::string("apex.quant.") + n) == 0);
  }
  CHECK(bitwise_equal(file.matrix<float>("router.weight"), moe.router().weight()));
}

TEST_CASE("write_raw lays out float tensors as write does", "[checkpoint][safetensors]") {
  const Matrix<float> a = test::rnd<float>(3, 5, 60, 1.0), b = test::rnd<float>(1, 7, 61, 1.0);
  const safetensors::Metadata meta{{"k", "v"}};
  safetensors::VectorSink plain, raw;
  safetensors::write<float>(plain, {{"b", {7}, b.data()}, {"a", {3, 5}, a.data()}}, safetensors::DType::F32, meta);
  safetensors::write_raw(raw,
                         {safetensors::raw_tensor("b", safetensors::DType::F32, {7}, b.data()),
                          safetensors::raw_tensor("a", safetensors::DType::F32, {3, 5}, a.data())},
                         meta);
  CHECK(raw.bytes == plain.bytes);
  safetensors::RawTensor short_one{"u", safetensors::DType::U8, {4}, [](safetensors::ByteSink& s) { s.write("ab", 2); }};
  CHECK_THROWS_WITH(safetensors::write_raw(raw, {short_one}), Catch::Matchers::Contains("'u' wrote 2 bytes") &&
                                                                  Catch::Matchers::Contains("needs 4"));
}

TEST_CASE("bad quantized checkpoints are typed errors before any expert is read, the destination unchanged",
          "[inference][quant][checkpoint][errors]") {
  MoEFFN<float> moe(block_config(), 62);
  using Layer = PackedMoE<packed::q4_k>;
  const Layer good = Layer::from(moe, PackedTypes{{Dt::q4_k, Dt::q6_k}, Dt::q8_0});
  using Edit = std::function<void(std::vector<safetensors::RawTensor>&, safetensors::Metadata&)>;
  struct Bad {
    std::string what;
    Edit edit;
    std::string type;
    std::vector<std::string> names;
    std::optional<PackedTypes> types;
  };
  const std::string up1 = "experts.1.w_up.weight", down2 = "experts.2.w_down.weight";
  const std::vector<Bad> cases{
      {"no type", [&](auto&, auto& m) { m.erase("apex.quant." + up1); }, "FormatError", {up1, "no type"}, {}},
      {"an unknown type", [&](auto&, auto& m) { m["apex.quant." + up1] = "q5_k"; }, "FormatError",
       {up1, "'q5_k'", "not a type stored as U8", "q4_k"}, {}},
      {"a float type on U8", [&](auto&, auto& m) { m["apex.quant." + up1] = "f32"; }, "FormatError",
       {up1, "'f32'", "not a type stored as U8"}, {}},
      {"version 2", [&](auto&, auto& m) { m["apex.quant.version"] = "2"; }, "FormatError",
       {"apex.quant.version", "'2'"}, {}},
      {"no version", [&](auto&, auto& m) { m.erase("apex.quant.version"); }, "FormatError",
       {"apex.quant.version", "missing"}, {}},
      {"a wrong row length", [&](auto& t, auto&) { reshape(*raw_named(t, down2), 256, 208); }, "FormatError",
       {down2, "[256, 208]", "[256, 210]"}, {}},
      {"a float tensor with a type",
       [](auto& t, auto& m) {  // the shared expert's up as F32 rows, still carrying its block type
         auto* u = raw_named(t, "shared_experts.0.w_up.weight");
         u->dtype = safetensors::DType::F32;
         u->shape = {512, 256};
         u->bytes = [](safetensors::ByteSink& s) { s.write(std::vector<float>(512 * 256).data(), 512 * 256 * 4); };
         m["apex.quant.shared_experts.0.w_up.weight"] = "q8_0";
       },
       "FormatError", {"shared_experts.0.w_up.weight", "is F32", "'q8_0'", "U8"}, {}},
      {"experts of two types",
       [&](auto& t, auto& m) {
         reshape(*raw_named(t, "experts.3.w_gate.weight"), 256, 8 * 34);
         m["apex.quant.experts.3.w_gate.weight"] = "q8_0";
       },
       "FormatError", {"experts.3.w_gate.weight", "q8_0", "experts.0.w_gate.weight", "q4_k"}, {}},
      {"an expert matrix of dtype I64",
       [&](auto& t, auto&) {
         auto* u = raw_named(t, up1);
         u->dtype = safetensors::DType::I64;
         u->shape = {256, 18};  // the bytes of 256 × 144
       },
       "FormatError", {up1, "I64"}, {}},
      {"options.types disagreeing", [](auto&, auto&) {}, "ConfigError",
       {"options.types", "q8_0", "routed q4_k/q6_k, shared q8_0"}, PackedTypes(Dt::q8_0)},
  };
  Layer dst = good;
  const Matrix<float> x = test::rnd<float>(5, 256, 63, 1.0);
  const Matrix<float> before = dst.forward(x);
  for (const Bad& b : cases) {
    INFO(b.what);
    const std::vector<unsigned char> bytes = spoiled(good, b.edit);
    const auto log = std::make_shared<test::LoggingSource::Log>();
    const safetensors::Reader r = test::logged_reader(bytes, log);
    PackedLoadOptions o;
    o.types = b.types;
    const std::string got = test::outcome([&] { dst = load_packed_moe<packed::q4_k>(r, moe.config(), o); });
    test::expect(got, b.type, b.names);
    for (const std::string& name : test::tensors_read(r, *log)) {
      INFO("read " << name);
      CHECK(name.find("experts") == std::string::npos);
    }
    CHECK(test::same_bits(dst.forward(x), before));
  }
  // truncated data: the reader refuses the file before a loader sees it
  std::vector<unsigned char> bytes = file_of(good);
  bytes.resize(bytes.size() - 100);
  test::expect(test::outcome([&] { dst = load_packed_moe<packed::q4_k>(test::reader(bytes), moe.config()); }),
               "FormatError", {"shared_expert_gate.weight", "ends at byte"});
  CHECK(test::same_bits(dst.forward(x), before));
}

TEST_CASE("the packed sublayer loads a quantized FFN", "[inference][quant][checkpoint][sublayer]") {
  MoEFFN<float> moe(block_config(), 64);
  const auto layer = PackedMoE<packed::q6_k>::from(moe, PackedTypes{Dt::q6_k, Dt::q8_0});
  safetensors::Metadata meta, prefixed;
  auto tensors = detail::inference::packed_moe_tensors(layer, meta);
  for (auto& t : tensors) t.name = "ffn." + t.name;
  for (const auto& [k, v] : meta)
    prefixed[k == "apex.quant.version" ? k : "apex.quant.ffn." + k.substr(std::strlen("apex.quant."))] = v;
  const RowVector<float> norm = RowVector<float>::Ones(256);
  tensors.push_back(safetensors::raw_tensor("norm.weight", safetensors::DType::F32, {256}, norm.data()));
  safetensors::VectorSink sink;
  safetensors::write_raw(sink, tensors, prefixed);
  const auto sub = load_packed_sublayer<packed::q6_k>(test::reader(sink.bytes), moe.config());
  check_same(layer, sub.ffn(), test::rnd<float>(3, 256, 65, 1.0));
}
