// Checkpoints in the safetensors format (io/checkpoint.hpp): the file layout
// byte for byte, round trips in each dtype (BF16 rounding included), dtype
// conversion on load, strict name/shape/dtype matching, one-dimensional
// tensors, metadata, names rejected before anything is written, no gradient
// allocated by saving or loading, and the error sweep of mismatched files and
// bad options.
#include <apex/ffn/io/checkpoint.hpp>
#include <apex/ffn/io/name_maps.hpp>
#include <apex/ffn/io/sharded_checkpoint.hpp>
#include <apex/ffn/layers/ffn_sublayer.hpp>
#include <apex/ffn/layers/kappa_swiglu.hpp>
#include <apex/ffn/layers/multi_token_heads.hpp>
#include <apex/ffn/layers/rms_norm.hpp>
#include <apex/ffn/layers/swiglu.hpp>
#include <apex/ffn/moe/moe_ffn.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <unistd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>

#include "checkpoint_bytes.hpp"
#include "sweep.hpp"
#include "temp_dir.hpp"

using namespace apex;
namespace fs = std::filesystem;
namespace st = apex::safetensors;
using Catch::Matchers::Contains;
using apex::test::Bytes;
using apex::test::make_file;
using apex::test::open_memory;
using apex::test::serialise;
using apex::test::snapshot;
using apex::test::unchanged;
using apex::test::TempDir;

TEMPLATE_TEST_CASE("A checkpoint round-trips a SwiGLU exactly in its own dtype", "[checkpoint]", float, double) {
  TempDir dir;
  SwiGLU<TestType> a(5, 7, 1), b(5, 7, 2);
  REQUIRE(a.w_down() != b.w_down());
  save_checkpoint(dir / "ffn.safetensors", a.param_values());
  const LoadResult r = load_checkpoint(dir / "ffn.safetensors", b.param_values());
  CHECK(r.loaded == std::vector<std::string>{"w_gate.weight", "w_up.weight", "w_down.weight"});
  CHECK(r.missing.empty());
  CHECK(r.unexpected.empty());
  CHECK(a.w_gate_up() == b.w_gate_up());
  CHECK(a.w_down() == b.w_down());
  const st::Reader file(dir / "ffn.safetensors");
  for (const auto& t : file.tensors()) CHECK(t.dtype == st::dtype_of<TestType>());
}

