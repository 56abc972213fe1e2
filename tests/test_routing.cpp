// Routing options of the open MoE families (docs/routing.md): scorings,
// group-limited selection, renormalisation and routed scale against worked
// examples, gradients by finite differences for every combination, the
// default path unchanged, shared experts of another width, and the
// RoutingConfig error sweep.
#include <apex/ffn/moe/families.hpp>
#include <apex/ffn/inference.hpp>
#include <apex/ffn/layers/kappa_swiglu.hpp>
#include <apex/ffn/moe/moe_ffn.hpp>
#include <apex/ffn/io/name_maps.hpp>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <limits>

#include <unistd.h>

#include "families.hpp"
#include "gradcheck.hpp"
#include "sweep.hpp"

using namespace apex;
using apex::test::check_params;
using apex::test::check_values;
using apex::test::dot_all;
using apex::test::random_matrix;
using Catch::Matchers::WithinAbs;

namespace {

namespace fs = std::filesystem;
namespace st = apex::safetensors;

using apex::test::fixture_config;
using apex::test::kFamilies;
using apex::test::read_tensor;

double rel_error(const Matrix<double>& a, const Matrix<double>& b) {
  const double scale = std::max(a.norm(), b.norm());
  return scale > 0 ? (a - b).norm() / scale : 0.0;
}

MoEConfig routed_config(Index e, Index k, Index shared, const RoutingConfig& routing) {
  MoEConfig cfg;
  cfg.d_model = 6;
  cfg.d_ffn = 5;
  cfg.n_experts = e;
  cfg.n_active = k;
  cfg.n_shared = shared;
  cfg.routing = routing;
  return cfg;
}

}  // namespace

TEST_CASE("default RoutingConfig is APEX-1's router", "[routing]") {
  MoEConfig cfg = routed_config(8, 3, 1, RoutingConfig{});
  MoEFFN<double> moe(cfg, 3);
  moe.balancer().set_bias(random_matrix(1, 8, 4, 0.2));
  const Matrix<double> x = random_matrix(9, 6, 5);
  Routing<double> r;
  moe.router().route(x, moe.balancer().bias(), false, r);
  CHECK(r.scores.size() == 0);
  // The same softmax over the selected biased logits, written out.
  for (Index t = 0; t < x.rows(); ++t) {
    Eigen::Array<double, 1, Eigen::Dynamic> v(3);
    for (Index k = 0; k < 3; ++k) v(k) = r.logits(t, r.experts(t, k)) + moe.balancer().bias()(r.experts(t, k));
    v = (v - v.maxCoeff()).exp();
    v /= v.sum();
    for (Index k = 0; k < 3; ++k) CHECK_THAT(r.weights(t, k), WithinAbs(v(k), 1e-15));
  }
}

TEST_CASE("sigmoid scoring with group-limited selection, worked example (docs/routing.md)", "[routing]") {
  // E = 8 in G = 4 groups of 2, keep 2 groups, K = 2, renormalised, c = 2.5.
  RoutingConfig rc;
  rc.scoring = Scoring::Sigmoid;
  rc.n_groups = 4;
  rc.topk_group = 2;
  rc.routed_scale = 2.5;
  Rng rng(1);
  Router<double> router(2, 8, 2, rng);
  router.set_routing(rc);
  // ℓ = x·Wᵀ with x = (1, 0): the logits are W's first column.
  router.weight().setZero();
  const double l[8] = {2.0, -3.0, 0.5, 0.4, 1.5, -2.0, 0.0, 0.1};
  for (int e = 0; e < 8; ++e) router.weight()(e, 0) = l[e];
  RowVector<double> bias = RowVector<double>::Zero(8);
  bias(3) = 0.3;  // steers selection only
  Matrix<double> x(1, 2);
  x << 1, 0;
  Routing<double> r;
  router.route(x, bias, false, r);
  auto sig = [](double v) { return 1 / (1 + std::exp(-v)); };
  // Group scores, top-2 sums of σ(ℓ) + b: g0 = 0.9282, g1 = 1.5212, g2 = 0.9368,
  // g3 = 1.0250: keep g1 and g3, then the top 2 of experts {2, 3, 6, 7}.
  CHECK(r.experts(0, 0) == 3);  // σ(.4)+.3 = 0.899 beats σ(.5) = 0.622
  CHECK(r.experts(0, 1) == 2);
  const double w3 = sig(0.4), w2 = sig(0.5);
  CHECK_THAT(r.weights(0, 0), WithinAbs(2.5 * w3 / (w3 + w2), 1e-14));  // the bias is not in the weight
  CHECK_THAT(r.weights(0, 1), WithinAbs(2.5 * w2 / (w3 + w2), 1e-14));
  // Expert 0 has the best single score but its group loses on the top-2
  // sum. With the max as group score: g0 = 0.8808, g1 = 0.8987, g2 = 0.8176,
  // g3 = 0.525: keep g1 and g0.
  rc.group_score = GroupScore::Max;
  router.set_routing(rc);
  router.route(x, bias, false, r);
  CHECK(r.experts(0, 0) == 3);
  CHECK(r.experts(0, 1) == 0);
}

