// Low-rank adapters on frozen MoE layers (adapters/lora_moe.hpp): every
// gradient (A, B, router, x) against central differences in double for each
// expert kind, tied and per-expert adapters and every target choice; the
// packed layer in every weight type against the float layer built from the
// same (dequantized) weights; the same bits on every kernel path and thread
// count; bad options.
#include <apex/ffn/adapters.hpp>
#include <apex/ffn/inference.hpp>
#include <apex/ffn/io/optimizer_state.hpp>
#include <apex/ffn/moe/gpt_oss.hpp>

#include <catch2/catch.hpp>

#include <limits>
#include <string>
#include <vector>

#include "fixtures.hpp"
#include "gradcheck.hpp"
#include "packed_layers.hpp"
#include "temp_dir.hpp"

using namespace apex;
using apex::test::check_params;
using apex::test::check_values;
using apex::test::dot_all;
using apex::test::random_matrix;
using apex::test::topk_margin;

namespace {

/// B of every adapter drawn (B starts at 0, which would leave ∂L/∂A = 0 untested).
template <class Layer>
void randomise_b(Layer& layer, std::uint64_t seed) {
  for (auto& p : layer.param_values())
    if (p.name.find("lora_B") != std::string::npos)
      p.value() = random_matrix(p.rows, p.cols, seed++, 0.5).template cast<typename Layer::Scalar>();
}

/// κ experts whose κ varies per token and unit (α, b away from 0).
template <class T>
void perturb(MoEFFN<T, KappaSwiGLU<T>>& moe, std::uint64_t seed) {
  for (std::size_t e = 0; e < moe.experts().size(); ++e) {
    auto& x = moe.experts()[e];
    x.kappa_alpha() = test::rnd<T>(1, x.d_ffn(), seed + 2 * e, 2.0);
    x.kappa_bias() = test::rnd<T>(1, x.d_ffn(), seed + 2 * e + 1, 1.0);
    KappaOptions o = x.options();
    o.rho = 1.0;  // the full ∂L/∂ℓ (the default 0.1 scales it on purpose), so differences in x check it
    x.set_options(o);
  }
}
/// Clamped experts with biases (the clamps themselves are tested in test_gpt_oss.cpp).
template <class T>
void perturb(MoEFFN<T, ClampedSwiGLU<T>>& moe, std::uint64_t seed) {
  for (std::size_t e = 0; e < moe.experts().size(); ++e) {
    auto& x = moe.experts()[e];
    x.b_gate() = test::rnd<T>(1, x.d_ffn(), seed + 3 * e, 0.3);
    x.b_up() = test::rnd<T>(1, x.d_ffn(), seed + 3 * e + 1, 0.3);
    x.b_down() = test::rnd<T>(1, x.d_model(), seed + 3 * e + 2, 0.3);
  }
}
template <class T>
void perturb(MoEFFN<T, SwiGLU<T>>&, std::uint64_t) {}

template <class Expert>
MoEConfig kind_config(Index e, Index k, Index shared, Index d, Index f) {
  MoEConfig c = test::moe_config(e, k, shared, d, f);
  if constexpr (std::is_same_v<Expert, ClampedSwiGLU<double>> || std::is_same_v<Expert, ClampedSwiGLU<float>>)
    c.router_bias = true;
  else c.shared_expert_gate = shared > 0;
  return c;
}

/// Central differences on every trainable tensor and on x, L = Σ y ⊙ R.
template <class Expert>
void check_lora_gradients(const LoraOptions& o, Index n, std::uint64_t seed) {
  const MoEConfig cfg = kind_config<Expert>(4, 2, 1, 6, 5);
  MoEFFN<double, Expert> base(cfg, seed);
  perturb(base, seed + 100);
  const Matrix<double> x0 = random_matrix(n, cfg.d_model, seed + 1);
  REQUIRE(topk_margin(base, x0) > 1e-3);
  LoraMoE<MoEFFN<double, Expert>> layer(std::move(base), o, Rng(seed + 2));
  randomise_b(layer, seed + 3);
  const Matrix<double> r = random_matrix(n, cfg.d_model, seed + 4);
  Matrix<double> x = x0;
  const auto loss = [&] { return dot_all(layer.forward(x), r); };
  typename decltype(layer)::Cache cache;
  layer.zero_grad();
  layer.forward(x, &cache);
  const Matrix<double> dx = layer.backward(r, cache);
  const auto grads = check_params(layer.params(), loss);
  APEX_CHECK_GRADS(grads, 1e-6);
  CHECK(grads.size() == layer.params().size());
  const auto gx = check_values("x", x.data(), dx.data(), x.size(), loss);
  INFO("dx rel " << gx.rel_error);
  CHECK(gx.rel_error <= 1e-6);
}

LoraOptions lora(Index rank, bool per_expert = true, bool router = true) {
  LoraOptions o;
  o.rank = rank;
  o.alpha = 3.0;
  o.per_expert = per_expert;
  o.train_router = router;
  return o;
}

}  // namespace