TEST_CASE("Saving, loading and running forward never allocate gradients", "[checkpoint][lazy]") {
  // A layer loaded to serve holds its weights only (core/param.hpp): every
  // checkpoint path takes the values-only view.
  TempDir dir;
  MoEConfig cfg;
  cfg.d_model = 6;
  cfg.d_ffn = 5;
  cfg.n_experts = 4;
  cfg.n_active = 2;
  cfg.n_shared = 1;
  const Matrix<double> x = Matrix<double>::Random(7, 6);
  using Sub = FFNSublayer<double, MoEFFN<double>>;
  SkipGateConfig gc;
  gc.d_model = 6;
  gc.hidden = 4;
  gc.threshold = 0.0;
  Sub a(6, MoEFFN<double>(cfg, 1), SkipGate<double>(gc, 2)), b(6, MoEFFN<double>(cfg, 3), SkipGate<double>(gc, 4));
  const auto none = [](Sub& s) {
    return !s.norm().has_gradients() && !s.ffn().has_gradients() && !s.ffn().router().has_gradients() &&
           !s.ffn().experts()[0].has_gradients() && !s.ffn().shared_experts()[0].has_gradients() &&
           !s.skip_gate()->has_gradients();
  };
  save_checkpoint(dir / "sub.safetensors", a.param_values());
  load_checkpoint(dir / "sub.safetensors", b.param_values());
  CHECK(b.forward(x) == a.forward(x));
  CHECK(none(a));
  CHECK(none(b));

  // A sharded checkpoint: router and gate in one file, the rest in another.
  ParamList<double> first, second;
  ShardIndex index;
  for (const auto& p : a.param_values()) {
    const bool one = p.name.find("experts") == std::string::npos;
    (one ? first : second).push_back(p);
    index.weight_map[p.name] = one ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
  }
  save_checkpoint(dir / "model-00001-of-00002.safetensors", first);
  save_checkpoint(dir / "model-00002-of-00002.safetensors", second);
  write_shard_index(dir / kShardIndexName, index);
  Sub c(6, MoEFFN<double>(cfg, 5), SkipGate<double>(gc, 6));
  load_sharded_checkpoint(dir.path.string(), c.param_values());
  CHECK(c.forward(x) == a.forward(x));
  CHECK(none(c));

  // A family checkpoint (io/name_maps.hpp), bias included.
  MoEFFN<double> m(cfg, 7), n(cfg, 8);
  m.balancer().set_bias(RowVector<double>::LinSpaced(4, -0.1, 0.1));
  save_family_checkpoint(dir / "ds.safetensors", m, MoEFamily::DeepSeekV3);
  load_family_checkpoint(dir / "ds.safetensors", n, MoEFamily::DeepSeekV3);
  CHECK(n.forward(x) == m.forward(x));
  CHECK_FALSE(m.has_gradients());
  CHECK_FALSE(n.has_gradients());

  // κ experts and multi-token heads.
  MoEFFN<double, KappaSwiGLU<double>> k(cfg, 9), k2(cfg, 10);
  save_checkpoint(dir / "k.safetensors", k.param_values());
  load_checkpoint(dir / "k.safetensors", k2.param_values());
  CHECK(k2.forward(x) == k.forward(x));
  CHECK_FALSE(k2.has_gradients());
  CHECK_FALSE(k2.experts()[1].has_gradients());
  MultiTokenHeads<double> h(6, 9, MultiTokenOptions{}, 11), h2(6, 9, MultiTokenOptions{}, 12);
  save_checkpoint(dir / "h.safetensors", h.param_values());
  load_checkpoint(dir / "h.safetensors", h2.param_values());
  CHECK(h2.forward(x) == h.forward(x));
  CHECK_FALSE(h2.has_gradients());

  // Training after a load: backward allocates, and params() names the same tensors.
  b.zero_grad();
  CHECK(b.has_gradients());
  CHECK(b.params().size() == b.param_values().size());
}

TEST_CASE("The file layout follows the safetensors format", "[checkpoint][format]") {
  SwiGLU<double> ffn(3, 2, 4);
  SaveOptions o;
  o.metadata = {{"format", "pt"}, {"step", "12"}};
  const Bytes b = serialise(ffn.param_values(), o);
  const std::uint64_t n = st::detail::load_le(b.data(), 8);
  INFO("header length " << n);
  REQUIRE(8 + n <= b.size());
  CHECK((8 + n) % 8 == 0);  // data buffer 8-byte aligned
  const std::string header(b.begin() + 8, b.begin() + 8 + std::ptrdiff_t(n));
  CHECK(header.front() == '{');
  const auto close = header.find_last_of('}');
  CHECK(header.find_first_not_of(' ', close + 1) == std::string::npos);  // padded with spaces only
  const auto j = nlohmann::json::parse(header);
  CHECK(j["__metadata__"] == nlohmann::json({{"format", "pt"}, {"step", "12"}}));
  CHECK(j.size() == 4);
  // Offsets are relative to the data start, little-endian doubles, in params() order.
  std::uint64_t expect_begin = 0;
  for (const auto& p : ffn.param_values()) {
    const auto& e = j[p.name];
    CHECK(e["dtype"] == "F64");
    CHECK(e["shape"] == nlohmann::json({p.rows, p.cols}));
    const std::uint64_t begin = e["data_offsets"][0], end = e["data_offsets"][1];
    CHECK(begin == expect_begin);
    CHECK(end - begin == std::uint64_t(p.size()) * 8);
    for (Index i = 0; i < p.size(); ++i) {
      const std::uint64_t bits = st::detail::load_le(b.data() + 8 + n + begin + 8 * std::uint64_t(i), 8);
      CHECK(st::detail::bits_to_double(bits) == p.value_data[i]);
    }
    expect_begin = end;
  }
  CHECK(8 + n + expect_begin == b.size());
}