TEST_CASE("ties in group and expert selection go to the lower index", "[routing]") {
  RoutingConfig rc;
  rc.scoring = Scoring::SoftmaxAll;
  rc.n_groups = 4;
  rc.topk_group = 2;
  Rng rng(1);
  Router<double> router(1, 8, 2, rng);
  router.set_routing(rc);
  router.weight().setZero();  // every score equal
  Matrix<double> x = Matrix<double>::Ones(1, 1);
  Routing<double> r;
  router.route(x, RowVector<double>::Zero(8), false, r);
  CHECK(r.experts(0, 0) == 0);
  CHECK(r.experts(0, 1) == 1);
  CHECK_THAT(r.weights(0, 0), WithinAbs(0.5, 1e-15));
}

TEST_CASE("every routing option: gradients by finite differences", "[routing][gradcheck]") {
  struct Opt {
    const char* what;
    Scoring scoring;
    Index groups, topk_group;
    bool renorm;
    double scale;
    GroupScore gs;
    bool unbiased;
  };
  const Opt opts[] = {
      {"softmax selected, scale 1.7", Scoring::SoftmaxSelected, 1, 1, true, 1.7, GroupScore::Top2Sum, false},
      {"softmax selected, groups, unbiased", Scoring::SoftmaxSelected, 4, 2, true, 1.0, GroupScore::Max, true},
      {"softmax all, renormalised", Scoring::SoftmaxAll, 1, 1, true, 1.0, GroupScore::Top2Sum, false},
      {"softmax all, raw", Scoring::SoftmaxAll, 1, 1, false, 1.0, GroupScore::Top2Sum, false},
      {"softmax all, raw, scaled, groups", Scoring::SoftmaxAll, 2, 1, false, 2.0, GroupScore::Max, false},
      {"sigmoid, renormalised, groups, scale 2.5", Scoring::Sigmoid, 4, 2, true, 2.5, GroupScore::Top2Sum, false},
      {"sigmoid, raw", Scoring::Sigmoid, 1, 1, false, 1.0, GroupScore::Top2Sum, false},
  };
  for (const Opt& o : opts) {
    INFO(o.what);
    RoutingConfig rc;
    rc.scoring = o.scoring;
    rc.n_groups = o.groups;
    rc.topk_group = o.topk_group;
    rc.renormalize = o.renorm;
    rc.routed_scale = o.scale;
    rc.group_score = o.gs;
    MoEConfig cfg = routed_config(8, 3, 1, rc);
    cfg.weights_from_unbiased = o.unbiased;
    cfg.d_shared_ffn = 7;
    MoEFFN<double> moe(cfg, 21);
    moe.balancer().set_bias(random_matrix(1, 8, 22, 0.1));
    const Matrix<double> x0 = random_matrix(5, 6, 23, 1.5);
    Matrix<double> x = x0;
    Routing<double> base;
    moe.router().route(x, moe.balancer().bias(), o.unbiased, base);
    // Any ±ε step that changed a choice would invalidate the check: count them.
    int flips = 0;
    const Matrix<double> rr = random_matrix(5, 6, 24);
    auto loss = [&] {
      Routing<double> now;
      moe.router().route(x, moe.balancer().bias(), o.unbiased, now);
      if (now.experts != base.experts) ++flips;
      return dot_all(moe.forward(x), rr);
    };
    MoEFFN<double>::Cache cache;
    moe.forward(x, &cache);
    const Matrix<double> dx = moe.backward(rr, cache);
    APEX_CHECK_GRADS(check_params(moe.params(), loss), 1e-6);
    APEX_CHECK_GRADS(std::vector{check_values("x", x.data(), dx.data(), x.size(), loss)}, 1e-6);
    CHECK(flips == 0);
    CHECK(moe.router().weight_grad().norm() > 0);
    CHECK(moe.shared_experts()[0].params()[0].rows == 7);
  }
}