TEMPLATE_TEST_CASE("LoRA on frozen MoE layers: every gradient against central differences", "[lora][gradcheck]",
                   SwiGLU<double>, KappaSwiGLU<double>, ClampedSwiGLU<double>) {
  for (Index n : {Index(0), Index(1), Index(5)}) {
    SECTION("fused gate/up and down, per expert, N = " + std::to_string(n)) {
      check_lora_gradients<TestType>(lora(2), n, 11);
    }
    SECTION("separate gate, up, down, N = " + std::to_string(n)) {
      LoraOptions o = lora(3);
      o.targets = {true, true, false, true};
      o.rslora = true;
      check_lora_gradients<TestType>(o, n, 21);
    }
    SECTION("one adapter tied across the routed experts, N = " + std::to_string(n)) {
      check_lora_gradients<TestType>(lora(2, false), n, 31);
    }
  }
  SECTION("fused gate/up on the routed experts, the shared experts' gate and up apart (shared_targets)") {
    LoraOptions o = lora(2);
    o.shared_targets = LoraTargets{true, true, false, true};
    check_lora_gradients<TestType>(o, 5, 51);
  }
  SECTION("down only, router frozen, no shared adapters") {
    LoraOptions o = lora(1, true, false);
    o.targets = {false, false, false, true};
    o.shared_experts = false;
    check_lora_gradients<TestType>(o, 4, 41);
  }
}

TEST_CASE("a fresh LoRA layer computes what its frozen base computes", "[lora]") {
  const MoEConfig cfg = test::moe_config(4, 2, 1, 6, 5);
  MoEFFN<double> base(cfg, 5);
  const Matrix<double> x = random_matrix(7, 6, 6);
  const Matrix<double> y0 = base.forward(x);
  LoraMoE<MoEFFN<double>> layer(std::move(base), lora(2), Rng(7));
  CHECK((layer.forward(x) - y0).norm() <= 1e-14 * y0.norm());
  CHECK(layer.params().size() == 4 * 4 + 4 + 1);  // 4 experts × 2 slots × (A, B); shared 2 slots; router
}