TEST_CASE("BF16 saves round to nearest with ties to even", "[checkpoint][bf16]") {
  using st::detail::double_to_bf16;
  using st::detail::float_to_bf16;
  const double ulp8 = std::ldexp(1.0, -8);
  SECTION("ties and near-ties from float") {
    CHECK(float_to_bf16(1.0f) == 0x3F80);
    CHECK(float_to_bf16(float(1 + ulp8)) == 0x3F80);                            // tie, down to even
    CHECK(float_to_bf16(float(1 + 3 * ulp8)) == 0x3F82);                        // tie, up to even
    CHECK(float_to_bf16(float(1 + ulp8 + std::ldexp(1.0, -23))) == 0x3F81);   // just above the tie
    CHECK(float_to_bf16(float(1 + ulp8 - std::ldexp(1.0, -23))) == 0x3F80);   // just below
    CHECK(float_to_bf16(-0.0f) == 0x8000);
    CHECK(float_to_bf16(std::numeric_limits<float>::infinity()) == 0x7F80);
    CHECK(float_to_bf16(-std::numeric_limits<float>::infinity()) == 0xFF80);
    CHECK(float_to_bf16(std::numeric_limits<float>::max()) == 0x7F80);  // beyond bf16's largest: infinity
    CHECK(float_to_bf16(st::detail::bf16_to_float(0x7F7F)) == 0x7F7F);  // bf16's largest stays
    const std::uint16_t nan = float_to_bf16(std::numeric_limits<float>::quiet_NaN());
    CHECK((nan & 0x7F80) == 0x7F80);
    CHECK((nan & 0x007F) != 0);
    // A NaN whose payload sits only in the low 16 bits must not become infinity.
    CHECK((float_to_bf16(st::detail::bits_to_float(0x7F800001u)) & 0x007F) != 0);
    // Every NaN, of either sign, is PyTorch's canonical 0x7FC0 (as the packed engine writes it).
    CHECK(float_to_bf16(st::detail::bits_to_float(0xFFC00001u)) == 0x7FC0);
    CHECK(double_to_bf16(-std::nan("")) == 0x7FC0);
  }
  SECTION("doubles are rounded once") {
    // Double → float → bf16 would round twice: 1 + 2⁻⁸ + 2⁻³⁰ becomes the
    // float 1 + 2⁻⁸, a bf16 tie that goes down to 1. Rounded once it is above
    // the tie and goes up.
    const double d = 1 + ulp8 + std::ldexp(1.0, -30);
    CHECK(float_to_bf16(float(d)) == 0x3F80);  // the double-rounding answer
    CHECK(double_to_bf16(d) == 0x3F81);
    CHECK(double_to_bf16(-d) == 0xBF81);
    CHECK(double_to_bf16(1 + ulp8) == 0x3F80);
    CHECK(double_to_bf16(1e300) == 0x7F80);
    CHECK(double_to_bf16(-1e300) == 0xFF80);
    CHECK(double_to_bf16(1e-300) == 0x0000);
    CHECK(double_to_bf16(-1e-300) == 0x8000);
    CHECK((double_to_bf16(std::nan("")) & 0x7FFF) > 0x7F80);
  }
  SECTION("random doubles land on the nearest bf16 and ties go to even") {
    std::mt19937_64 gen(7);
    std::uniform_real_distribution<double> mant(-2.0, 2.0);
    std::uniform_int_distribution<int> expo(-120, 120);
    for (int i = 0; i < 20000; ++i) {
      double d = std::ldexp(mant(gen), expo(gen));
      if (i % 4 == 0) {  // exact ties: a bf16 value plus half its spacing
        const double c = st::detail::bf16_to_float(double_to_bf16(d));
        const double half = std::ldexp(1.0, std::ilogb(c) - 8);
        d = c + half;
      }
      const std::uint16_t b = double_to_bf16(d);
      const double c = st::detail::bf16_to_float(b);
      const double up = st::detail::bf16_to_float(std::uint16_t(b + 1));
      const double down = st::detail::bf16_to_float(std::uint16_t(b - 1));
      INFO("d = " << d << ", bf16 = " << b);
      REQUIRE(std::fabs(d - c) <= std::fabs(d - up));
      REQUIRE(std::fabs(d - c) <= std::fabs(d - down));
      if (std::fabs(d - c) == std::fabs(d - up) || std::fabs(d - c) == std::fabs(d - down)) REQUIRE((b & 1) == 0);
    }
  }
  SECTION("save_checkpoint writes those bits and loading decodes them") {
    SwiGLU<double> a(4, 3, 9), b(4, 3, 10);
    SaveOptions o;
    o.dtype = st::DType::BF16;
    const Bytes bytes = serialise(a.param_values(), o);
    const auto file = open_memory(bytes);
    const auto& t = file.at("w_down.weight");
    CHECK(t.dtype == st::DType::BF16);
    CHECK(t.nbytes() == 2 * 4 * 3);
    for (Index i = 0; i < 12; ++i) {
      const auto raw = std::uint16_t(
          st::detail::load_le(bytes.data() + file.header().data_offset() + t.begin + 2 * std::uint64_t(i), 2));
      CHECK(raw == double_to_bf16(a.w_down().data()[i]));
    }
    load_checkpoint(file, b.param_values());
    for (Index i = 0; i < 12; ++i)
      CHECK(b.w_down().data()[i] == double(st::detail::bf16_to_float(double_to_bf16(a.w_down().data()[i]))));
  }
}

