#pragma once
/// \file moe/config.hpp
/// MoE layer configuration, its validation, and the APEX-1 model presets.

#include <cmath>
#include <string>

#include "../core/errors.hpp"
#include "routing_config.hpp"
#include "../core/types.hpp"

namespace apex {

/// Shape and routing options of one MoEFFN layer.
struct MoEConfig {
  Index d_model = 0;    ///< token width d
  Index d_ffn = 0;      ///< hidden width f of every expert (routed and shared)
  Index n_experts = 0;  ///< routed experts E ≥ 1
  Index n_active = 0;   ///< experts per token K, 1 ≤ K ≤ E
  Index n_shared = 0;   ///< always-active shared experts, ≥ 0
  /// Routing weights from the unbiased logits ℓ (DeepSeek-V3) instead of the
  /// biased r = ℓ + b (the default); the bias then only steers selection.
  bool weights_from_unbiased = false;
  double balancer_alpha = 1e-3;  ///< bias step α of the load balancer
  /// Scoring, group-limited selection, renormalisation and routed scale
  /// (moe/routing_config.hpp, docs/routing.md); the default is APEX-1's router.
  RoutingConfig routing{};
  /// Hidden width of each shared expert (0: d_ffn). Qwen2-MoE's shared
  /// expert is wider than its routed ones; DeepSeek-V3 fuses its shared
  /// experts into one of width n_shared·d_ffn.
  Index d_shared_ffn = 0;
  /// Qwen2-MoE's `shared_expert_gate`: the shared experts' sum is scaled per
  /// token by σ(x·w_gate) (w_gate: 1 × d, trained, no bias).
  bool shared_expert_gate = false;
  /// gpt-oss's router `Linear(d, E)` with a bias: ℓ = X·W_routerᵀ + b_r, b_r
  /// (1 × E, `router.bias`) trained with its gradient. Not the balancer's
  /// selection bias, which it adds to.
  bool router_bias = false;

  /// The shared experts' hidden width.
  Index shared_ffn() const { return d_shared_ffn > 0 ? d_shared_ffn : d_ffn; }

  /// Throws ConfigError naming the first field that is out of range.
  void validate(const char* where = "MoEConfig") const {
    auto need = [&](bool ok, const std::string& what) { detail::require_config(ok, where, what); };
    need(d_model > 0, "d_model must be positive, got " + std::to_string(d_model));
    need(d_ffn > 0, "d_ffn must be positive, got " + std::to_string(d_ffn));
    need(n_experts >= 1, "n_experts must be >= 1, got " + std::to_string(n_experts));
    need(n_active >= 1 && n_active <= n_experts, "n_active (K) must satisfy 1 <= K <= n_experts = " +
                                                      std::to_string(n_experts) + ", got " + std::to_string(n_active));
    need(n_shared >= 0, "n_shared must be >= 0, got " + std::to_string(n_shared));
    need(std::isfinite(balancer_alpha) && balancer_alpha >= 0,
         "balancer_alpha must be finite and >= 0, got " + std::to_string(balancer_alpha));
    need(d_shared_ffn >= 0, "d_shared_ffn must be >= 0 (0: d_ffn), got " + std::to_string(d_shared_ffn));
    routing.validate(where, n_experts, n_active);
  }

  /// As validate(), for a layer that computes in T: also ConfigError for a
  /// floating option beyond T's range (core/scalar_range.hpp). Every MoE layer
  /// calls this where it is built (PackedMoE with T = float).
  template <class T>
  void validate_for(const char* where = "MoEConfig") const {
    validate(where);
    detail::require_fits<T>(where, "balancer_alpha", balancer_alpha);
    routing.check_scalar_range<T>(where);
  }
};

/// Whole-model sizes of the APEX-1 code's presets (docs/math.md#router). An
/// older table lists other expert counts (Small 4/2/1, Medium 64/8/2, Large
/// 256/8/2): an erratum (docs/math.md#errata); these are the code's values.
struct ModelPreset {
  const char* name;
  Index d_model, n_layers, d_ffn, n_experts, n_active, n_shared, skip_hidden;

  /// The MoE layer configuration of this preset.
  MoEConfig moe() const { return MoEConfig{d_model, d_ffn, n_experts, n_active, n_shared}; }

  /// APEX-1 places MoE on odd layers (`layer % 2 != 0`), dense SwiGLU on even ones.
  static constexpr bool is_moe_layer(Index layer) { return layer % 2 != 0; }

  static constexpr ModelPreset tiny() { return {"tiny", 64, 6, 128, 4, 2, 1, 16}; }
  static constexpr ModelPreset small() { return {"small", 512, 12, 1376, 8, 2, 1, 64}; }
  static constexpr ModelPreset medium() { return {"medium", 2048, 36, 5504, 64, 4, 2, 128}; }
  static constexpr ModelPreset large() { return {"large", 7168, 72, 18432, 256, 8, 4, 256}; }

  /// Preset by name ("tiny", "small", "medium", "large"); ConfigError otherwise.
  static ModelPreset by_name(const std::string& name) {
    for (const ModelPreset& p : {tiny(), small(), medium(), large()})
      if (name == p.name) return p;
    throw ConfigError("ModelPreset::by_name: unknown preset '" + name + "' (tiny, small, medium, large)");
  }
};

}  // namespace apex