namespace {

/// `trained` with every routed and shared expert weight replaced by the
/// values `packed` holds (bf16-rounded, or a block format's dequantized values).
template <class Expert>
MoEFFN<float, Expert> dequantized(MoEFFN<float, Expert> trained, const PackedMoE<float, Expert>& packed) {
  for (std::size_t e = 0; e < trained.experts().size(); ++e) {
    auto& w = ExpertKind<Expert>::weights(trained.experts()[e]);
    w.w_gate() = packed.experts()[e].w_gate();
    w.w_up() = packed.experts()[e].w_up();
    w.w_down() = packed.experts()[e].w_down();
  }
  for (std::size_t s = 0; s < trained.shared_experts().size(); ++s) {
    auto& w = trained.shared_experts()[s];
    w.w_gate() = packed.shared_experts()[s].w_gate();
    w.w_up() = packed.shared_experts()[s].w_up();
    w.w_down() = packed.shared_experts()[s].w_down();
  }
  return trained;
}

/// Output, ∂L/∂x and every gradient of one step of `layer` on x with ∂L/∂y = dy.
struct Step {
  Matrix<float> y, dx;
  std::vector<Matrix<float>> grads;
};
template <class Layer>
Step run_step(Layer& layer, const Matrix<float>& x, const Matrix<float>& dy) {
  typename Layer::Cache cache;
  Step s;
  layer.zero_grad();
  s.y = layer.forward(x, &cache);
  s.dx = layer.backward(dy, cache);
  for (const auto& p : layer.params()) s.grads.push_back(p.grad());
  return s;
}

bool same_step(const Step& a, const Step& b) {
  if (!test::bitwise_equal(a.y, b.y) || !test::bitwise_equal(a.dx, b.dx) || a.grads.size() != b.grads.size())
    return false;
  for (std::size_t i = 0; i < a.grads.size(); ++i)
    if (!test::bitwise_equal(a.grads[i], b.grads[i])) return false;
  return true;
}

struct TypeCase {
  packed::Dtype type;
  Index d, f;
};
/// Every weight type at widths it holds: odd ones for the unblocked types.
const TypeCase kTypeCases[] = {{packed::Dtype::f32, 37, 53},  {packed::Dtype::bf16, 37, 53},
                               {packed::Dtype::f16, 37, 53},  {packed::Dtype::q8_0, 64, 96},
                               {packed::Dtype::q4_0, 64, 96}, {packed::Dtype::mxfp4, 64, 96},
                               {packed::Dtype::q4_k, 256, 256}, {packed::Dtype::q6_k, 256, 256}};

template <class Expert>
void check_packed_against_float(const TypeCase& tc, Index n, std::uint64_t seed) {
  const MoEConfig cfg = kind_config<Expert>(5, 2, 1, tc.d, tc.f);
  MoEFFN<float, Expert> trained(cfg, seed);
  perturb(trained, seed + 7);
  auto packed = PackedMoE<float, Expert>::from(trained, tc.type);
  MoEFFN<float, Expert> dense = dequantized(trained, packed);
  LoraOptions o = lora(4);
  LoraMoE<MoEFFN<float, Expert>> ref(std::move(dense), o, Rng(seed + 1));
  LoraMoE<PackedMoE<float, Expert>> lay(std::move(packed), o, Rng(seed + 1));
  randomise_b(ref, seed + 2);
  randomise_b(lay, seed + 2);
  const Matrix<float> x = test::rnd<float>(n, tc.d, seed + 3), dy = test::rnd<float>(n, tc.d, seed + 4);
  const Step a = run_step(ref, x, dy), b = run_step(lay, x, dy);
  INFO(packed::dtype_name(tc.type) << ", d " << tc.d << ", f " << tc.f << ", N " << n);
  CHECK(test::rel(b.y, a.y) <= 1e-5);
  CHECK(test::rel(b.dx, a.dx) <= 1e-5);
  REQUIRE(a.grads.size() == b.grads.size());
  const auto names = lay.param_values();
  for (std::size_t i = 0; i < a.grads.size(); ++i) {
    INFO(names[i].name);
    CHECK(test::rel(b.grads[i], a.grads[i]) <= 1e-5);
  }
}

}  // namespace

TEMPLATE_TEST_CASE("LoRA on packed experts equals LoRA on the float layer of the same weights", "[lora][packed]",
                   SwiGLU<float>, KappaSwiGLU<float>, ClampedSwiGLU<float>) {
  for (const TypeCase& tc : kTypeCases)
    for (Index n : {Index(1), Index(40)}) check_packed_against_float<TestType>(tc, n, 50 + Index(tc.type));
}