TEMPLATE_TEST_CASE("F32 F64 and BF16 tensors load into either scalar type", "[checkpoint]", float, double) {
  SwiGLU<double> src(3, 2, 5);
  for (st::DType d : {st::DType::F32, st::DType::F64, st::DType::BF16}) {
    INFO("on disk " << st::dtype_name(d));
    SaveOptions o;
    o.dtype = d;
    const Bytes bytes = serialise(src.param_values(), o);
    SwiGLU<TestType> dst(3, 2, 6);
    load_checkpoint(open_memory(bytes), dst.param_values());
    // Weights are below 1 in magnitude: BF16 keeps 8 significant bits, F32 24;
    // F64 into double is exact.
    const bool exact = d == st::DType::F64 && std::is_same_v<TestType, double>;
    const double tol = d == st::DType::BF16 ? 1.0 / 256 : exact ? 0.0 : 1e-7;
    CHECK((dst.w_down().template cast<double>() - src.w_down()).cwiseAbs().maxCoeff() <= tol);
    CHECK((dst.w_gate_up().template cast<double>() - src.w_gate_up()).cwiseAbs().maxCoeff() <= tol);
  }
}

TEST_CASE("Strict loading names missing and unexpected tensors", "[checkpoint][strict]") {
  SwiGLU<double> a(4, 3, 1), b(4, 3, 2);
  ParamList<double> renamed = a.param_values();
  renamed[1].name = "w_value.weight";  // the file will lack w_up.weight and have w_value.weight
  const Bytes bytes = serialise(renamed);
  const auto before = snapshot(b.param_values());

  SECTION("strict by default") {
    try {
      load_checkpoint(open_memory(bytes), b.param_values());
      FAIL("no exception");
    } catch (const FormatError& e) {
      CHECK_THAT(e.what(), Contains("missing 'w_up.weight'"));
      CHECK_THAT(e.what(), Contains("unexpected 'w_value.weight'"));
    }
    CHECK(unchanged(b.param_values(), before));
  }
  SECTION("extras allowed, missing still rejected") {
    LoadOptions o;
    o.allow_unexpected = true;
    CHECK_THROWS_AS(load_checkpoint(open_memory(bytes), b.param_values(), o), FormatError);
    CHECK(unchanged(b.param_values(), before));
  }
  SECTION("both allowed") {
    LoadOptions o;
    o.allow_unexpected = o.allow_missing = true;
    const LoadResult r = load_checkpoint(open_memory(bytes), b.param_values(), o);
    CHECK(r.missing == std::vector<std::string>{"w_up.weight"});
    CHECK(r.unexpected == std::vector<std::string>{"w_value.weight"});
    CHECK(r.loaded == std::vector<std::string>{"w_gate.weight", "w_down.weight"});
    CHECK(b.w_gate() == a.w_gate());
    CHECK(b.w_up() == before[1]);  // left alone
  }
  SECTION("a file with extras loads with allow_unexpected") {
    ParamList<double> more = a.param_values();
    RowVector<double> extra = RowVector<double>::LinSpaced(4, 0, 3);
    more.push_back({"expert_bias", extra.data(), nullptr, 1, 4});
    const Bytes with_extra = serialise(more);
    CHECK_THROWS_AS(load_checkpoint(open_memory(with_extra), b.param_values()), FormatError);
    LoadOptions o;
    o.allow_unexpected = true;
    const LoadResult r = load_checkpoint(open_memory(with_extra), b.param_values(), o);
    CHECK(r.unexpected == std::vector<std::string>{"expert_bias"});
    CHECK(b.w_down() == a.w_down());
  }
}

