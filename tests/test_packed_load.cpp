// Packed layers loaded from the checkpoints the training layers save
// (inference/files/checkpoint/load.hpp): F32 and BF16 files give the layer that packing
// the float layer gives; bad files are typed errors naming the tensor; and a
// rejected packed load changes nothing and costs little: load_packed_moe
// (SwiGLU and κ experts), load_packed_swiglu and load_packed_sublayer, fed a
// file with a missing, misshapen, mistyped or unexpected tensor, a non-finite
// router weight or bias, or options the layer rejects, throw the typed error
// before any expert is read and packed, and a layer the caller assigns the
// result to keeps its weights.
#include <catch2/catch.hpp>

#include <apex/ffn/io/checkpoint.hpp>
#include <apex/ffn/inference.hpp>
#include <apex/ffn/inference/files/checkpoint/load.hpp>
#include <apex/ffn/layers/kappa_swiglu.hpp>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "bits.hpp"
#include "fixtures.hpp"
#include "fuzz/fuzz_packed.hpp"
#include "fuzz/replay.hpp"
#include "packed_layers.hpp"
#include "sweep.hpp"
#include "tensor_files.hpp"

using namespace apex;
using apex::packed::bf16;
using apex::test::bitwise_equal;
using apex::test::full_config;
using apex::test::odd_config;
using apex::test::perturb_kappa;
using apex::test::reader;
using apex::test::rel;
using apex::test::set_bias;
using Catch::Matchers::Message;