TEST_CASE("sigmoid-gated shared experts: forward and gradients", "[routing][gradcheck]") {
  RoutingConfig rc;
  rc.scoring = Scoring::SoftmaxAll;
  rc.renormalize = false;
  for (Index n_shared : {1, 2}) {
    INFO("shared experts " << n_shared);
    MoEConfig cfg = routed_config(6, 2, n_shared, rc);
    cfg.shared_expert_gate = true;
    cfg.d_shared_ffn = 9;
    MoEFFN<double> moe(cfg, 31);
    Matrix<double> x = random_matrix(4, 6, 32, 1.5);
    // Forward: the gated shared sum plus the routed part.
    MoEConfig ungated = cfg;
    ungated.shared_expert_gate = false;
    MoEFFN<double> plain(ungated, 31);  // same seed: same weights but the gate
    const auto params = moe.params();
    const Param<double>& gate = params.back();
    CHECK(gate.name == "shared_expert_gate.weight");
    CHECK(gate.rows == 1);
    Matrix<double> shared_sum = Matrix<double>::Zero(4, 6);
    for (const auto& s : moe.shared_experts()) shared_sum += s.forward(x);
    const Matrix<double> y_plain = plain.forward(x);
    const Vector<double> z = x * gate.value().transpose();
    const Vector<double> sig = (1.0 + (-z.array()).exp()).inverse().matrix();
    const Matrix<double> expected = y_plain - shared_sum + sig.asDiagonal() * shared_sum;
    CHECK((moe.forward(x) - expected).cwiseAbs().maxCoeff() < 1e-13);

    const Matrix<double> rr = random_matrix(4, 6, 33);
    auto loss = [&] { return dot_all(moe.forward(x), rr); };
    MoEFFN<double>::Cache cache;
    moe.forward(x, &cache);
    const Matrix<double> dx = moe.backward(rr, cache);
    APEX_CHECK_GRADS(check_params(moe.params(), loss), 1e-6);
    APEX_CHECK_GRADS(std::vector{check_values("x", x.data(), dx.data(), x.size(), loss)}, 1e-6);
  }
}

TEST_CASE("the balancer counts selections under every scoring", "[routing]") {
  RoutingConfig rc;
  rc.scoring = Scoring::Sigmoid;
  rc.n_groups = 2;
  rc.topk_group = 1;
  MoEFFN<double> moe(routed_config(8, 2, 0, rc), 2);
  MoEFFN<double>::Cache cache;
  moe.forward(random_matrix(16, 6, 3), &cache);
  moe.observe(cache);
  const auto report = moe.balancer().update();
  Index total = 0;
  for (Index c : report.counts) total += c;
  CHECK(total == 32);
  CHECK(moe.balancer().bias().cwiseAbs().maxCoeff() > 0);
}

TEST_CASE("RoutingConfig error sweep", "[routing][errors]") {
  auto with = [](auto edit) {
    return [edit] {
      RoutingConfig rc;
      edit(rc);
      MoEFFN<double> moe(routed_config(8, 4, 0, rc), 1);
    };
  };
  apex::test::run_sweep({
      {"groups not dividing E", with([](RoutingConfig& r) { r.n_groups = 3; }), "ConfigError",
       {"MoEFFN", "routing.n_groups", "divide n_experts"}},
      {"topk_group > groups", with([](RoutingConfig& r) { r.n_groups = 2; r.topk_group = 3; }), "ConfigError",
       {"routing.topk_group"}},
      {"too few experts in kept groups", with([](RoutingConfig& r) { r.n_groups = 4; r.topk_group = 1; }),
       "ConfigError", {"routing.topk_group * n_experts / n_groups = 2", "n_active = 4"}},
      {"scale zero", with([](RoutingConfig& r) { r.routed_scale = 0; }), "ConfigError", {"routing.routed_scale"}},
      {"scale negative", with([](RoutingConfig& r) { r.routed_scale = -1; }), "ConfigError",
       {"routing.routed_scale"}},
      {"scale NaN", with([](RoutingConfig& r) { r.routed_scale = std::nan(""); }), "ConfigError",
       {"routing.routed_scale"}},
      {"scale inf", with([](RoutingConfig& r) { r.routed_scale = INFINITY; }), "ConfigError",
       {"routing.routed_scale"}},
      {"groups zero", with([](RoutingConfig& r) { r.n_groups = 0; }), "ConfigError", {"routing.n_groups"}},
      {"shared width negative", [] {
         MoEConfig c = routed_config(8, 4, 1, RoutingConfig{});
         c.d_shared_ffn = -1;
         MoEFFN<double> moe(c, 1);
       }, "ConfigError", {"d_shared_ffn"}},
  });
}

