// Checkpoints: the safetensors format byte for byte, dtype conversion (BF16
// rounding included), strict name/shape/dtype matching, atomic saves under
// injected failures, malformed files (every class the reader guards against,
// every truncation, random corruption, the fuzz corpus and its regression
// inputs), PyTorch interop in both directions, and the error sweep of
// mismatched files and bad options.
#include <apex/ffn/io/checkpoint.hpp>
#include <apex/ffn/layers/ffn_sublayer.hpp>
#include <apex/ffn/layers/kappa_swiglu.hpp>
#include <apex/ffn/moe/moe_ffn.hpp>
#include <apex/ffn/layers/multi_token_heads.hpp>
#include <apex/ffn/io/name_maps.hpp>
#include <apex/ffn/layers/rms_norm.hpp>
#include <apex/ffn/io/sharded_checkpoint.hpp>
#include <apex/ffn/layers/swiglu.hpp>

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
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "fuzz/fuzz_loader.hpp"
#include "fuzz/replay.hpp"
#include "sweep.hpp"
#include "temp_dir.hpp"

using namespace apex;
namespace fs = std::filesystem;
namespace st = apex::safetensors;
using Catch::Matchers::Contains;
using Bytes = std::vector<std::uint8_t>;

namespace {

const fs::path kTests = fs::path(__FILE__).parent_path();

using test::TempDir;

Bytes read_bytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

void write_bytes(const fs::path& p, const Bytes& b) {
  std::ofstream f(p, std::ios::binary);
  f.write(reinterpret_cast<const char*>(b.data()), std::streamsize(b.size()));
}

/// A file from a header text and a data buffer (no padding added).
Bytes make_file(const std::string& header, const Bytes& data = {}) {
  // Sized once and filled: GCC 12 at -O3 reports a false -Warray-bounds on
  // inserting after an 8-byte vector.
  Bytes out(8 + header.size() + data.size());
  st::detail::store_le(out.data(), header.size(), 8);
  std::copy(header.begin(), header.end(), out.begin() + 8);
  std::copy(data.begin(), data.end(), out.begin() + 8 + std::ptrdiff_t(header.size()));
  return out;
}

Bytes serialise(const ParamList<double>& params, const SaveOptions& o = {}) {
  st::VectorSink sink;
  write_checkpoint(sink, params, o);
  return Bytes(sink.bytes.begin(), sink.bytes.end());
}

st::Reader open_memory(const Bytes& b) { return st::Reader::from_memory(b.data(), b.size()); }

/// Copies of every parameter value, to prove a rejected load changed nothing.
template <class T>
std::vector<Matrix<T>> snapshot(const ParamList<T>& ps) {
  std::vector<Matrix<T>> out;
  for (const auto& p : ps) out.push_back(p.value());
  return out;
}
template <class T>
bool unchanged(const ParamList<T>& ps, const std::vector<Matrix<T>>& before) {
  for (std::size_t i = 0; i < ps.size(); ++i)
    if (!(ps[i].value().array() == before[i].array()).all()) return false;
  return true;
}

double rel_error(const Matrix<double>& a, const Matrix<double>& b) {
  const double scale = b.norm();
  return (a - b).norm() / (scale > 0 ? scale : 1.0);
}

}  // namespace

// ─────────────────────────────── round trips ──────────────────────────────────

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

// ──────────────────────────── matching a layer ──────────────────────────────

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

// ─────────────────────────────── atomic saves ─────────────────────────────────

TEST_CASE("Saving replaces the previous checkpoint atomically", "[checkpoint][atomic]") {
  TempDir dir;
  const std::string path = dir / "ckpt.safetensors";
  SwiGLU<double> a(4, 3, 1), b(4, 3, 2), c(4, 3, 3);
  save_checkpoint(path, a.param_values());
  save_checkpoint(path, b.param_values());
  load_checkpoint(path, c.param_values());
  CHECK(c.w_down() == b.w_down());
  CHECK(dir.entries() == 1);
  // A bare file name saves into the working directory's folder ".".
  const auto cwd = fs::current_path();
  fs::current_path(dir.path);
  save_checkpoint("bare.safetensors", a.param_values());
  fs::current_path(cwd);
  CHECK(fs::exists(dir / "bare.safetensors"));
}