namespace {

/// `params` (and `bias` as `expert_bias`, if given) as the tensors of a file.
std::vector<test::TensorData> tensors_of(const ParamList<float>& params, const RowVector<float>* bias = nullptr) {
  ParamList<float> state = params;
  RowVector<float> b = bias ? *bias : RowVector<float>();
  if (bias) state.push_back({"expert_bias", b.data(), nullptr, 1, b.cols()});
  safetensors::VectorSink sink;
  write_checkpoint(sink, state);
  return test::read_tensors(safetensors::Reader::from_memory(sink.bytes.data(), sink.bytes.size()));
}

/// One way to spoil a file, and the error its load must give.
struct Spoil {
  std::string what;
  std::vector<test::TensorData> tensors;
  std::string type;
  std::vector<std::string> names;
};

/// The spoils every loader shares: `weight` (a name of the file) missing,
/// transposed, of dtype I64; an unexpected tensor; and, for each of
/// `finite` (tensors the loader checks), a NaN and an Inf in it.
std::vector<Spoil> spoils(const std::vector<test::TensorData>& ts, const std::string& weight,
                          const std::vector<std::string>& finite) {
  std::vector<Spoil> out;
  out.push_back({weight + " missing", test::without(ts, weight), "FormatError", {"missing", weight}});
  auto t = ts;
  auto* w = test::find_tensor(t, weight);
  std::swap(w->shape[0], w->shape[1]);
  out.push_back({weight + " transposed", t, "ShapeError", {weight}});
  t = ts;
  test::find_tensor(t, weight)->dtype = "I64";
  out.push_back({weight + " of dtype I64", t, "FormatError", {weight, "I64"}});
  t = ts;
  t.push_back({"extra.weight", {2}, {1.0, 2.0}});
  out.push_back({"an unexpected tensor", t, "FormatError", {"unexpected", "extra.weight"}});
  for (const std::string& name : finite)
    for (double v : {test::kNaN, test::kInf}) {
      t = ts;
      test::find_tensor(t, name)->values.back() = v;
      out.push_back({name + " holding " + std::to_string(v), t, "ValueError", {name, "NaN or Inf"}});
    }
  return out;
}

/// For each spoil: `load(reader)` assigned over `dst` (a layer loaded from
/// the good file) throws the spoil's error, reads no expert's tensors, and
/// leaves `dst`'s output bitwise as it was.
template <class Layer, class Load>
void check_rejections(const char* loader, const std::vector<Spoil>& cases, Layer& dst, const Load& load) {
  const Matrix<float> x = test::rnd<float>(7, dst.d_model(), 9, 2.0);
  const Matrix<float> before = dst.forward(x);
  for (const Spoil& s : cases) {
    INFO(loader << ": " << s.what);
    const std::vector<unsigned char> bytes = test::write_tensors(s.tensors);
    const auto log = std::make_shared<test::LoggingSource::Log>();
    const safetensors::Reader r = test::logged_reader(bytes, log);
    test::expect(test::outcome([&] { dst = load(r); }), s.type, s.names);
    for (const std::string& name : test::tensors_read(r, *log)) {
      INFO("read " << name);
      CHECK(name.find("experts") == std::string::npos);
      CHECK(name.find("w_") == std::string::npos);
    }
    CHECK(test::same_bits(dst.forward(x), before));
  }
}

MoEConfig gated_config() {
  MoEConfig c = test::moe_config(4, 2, 1, 8, 6);
  c.d_shared_ffn = 5;
  c.shared_expert_gate = true;
  return c;
}


/// The layer's parameters plus its bias as `expert_bias`, serialised.
template <class Expert>
std::vector<unsigned char> save(MoEFFN<float, Expert>& moe, safetensors::DType dtype, const std::string& prefix = "") {
  RowVector<float> bias = moe.balancer().bias();
  ParamList<float> state;
  detail::append_prefixed(state, prefix, moe.param_values());
  state.push_back({prefix + "expert_bias", bias.data(), nullptr, 1, bias.cols()});
  SaveOptions o;
  o.dtype = dtype;
  safetensors::VectorSink sink;
  write_checkpoint(sink, state, o);
  return sink.bytes;
}

/// A safetensors buffer holding one tensor per (name, dtype, shape), zeros.
std::vector<unsigned char> raw_file(const std::vector<std::tuple<std::string, std::string, std::vector<int>>>& ts) {
  std::string json = "{";
  std::size_t off = 0;
  for (const auto& [name, dtype, shape] : ts) {
    std::size_t n = dtype == "F32" ? 4 : 2;
    std::string s;
    for (int v : shape) {
      n *= std::size_t(v);
      s += (s.empty() ? "" : ",") + std::to_string(v);
    }
    json += (json.size() > 1 ? "," : "") + std::string("\"") + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":[" + s +
            "],\"data_offsets\":[" + std::to_string(off) + "," + std::to_string(off + n) + "]}";
    off += n;
  }
  json += "}";
  while (json.size() % 8) json += ' ';
  // Sized once and filled: GCC 12 at -O3 reports a false -Warray-bounds on
  // inserting after an 8-byte vector.
  std::vector<unsigned char> out(8 + json.size() + off, 0);
  for (int i = 0; i < 8; ++i) out[std::size_t(i)] = (unsigned char)((json.size() >> (8 * i)) & 0xFF);
  std::copy(json.begin(), json.end(), out.begin() + 8);
  return out;
}

/// The float layer of `cfg` loaded from a file written by `save` (bias included).
MoEFFN<float> load_float(const std::vector<unsigned char>& bytes, const MoEConfig& cfg) {
  MoEFFN<float> back(cfg, 0);
  RowVector<float> bias(1, cfg.n_experts);
  ParamList<float> state = back.param_values();
  state.push_back({"expert_bias", bias.data(), nullptr, 1, bias.cols()});
  load_checkpoint(reader(bytes), state);
  back.balancer().set_bias(bias);
  return back;
}

}  // namespace

TEST_CASE("a rejected packed MoE load leaves the layer as it was, before packing", "[inference][checkpoint][sweeps]") {
  const MoEConfig cfg = gated_config();
  MoEFFN<float> moe(cfg, 5);
  moe.balancer().set_bias(test::rnd<float>(1, cfg.n_experts, 6, 0.3));
  const auto ts = tensors_of(moe.param_values(), &moe.balancer().bias());
  const auto load = [&](const safetensors::Reader& r) { return load_packed_moe<bf16>(r, cfg); };
  const std::vector<unsigned char> good = test::write_tensors(ts);
  auto dst = load(safetensors::Reader::from_memory(good.data(), good.size()));
  std::vector<Spoil> cases = spoils(ts, "experts.3.w_down.weight", {"router.weight", "expert_bias"});
  for (const Spoil& s : spoils(ts, "shared_expert_gate.weight", {})) cases.push_back(s);
  check_rejections("load_packed_moe", cases, dst, load);
}