TEST_CASE("LoRA on packed experts: the same bits on every kernel path and thread count", "[lora][packed][threads]") {
  for (const TypeCase& tc : kTypeCases) {
    const MoEConfig cfg = kind_config<KappaSwiGLU<float>>(5, 2, 1, tc.d, tc.f);
    MoEFFN<float, KappaSwiGLU<float>> trained(cfg, 60);
    perturb(trained, 61);
    LoraMoE<PackedMoE<float, KappaSwiGLU<float>>> lay(PackedMoE<float, KappaSwiGLU<float>>::from(trained, tc.type),
                                                       lora(3), Rng(62));
    randomise_b(lay, 63);
    for (Index n : {Index(3), Index(70)}) {
      const Matrix<float> x = test::rnd<float>(n, tc.d, 64 + n), dy = test::rnd<float>(n, tc.d, 65 + n);
      lay.set_isa(packed::Isa::scalar);
      lay.set_threads(1);
      const Step ref = run_step(lay, x, dy);
      for (packed::Isa isa : packed::kAllIsas) {
        if (!packed::cpu_supports(isa)) {
          WARN("path " << packed::isa_name(isa) << " skipped: this CPU lacks it");
          continue;
        }
        for (int threads : {1, 2}) {
          INFO(packed::dtype_name(tc.type) << ", path " << packed::isa_name(isa) << ", threads " << threads << ", N "
                                           << n);
          lay.set_isa(isa);
          lay.set_threads(threads);
          CHECK(same_step(run_step(lay, x, dy), ref));
        }
      }
    }
  }
}

TEST_CASE("LoRA on a dense SwiGLU: gradients against central differences, packed against float", "[lora][dense]") {
  SECTION("double, every gradient and dx") {
    for (Index n : {Index(0), Index(1), Index(6)}) {
      LoraOptions o = lora(2);
      o.targets = {true, false, false, true};  // gate and down
      LoraSwiGLU<SwiGLU<double>> layer(SwiGLU<double>(7, 5, 70), o, Rng(71));
      randomise_b(layer, 72);
      Matrix<double> x = random_matrix(n, 7, 73);
      const Matrix<double> r = random_matrix(n, 7, 74);
      const auto loss = [&] { return dot_all(layer.forward(x), r); };
      LoraSwiGLU<SwiGLU<double>>::Cache cache;
      layer.zero_grad();
      layer.forward(x, &cache);
      const Matrix<double> dx = layer.backward(r, cache);
      APEX_CHECK_GRADS(check_params(layer.params(), loss), 1e-6);
      CHECK(check_values("x", x.data(), dx.data(), x.size(), loss).rel_error <= 1e-6);
    }
  }
  SECTION("packed in every type equals the float layer of the same weights") {
    for (const TypeCase& tc : kTypeCases) {
      const SwiGLU<float> trained(tc.d, tc.f, 75);
      auto packed = PackedSwiGLU<float>::from(trained, tc.type);
      SwiGLU<float> dense = trained;
      dense.w_gate() = packed.weights().w_gate();
      dense.w_up() = packed.weights().w_up();
      dense.w_down() = packed.weights().w_down();
      LoraSwiGLU<SwiGLU<float>> ref(std::move(dense), lora(4), Rng(76));
      LoraSwiGLU<PackedSwiGLU<float>> lay(std::move(packed), lora(4), Rng(76));
      randomise_b(ref, 77);
      randomise_b(lay, 77);
      const Matrix<float> x = test::rnd<float>(45, tc.d, 78), dy = test::rnd<float>(45, tc.d, 79);
      const Step a = run_step(ref, x, dy), b = run_step(lay, x, dy);
      INFO(packed::dtype_name(tc.type));
      CHECK(test::rel(b.y, a.y) <= 1e-5);
      CHECK(test::rel(b.dx, a.dx) <= 1e-5);
      for (std::size_t i = 0; i < a.grads.size(); ++i) CHECK(test::rel(b.grads[i], a.grads[i]) <= 1e-5);
    }
  }
}

