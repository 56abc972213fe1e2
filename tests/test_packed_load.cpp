// A rejected packed load (inference/packed_load.hpp) changes nothing and
// costs little: load_packed_moe (SwiGLU and κ experts), load_packed_swiglu
// and load_packed_sublayer, fed a file with a missing, misshapen, mistyped or
// unexpected tensor, a non-finite router weight or bias, or options the layer
// rejects, throw the typed error before any expert is read and packed, and a
// layer the caller assigns the result to keeps its weights.
#include <catch2/catch.hpp>

#include <apex/ffn/io/checkpoint.hpp>
#include <apex/ffn/inference.hpp>
#include <apex/ffn/inference/packed_load.hpp>
#include <apex/ffn/layers/kappa_swiglu.hpp>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bits.hpp"
#include "fixtures.hpp"
#include "sweep.hpp"
#include "tensor_files.hpp"

using namespace apex;
using apex::packed::bf16;

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
    o.kappa.U = u;
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