TEST_CASE("a rejected packed kappa MoE load leaves the layer as it was, before packing",
          "[inference][checkpoint][sweeps][regression]") {
  // κ options the layer rejects (U < 1) were found by the PackedMoE
  // constructor only, after every expert had been read and packed.
  const MoEConfig cfg = gated_config();
  MoEFFN<float, KappaSwiGLU<float>> moe(cfg, 5);
  const auto ts = tensors_of(moe.param_values());
  PackedLoadOptions o;
  const auto load = [&](const safetensors::Reader& r) { return load_packed_moe<float, KappaSwiGLU<float>>(r, cfg, o); };
  const std::vector<unsigned char> good = test::write_tensors(ts);
  auto dst = load(safetensors::Reader::from_memory(good.data(), good.size()));
  check_rejections("load_packed_moe<kappa>", spoils(ts, "experts.0.kappa_alpha", {"router.weight"}), dst, load);
  for (double u : {0.5, test::kNaN, 1e39}) {
    INFO("kappa U = " << u);
    o.expert_options.of<KappaSwiGLU<float>>().U = u;
    const std::vector<Spoil> bad_options{{"kappa U " + std::to_string(u), ts, "ConfigError", {"load_packed_moe", "U"}}};
    check_rejections("load_packed_moe<kappa>", bad_options, dst, load);
  }
}

TEST_CASE("a rejected packed SwiGLU or sublayer load leaves the layer as it was", "[inference][checkpoint][sweeps]") {
  SwiGLU<float> mlp(8, 6, 3);
  const auto ts = tensors_of(mlp.param_values());
  const auto load = [](const safetensors::Reader& r) { return load_packed_swiglu<float>(r, 8, 6); };
  const std::vector<unsigned char> good = test::write_tensors(ts);
  auto dst = load(safetensors::Reader::from_memory(good.data(), good.size()));
  check_rejections("load_packed_swiglu", spoils(ts, "w_up.weight", {}), dst, load);

  const MoEConfig cfg = gated_config();
  const SkipGateConfig gate = test::gate_config(cfg.d_model, 4, 0.2);
  FFNSublayer<float, MoEFFN<float>> sub(cfg.d_model, MoEFFN<float>(cfg, 7), SkipGate<float>(gate, 8));
  const auto sts = tensors_of(sub.param_values());
  const auto load_sub = [&](const safetensors::Reader& r) { return load_packed_sublayer<float>(r, cfg, gate); };
  const std::vector<unsigned char> sgood = test::write_tensors(sts);
  auto sdst = load_sub(safetensors::Reader::from_memory(sgood.data(), sgood.size()));
  std::vector<Spoil> cases = spoils(sts, "ffn.experts.1.w_gate.weight", {"ffn.router.weight"});
  for (const Spoil& s : spoils(sts, "norm.weight", {})) cases.push_back(s);
  for (const Spoil& s : spoils(sts, "skip_gate.w1.weight", {})) cases.push_back(s);
  check_rejections("load_packed_sublayer", cases, sdst, load_sub);
}

