// Every option of every configuration against what it will be used as: a
// floating option against the range of the scalar type the layer computes
// in, an enum field against its enumerators. A value a double holds but a
// float does not (1e39) must be a ConfigError naming the field in a float
// layer, and accepted in a double layer; an enum value outside its
// enumerators (a cast from an integer) must be a ConfigError naming the
// field and the value, never silently read as another enumerator.
// docs/error_model.md lists what is checked.
#include <apex/ffn/cross_entropy.hpp>
#include <apex/ffn/family_presets.hpp>
#include <apex/ffn/ffn_sublayer.hpp>
#include <apex/ffn/inference.hpp>
#include <apex/ffn/inference/packed_load.hpp>
#include <apex/ffn/kappa_swiglu.hpp>
#include <apex/ffn/load_balancer.hpp>
#include <apex/ffn/moe.hpp>
#include <apex/ffn/multi_token_heads.hpp>
#include <apex/ffn/name_maps.hpp>
#include <apex/ffn/rms_norm.hpp>
#include <apex/ffn/skip_gate.hpp>

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

MoEConfig small_config() {
  MoEConfig c;
  c.d_model = 4;
  c.d_ffn = 3;
  c.n_experts = 4;
  c.n_active = 2;
  c.n_shared = 1;
  return c;
}

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
  // routing_config.hpp, moe_config.hpp and the other configs checked their
  // floating options for finiteness as doubles only: routing.routed_scale =
  // 1e39 in MoEFFN<float> became +inf and the output non-finite (the κ
  // options alone were checked against the layer's scalar). Fixed: every
  // option a layer converts to its scalar type T must lie within T's range
  // (detail::require_fits, scalar_range.hpp), checked where the layer is
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
  // in double and clamped to the batch (capacity.hpp), so it is the one
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
