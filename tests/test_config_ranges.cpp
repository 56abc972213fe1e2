// Every option of every configuration against what it will be used as: a
// floating option against the range of the scalar type the layer computes
// in, an enum field against its enumerators. A value a double holds but a
// float does not (1e39) must be a ConfigError naming the field in a float
// layer, and accepted in a double layer; an enum value outside its
// enumerators (a cast from an integer) must be a ConfigError naming the
// field and the value, never silently read as another enumerator.
// docs/error_model.md lists what is checked.
#include <apex/ffn/io/checkpoint.hpp>
#include <apex/ffn/layers/cross_entropy.hpp>
#include <apex/ffn/moe/families.hpp>
#include <apex/ffn/layers/ffn_sublayer.hpp>
#include <apex/ffn/inference.hpp>
#include <apex/ffn/inference/files/checkpoint/load.hpp>
#include <apex/ffn/layers/kappa_swiglu.hpp>
#include <apex/ffn/moe/load_balancer.hpp>
#include <apex/ffn/moe/moe_ffn.hpp>
#include <apex/ffn/layers/multi_token_heads.hpp>
#include <apex/ffn/io/name_maps.hpp>
#include <apex/ffn/layers/rms_norm.hpp>
#include <apex/ffn/layers/skip_gate.hpp>

#include <catch2/catch.hpp>

#include <unistd.h>

#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "sweep.hpp"

using namespace apex;
using apex::test::Case;
using apex::test::expect;
using apex::test::outcome;
using apex::test::run_sweep;

namespace {

constexpr double kBeyondFloat = 1e39;  // finite as a double, +inf as a float

/// d 4, f 3, E 4, K 2, one shared expert.
MoEConfig small_config() { return test::moe_config(4, 2, 1, 4, 3); }

/// PackedMoE's parts constructor (the loaders' path) with another config.
void packed_from_parts(const MoEConfig& bad) {
  const MoEFFN<float> src(small_config(), 3);
  const auto p = PackedMoE<float>::from(src);
  PackedMoE<float> q(bad, p.router().weight(), p.bias(), p.experts(), {}, p.shared_experts());
}

/// Every use of a floating option, in scalar type T, with `v` put in it. `add`
/// receives (what, call, field): the call must reject v as out of range for
/// T naming `field`, or accept it, as the caller decides.
template <class T>
void for_each_float_option(double v, const std::function<void(std::string, std::function<void()>, std::string)>& add) {
  auto moe_with = [v](auto edit) {
    return [v, edit] {
      MoEConfig c = small_config();
      edit(c, v);
      MoEFFN<T> moe(c, 1);
    };
  };
  add("MoEFFN routing.routed_scale", moe_with([](MoEConfig& c, double x) { c.routing.routed_scale = x; }),
      "routing.routed_scale");
  add("MoEFFN balancer_alpha", moe_with([](MoEConfig& c, double x) { c.balancer_alpha = x; }), "balancer_alpha");
  add("kappa MoEFFN routing.routed_scale", [v] {
        MoEConfig c = small_config();
        c.routing.routed_scale = v;
        MoEFFN<T, KappaSwiGLU<T>> moe(c, 1);
      }, "routing.routed_scale");
  add("Router::set_routing routed_scale", [v] {
        Rng rng(1);
        Router<T> r(4, 4, 2, rng);
        RoutingConfig rc;
        rc.routed_scale = v;
        r.set_routing(rc);
      }, "routing.routed_scale");
  add("LoadBalancer alpha", [v] { LoadBalancer<T> b(4, 2, v); }, "alpha");
  add("LoadBalancer::set_alpha", [v] { LoadBalancer<T>(4, 2).set_alpha(v); }, "alpha");
  add("SkipGate penalty", [v] {
        SkipGateConfig g;
        g.d_model = 4, g.hidden = 3, g.penalty = v;
        SkipGate<T> gate(g, 1);
      }, "penalty");
  add("RMSNorm eps", [v] { RMSNorm<T> n(4, v); }, "eps");
  auto kappa_with = [v](auto edit) {
    return [v, edit] {
      KappaOptions o;
      edit(o, v);
      KappaSwiGLU<T> k(4, 3, 0, o);
    };
  };
  add("KappaSwiGLU U", kappa_with([](KappaOptions& o, double x) { o.U = x; }), "U");
  add("KappaSwiGLU c", kappa_with([](KappaOptions& o, double x) { o.c = x; }), "c");
  add("KappaSwiGLU rho (rho*c)", kappa_with([](KappaOptions& o, double x) { o.rho = x / o.c; }), "rho");
  add("KappaSwiGLU reg_weight", kappa_with([](KappaOptions& o, double x) { o.reg_weight = x; }), "reg_weight");
  add("KappaSwiGLU::set_options c", [v] {
        KappaSwiGLU<T> k(4, 3, 0);
        KappaOptions o;
        o.c = v;
        k.set_options(o);
      }, "c");
  add("cross_entropy grad_scale", [v] {
        CrossEntropyOptions o;
        o.grad_scale = v;
        const Matrix<T> z = Matrix<T>::Zero(2, 3);
        Matrix<T> dz;
        cross_entropy(z, TokenIds::Zero(2), &dz, o);
      }, "grad_scale");
  add("multi_token_loss lambda", [v] {
        MultiTokenOptions o;
        o.num_heads = 1, o.lambda = v;
        const Matrix<T> zm = Matrix<T>::Zero(2, 3), zh = Matrix<T>::Zero(2, 3);
        multi_token_loss(zm, zh, TokenIds::Zero(2), o);
      }, "lambda");
  add("MultiTokenHeads lambda", [v] {
        MultiTokenOptions o;
        o.num_heads = 1, o.lambda = v;
        MultiTokenHeads<T> h(4, 3, o);
      }, "lambda");
  add("MultiTokenHeads::set_lambda", [v] { MultiTokenHeads<T>(4, 3).set_lambda(v); }, "lambda");
}

}  // namespace