TEST_CASE("packed MoE loads from F32 and BF16 checkpoints of the training layer", "[inference][checkpoint]") {
  const MoEConfig cfg = odd_config(1);
  MoEFFN<float> moe(cfg, 21);
  set_bias(moe, 8);
  const Matrix<float> x = test::rnd<float>(33, 37, 22);

  SECTION("F32: the same layer as packing the float layer") {
    const auto bytes = save(moe, safetensors::DType::F32, "layers.1.ffn.");
    PackedLoadOptions o;
    o.prefix = "layers.1.ffn.";
    const auto p = load_packed_moe<bf16>(reader(bytes), cfg, o);
    CHECK(bitwise_equal(p.forward(x), PackedMoE<bf16>::from(moe).forward(x)));
    CHECK_NOTHROW(p.check_source(moe));
  }
  SECTION("BF16: the float layer loaded from the same file, packed") {
    const auto bytes = save(moe, safetensors::DType::BF16);
    const MoEFFN<float> back = load_float(bytes, cfg);
    const auto pb = load_packed_moe<bf16>(reader(bytes), cfg);
    const auto pf = load_packed_moe<float>(reader(bytes), cfg);
    CHECK(bitwise_equal(pb.forward(x), PackedMoE<bf16>::from(back).forward(x)));
    CHECK(bitwise_equal(pf.forward(x), pb.forward(x)));  // bf16 values: float storage holds them exactly
    CHECK(rel(pf.forward(x), back.forward(x)) <= 1e-6);
  }
  SECTION("a gated shared expert of its own width, capacity on, F32 and BF16") {
    const MoEConfig gc = full_config(1, 43, Scoring::SoftmaxAll, 0.75);
    MoEFFN<float> g(gc, 27);
    set_bias(g, 28);
    for (const auto dtype : {safetensors::DType::F32, safetensors::DType::BF16}) {
      INFO(safetensors::dtype_name(dtype));
      const auto bytes = save(g, dtype);
      CHECK(reader(bytes).at("shared_expert_gate.weight").shape == std::vector<std::uint64_t>{1, 37});
      const MoEFFN<float> back = load_float(bytes, gc);
      const auto pf = load_packed_moe<float>(reader(bytes), gc);
      const auto pb = load_packed_moe<bf16>(reader(bytes), gc);
      PackedMoE<float>::Cache c1;
      MoEFFN<float>::Cache c0;
      CHECK(bitwise_equal(pf.forward(x, &c1), PackedMoE<float>::from(back).forward(x)));
      CHECK(bitwise_equal(pb.forward(x), PackedMoE<bf16>::from(back).forward(x)));
      CHECK(rel(pf.forward(x), back.forward(x, &c0)) <= 1e-6);
      CHECK(c1.dropped == c0.dropped);
      CHECK_FALSE(c0.dropped.empty());
      CHECK(bitwise_equal(pf.shared_gate_weight(), back.shared_gate_weight()));
      CHECK_NOTHROW(pf.check_source(back));
      CHECK_NOTHROW(pb.check_source(back));
    }
    CHECK_NOTHROW(load_packed_moe<float>(reader(save(g, safetensors::DType::F32)), gc).check_source(g));
    // The gate weight is in the fingerprint: a changed gate is a stale copy.
    const auto p = PackedMoE<bf16>::from(g);
    for (auto& q : g.params())
      if (q.name == "shared_expert_gate.weight") q.value_data[3] += 1.0f;
    CHECK_THROWS_AS(p.check_source(g), ValueError);
  }
  SECTION("kappa experts, file without the bias") {
    MoEFFN<float, KappaSwiGLU<float>> k(cfg, 23);
    perturb_kappa(k, 50);
    safetensors::VectorSink sink;
    write_checkpoint(sink, k.param_values());
    const auto p = load_packed_moe<float, KappaSwiGLU<float>>(reader(sink.bytes), cfg);
    CHECK(rel(p.forward(x), k.forward(x)) <= 1e-6);
    CHECK_NOTHROW(p.check_source(k));
  }
  SECTION("dense SwiGLU and a gated sublayer") {
    SwiGLU<float> mlp(37, 53, 24);
    safetensors::VectorSink s1;
    write_checkpoint(s1, mlp.param_values());
    CHECK(bitwise_equal(load_packed_swiglu<float>(reader(s1.bytes), 37, 53).forward(x),
                        PackedSwiGLU<float>::from(mlp).forward(x)));
    FFNSublayer<float, MoEFFN<float>> sub(37, MoEFFN<float>(cfg, 25), SkipGate<float>(test::gate_config(37, 8, 0.9), 4));
    safetensors::VectorSink s2;
    ParamList<float> state;
    detail::append_prefixed(state, "blk.", sub.param_values());
    write_checkpoint(s2, state);
    PackedLoadOptions o;
    o.prefix = "blk.";
    const auto p = load_packed_sublayer<float>(reader(s2.bytes), cfg, test::gate_config(37, 8, 0.9), o);
    FFNSublayer<float, MoEFFN<float>>::Cache c0;
    PackedSublayer<PackedMoE<float>>::Cache c1;
    const Matrix<float> xs = test::rnd<float>(40, 37, 26, 3.0);
    const Matrix<float> y0 = sub.forward(xs, SublayerMode::inference, &c0);
    CHECK(rel(p.forward(xs, &c1), y0) <= 1e-6);
    CHECK(c1.kept == c0.kept);
  }
}