TEST_CASE("Shape mismatches raise ShapeError naming the tensor", "[checkpoint][strict]") {
  SwiGLU<double> a(4, 6, 1), b(4, 5, 2);
  const Bytes bytes = serialise(a.param_values());
  const auto before = snapshot(b.param_values());
  try {
    load_checkpoint(open_memory(bytes), b.param_values());
    FAIL("no exception");
  } catch (const ShapeError& e) {
    CHECK_THAT(e.what(), Contains("'w_gate.weight' is [6, 4] in the file, the parameter [5, 4]"));
    CHECK_THAT(e.what(), Contains("'w_down.weight' is [4, 6] in the file, the parameter [4, 5]"));
  }
  CHECK(unchanged(b.param_values(), before));
}

TEST_CASE("Integer tensors are not loaded into parameters", "[checkpoint][strict]") {
  const Bytes b = make_file(R"({"weight":{"dtype":"I32","shape":[3],"data_offsets":[0,12]}})", Bytes(12, 1));
  RMSNorm<double> norm(3);
  const auto before = snapshot(norm.param_values());
  CHECK_THROWS_WITH(load_checkpoint(open_memory(b), norm.param_values()), Contains("'weight (I32)'"));
  CHECK(unchanged(norm.param_values(), before));
}

TEST_CASE("One-dimensional tensors load into 1 x n parameters", "[checkpoint][shape]") {
  RMSNorm<double> a(4), b(4);
  a.gain() << 1, 2, 3, 4;
  SECTION("saved 1-D with a shape override") {
    SaveOptions o;
    o.shapes = {{"weight", {4}}};
    const Bytes bytes = serialise(a.param_values(), o);
    CHECK(open_memory(bytes).at("weight").shape == std::vector<std::uint64_t>{4});
    load_checkpoint(open_memory(bytes), b.param_values());
    CHECK(b.gain() == a.gain());
  }
  SECTION("saved as [1, 4] by default") {
    const Bytes bytes = serialise(a.param_values());
    CHECK(open_memory(bytes).at("weight").shape == std::vector<std::uint64_t>{1, 4});
    load_checkpoint(open_memory(bytes), b.param_values());
    CHECK(b.gain() == a.gain());
  }
  SECTION("a column [4, 1] is a different shape") {
    SaveOptions o;
    o.shapes = {{"weight", {4, 1}}};
    CHECK_THROWS_AS(load_checkpoint(open_memory(serialise(a.param_values(), o)), b.param_values()), ShapeError);
  }
  SECTION("overrides are checked") {
    SaveOptions o;
    o.shapes = {{"weight", {5}}};
    CHECK_THROWS_AS(serialise(a.param_values(), o), ShapeError);
    o.shapes = {{"gain", {4}}};
    CHECK_THROWS_WITH(serialise(a.param_values(), o), Contains("'gain', which is not a parameter"));
  }
  SECTION("Reader::matrix views rank 0 1 and 2") {
    SaveOptions o;
    o.shapes = {{"weight", {4}}};
    const Bytes bytes = serialise(a.param_values(), o);
    const Matrix<double> m = open_memory(bytes).matrix<double>("weight");
    CHECK(m.rows() == 1);
    CHECK(m == a.gain());
  }
}