TEST_CASE("family presets have their published shapes and routing", "[routing][families]") {
  const MoEConfig ds = deepseek_v3_moe();
  CHECK(ds.d_model == 7168);
  CHECK(ds.n_experts == 256);
  CHECK(ds.n_active == 8);
  CHECK(ds.n_shared == 1);
  CHECK(ds.routing.scoring == Scoring::Sigmoid);
  CHECK(ds.routing.n_groups == 8);
  CHECK(ds.routing.topk_group == 4);
  CHECK(ds.routing.routed_scale == 2.5);
  CHECK(mixtral_8x7b_moe().n_experts == 8);
  CHECK(mixtral_8x7b_moe().n_active == 2);
  CHECK(qwen2_moe_a2_7b_moe().shared_ffn() == 5632);
  CHECK(qwen2_moe_a2_7b_moe().shared_expert_gate);
  CHECK_FALSE(qwen2_moe_a2_7b_moe().routing.renormalize);
  CHECK(qwen3_moe_30b_a3b_moe().routing.renormalize);
  CHECK_FALSE(olmoe_1b_7b_moe().routing.renormalize);
  for (MoEFamily f : kFamilies) {
    INFO(family_name(f));
    CHECK_NOTHROW(family_preset(f).validate());
    CHECK(family_by_name(family_name(f)) == f);
  }
  apex::test::expect(apex::test::outcome([] { family_by_name("llama"); }), "ConfigError", {"llama", "family"});
}

TEST_CASE("each family's block matches its PyTorch reference", "[routing][families][reference]") {
  // The committed fixtures, and a fresh set when routing_interop.cmake made one.
  std::vector<fs::path> dirs{fs::path(__FILE__).parent_path() / "data"};
  if (const char* d = std::getenv("APEX_FFN_FAMILY_DIR")) dirs.emplace_back(d);
  for (const fs::path& data : dirs)
  for (MoEFamily f : kFamilies) {
    const std::string path = (data / ("family_" + std::string(family_name(f)) + ".safetensors")).string();
    INFO(path);
    REQUIRE(fs::exists(path));
    const st::Reader file(path);
    REQUIRE(file.metadata().at("family") == family_name(f));
    const std::string prefix = file.metadata().at("prefix");
    const MoEConfig cfg = fixture_config(f, file);
    MoEFFN<double> moe(cfg, 7);
    LoadOptions lo;
    lo.allow_unexpected = true;  // the test.* and grad.* tensors
    const LoadResult r = load_family_checkpoint(file, moe, f, prefix, lo);
    CHECK(r.missing.empty());
    const Index n = file.at("test.x").shape[0], d = cfg.d_model, k = cfg.n_active;
    const Matrix<double> x = read_tensor(file, "test.x", n, d);
    MoEFFN<double>::Cache cache;
    const Matrix<double> y = moe.forward(x, &cache);
    CHECK(rel_error(y, read_tensor(file, "test.y", n, d)) <= 1e-10);
    const Matrix<double> experts = read_tensor(file, "test.experts", n, k);
    for (Index t = 0; t < n; ++t)
      for (Index j = 0; j < k; ++j) CHECK(cache.routing.experts(t, j) == Index(experts(t, j)));
    const Matrix<double> dx = moe.backward(read_tensor(file, "test.dy", n, d), cache);
    CHECK(rel_error(dx, read_tensor(file, "test.dx", n, d)) <= 1e-10);
    for (const auto& p : family_params(moe, f, prefix)) {
      INFO(p.name);
      CHECK(rel_error(p.grad(), read_tensor(file, "grad." + p.name, p.rows, p.cols)) <= 1e-10);
    }
  }
}

TEST_CASE("family checkpoints save and load under the family's names", "[routing][families][checkpoint]") {
  const fs::path dir = fs::temp_directory_path() / ("apex_routing_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  for (MoEFamily f : kFamilies) {
    INFO(family_name(f));
    MoEConfig cfg = family_preset(f);
    cfg.d_model = 4, cfg.d_ffn = 3, cfg.n_experts = 8, cfg.n_active = 2;
    if (cfg.n_shared) cfg.d_shared_ffn = 5;
    if (f == MoEFamily::DeepSeekV3) cfg.routing.n_groups = 4, cfg.routing.topk_group = 2;
    MoEFFN<double> a(cfg, 1), b(cfg, 2);
    a.balancer().set_bias(random_matrix(1, 8, 3, 0.1));
    const std::string path = (dir / (std::string(family_name(f)) + ".safetensors")).string();
    save_family_checkpoint(path, a, f, "model.layers.3.");
    const st::Reader file(path);
    const std::string block = f == MoEFamily::Mixtral ? "block_sparse_moe." : "mlp.";
    CHECK(file.header().find("model.layers.3." + block + "gate.weight"));
    CHECK(file.header().find("model.layers.3." + block + "experts.7." +
                             (f == MoEFamily::Mixtral ? "w2.weight" : "down_proj.weight")));
    CHECK(bool(file.header().find("model.layers.3.mlp.gate.e_score_correction_bias")) == (f == MoEFamily::DeepSeekV3));
    if (f == MoEFamily::DeepSeekV3) {
      CHECK(file.at("model.layers.3.mlp.gate.e_score_correction_bias").shape == std::vector<std::uint64_t>{8});
      CHECK(file.header().find("model.layers.3.mlp.shared_experts.up_proj.weight"));
    }
    if (f == MoEFamily::Qwen2MoE) {
      CHECK(file.header().find("model.layers.3.mlp.shared_expert.up_proj.weight"));
      CHECK(file.header().find("model.layers.3.mlp.shared_expert_gate.weight"));
    }
    const LoadResult r = load_family_checkpoint(file, b, f, "model.layers.3.");  // strict
    CHECK(r.loaded.size() == a.params().size() + (f == MoEFamily::DeepSeekV3 ? 1 : 0));
    const auto pa = a.params(), pb = b.params();
    for (std::size_t i = 0; i < pa.size(); ++i) CHECK(pa[i].value() == pb[i].value());
    if (f == MoEFamily::DeepSeekV3) CHECK(a.balancer().bias() == b.balancer().bias());
    else CHECK(b.balancer().bias().isZero());
  }
  fs::remove_all(dir);
}