TEST_CASE("packed loaders reject bad files with typed errors", "[inference][checkpoint][errors]") {
  const MoEConfig cfg = test::moe_config(2, 1, 0, 4, 6);
  MoEFFN<float> moe(cfg, 31);
  const auto good = save(moe, safetensors::DType::BF16);
  CHECK_NOTHROW(load_packed_moe<bf16>(reader(good), cfg));

  SECTION("unsupported dtype") {
    const auto f = raw_file({{"router.weight", "F16", {2, 4}},
                             {"experts.0.w_gate.weight", "F32", {6, 4}}, {"experts.0.w_up.weight", "F32", {6, 4}},
                             {"experts.0.w_down.weight", "F32", {4, 6}}, {"experts.1.w_gate.weight", "F32", {6, 4}},
                             {"experts.1.w_up.weight", "F32", {6, 4}}, {"experts.1.w_down.weight", "F32", {4, 6}}});
    CHECK_THROWS_MATCHES(load_packed_moe<bf16>(reader(f), cfg), FormatError,
                         Message("load_packed_moe(memory buffer): only F32, F64 and BF16 tensors load into packed "
                                 "layers: 'router.weight (F16)'"));
  }
  SECTION("shape mismatch") {
    CHECK_THROWS_CONTAINING(load_packed_moe<bf16>(reader(good), test::moe_config(2, 1, 0, 4, 8)), ShapeError, "'experts.0.w_gate.weight' is [6, 4] in the file, the layer needs [8, 4]");
  }
  SECTION("missing and unexpected names, strict by default") {
    CHECK_THROWS_CONTAINING(load_packed_moe<bf16>(reader(good), test::moe_config(3, 1, 0, 4, 6)), Error, "missing 'experts.2.w_gate.weight'");
    CHECK_THROWS_AS(load_packed_moe<bf16>(reader(good), test::moe_config(3, 1, 0, 4, 6)), FormatError);
    MoEFFN<float> bigger(test::moe_config(2, 1, 1, 4, 6), 32);
    const auto extra = save(bigger, safetensors::DType::F32);
    CHECK_THROWS_CONTAINING(load_packed_moe<float>(reader(extra), cfg), FormatError, "unexpected 'shared_experts.0.w_down.weight'");
    PackedLoadOptions o;
    o.allow_unexpected = true;
    CHECK_NOTHROW(load_packed_moe<float>(reader(extra), cfg, o));
  }
  SECTION("shared gate and shared width: missing tensor, wrong shapes, gate the layer has not") {
    MoEConfig gc = test::moe_config(2, 1, 1, 4, 6);
    gc.d_shared_ffn = 3;
    gc.shared_expert_gate = true;
    MoEFFN<float> g(gc, 33);
    const auto gated = save(g, safetensors::DType::BF16);
    CHECK_NOTHROW(load_packed_moe<bf16>(reader(gated), gc));
    MoEConfig ungated_cfg = gc;
    ungated_cfg.shared_expert_gate = false;
    MoEFFN<float> plain(ungated_cfg, 34);
    const auto ungated = save(plain, safetensors::DType::F32);
    CHECK_THROWS_MATCHES(load_packed_moe<float>(reader(ungated), gc), FormatError,
                         Message("load_packed_moe(memory buffer): the file does not match the layer: missing "
                                 "'shared_expert_gate.weight';"));
    CHECK_THROWS_CONTAINING(load_packed_moe<float>(reader(gated), ungated_cfg), FormatError,
                            "unexpected 'shared_expert_gate.weight'");
    MoEConfig wider = gc;
    wider.d_shared_ffn = 5;
    CHECK_THROWS_CONTAINING(load_packed_moe<bf16>(reader(gated), wider), ShapeError,
                            "'shared_experts.0.w_gate.weight' is [3, 4] in the file, the layer needs [5, 4]");
    std::vector<std::tuple<std::string, std::string, std::vector<int>>> ts{{"router.weight", "F32", {2, 4}}};
    for (const char* e : {"experts.0.", "experts.1."})
      for (const auto& [w, r, c] : {std::tuple<const char*, int, int>{"w_gate.weight", 6, 4}, {"w_up.weight", 6, 4},
                                    {"w_down.weight", 4, 6}})
        ts.push_back({std::string(e) + w, "BF16", {r, c}});
    for (const auto& [w, r, c] : {std::tuple<const char*, int, int>{"w_gate.weight", 3, 4}, {"w_up.weight", 3, 4},
                                  {"w_down.weight", 4, 3}})
      ts.push_back({std::string("shared_experts.0.") + w, "BF16", {r, c}});
    ts.push_back({"shared_expert_gate.weight", "F32", {4}});  // 1-D, as [1, 4]
    CHECK_NOTHROW(load_packed_moe<bf16>(reader(raw_file(ts)), gc));
    ts.back() = {"shared_expert_gate.weight", "F32", {1, 5}};
    CHECK_THROWS_CONTAINING(load_packed_moe<bf16>(reader(raw_file(ts)), gc), ShapeError,
                            "'shared_expert_gate.weight' is [1, 5] in the file, the layer needs [1, 4]");
  }
  SECTION("NaN or Inf where the float layer rejects them") {
    MoEFFN<float> bad = moe;
    bad.router().weight()(1, 2) = std::numeric_limits<float>::quiet_NaN();
    CHECK_THROWS_CONTAINING(load_packed_moe<bf16>(reader(save(bad, safetensors::DType::BF16)), cfg), ValueError, "tensor 'router.weight' contains NaN or Inf");
    MoEFFN<float> inf = moe;
    inf.router().weight()(0, 0) = std::numeric_limits<float>::infinity();
    CHECK_THROWS_AS(load_packed_moe<float>(reader(save(inf, safetensors::DType::F32)), cfg), ValueError);
    // The float layer rejects the same layer at its first forward.
    CHECK_THROWS_AS(bad.forward(test::rnd<float>(1, 4, 1)), ValueError);
    // Expert weights propagate NaN, as in the float layer.
    MoEFFN<float> nan_expert = moe;
    nan_expert.experts()[0].w_down()(0, 0) = std::numeric_limits<float>::quiet_NaN();
    CHECK_NOTHROW(load_packed_moe<bf16>(reader(save(nan_expert, safetensors::DType::BF16)), cfg));
  }
}