TEST_CASE("float options beyond float's range are rejected in float layers", "[sweeps][regression]") {
  // moe/routing_config.hpp, moe/config.hpp and the other configs checked their
  // floating options for finiteness as doubles only: routing.routed_scale =
  // 1e39 in MoEFFN<float> became +inf and the output non-finite (the κ
  // options alone were checked against the layer's scalar). Fixed: every
  // option a layer converts to its scalar type T must lie within T's range
  // (detail::require_fits, core/scalar_range.hpp), checked where the layer is
  // built (validate_for<T>).
  std::vector<Case> cases;
  for_each_float_option<float>(kBeyondFloat, [&](std::string what, std::function<void()> call, std::string field) {
    cases.push_back({what + " = 1e39 (float)", call, "ConfigError", {field, "float", "1e+39"}});
  });
  // The packed layer computes in float whatever its source's type.
  auto packed_with = [](double v) {
    MoEConfig c = small_config();
    c.routing.routed_scale = v;
    return c;
  };
  cases.push_back({"PackedMoE::check_fits routed_scale = 1e39",
                   [&] { PackedMoE<float>::check_fits("PackedMoE::check_fits", packed_with(kBeyondFloat), 0); },
                   "ConfigError", {"PackedMoE::check_fits", "routing.routed_scale", "float"}});
  cases.push_back({"PackedMoE(parts) routed_scale = 1e39", [&] { packed_from_parts(packed_with(kBeyondFloat)); },
                   "ConfigError", {"PackedMoE", "routing.routed_scale", "float"}});
  cases.push_back({"PackedMoE(parts) balancer_alpha = 1e39", [] {
                     MoEConfig c = small_config();
                     c.balancer_alpha = kBeyondFloat;
                     packed_from_parts(c);
                   }, "ConfigError", {"PackedMoE", "balancer_alpha", "float"}});
  run_sweep(cases);
}

TEST_CASE("float options that fit double are accepted in double layers", "[sweeps]") {
  for_each_float_option<double>(kBeyondFloat, [](std::string what, std::function<void()> call, std::string) {
    INFO(what << " = 1e39 (double)");
    CHECK(outcome(call) == "returned");
  });
  // ... and a value beyond double's range cannot be given at all; NaN and Inf
  // are rejected as before.
  for_each_float_option<double>(apex::test::kInf, [](std::string what, std::function<void()> call, std::string field) {
    INFO(what << " = inf (double)");
    expect(outcome(call), "ConfigError", {field});
  });
}