TEST_CASE("A failed save keeps the previous checkpoint and leaves no temporary file", "[checkpoint][atomic]") {
  TempDir dir;
  const std::string path = dir / "ckpt.safetensors";
  SwiGLU<double> old_layer(4, 3, 1);
  save_checkpoint(path, old_layer.param_values());
  const Bytes old_bytes = read_bytes(path);

  SECTION("the writer throws midway") {
    struct Boom : std::runtime_error {
      using std::runtime_error::runtime_error;
    };
    CHECK_THROWS_AS(st::write_file_atomic(path,
                                          [](st::ByteSink& out) {
                                            const Bytes half(100, 0xAB);
                                            out.write(half.data(), half.size());
                                            throw Boom("simulated failure");
                                          }),
                    Boom);
  }
  SECTION("the file system refuses the data (file size limit)") {
    // RLIMIT_FSIZE makes write() fail with EFBIG, as a full disk fails with
    // ENOSPC — even for root. SIGXFSZ would kill the process: ignore it.
    SwiGLU<double> big(64, 128, 2);  // ~200 KB of F64
    struct rlimit saved {};
    REQUIRE(::getrlimit(RLIMIT_FSIZE, &saved) == 0);
    auto* old_handler = std::signal(SIGXFSZ, SIG_IGN);
    struct rlimit small = saved;
    small.rlim_cur = 16 * 1024;
    REQUIRE(::setrlimit(RLIMIT_FSIZE, &small) == 0);
    bool threw = false;
    std::string what;
    try {
      save_checkpoint(path, big.param_values());
    } catch (const FormatError& e) {
      threw = true;
      what = e.what();
    }
    ::setrlimit(RLIMIT_FSIZE, &saved);
    std::signal(SIGXFSZ, old_handler);
    CHECK(threw);
    CHECK_THAT(what, Contains("cannot write"));
  }
  SECTION("the rename fails (the target became a folder)") {
    const std::string folder = dir / "taken";
    fs::create_directories(fs::path(folder) / "inside");
    CHECK_THROWS_AS(save_checkpoint(folder, old_layer.param_values()), FormatError);
    CHECK(fs::is_directory(folder));
    fs::remove_all(folder);
  }
  CHECK(read_bytes(path) == old_bytes);
  CHECK(dir.entries() == 1);
}

TEST_CASE("Saving into an unwritable or missing folder raises FormatError", "[checkpoint][atomic]") {
  SwiGLU<double> ffn(2, 2, 1);
  CHECK_THROWS_WITH(save_checkpoint("/nonexistent-apex-folder/x.safetensors", ffn.param_values()),
                    Contains("cannot create a temporary file"));
  // /proc/self exists and takes no new files, whoever we are (root included).
  CHECK_THROWS_AS(save_checkpoint("/proc/self/x.safetensors", ffn.param_values()), FormatError);
  CHECK_THROWS_AS(save_checkpoint("", ffn.param_values()), FormatError);
  if (::geteuid() != 0) {  // permission bits do not stop root
    TempDir dir;
    fs::permissions(dir.path, fs::perms::owner_read | fs::perms::owner_exec);
    CHECK_THROWS_AS(save_checkpoint(dir / "x.safetensors", ffn.param_values()), FormatError);
    fs::permissions(dir.path, fs::perms::owner_all);
    CHECK(dir.entries() == 0);
  }
}

TEST_CASE("A file name of up to 255 bytes saves and loads, leaving no temporary file",
          "[checkpoint][regression][atomic]") {
  // write_file_atomic (io/safetensors/atomic_save.hpp) named its temporary file
  // "." + name + ".tmp.<pid>.<n>", some 20 bytes longer than the target, so
  // a valid 250-byte name failed with FormatError ("File name too long")
  // (issue 17, defect 4). Fixed: where the temporary name would not fit the
  // folder's limit, its copy of the target name is shortened; pid and
  // counter keep it unique. A name beyond the limit is rejected up front.
  TempDir dir;
  const long name_max = ::pathconf(dir.path.c_str(), _PC_NAME_MAX);
  REQUIRE(name_max == 255);  // Linux file systems; the sizes below assume it
  SwiGLU<double> saved(3, 4, 1);
  for (std::size_t len : {std::size_t(250), std::size_t(255)}) {
    INFO(len << "-byte name");
    const std::string path = dir / (std::string(len - 12, 'c') + ".safetensors");
    SwiGLU<double> loaded(3, 4, 2);
    save_checkpoint(path, saved.param_values());
    save_checkpoint(path, saved.param_values());  // and over an existing file
    load_checkpoint(path, loaded.param_values());
    CHECK(loaded.w_down() == saved.w_down());
    CHECK(dir.entries() == 1);
    fs::remove(path);
  }
  CHECK_THROWS_WITH(save_checkpoint(dir / std::string(256, 'c'), saved.param_values()),
                    Contains("256 bytes") && Contains("255"));
  CHECK(dir.entries() == 0);
}

// ─────────────────────────── paths that are not regular files ─────────────────