TEST_CASE("packed-layout fuzz corpus and regression inputs replay safely", "[inference][fuzz]") {
  // Each input of tests/fuzz/corpus_packed/ and regressions_packed/ through
  // the fuzz target's own body (fuzz_packed.hpp), in this process (a packed
  // forward opens OpenMP teams, which a forked child cannot): it opens
  // through both packed readers and runs a forward, or throws an
  // apex::Error. The seeds are valid files of one reader or the other.
  namespace fs = std::filesystem;
  const std::size_t files = fuzz::for_each_committed_input(
      fs::path(__FILE__).parent_path(), {"fuzz/corpus_packed", "fuzz/regressions_packed"},
      [](const fs::path& path, const std::string& bytes) {
        INFO(path.string());
        int accepted = 0;
        const auto* data = reinterpret_cast<const std::uint8_t*>(bytes.data());
        const std::string got = apex::test::outcome([&] { accepted = fuzz::exercise_packed(data, bytes.size()); });
        INFO(got);
        const bool typed = got.rfind("FormatError: ", 0) == 0 || got.rfind("ConfigError: ", 0) == 0 ||
                           got.rfind("ShapeError: ", 0) == 0 || got.rfind("ValueError: ", 0) == 0;
        CHECK((got == "returned" || typed));
        if (path.parent_path().filename() == "corpus_packed") CHECK((got == "returned" && accepted == 1));
      });
  CHECK(files >= 6);
}