TEST_CASE("Metadata round-trips", "[checkpoint]") {
  TempDir dir;
  SwiGLU<float> ffn(2, 2, 3);
  SaveOptions o;
  o.metadata = {{"format", "pt"}, {"apex.config", R"({"d_model": 2})"}, {"note", "ünïcödé"}};
  save_checkpoint(dir / "m.safetensors", ffn.param_values(), o);
  CHECK(load_checkpoint(dir / "m.safetensors", ffn.param_values()).metadata == o.metadata);
  CHECK(st::Reader(dir / "m.safetensors").metadata() == o.metadata);
}

TEST_CASE("Bad names are rejected before anything is written", "[checkpoint]") {
  TempDir dir;
  SwiGLU<double> ffn(2, 2, 3);
  ParamList<double> ps = ffn.param_values();
  SECTION("duplicate") {
    ps[1].name = ps[0].name;
    CHECK_THROWS_AS(save_checkpoint(dir / "x.safetensors", ps), ValueError);
    CHECK_THROWS_AS(load_checkpoint(open_memory(serialise(ffn.param_values())), ps), ValueError);
  }
  SECTION("reserved") {
    ps[0].name = "__metadata__";
    CHECK_THROWS_AS(save_checkpoint(dir / "x.safetensors", ps), ValueError);
  }
  SECTION("not UTF-8") {
    ps[0].name = "w\xff";
    CHECK_THROWS_AS(save_checkpoint(dir / "x.safetensors", ps), ValueError);
  }
  SECTION("unwritable dtype") {
    SaveOptions o;
    o.dtype = st::DType::I64;
    CHECK_THROWS_AS(save_checkpoint(dir / "x.safetensors", ps, o), ValueError);
  }
  CHECK(dir.entries() == 0);
}