TEMPLATE_TEST_CASE("merged adapters: the float layer W + sBA and its re-quantized copy", "[lora][merge]",
                   SwiGLU<float>, KappaSwiGLU<float>, ClampedSwiGLU<float>) {
  const MoEConfig cfg = kind_config<TestType>(4, 2, 1, 64, 96);
  MoEFFN<float, TestType> trained(cfg, 80);
  perturb(trained, 81);
  LoraOptions o = lora(4);
  o.targets = {true, true, false, true};
  LoraMoE<PackedMoE<float, TestType>> lay(PackedMoE<float, TestType>::from(trained, packed::Dtype::q8_0), o, Rng(82));
  randomise_b(lay, 83);
  lay.router().weight() *= 1.5f;  // as if the router had trained
  const Matrix<float> x = test::rnd<float>(30, 64, 84);
  const Matrix<float> y = lay.forward(x);
  const auto merged = merged_float(lay);
  CHECK(test::rel(merged.forward(x), y) <= 1e-5);
  const auto f32 = merged_packed<float>(lay, packed::Dtype::f32);
  CHECK(test::rel(f32.forward(x), y) <= 1e-5);
  const auto bf = merged_packed<packed::bf16>(lay);
  CHECK(test::rel(bf.forward(x), y) <= 1e-2);  // bf16's rounding of W + sBA
  CHECK(test::rel(bf.forward(x), y) > 0);
}

TEST_CASE("merged dense adapters: SwiGLU with W + sBA and its re-packed copy", "[lora][merge][dense]") {
  const SwiGLU<float> trained(64, 96, 85);
  LoraOptions o = lora(4);
  o.targets = {true, true, false, true};
  LoraSwiGLU<PackedSwiGLU<float>> lay(PackedSwiGLU<float>::from(trained, packed::Dtype::q4_0), o, Rng(86));
  randomise_b(lay, 87);
  const Matrix<float> x = test::rnd<float>(20, 64, 88);
  const Matrix<float> y = lay.forward(x);
  CHECK(test::rel(merged_float(lay).forward(x), y) <= 1e-5);
  CHECK(test::rel(merged_packed<float>(lay, packed::Dtype::f32).forward(x), y) <= 1e-5);
}

TEST_CASE("LoRA options and adapters that do not fit are refused", "[lora][errors]") {
  const MoEConfig cfg = test::moe_config(4, 2, 1, 6, 5);
  const auto make = [&](const LoraOptions& o) { LoraMoE<MoEFFN<float>> l(MoEFFN<float>(cfg, 1), o, Rng(2)); };
  LoraOptions o = lora(2);
  o.rank = 0;
  CHECK_THROWS_CONTAINING(make(o), ConfigError, "rank must be >= 1, got 0");
  o.rank = 6;
  CHECK_THROWS_CONTAINING(make(o), ConfigError, "rank 6 exceeds min(in, out) = 5");
  o = lora(2);
  o.targets = {true, false, true, false};
  CHECK_THROWS_CONTAINING(make(o), ConfigError, "targets.gate_up adapts gate and up together");
  o.targets = {false, false, false, false};
  CHECK_THROWS_CONTAINING(make(o), ConfigError, "no projection is targeted");
  o = lora(2);
  o.alpha = std::nan("");
  CHECK_THROWS_CONTAINING(make(o), ConfigError, "alpha must be finite and > 0");
  o.alpha = 1e39;
  CHECK_THROWS_CONTAINING(make(o), ConfigError, "alpha");
  o.alpha = -1;
  CHECK_THROWS_CONTAINING(make(o), ConfigError, "alpha must be finite and > 0");
  MoEConfig wide_shared = cfg;
  wide_shared.d_shared_ffn = 2;  // the shared experts are narrower than the rank
  o = lora(3);
  CHECK_THROWS_CONTAINING(LoraMoE<MoEFFN<float>>(MoEFFN<float>(wide_shared, 1), o, Rng(2)), ConfigError,
                          "shared experts");
  o.shared_experts = false;
  CHECK_NOTHROW(LoraMoE<MoEFFN<float>>(MoEFFN<float>(wide_shared, 1), o, Rng(2)));
  LoraMoE<MoEFFN<float>> ok(MoEFFN<float>(cfg, 1), lora(2), Rng(2));
  CHECK_THROWS_AS(ok.forward(Matrix<float>(3, 7)), ShapeError);
  LoraMoE<MoEFFN<float>>::Cache empty;
  CHECK_THROWS_AS(ok.backward(Matrix<float>(3, 6), empty), ShapeError);
}