namespace {

using Clock = std::chrono::steady_clock;

/// Longest a rejected open may take before the test calls it blocked.
constexpr double kPromptSeconds = 2.0;
/// When the watchdog starts releasing readers blocked in open() of a FIFO.
constexpr double kWatchdogSeconds = 4.0;

/// Runs `call` under a watchdog for the FIFO `fifo`, so that a reader
/// blocked in open() (waiting for a writer that never comes) cannot hang the
/// suite: after kWatchdogSeconds the watchdog opens and closes the write end
/// every 50 ms — non-blocking, so it cannot block itself; ENXIO while no
/// reader waits — which releases the reader (and gives a blocked read EOF).
/// Returns the seconds `call` took; `what` gets its outcome, e.g.
/// "FormatError: safetensors: file '…' is not a regular file".
double run_with_fifo_watchdog(const std::string& fifo, const std::function<void()>& call, std::string& what) {
  std::atomic<bool> done{false};
  std::thread watchdog([&] {
    const auto start = Clock::now();
    while (!done) {
      if (std::chrono::duration<double>(Clock::now() - start).count() > kWatchdogSeconds) {
        const int wfd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
        if (wfd >= 0) ::close(wfd);
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  });
  const auto start = Clock::now();
  try {
    call();
    what = "returned";
  } catch (const FormatError& e) {
    what = std::string("FormatError: ") + e.what();
  } catch (const std::exception& e) {
    what = std::string("another exception: ") + e.what();
  } catch (...) {
    what = "a non-standard exception";
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  done = true;
  watchdog.join();
  return seconds;
}

}  // namespace

TEST_CASE("Loading from a FIFO raises FormatError at once instead of blocking", "[checkpoint][regression][filetype]") {
  // FileSource (io/safetensors/posix_file.hpp): open(path, O_RDONLY) of a named
  // pipe waits for a writer before fstat can show it is no regular file, so
  // load_checkpoint on a FIFO blocked forever (issue 17, defect 3). Fixed:
  // the path is opened with O_NONBLOCK, which returns at once, and rejected
  // by fstat on that descriptor unless it is a regular file; only then is
  // O_NONBLOCK cleared for the reads.
  TempDir dir;
  const std::string fifo = dir / "pipe.safetensors";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  SwiGLU<double> ffn(2, 3, 1);
  const auto before = snapshot(ffn.param_values());
  std::string what;
  const double seconds = run_with_fifo_watchdog(fifo, [&] { load_checkpoint(fifo, ffn.param_values()); }, what);
  INFO(what);
  CHECK(seconds < kPromptSeconds);
  CHECK_THAT(what, Contains("FormatError") && Contains("is not a regular file") && Contains("pipe.safetensors"));
  CHECK(unchanged(ffn.param_values(), before));
}

// The class behind defects 3 and 4 of issue 17, swept rather than sampled:
// every path a load opens is proven a regular file before any call that can
// block, and every temporary name a save makes is bounded by the folder's
// name limit.

TEST_CASE("Every read path rejects what is not a regular file without blocking", "[checkpoint][sweep][filetype]") {
  // Each public entry point that takes a path, against each kind of file
  // that is not a regular one. A reader that blocks is released by the
  // FIFO watchdog and fails on time.
  TempDir dir;
  const std::string fifo = dir / "pipe";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  const std::string link = dir / "link-to-pipe";
  fs::create_symlink(fifo, link);
  const std::string folder = dir / "folder";
  fs::create_directories(folder);
  const std::string dangling = dir / "dangling";
  fs::create_symlink(dir / "absent", dangling);
  const std::string socket_path = dir / "socket";
  const int sock = ::socket(AF_UNIX, SOCK_STREAM, 0);
  REQUIRE(sock >= 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  REQUIRE(socket_path.size() < sizeof addr.sun_path);
  std::copy(socket_path.begin(), socket_path.end(), addr.sun_path);
  REQUIRE(::bind(sock, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) == 0);

  struct Kind {
    const char* what;
    std::string path;
    const char* message;
  };
  const std::vector<Kind> kinds = {
      {"a FIFO", fifo, "is not a regular file"},
      {"a symbolic link to a FIFO", link, "is not a regular file"},
      {"a folder", folder, "is not a regular file"},
      {"a character device", "/dev/null", "is not a regular file"},
      {"a socket", socket_path, "cannot open"},  // open() of a socket fails: ENXIO
      {"a dangling symbolic link", dangling, "cannot open"},
  };
  SwiGLU<double> ffn(2, 3, 1);
  const auto before = snapshot(ffn.param_values());
  LoadOptions lenient;
  lenient.allow_missing = lenient.allow_unexpected = true;
  for (const Kind& k : kinds) {
    const std::vector<std::pair<const char*, std::function<void()>>> entries = {
        {"load_checkpoint(path)", [&] { load_checkpoint(k.path, ffn.param_values()); }},
        {"load_checkpoint(path, lenient)", [&] { load_checkpoint(k.path, ffn.param_values(), lenient); }},
        {"safetensors::Reader(path)", [&] { (void)st::Reader(k.path); }},
        {"safetensors::FileSource(path)", [&] { (void)st::FileSource(k.path); }},
    };
    for (const auto& [entry, call] : entries) {
      INFO(entry << " on " << k.what << " (" << k.path << ")");
      std::string what;
      const double seconds = run_with_fifo_watchdog(fifo, call, what);
      INFO(what);
      CHECK(seconds < kPromptSeconds);
      CHECK_THAT(what, Contains("FormatError") && Contains(k.message) && Contains(k.path));
    }
  }
  CHECK(unchanged(ffn.param_values(), before));
  ::close(sock);

  // Saves never open their target: a FIFO there is replaced by the file,
  // and a FIFO where the folder should be is refused (O_DIRECTORY), both at once.
  std::string what;
  CHECK(run_with_fifo_watchdog(fifo, [&] { save_checkpoint(fifo, ffn.param_values()); }, what) < kPromptSeconds);
  CHECK(what == "returned");
  CHECK(fs::is_regular_file(fifo));
  const std::string other_fifo = dir / "pipe2";
  REQUIRE(::mkfifo(other_fifo.c_str(), 0600) == 0);
  CHECK(run_with_fifo_watchdog(other_fifo, [&] { save_checkpoint(other_fifo + "/x.safetensors", ffn.param_values()); },
                               what) < kPromptSeconds);
  CHECK_THAT(what, Contains("FormatError") && Contains("pipe2"));
}

TEST_CASE("Every temporary name fits the folder's limit whenever the target's name does", "[checkpoint][sweep][atomic]") {
  // temp_name is the one place a temporary name is made. Swept over name
  // limits (POSIX's minimum 14, eCryptfs' 143, Linux's 255), every target
  // length up to the limit, one- to four-byte UTF-8 characters, and the
  // widest pid and counter: the name fits, is hidden, ends in the unique
  // ".tmp.<pid>.<n>", keeps a whole-character prefix of the target, and is
  // exactly ".<name>.tmp.<pid>.<n>" whenever that fits.
  std::vector<std::string> failures;
  for (const std::size_t name_max : {std::size_t(14), std::size_t(143), std::size_t(255)})
    for (const std::string ch : {"a", "\xC3\xA9", "\xE2\x82\xAC", "\xF0\x9F\x98\x80"})  // a é € 😀
      for (const unsigned long long pid : {1ull, 4194304ull})
        for (const unsigned long long n : {0ull, 4294967295ull}) {
          const std::string suffix = ".tmp." + std::to_string(pid) + "." + std::to_string(n);
          if (1 + suffix.size() > name_max) continue;  // no name could fit
          std::string name;
          while (name.size() + ch.size() <= name_max) {
            name += ch;
            const std::string tmp = st::detail::temp_name(name, pid, n, name_max);
            const std::string kept = tmp.substr(1, tmp.size() - 1 - suffix.size());
            const bool fits_whole = 1 + name.size() + suffix.size() <= name_max;
            const bool ok = tmp.size() <= name_max && tmp.front() == '.' &&
                            tmp.compare(tmp.size() - suffix.size(), suffix.size(), suffix) == 0 &&
                            name.compare(0, kept.size(), kept) == 0 && kept.size() % ch.size() == 0 &&
                            (!fits_whole || kept == name);
            if (!ok) failures.push_back(std::to_string(name_max) + ": " + name + " -> " + tmp);
          }
        }
  INFO((failures.empty() ? std::string() : failures.front()));
  CHECK(failures.empty());

  // And through the file system: saves at lengths up to the limit land,
  // load back, and leave only the checkpoint behind.
  TempDir dir;
  REQUIRE(::pathconf(dir.path.c_str(), _PC_NAME_MAX) == 255);
  SwiGLU<double> saved(2, 3, 1);
  for (std::size_t len : {1, 100, 200, 220, 230, 235, 236, 237, 238, 239, 240, 245, 250, 254, 255}) {
    INFO(len << "-byte name");
    const std::string path = dir / std::string(len, 'k');
    SwiGLU<double> loaded(2, 3, 2);
    save_checkpoint(path, saved.param_values());
    load_checkpoint(path, loaded.param_values());
    CHECK(loaded.w_down() == saved.w_down());
    CHECK(dir.entries() == 1);
    fs::remove(path);
  }
}

// ───────────────────────────────── malformed files ────────────────────────────

namespace {

struct Bad {
  const char* what;
  Bytes bytes;
  const char* message;  // a piece of the expected FormatError message
};

std::string nested(int depth) { return std::string(std::size_t(depth), '[') + std::string(std::size_t(depth), ']'); }

std::vector<Bad> malformed_files() {
  const std::string ok_entry = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  const Bytes eight(8, 0);
  Bytes huge_len(16, ' ');
  st::detail::store_le(huge_len.data(), std::uint64_t(1) << 63, 8);
  Bytes over_cap(16, ' ');
  st::detail::store_le(over_cap.data(), 200'000'000, 8);
  Bytes beyond(16, ' ');
  st::detail::store_le(beyond.data(), 9, 8);
  return {
      {"empty file", {}, "fewer than the 8-byte header length"},
      {"7 bytes", Bytes(7, 0), "fewer than the 8-byte header length"},
      {"header length 2^63", huge_len, "more than the limit"},
      {"header length over the 100 MB cap", over_cap, "more than the limit"},
      {"header length beyond the file", beyond, "has only 8 bytes after the length"},
      {"zero-length header", make_file(""), "does not start with '{'"},
      {"header not starting with {", make_file(" {}"), "does not start with '{'"},
      {"not JSON", make_file("{nope}"), "not valid JSON"},
      {"trailing garbage", make_file("{}x"), "not valid JSON"},
      {"truncated JSON", make_file(R"({"a":{"dtype":"F32")"), "not valid JSON"},
      {"non-UTF-8 name", make_file("{\"\xff\xfe\":{}}"), "not valid JSON"},
      {"overlong UTF-8", make_file("{\"\xc0\xaf\":{}}"), "not valid JSON"},
      {"lone surrogate", make_file(R"({"\ud800":{}})"), "not valid JSON"},
      {"value without a key", make_file("{" + nested(1) + "}"), "not valid JSON"},
      {"deep nesting in metadata", make_file(R"({"__metadata__":)" + nested(100000) + "}"), "array where"},
      {"deep nesting of objects", make_file(R"({"a":{"shape":{"c":{}}}})"), "deeper than the format allows"},
      {"duplicate tensor", make_file("{" + ok_entry + "," + ok_entry + "}", eight), "repeats the key 'a'"},
      {"duplicate field", make_file(R"({"a":{"dtype":"F32","dtype":"F64","shape":[2],"data_offsets":[0,8]}})", eight),
       "repeats the key 'dtype'"},
      {"unknown field", make_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}})", eight),
       "unknown field 'x'"},
      {"missing dtype", make_file(R"({"a":{"shape":[2],"data_offsets":[0,8]}})", eight), "has no 'dtype'"},
      {"missing shape", make_file(R"({"a":{"dtype":"F32","data_offsets":[0,8]}})", eight), "has no 'shape'"},
      {"missing offsets", make_file(R"({"a":{"dtype":"F32","shape":[2]}})", eight), "has no 'data_offsets'"},
      {"tensor not an object", make_file(R"({"a":3})"), "not a JSON object"},
      {"unknown dtype", make_file(R"({"a":{"dtype":"F31","shape":[2],"data_offsets":[0,8]}})", eight), "unknown or unsupported dtype"},
      {"lower-case dtype", make_file(R"({"a":{"dtype":"f32","shape":[2],"data_offsets":[0,8]}})", eight), "unknown or unsupported dtype"},
      {"sub-byte dtype", make_file(R"({"a":{"dtype":"F4","shape":[16],"data_offsets":[0,8]}})", eight), "unknown or unsupported dtype"},
      {"dtype not a string", make_file(R"({"a":{"dtype":4,"shape":[2],"data_offsets":[0,8]}})", eight), "unknown or unsupported dtype"},
      {"negative dimension", make_file(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", eight), "non-negative integer"},
      {"fractional dimension", make_file(R"({"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", eight), "non-negative integer"},
      {"dimension as a string", make_file(R"({"a":{"dtype":"F32","shape":["2"],"data_offsets":[0,8]}})", eight), "non-negative integer"},
      {"dimension beyond 2^64", make_file(R"({"a":{"dtype":"F32","shape":[18446744073709551616],"data_offsets":[0,8]}})", eight),
       "non-negative integer"},
      {"dimension beyond 2^63", make_file(R"({"a":{"dtype":"U8","shape":[9223372036854775808],"data_offsets":[0,8]}})", eight),
       "beyond 2^63 - 1"},
      {"element count overflows", make_file(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296,2],"data_offsets":[0,8]}})", eight),
       "element count overflows"},
      {"byte size overflows", make_file(R"({"a":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,8]}})", eight),
       "byte size overflows"},
      {"huge declared size", make_file(R"({"a":{"dtype":"F64","shape":[1000000000000],"data_offsets":[0,8000000000000]}})", eight),
       "ends at byte 8000000000000"},
      {"shape not an array", make_file(R"({"a":{"dtype":"F32","shape":2,"data_offsets":[0,8]}})", eight), "not an array"},
      {"200-digit dimension", make_file(R"({"a":{"dtype":"F32","shape":[)" + std::string(200, '1') + R"(],"data_offsets":[0,8]}})", eight),
       "non-negative integer"},
      {"rank above 64", make_file(R"({"a":{"dtype":"U8","shape":[)" + [] {
                                   std::string s = "1";
                                   for (int i = 0; i < 70; ++i) s += ",1";
                                   return s;
                                 }() + R"(],"data_offsets":[0,1]}})", Bytes(1, 0)),
       "array longer than 64"},
      {"three offsets", make_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8,8]}})", eight), "[begin, end]"},
      {"end before begin", make_file(R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", eight), "end < begin"},
      {"size disagrees with shape", make_file(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", eight), "needs 12"},
      {"offset past the data", make_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", eight), "belong to no tensor"},
      {"end past the data", make_file(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", eight), "ends at byte 16"},
      {"overlapping tensors",
       make_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", eight),
       "overlaps"},
      {"gap between tensors",
       make_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[2],"data_offsets":[6,8]}})", eight),
       "belong to no tensor"},
      {"data not fully covered", make_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", eight),
       "cover 4 bytes of a 8-byte"},
      {"metadata not an object", make_file(R"({"__metadata__":"x"})"), "'__metadata__' is not a JSON object"},
      {"metadata value not a string", make_file(R"({"__metadata__":{"k":1}})"), "is not a string"},
      {"metadata value an object", make_file(R"({"__metadata__":{"k":{}}})"), "deeper than the format allows"},
      {"comments", make_file(R"({/*c*/})"), "not valid JSON"},
  };
}

}  // namespace

TEST_CASE("Malformed files raise FormatError", "[checkpoint][malformed]") {
  for (const Bad& bad : malformed_files()) {
    INFO(bad.what);
    try {
      open_memory(bad.bytes);
      FAIL_CHECK("accepted");
    } catch (const FormatError& e) {
      CHECK_THAT(e.what(), Contains(bad.message));
    }
    // The same through the file reader.
    TempDir dir;
    write_bytes(dir.path / "bad.safetensors", bad.bytes);
    SwiGLU<double> ffn(2, 2, 1);
    CHECK_THROWS_AS(load_checkpoint(dir / "bad.safetensors", ffn.param_values()), FormatError);
  }
}

TEST_CASE("Edge cases the format allows are accepted", "[checkpoint][malformed]") {
  // Scalars, empty tensors, zero dimensions, unused dtypes, metadata alone.
  const Bytes b = make_file(
      R"({"__metadata__":{},"s":{"dtype":"F64","shape":[],"data_offsets":[0,8]},)"
      R"("e":{"dtype":"F32","shape":[0,5],"data_offsets":[8,8]},"i":{"dtype":"I64","shape":[1],"data_offsets":[8,16]}})"
      "   ",
      Bytes(16, 0));
  const auto file = open_memory(b);
  CHECK(file.tensors().size() == 3);
  CHECK(file.matrix<double>("s").size() == 1);
  CHECK(file.at("e").numel() == 0);
  CHECK_THROWS_AS(file.matrix<double>("i"), FormatError);  // not a float type
  CHECK_THROWS_AS(file.at("nope"), FormatError);
  CHECK(open_memory(make_file("{}")).tensors().empty());
}

TEST_CASE("The header length is checked against the cap before any allocation", "[checkpoint][malformed]") {
  SwiGLU<double> ffn(8, 8, 1);
  const Bytes good = serialise(ffn.param_values());
  const std::uint64_t n = st::detail::load_le(good.data(), 8);
  st::Limits tight;
  tight.max_header_bytes = n - 1;
  CHECK_THROWS_WITH(st::Reader::from_memory(good.data(), good.size(), tight), Contains("more than the limit"));
  tight.max_header_bytes = n;
  CHECK_NOTHROW(st::Reader::from_memory(good.data(), good.size(), tight));
}

TEST_CASE("Every truncation of a valid file is rejected", "[checkpoint][malformed]") {
  SwiGLU<double> ffn(3, 2, 1);
  SaveOptions o;
  o.metadata = {{"k", "v"}};
  const Bytes good = serialise(ffn.param_values(), o);
  REQUIRE_NOTHROW(open_memory(good));
  for (std::size_t len = 0; len < good.size(); ++len) {
    INFO("length " << len);
    CHECK_THROWS_AS(st::Reader::from_memory(good.data(), len), FormatError);
  }
  // A file that shrinks after it was opened is caught when the data are read.
  TempDir dir;
  const std::string path = dir / "shrinks.safetensors";
  write_bytes(path, good);
  const st::Reader file(path);
  fs::resize_file(path, good.size() - 4);
  SwiGLU<double> other(3, 2, 2);
  CHECK_THROWS_WITH(load_checkpoint(file, other.param_values()), Contains("ended early"));
}

TEST_CASE("Random corruptions only ever raise library errors", "[checkpoint][malformed]") {
  SwiGLU<double> ffn(3, 2, 1);
  SaveOptions o;
  o.metadata = {{"format", "pt"}};
  o.dtype = st::DType::BF16;
  const Bytes good = serialise(ffn.param_values(), o);
  std::mt19937_64 gen(2024);
  int accepted = 0, rejected = 0;
  for (int i = 0; i < 3000; ++i) {
    Bytes b = good;
    const int edits = 1 + int(gen() % 4);
    for (int e = 0; e < edits; ++e) {
      const std::size_t at = gen() % b.size();
      switch (gen() % 4) {
        case 0: b[at] = std::uint8_t(gen()); break;                                  // overwrite
        case 1: b[at] ^= std::uint8_t(1u << (gen() % 8)); break;                      // bit flip
        case 2: b.insert(b.begin() + std::ptrdiff_t(at), std::uint8_t(gen())); break;  // insert
        default: b.erase(b.begin() + std::ptrdiff_t(at)); break;                     // delete
      }
    }
    try {
      fuzz::exercise(b.data(), b.size());
      ++accepted;
    } catch (const Error&) {
      ++rejected;
    }  // anything else propagates and fails the test
  }
  INFO(accepted << " accepted, " << rejected << " rejected");
  CHECK(accepted > 0);  // data-only flips stay valid files
  CHECK(rejected > 0);
}

TEST_CASE("The fuzz corpus and regression inputs replay safely", "[checkpoint][fuzz]") {
  const std::size_t files = fuzz::for_each_committed_input(
      kTests, {"fuzz/corpus", "fuzz/regressions"}, [](const fs::path& path, const std::string& bytes) {
        INFO(path.string());
        try {
          fuzz::exercise(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size());
        } catch (const Error&) {
        }
      });
  CHECK(files >= 10);
}

// ──────────────────────────────── PyTorch interop ─────────────────────────────

namespace {

struct IO {
  Matrix<double> x, y;
};
IO read_io(const std::string& path) {
  const st::Reader f(path);
  return {f.matrix<double>("x"), f.matrix<double>("y")};
}

/// The directory of PyTorch-written fixtures: the committed ones, plus a
/// freshly generated set when CTest's interop fixture provides one.
std::vector<fs::path> torch_dirs() {
  std::vector<fs::path> dirs{kTests / "data"};
  if (const char* d = std::getenv("APEX_FFN_TORCH_DIR")) dirs.emplace_back(d);
  return dirs;
}

}  // namespace

TEST_CASE("A SwiGLU checkpoint written by PyTorch reproduces PyTorch's output", "[checkpoint][interop][import]") {
  for (const fs::path& dir : torch_dirs()) {
    const std::string weights = (dir / "swiglu_f64.safetensors").string();
    INFO(weights);
    REQUIRE(fs::exists(weights));
    const st::Reader file(weights);
    const auto config = nlohmann::json::parse(file.metadata().at("apex.config"));
    REQUIRE(config["layer"] == "SwiGLU");
    SwiGLU<double> ffn(config["d_model"].get<Index>(), config["d_ffn"].get<Index>(), std::uint64_t(0));
    load_checkpoint(file, ffn.param_values());
    const IO io = read_io((dir / "swiglu_f64_io.safetensors").string());
    const double err = rel_error(ffn.forward(io.x), io.y);
    INFO("relative error " << err);
    CHECK(err <= 1e-10);
  }
}

TEST_CASE("A SwiGLU checkpoint saved here loads into PyTorch", "[checkpoint][interop][export]") {
  // With APEX_FFN_INTEROP_DIR set (CTest's interop fixture) the files stay
  // there for tools/torch_reference.py check; otherwise they are verified
  // here and removed.
  TempDir tmp;
  const char* env = std::getenv("APEX_FFN_INTEROP_DIR");
  const fs::path dir = env ? fs::path(env) : tmp.path;
  fs::create_directories(dir);
  SwiGLU<double> ffn(6, 10, 77);
  const Matrix<double> x = Matrix<double>::Random(5, 6);
  const Matrix<double> y = ffn.forward(x);
  SaveOptions o;
  o.metadata = {{"format", "pt"}, {"apex.config", R"({"layer": "SwiGLU", "d_model": 6, "d_ffn": 10})"}};
  save_checkpoint((dir / "apex_swiglu_f64.safetensors").string(), ffn.param_values(), o);
  st::save<double>((dir / "apex_swiglu_f64_io.safetensors").string(),
                   {{"x", {5, 6}, x.data()}, {"y", {5, 6}, y.data()}}, st::DType::F64, {{"format", "pt"}});
  SwiGLU<double> back(6, 10, 1);
  load_checkpoint((dir / "apex_swiglu_f64.safetensors").string(), back.param_values());
  CHECK(rel_error(back.forward(read_io((dir / "apex_swiglu_f64_io.safetensors").string()).x), y) == 0.0);
}

namespace {

/// The MoE's parameters plus its balancing bias, as PyTorch's state_dict
/// holds them (`expert_bias` is a buffer there). `bias` is the staging copy:
/// after a load, hand it to the balancer.
template <class T>
ParamList<T> moe_state(MoEFFN<T>& moe, RowVector<T>& bias) {
  bias = moe.balancer().bias();
  ParamList<T> state = moe.param_values();
  state.push_back({"expert_bias", bias.data(), nullptr, 1, bias.cols()});
  return state;
}

MoEConfig moe_config(const nlohmann::json& c) {
  REQUIRE(c["layer"] == "MoEFFN");
  MoEConfig cfg;
  cfg.d_model = c["d_model"];
  cfg.d_ffn = c["d_ffn"];
  cfg.n_experts = c["n_experts"];
  cfg.n_active = c["n_active"];
  cfg.n_shared = c["n_shared"];
  cfg.weights_from_unbiased = c["weights_from_unbiased"];
  return cfg;
}

nlohmann::json config_json(const MoEConfig& c) {
  return {{"layer", "MoEFFN"},       {"d_model", c.d_model},     {"d_ffn", c.d_ffn},
          {"n_experts", c.n_experts}, {"n_active", c.n_active},   {"n_shared", c.n_shared},
          {"weights_from_unbiased", c.weights_from_unbiased}};
}

/// Smallest gap between the K-th and (K+1)-th routing score over tokens:
/// far from 0, rounding differences between implementations cannot change
/// which experts are selected.
double routing_margin(MoEFFN<double>& moe, const Matrix<double>& x) {
  const Matrix<double> scores =
      (x * moe.router().weight().transpose()).rowwise() + moe.balancer().bias();  // N × E
  const Index k = moe.config().n_active;
  if (k == scores.cols()) return 1.0;
  double margin = 1e300;
  for (Index t = 0; t < scores.rows(); ++t) {
    std::vector<double> s(scores.row(t).data(), scores.row(t).data() + scores.cols());
    std::sort(s.rbegin(), s.rend());
    margin = std::min(margin, s[std::size_t(k - 1)] - s[std::size_t(k)]);
  }
  return margin;
}

}  // namespace

TEST_CASE("MoE checkpoints written by PyTorch reproduce PyTorch's output", "[checkpoint][interop][import][moe]") {
  for (const fs::path& dir : torch_dirs()) {
    for (const char* name : {"moe_f64", "moe_f32", "moe_bf16", "moe_unbiased_f64"}) {
      const std::string weights = (dir / (std::string(name) + ".safetensors")).string();
      INFO(weights);
      REQUIRE(fs::exists(weights));
      const st::Reader file(weights);
      const MoEConfig cfg = moe_config(nlohmann::json::parse(file.metadata().at("apex.config")));
      const IO io = read_io((dir / (std::string(name) + "_io.safetensors")).string());

      MoEFFN<double> moe(cfg, std::uint64_t(0));
      // The balancing bias is state, not a parameter: a strict load of
      // params() alone names it as unexpected.
      CHECK_THROWS_WITH(load_checkpoint(file, moe.param_values()), Contains("unexpected 'expert_bias'"));
      RowVector<double> bias;
      const ParamList<double> state = moe_state(moe, bias);
      load_checkpoint(file, state);
      moe.balancer().set_bias(bias);
      CHECK(bias.cwiseAbs().maxCoeff() > 0);
      const double err = rel_error(moe.forward(io.x), io.y);
      INFO("double: relative error " << err);
      CHECK(err <= 1e-10);

      // The same file into a float layer.
      MoEFFN<float> moe32(cfg, std::uint64_t(0));
      RowVector<float> bias32;
      load_checkpoint(file, moe_state(moe32, bias32));
      moe32.balancer().set_bias(bias32);
      const Matrix<float> x32 = io.x.cast<float>();
      const double err32 = rel_error(moe32.forward(x32).cast<double>(), io.y);
      INFO("float: relative error " << err32);
      CHECK(err32 <= 1e-5);
    }
  }
}

TEST_CASE("MoE checkpoints saved here load into PyTorch", "[checkpoint][interop][export][moe]") {
  TempDir tmp;
  const char* env = std::getenv("APEX_FFN_INTEROP_DIR");
  const fs::path dir = env ? fs::path(env) : tmp.path;
  fs::create_directories(dir);

  MoEConfig cfg;
  cfg.d_model = 8;
  cfg.d_ffn = 12;
  cfg.n_experts = 5;
  cfg.n_active = 2;
  cfg.n_shared = 1;
  MoEFFN<double> moe(cfg, std::uint64_t(42));
  RowVector<double> b(5);
  b << 0.1, -0.05, 0.0, 0.02, -0.2;
  moe.balancer().set_bias(b);
  Rng rng(43);
  Matrix<double> x(7, 8);
  fill_uniform(x, rng, 1.5);
  REQUIRE(routing_margin(moe, x) > 1e-6);

  for (st::DType dtype : {st::DType::F64, st::DType::BF16}) {
    const std::string stem = std::string("apex_moe_") + (dtype == st::DType::F64 ? "f64" : "bf16");
    INFO(stem);
    RowVector<double> bias;
    SaveOptions o;
    o.dtype = dtype;
    o.metadata = {{"format", "pt"}, {"apex.config", config_json(cfg).dump()}};
    o.shapes = {{"expert_bias", {std::uint64_t(cfg.n_experts)}}};  // a 1-D buffer in PyTorch
    save_checkpoint((dir / (stem + ".safetensors")).string(), moe_state(moe, bias), o);

    // The output PyTorch must reproduce is that of the weights as stored
    // (BF16 rounds them), so it is computed from a reloaded layer.
    MoEFFN<double> stored(cfg, std::uint64_t(1));
    RowVector<double> stored_bias;
    const LoadResult r = load_checkpoint((dir / (stem + ".safetensors")).string(), moe_state(stored, stored_bias));
    CHECK(r.loaded.size() == 1 + 3 * std::size_t(cfg.n_experts + cfg.n_shared) + 1);
    stored.balancer().set_bias(stored_bias);
    REQUIRE(routing_margin(stored, x) > 1e-6);
    const Matrix<double> y = stored.forward(x);
    if (dtype == st::DType::F64) CHECK(rel_error(y, moe.forward(x)) == 0.0);
    if (dtype == st::DType::BF16) CHECK(rel_error(y, moe.forward(x)) < 1e-2);
    st::save<double>((dir / (stem + "_io.safetensors")).string(), {{"x", {7, 8}, x.data()}, {"y", {7, 8}, y.data()}},
                     st::DType::F64, {{"format", "pt"}});
  }
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