TEST_CASE("A family checkpoint save refuses a bias its load refuses and leaves the previous file",
          "[checkpoint][errors][regression]") {
  // save_family_checkpoint stored a double bias beyond float's range as F32
  // (+Inf in the file) over the previous file, which load_family_checkpoint
  // refuses (ValueError: the balancer's bias must be finite). Fixed: the
  // save applies the load's rule to the bias as stored, before any file.
  TempDir dir;
  MoEConfig cfg;
  cfg.d_model = 6, cfg.d_ffn = 5, cfg.n_experts = 4, cfg.n_active = 2;
  MoEFFN<double> m(cfg, 7), n(cfg, 8);
  const std::string path = dir / "ds.safetensors";
  SaveOptions f32;
  f32.dtype = st::DType::F32;
  save_family_checkpoint(path, m, MoEFamily::DeepSeekV3, "", f32);
  const auto bytes = [](const std::string& p) {
    std::ifstream f(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  };
  const std::string before = bytes(path);
  RowVector<double> bias = RowVector<double>::Zero(4);
  bias(2) = 1e39;  // finite in the double layer
  m.balancer().set_bias(bias);
  CHECK_THROWS_AS(save_family_checkpoint(path, m, MoEFamily::DeepSeekV3, "", f32), ValueError);
  CHECK_THROWS_WITH(save_family_checkpoint(path, m, MoEFamily::DeepSeekV3, "", f32),
                    Catch::Matchers::Contains("save_family_checkpoint: tensor 'mlp.gate.e_score_correction_bias' "
                                              "contains NaN or Inf: 1e+39 (+Inf) at element 2") &&
                        Catch::Matchers::Contains("as F32 stores it"));
  CHECK(bytes(path) == before);  // the previous file, whole
  CHECK(dir.entries() == 1);     // and no temporary file left
  load_family_checkpoint(path, n, MoEFamily::DeepSeekV3);
  save_family_checkpoint(dir / "f64.safetensors", m, MoEFamily::DeepSeekV3);  // F64 holds it
  load_family_checkpoint(dir / "f64.safetensors", n, MoEFamily::DeepSeekV3);
  CHECK(n.balancer().bias() == bias);
}

// ---- error handling (sweeps) ----
using namespace apex::test;  // the sweep machinery of support/sweep.hpp

TEST_CASE("checkpoint sweep: mismatched files and bad options raise typed errors and change nothing",
          "[sweeps][checkpoint]") {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("apex_ffn_sweeps_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string file = (dir / "swiglu.safetensors").string();
  SwiGLU<double> saved(4, 6, 1);
  save_checkpoint(file, saved.param_values());
  SwiGLU<double> wider(4, 8, 2);
  const Matrix<double> before = wider.w_gate_up();
  MoEFFN<double> moe(moe_config(2, 1, 0, 4, 6), 3);
  const std::string missing = (dir / "absent.safetensors").string();
  const std::string nowhere = (dir / "no" / "such" / "folder" / "x.safetensors").string();

  std::vector<Case> cases = {
      {"load into a layer of another width", [&] { load_checkpoint(file, wider.param_values()); }, "ShapeError",
       {"load_checkpoint", "w_gate.weight", "[6, 4]", "[8, 4]"}},
      {"load a file that does not exist", [&] { load_checkpoint(missing, saved.param_values()); }, "FormatError",
       {"absent.safetensors"}},
      {"load a SwiGLU file into an MoE layer", [&] { load_checkpoint(file, moe.param_values()); }, "FormatError",
       {"load_checkpoint", "missing", "router.weight", "unexpected", "w_down.weight"}},
      {"save into a folder that does not exist", [&] { save_checkpoint(nowhere, saved.param_values()); }, "FormatError",
       {"x.safetensors"}},
      {"save with a shape override of the wrong size",
       [&] {
         SaveOptions o;
         o.shapes["w_down.weight"] = {5};
         save_checkpoint(file, saved.param_values(), o);
       },
       "ShapeError", {"save_checkpoint", "w_down.weight"}},
      {"save with a shape override for no parameter",
       [&] {
         SaveOptions o;
         o.shapes["nope"] = {1};
         save_checkpoint(file, saved.param_values(), o);
       },
       "ValueError", {"save_checkpoint", "nope"}},
      {"save a list naming a parameter twice",
       [&] {
         ParamList<double> p = saved.param_values();
         p.push_back(p[0]);
         save_checkpoint(file, p);
       },
       "ValueError", {"save_checkpoint", "w_gate.weight", "twice"}},
      {"load into a list naming a parameter twice",
       [&] {
         ParamList<double> p = saved.param_values();
         p.push_back(p[1]);
         load_checkpoint(file, p);
       },
       "ValueError", {"load_checkpoint", "w_up.weight", "twice"}},
      {"read a buffer that is not a safetensors file",
       [] {
         const char junk[] = "not a safetensors file";
         (void)safetensors::Reader::from_memory(junk, sizeof junk);
       },
       "FormatError", {"safetensors"}},
      {"read a tensor the file lacks", [&] { (void)safetensors::Reader(file).matrix<double>("nope"); }, "FormatError",
       {"nope"}},
  };
  run_sweep(cases);
  CHECK(wider.w_gate_up() == before);  // a rejected load writes nothing
  // The failed saves left the good file intact.
  SwiGLU<double> reloaded(4, 6, 9);
  load_checkpoint(file, reloaded.param_values());
  CHECK(reloaded.w_gate_up() == saved.w_gate_up());
  CHECK(reloaded.w_down() == saved.w_down());
  fs::remove_all(dir);
}