TEST_CASE("a capacity factor beyond float's range is accepted and saturates", "[sweeps]") {
  // The capacity factor is never converted to the scalar type: C is computed
  // in double and clamped to the batch (moe/capacity.hpp), so it is the one
  // floating option a float layer accepts beyond float's range.
  MoEConfig c = small_config();
  MoEFFN<float> dropless(c, 5);
  c.routing.capacity_factor = kBeyondFloat;
  MoEFFN<float> capped(c, 5);
  const Matrix<float> x = Matrix<float>::Random(6, 4);
  MoEFFN<float>::Cache cache;
  CHECK(capped.forward(x, &cache) == dropless.forward(x));
  CHECK(cache.dropped.empty());
  CHECK(PackedMoE<float>::from(capped).forward(x) == PackedMoE<float>::from(dropless).forward(x));
}

namespace {

/// An enum value no enumerator has, as a cast from an integer gives it.
template <class E>
E out_of_range(int v) {
  return static_cast<E>(v);
}

}  // namespace

TEST_CASE("every enum field of every config rejects a value outside its enumerators", "[sweeps][regression]") {
  // moe/routing_config.hpp validated Scoring but not GroupScore: GroupScore(7)
  // was accepted and read as Max (the router tests == Top2Sum). The same
  // held for every other enum a configuration carries: MoEFamily (read as
  // Qwen3-MoE/OLMoE by the name maps, a default routing by family_routing),
  // SublayerMode (read as inference), packed::Bf16Products (read as
  // widened) and packed::Isa (rejected, but as "kernel path 'unknown'").
  // Fixed: each is checked where it is used, ConfigError naming the field
  // and the value.
  const auto group = out_of_range<GroupScore>(7);
  const auto scoring = out_of_range<Scoring>(7);
  const auto family = out_of_range<MoEFamily>(9);
  const auto mode = out_of_range<SublayerMode>(5);
  const auto isa = out_of_range<packed::Isa>(9);
  const auto products = out_of_range<packed::Bf16Products>(9);
  auto moe_with = [](auto edit) {
    return [edit] {
      MoEConfig c = small_config();
      edit(c.routing);
      MoEFFN<double> moe(c, 1);
    };
  };
  const std::string tmp =
      (std::filesystem::temp_directory_path() / ("apex_cfg_enum_" + std::to_string(::getpid()) + ".safetensors"))
          .string();
  {
    MoEConfig c = small_config();
    c.n_shared = 0;
    MoEFFN<double> m(c, 2);
    save_family_checkpoint(tmp, m, MoEFamily::Mixtral);
  }
  std::vector<Case> cases{
      {"MoEFFN routing.group_score = 7", moe_with([&](RoutingConfig& r) { r.group_score = group; }), "ConfigError",
       {"MoEFFN", "routing.group_score", "got 7"}},
      {"MoEFFN routing.group_score = 7 with groups", moe_with([&](RoutingConfig& r) {
         r.n_groups = 2, r.group_score = group;
       }), "ConfigError", {"routing.group_score", "got 7"}},
      {"MoEFFN routing.scoring = 7", moe_with([&](RoutingConfig& r) { r.scoring = scoring; }), "ConfigError",
       {"MoEFFN", "routing.scoring", "got 7"}},
      {"Router::set_routing group_score = 7", [&] {
         Rng rng(1);
         Router<float> r(4, 4, 2, rng);
         RoutingConfig rc;
         rc.group_score = group;
         r.set_routing(rc);
       }, "ConfigError", {"Router::set_routing", "routing.group_score", "got 7"}},
      {"PackedMoE::check_fits group_score = 7", [&] {
         MoEConfig c = small_config();
         c.routing.group_score = group;
         PackedMoE<float>::check_fits("PackedMoE::check_fits", c, 0);
       }, "ConfigError", {"routing.group_score", "got 7"}},
      {"family_routing(9)", [&] { family_routing(family); }, "ConfigError", {"family_routing", "family", "got 9"}},
      {"family_preset(9)", [&] { family_preset(family); }, "ConfigError", {"family_preset", "family", "got 9"}},
      {"family_params(9)", [&] {
         MoEConfig c = small_config();
         c.n_shared = 0;
         MoEFFN<double> m(c, 2);
         family_params(m, family);
       }, "ConfigError", {"family_params", "family", "got 9"}},
      {"save_family_checkpoint(9)", [&] {
         MoEConfig c = small_config();
         c.n_shared = 0;
         MoEFFN<double> m(c, 2);
         save_family_checkpoint(tmp + ".x", m, family);
       }, "ConfigError", {"family", "got 9"}},
      {"load_family_checkpoint(9)", [&] {
         MoEConfig c = small_config();
         c.n_shared = 0;
         MoEFFN<double> m(c, 2);
         load_family_checkpoint(tmp, m, family);
       }, "ConfigError", {"load_family_checkpoint", "family", "got 9"}},
      {"load_packed_moe PackedLoadOptions.family = 9", [&] {
         MoEConfig c = small_config();
         c.n_shared = 0;
         PackedLoadOptions o;
         o.family = family;
         load_packed_moe<float>(tmp, c, o);
       }, "ConfigError", {"load_packed_moe", "family", "got 9"}},
      {"FFNSublayer::set_mode(5)", [&] {
         FFNSublayer<double, SwiGLU<double>> s(4, SwiGLU<double>(4, 3));
         s.set_mode(mode);
       }, "ConfigError", {"FFNSublayer::set_mode", "mode", "got 5"}},
      {"FFNSublayer::forward(mode 5)", [&] {
         FFNSublayer<double, SwiGLU<double>> s(4, SwiGLU<double>(4, 3));
         FFNSublayer<double, SwiGLU<double>>::Cache cache;
         s.forward(Matrix<double>::Ones(2, 4), mode, &cache);
       }, "ConfigError", {"FFNSublayer::forward", "mode", "got 5"}},
  };
  auto packed_forward_with = [](packed::ForwardOptions o) {
    return [o] {
      auto p = PackedMoE<float>::from(MoEFFN<float>(small_config(), 3));
      p.set_kernel_options(o);
      p.forward(Matrix<float>::Ones(3, 4));
    };
  };
  packed::ForwardOptions bad_isa, bad_products;
  bad_isa.isa = isa;
  bad_products.bf16_products = products;
  cases.push_back({"PackedMoE::forward isa = 9", packed_forward_with(bad_isa), "ConfigError", {"isa", "got 9"}});
  cases.push_back({"PackedMoE::forward bf16_products = 9", packed_forward_with(bad_products), "ConfigError",
                   {"bf16_products", "got 9"}});
  cases.push_back({"PackedSwiGLU::forward bf16_products = 9", [&] {
                     auto p = PackedSwiGLU<float>::from(SwiGLU<float>(4, 3));
                     p.set_kernel_options(bad_products);
                     p.forward(Matrix<float>::Ones(3, 4));
                   }, "ConfigError", {"bf16_products", "got 9"}});
  cases.push_back({"kappa PackedMoE::forward bf16_products = 9", [&] {
                     MoEFFN<float, KappaSwiGLU<float>> m(small_config(), 3);
                     auto p = PackedMoE<float, KappaSwiGLU<float>>::from(m);
                     p.set_kernel_options(bad_products);
                     p.forward(Matrix<float>::Ones(3, 4), nullptr);
                   }, "ConfigError", {"bf16_products", "got 9"}});
  cases.push_back({"packed::to_bf16 isa = 9", [&] {
                     std::vector<float> src(4, 1.f);
                     std::vector<packed::bf16> dst(4);
                     packed::to_bf16(src.data(), dst.data(), 4, isa);
                   }, "ConfigError", {"isa", "got 9"}});
  // The writer's dtype was already a typed error (ValueError, as any dtype it cannot write).
  cases.push_back({"save_checkpoint SaveOptions.dtype = 99", [&] {
                     MoEFFN<double> m(small_config(), 2);
                     SaveOptions o;
                     o.dtype = out_of_range<safetensors::DType>(99);
                     save_checkpoint(tmp + ".y", m.param_values(), o);
                   }, "ValueError", {"dtype"}});
  run_sweep(cases);
  std::filesystem::remove(tmp);
}