TEST_CASE("family name maps reject another family's checkpoint and a missing correction bias",
          "[routing][families][errors]") {
  const fs::path data = fs::path(__FILE__).parent_path() / "data";
  auto load_as = [&](const char* file_family, MoEFamily as) {
    return [=] {
      const st::Reader file((data / ("family_" + std::string(file_family) + ".safetensors")).string());
      MoEFFN<double> moe(fixture_config(as, file), 1);
      LoadOptions lo;
      lo.allow_unexpected = true;
      load_family_checkpoint(file, moe, as, "model.layers.1.", lo);
    };
  };
  apex::test::run_sweep({
      {"mixtral map on a qwen3 file", load_as("qwen3_moe", MoEFamily::Mixtral), "FormatError",
       {"load_family_checkpoint", "mixtral name map", "another family", "qwen3_moe or olmoe"}},
      {"qwen3 map on a mixtral file", load_as("mixtral", MoEFamily::Qwen3MoE), "FormatError",
       {"qwen3_moe name map", "mixtral's"}},
      {"olmoe map on a deepseek file", load_as("deepseek_v3", MoEFamily::OLMoE), "FormatError",
       {"olmoe name map", "deepseek_v3's"}},
      {"deepseek map on a qwen2 file", load_as("qwen2_moe", MoEFamily::DeepSeekV3), "FormatError",
       {"deepseek_v3 name map", "qwen2_moe's"}},
      {"qwen2 map on an olmoe file", load_as("olmoe", MoEFamily::Qwen2MoE), "FormatError",
       {"qwen2_moe name map", "another family"}},
      {"shared experts that do not fit", [] {
         MoEConfig c = routed_config(8, 2, 2, RoutingConfig{});
         MoEFFN<double> moe(c, 1);
         family_params(moe, MoEFamily::Mixtral);
       }, "ConfigError", {"family_params", "mixtral", "n_shared = 2"}},
  });
  // A DeepSeek-V3 (sigmoid router) file without its e_score_correction_bias.
  const fs::path dir = fs::temp_directory_path() / ("apex_routing_bias_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  MoEConfig c = routed_config(8, 2, 1, family_routing(MoEFamily::DeepSeekV3));
  c.routing.n_groups = 4, c.routing.topk_group = 2;
  MoEFFN<double> moe(c, 1);
  const std::string path = (dir / "no_bias.safetensors").string();
  save_checkpoint(path, family_params(moe, MoEFamily::DeepSeekV3));
  apex::test::expect(apex::test::outcome([&] { load_family_checkpoint(path, moe, MoEFamily::DeepSeekV3); }),
                     "FormatError", {"sigmoid router", "correction bias", "'mlp.gate.e_score_correction_bias'"});
  fs::remove_all(dir);
}

TEST_CASE("the packed layer routes with the float layer's routing options", "[routing][inference]") {
  for (MoEFamily f : {MoEFamily::DeepSeekV3, MoEFamily::OLMoE, MoEFamily::Mixtral}) {
    INFO(family_name(f));
    RoutingConfig rc = family_routing(f);
    if (f == MoEFamily::DeepSeekV3) rc.n_groups = 4, rc.topk_group = 2;
    MoEConfig c = routed_config(8, 2, 1, rc);
    MoEFFN<float> moe(c, 5);
    moe.balancer().set_bias(random_matrix(1, 8, 6, 0.05).cast<float>());
    const auto p = PackedMoE<float>::from(moe);
    const Matrix<float> x = random_matrix(17, 6, 7).cast<float>();
    MoEFFN<float>::Cache c0;
    PackedMoE<float>::Cache c1;
    const Matrix<float> y0 = moe.forward(x, &c0), y1 = p.forward(x, &c1);
    CHECK(c1.routing.experts == c0.routing.experts);
    CHECK(c1.routing.weights == c0.routing.weights);
    CHECK((y1 - y0).norm() <= 1e-6 * y0.norm());
  }
  // Qwen2-MoE's gated shared expert of its own width (tests/test_inference.cpp tests more).
  MoEConfig gated = routed_config(8, 2, 1, family_routing(MoEFamily::Qwen2MoE));
  gated.shared_expert_gate = true;
  gated.d_shared_ffn = 7;
  MoEFFN<float> moe(gated, 5);
  const auto p = PackedMoE<float>::from(moe);
  const Matrix<float> x = random_matrix(17, 6, 8).cast<float>();
  const Matrix<float> y0 = moe.forward(x);
  CHECK((p.forward(x) - y0).norm() <= 1e-6 * y0.norm());
}

TEST_CASE("capacity factor drops the lowest-weighted overflow assignments", "[routing][capacity]") {
  RoutingConfig rc;
  MoEFFN<double> dropless(routed_config(4, 2, 1, rc), 9);
  MoEFFN<double>::Cache c0;
  const Matrix<double> x = random_matrix(8, 6, 10, 1.5);
  dropless.forward(x, &c0);
  CHECK(c0.dropped.empty());  // off by default
  CHECK(c0.kept_weights.size() == 0);

  rc.capacity_factor = 0.5;  // C = ceil(0.5 · 16 / 4) = 2
  MoEFFN<double> moe(routed_config(4, 2, 1, rc), 9);
  MoEFFN<double>::Cache c;
  const Matrix<double> y = moe.forward(x, &c);
  Index expected_drops = 0;
  for (Index e = 0; e < 4; ++e) expected_drops += std::max<Index>(0, c.plan.count(e) - 2);
  REQUIRE(expected_drops > 0);
  CHECK(Index(c.dropped.size()) == expected_drops);
  for (Index e = 0; e < 4; ++e) {
    // Kept: the expert's highest weights; every dropped weight ≤ every kept one.
    double min_kept = 1e9, max_dropped = -1e9;
    Index kept = 0;
    for (Index r = c.plan.offset[e]; r < c.plan.offset[e + 1]; ++r) {
      const Index t = c.plan.token[r], k = c.plan.slot[r];
      const bool is_dropped = std::binary_search(c.dropped.begin(), c.dropped.end(), t * 2 + k);
      CHECK((c.kept_weights(t, k) == 0) == is_dropped);
      if (is_dropped) max_dropped = std::max(max_dropped, c.routing.weights(t, k));
      else min_kept = std::min(min_kept, c.routing.weights(t, k)), ++kept;
    }
    CHECK(kept <= 2);
    CHECK(max_dropped <= min_kept);
  }
  // The output: shared experts plus the kept assignments only.
  Matrix<double> expected = moe.shared_experts()[0].forward(x);
  for (Index t = 0; t < 8; ++t)
    for (Index k = 0; k < 2; ++k)
      expected.row(t) += c.kept_weights(t, k) * moe.experts()[std::size_t(c.routing.experts(t, k))].forward(x.row(t));
  CHECK((y - expected).cwiseAbs().maxCoeff() < 1e-13);

  // Gradients: a dropped assignment has no effect and no gradient.
  Matrix<double> xv = x;
  const std::vector<Index> base = c.dropped;
  int changed = 0;
  const Matrix<double> rr = random_matrix(8, 6, 11);
  auto loss = [&] {
    MoEFFN<double>::Cache cc;
    const double l = dot_all(moe.forward(xv, &cc), rr);
    if (cc.dropped != base) ++changed;
    return l;
  };
  const Matrix<double> dx = moe.backward(rr, c);
  APEX_CHECK_GRADS(check_params(moe.params(), loss), 1e-6);
  APEX_CHECK_GRADS(std::vector{check_values("x", xv.data(), dx.data(), xv.size(), loss)}, 1e-6);
  CHECK(changed == 0);

  apex::test::expect(apex::test::outcome([] {
                       RoutingConfig bad;
                       bad.capacity_factor = -1;
                       MoEFFN<double> m(routed_config(4, 2, 0, bad), 1);
                     }),
                     "ConfigError", {"routing.capacity_factor"});
}

TEST_CASE("kappa-SwiGLU experts read the raw logit under every scoring", "[routing][kappa][gradcheck]") {
  for (Scoring scoring : {Scoring::SoftmaxAll, Scoring::Sigmoid}) {
    INFO(scoring_name(scoring));
    RoutingConfig rc;
    rc.scoring = scoring;
    rc.n_groups = 2;
    rc.routed_scale = 1.5;
    MoEFFN<double, KappaSwiGLU<double>> moe(routed_config(6, 2, 1, rc), 41);
    for (auto& e : moe.experts()) {
      KappaOptions opt = e.options();
      opt.rho = 1.0;  // the analytic gradient is then the true one, router included
      opt.c = 1.5;
      e.set_options(opt);
    }
    Matrix<double> x = random_matrix(5, 6, 42, 1.5);
    Routing<double> base;
    moe.router().route(x, moe.balancer().bias(), false, base);
    int flips = 0;
    const Matrix<double> rr = random_matrix(5, 6, 43);
    auto loss = [&] {
      Routing<double> now;
      moe.router().route(x, moe.balancer().bias(), false, now);
      if (now.experts != base.experts) ++flips;
      return dot_all(moe.forward(x), rr);
    };
    MoEFFN<double, KappaSwiGLU<double>>::Cache cache;
    moe.forward(x, &cache);
    // The side input is ℓ[t, e_k], not the score s or the weight g.
    for (Index r = 0; r < cache.plan.rows(); ++r)
      CHECK(cache.side_sorted(r) == cache.routing.logits(cache.plan.token[r],
                                                          cache.routing.experts(cache.plan.token[r], cache.plan.slot[r])));
    const Matrix<double> dx = moe.backward(rr, cache);
    APEX_CHECK_GRADS(check_params(moe.params(), loss), 1e-6);
    APEX_CHECK_GRADS(std::vector{check_values("x", x.data(), dx.data(), x.size(), loss)}, 1e-6);
    CHECK(flips == 0);
  }
}

TEST_CASE("a capacity at or above the batch saturates: nothing is dropped", "[routing][capacity][regression]") {
  // moe/capacity.hpp: expert_capacity computed Index(std::ceil(φ·rows/E)) for any
  // finite φ; φ = 1e300 passed validate() and the conversion of 4e300 to an
  // integer was undefined behaviour (a negative capacity in practice:
  // expert_capacity(1e30, 10, 1) was INT64_MIN), so every routed pair was
  // dropped and MoEFFN, PackedMoE and ExpertParallelMoE returned the shared
  // experts alone. Fixed: C is computed in double and clamped to `rows`
  // before the conversion, so a capacity of at least the batch drops nothing.
  using dispatch::expert_capacity;
  CHECK(expert_capacity(1e30, 10, 1) == 10);
  CHECK(expert_capacity(1e300, 16, 4) == 16);
  CHECK(expert_capacity(std::numeric_limits<double>::max(), 7, 3) == 7);
  CHECK(expert_capacity(4.0, 16, 4) == 16);  // exactly the batch
  CHECK(expert_capacity(1e300, 0, 4) == 0);
  const Index huge = std::numeric_limits<Index>::max();
  CHECK(expert_capacity(2.0, huge, 1) == huge);  // φ·rows beyond Index: saturates too
  CHECK(expert_capacity(0.5, 16, 4) == 2);       // ordinary factors unchanged
  CHECK(expert_capacity(1.25, 10, 4) == 4);

  for (double factor : {1e300, 1e30, 4.0}) {
    INFO("capacity factor " << factor);
    RoutingConfig rc = family_routing(MoEFamily::Mixtral);
    MoEFFN<double> dropless(routed_config(4, 2, 1, rc), 9);
    rc.capacity_factor = factor;
    MoEFFN<double> capped(routed_config(4, 2, 1, rc), 9);
    const Matrix<double> x = random_matrix(8, 6, 10, 1.5);
    MoEFFN<double>::Cache c;
    const Matrix<double> y = capped.forward(x, &c);
    CHECK(c.dropped.empty());
    CHECK(y == dropless.forward(x));  // bitwise

    // The function ExpertParallelMoE applies to the whole batch (global_capacity.hpp).
    const Index cap = expert_capacity(factor, c.plan.rows(), 4);
    CHECK(dispatch::capacity_drops(c.plan, c.routing.weights, cap).empty());

    // The packed layer (float).
    MoEFFN<float> dropless_f(routed_config(4, 2, 1, family_routing(MoEFamily::Mixtral)), 9);
    MoEFFN<float> capped_f(routed_config(4, 2, 1, rc), 9);
    const Matrix<float> xf = x.cast<float>();
    CHECK(capped_f.forward(xf) == dropless_f.forward(xf));
    PackedMoE<float>::Cache pc;
    const Matrix<float> yp = PackedMoE<float>::from(capped_f).forward(xf, &pc);
    CHECK(pc.dropped.empty());
    CHECK(yp == PackedMoE<float>::from(dropless_f).forward(xf));
  }
}

namespace {

/// A sigmoid-renormalised layer (DeepSeek-V3's rule, no groups) whose router
/// logits all lie near `logit`: column 0 of x is 1 and the router's column 0
/// is `logit`, the other columns add ±0.3 · x.
template <class T>
MoEFFN<T> sigmoid_layer_near(double logit, Matrix<T>& x) {
  RoutingConfig rc;
  rc.scoring = Scoring::Sigmoid;
  rc.renormalize = true;
  rc.routed_scale = 2.5;
  MoEFFN<T> moe(routed_config(8, 3, 1, rc), 31);
  Matrix<double> w = random_matrix(8, 6, 32, 0.3);
  w.col(0).setConstant(logit);
  moe.router().weight() = w.cast<T>();
  Matrix<double> xd = random_matrix(5, 6, 33, 1.0);
  xd.col(0).setOnes();
  x = xd.cast<T>();
  return moe;
}

}  // namespace

TEST_CASE("sigmoid renormalisation is finite when every score underflows", "[routing][regression]") {
  // moe/router.hpp: with sigmoid scoring and renormalisation the weights were
  // g_k = c·s_k / Σ_j s_j. In float, logits near −160 give σ = 0 exactly
  // (exp(160) overflows), so the weights were 0/0 = NaN and the output NaN
  // for a finite input. Fixed (DeepSeek-V3's rule as Hugging Face writes
  // it): the denominator is Σ_j s_j + 1e-20; the weights are then 0, the
  // layer returns its shared experts, and the backward is finite.
  auto finite_everywhere = [](auto& moe, const auto& x) {
    using M = std::decay_t<decltype(x)>;
    typename std::decay_t<decltype(moe)>::Cache c;
    const M y = moe.forward(x, &c);
    CHECK(y.allFinite());
    CHECK(c.routing.weights.allFinite());
    const M dx = moe.backward(M::Ones(x.rows(), x.cols()), c);
    CHECK(dx.allFinite());
    for (const auto& p : moe.params()) {
      INFO(p.name);
      CHECK(p.grad().allFinite());
    }
  };
  Matrix<float> xf;
  MoEFFN<float> f = sigmoid_layer_near<float>(-160, xf);
  finite_everywhere(f, xf);
  CHECK(f.forward(xf) == f.shared_experts()[0].forward(xf));  // every routed weight is 0
  Matrix<double> xd;
  MoEFFN<double> d = sigmoid_layer_near<double>(-800, xd);  // σ = 0 in double too
  finite_everywhere(d, xd);
}

TEST_CASE("sigmoid renormalisation divides by the sum plus 1e-20", "[routing][gradcheck]") {
  // Where the scores are tiny but not zero (double, logits near −40: σ ≈
  // 4e-18) the 1e-20 is visible: the weights sum to c·S/(S + 1e-20), as in
  // Hugging Face's DeepSeek-V3, and the backward (∂g/∂s includes the ε)
  // matches central differences.
  Matrix<double> x;
  MoEFFN<double> moe = sigmoid_layer_near<double>(-40, x);
  MoEFFN<double>::Cache c;
  moe.forward(x, &c);
  for (Index t = 0; t < x.rows(); ++t) {
    double sum = 0;
    for (Index k = 0; k < 3; ++k) sum += c.routing.scores(t, c.routing.experts(t, k));
    REQUIRE(sum < 1e-15);
    for (Index k = 0; k < 3; ++k)
      CHECK(c.routing.weights(t, k) == 2.5 * (c.routing.scores(t, c.routing.experts(t, k)) / (sum + 1e-20)));
    CHECK(c.routing.weights.row(t).sum() < 2.5 * (1 - 1e-6));
  }
  const Matrix<double> rr = random_matrix(5, 6, 34);
  Matrix<double> xv = x;
  int flips = 0;
  auto loss = [&] {
    MoEFFN<double>::Cache cc;
    const double l = dot_all(moe.forward(xv, &cc), rr);
    if (cc.routing.experts != c.routing.experts) ++flips;
    return l;
  };
  const Matrix<double> dx = moe.backward(rr, c);
  APEX_CHECK_GRADS(check_params(moe.params(), loss), 1e-6);
  APEX_CHECK_GRADS(std::vector{check_values("x", xv.data(), dx.data(), xv.size(), loss)}, 1e-6);
  CHECK(flips == 0);
  CHECK(moe.router().weight_grad().norm() > 0);
}