namespace {

/// A copy of the state file `from` at `to`, metadata `key` set to `value`.
void lora_state_edited(const std::string& from, const std::string& to, const std::string& key,
                       const std::string& value) {
  const safetensors::Reader saved(from);
  std::vector<std::vector<double>> values;
  std::vector<safetensors::TensorRef<double>> refs;
  for (const auto& t : saved.tensors()) {
    values.emplace_back(std::size_t(t.numel()));
    saved.read(t, values.back().data());
    refs.push_back({t.name, t.shape, values.back().data()});
  }
  safetensors::Metadata meta = saved.metadata();
  meta[key] = value;
  safetensors::save(to, refs, safetensors::DType::F64, meta);
}

}  // namespace

TEST_CASE("LoRA training resumed from a state file whose step count cannot grow: refused, nothing changed",
          "[lora][errors][regression]") {
  // AdamW::step (optim/adamw.hpp) counted ++t without a bound, and a state
  // file (io/optimizer_state.hpp) may say any step >= 0: one saying
  // 9223372036854775807 loaded, and the next step overflowed a signed long
  // (undefined behaviour; in practice a negative t, whose β^t corrections
  // blow the update up). Fixed: the step refuses, before anything changes.
  const MoEConfig cfg = test::moe_config(4, 2, 1, 6, 5);
  LoraMoE<MoEFFN<double>> layer(MoEFFN<double>(cfg, 1), lora(2), Rng(2));
  randomise_b(layer, 3);
  layer.zero_grad();
  AdamW<double> adamw(layer.params());
  adamw.step(1e-3);
  test::TempDir dir;
  save_optimizer_state(dir / "adamw.safetensors", adamw);
  // the same file, its step at the largest a long holds
  lora_state_edited(dir / "adamw.safetensors", dir / "last.safetensors", "step",
                    std::to_string(std::numeric_limits<long>::max()));
  AdamW<double> resumed(layer.params());
  load_optimizer_state(dir / "last.safetensors", resumed);
  REQUIRE(resumed.steps() == std::numeric_limits<long>::max());
  std::vector<Matrix<double>> before;
  for (const auto& p : layer.param_values()) before.push_back(p.value());
  CHECK_THROWS_CONTAINING(resumed.step(1e-3), ValueError, "AdamW::step: the step count");
  CHECK(resumed.steps() == std::numeric_limits<long>::max());
  std::size_t i = 0;
  for (const auto& p : layer.param_values()) CHECK(p.value() == before[i++]);
  CHECK(resumed.exp_avg(0) == adamw.exp_avg(0));
}

TEST_CASE("LoRA optimizer state: a no_decay list with more after a NUL byte is refused, nothing changed",
          "[lora][errors][regression]") {
  // load_optimizer_state (io/optimizer_state.hpp) parsed the metadata
  // 'no_decay' with nlohmann/json, which ends its input at a NUL byte: the
  // list before one was read and whatever followed it ignored. Fixed: a
  // NUL (never in JSON text) makes the list malformed, a FormatError.
  const MoEConfig cfg = test::moe_config(4, 2, 1, 6, 5);
  LoraMoE<MoEFFN<double>> layer(MoEFFN<double>(cfg, 1), lora(2), Rng(2));
  layer.zero_grad();
  AdamW<double> adamw(layer.params());
  adamw.step(1e-3);
  test::TempDir dir;
  save_optimizer_state(dir / "adamw.safetensors", adamw);
  const std::string no_decay = safetensors::Reader(dir / "adamw.safetensors").metadata().at("no_decay");
  lora_state_edited(dir / "adamw.safetensors", dir / "nul.safetensors", "no_decay",
                    no_decay + std::string(1, '\0') + "[\"experts.0.w_gate_up.lora_A.weight\"]");
  AdamW<double> resumed(layer.params());
  CHECK_THROWS_CONTAINING(load_optimizer_state(dir / "nul.safetensors", resumed), FormatError,
                          "metadata 'no_decay': not valid JSON: a NUL byte at offset " + std::to_string(no_decay.size()));
  CHECK(resumed.steps() == 0);
  CHECK(resumed.exp_avg(0).isZero());
}
