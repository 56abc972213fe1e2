#pragma once
/// \file adapters/lora_options.hpp
/// What a layer of low-rank adapters (LoRA, Hu et al. 2021) on frozen
/// experts trains: the rank r, the scale α, which projections of each expert
/// carry an adapter, whether the routed experts share one, and whether the
/// router trains too. An adapted projection W (out × in, frozen) computes
///
///     y = x·Wᵀ + s·(x·Aᵀ)·Bᵀ,   A: r × in,  B: out × r,  s = α/r  (α/√r with rslora)
///
/// as peft's `LoraConfig` (`r`, `lora_alpha`, `use_rslora`, `target_modules`)
/// defines it. B starts at zero, so the adapted layer starts equal to the
/// frozen one.

#include <cmath>
#include <string>

#include "../core/errors.hpp"
#include "../core/scalar_range.hpp"
#include "../core/types.hpp"

namespace apex {

/// The projections of an expert that carry an adapter. `gate_up` is one
/// adapter over the fused 2f × d gate/up weight (gate rows first): gate and
/// up share A, as peft adapts transformers' fused `gate_up_proj`; `gate` and
/// `up` are one adapter each, as peft adapts separate `gate_proj`/`up_proj`
/// modules. `gate_up` excludes the other two.
struct LoraTargets {
  bool gate = false;
  bool up = false;
  bool gate_up = true;
  bool down = true;
};

/// The options of one layer's adapters.
struct LoraOptions {
  Index rank = 8;          ///< r: 1 ≤ r ≤ min(in, out) of every adapted projection
  double alpha = 16;       ///< α: finite, > 0, within float
  bool rslora = false;     ///< s = α/√r (rank-stabilised, peft's `use_rslora`) instead of α/r
  LoraTargets targets;     ///< which projections of each expert are adapted
  bool per_expert = true;  ///< false: one adapter per projection, shared by every routed expert
  bool shared_experts = true;  ///< adapters on the shared experts too (each its own)
  bool train_router = false;   ///< router weights (and logit bias) among the trainable parameters

  /// s = α/r, or α/√r with rslora.
  double scale() const { return rslora ? alpha / std::sqrt(double(rank)) : alpha / double(rank); }

  /// ConfigError naming the field unless the options fit experts of width
  /// d (model) and f (hidden): targets chosen and consistent, 1 ≤ r ≤ the
  /// smaller side of every adapted projection, α finite, positive and a
  /// float. `what` names the experts ("routed experts", "shared experts").
  void validate(const char* where, Index d, Index f, const char* what = "experts") const {
    const auto fail = [&](const std::string& m) { throw ConfigError(std::string(where) + ": LoraOptions: " + m); };
    if (!(targets.gate || targets.up || targets.gate_up || targets.down))
      fail("no projection is targeted (set targets.gate_up, gate, up or down)");
    if (targets.gate_up && (targets.gate || targets.up))
      fail("targets.gate_up adapts gate and up together; it excludes targets.gate and targets.up");
    if (!(std::isfinite(alpha) && alpha > 0)) fail("alpha must be finite and > 0, got " + std::to_string(alpha));
    detail::require_fits<float>(where, "LoraOptions alpha", alpha);
    if (rank < 1) fail("rank must be >= 1, got " + std::to_string(rank));
    // Every adapted projection is d × f or f × d (gate_up 2f × d): r ≤ min(d, f) covers all.
    const Index limit = d < f ? d : f;
    if (rank > limit)
      fail("rank " + std::to_string(rank) + " exceeds min(in, out) = " + std::to_string(limit) + " of the " + what +
           "' projections (d_model " + std::to_string(d) + ", d_ffn " + std::to_string(f) + ")");
    detail::require_fits<float>(where, "LoraOptions scale", scale());
  }
};

}  // namespace apex
