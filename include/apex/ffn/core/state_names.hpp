#pragma once
/// \file core/state_names.hpp
/// The state_dict names of the library's layers, spelled once: what
/// `params()` / `param_values()` call each tensor, what checkpoints store
/// and what the packed loaders and the family name maps look up.
///
///     router.weight                 E × d    the router
///     router.bias                   1 × E    its trained logit bias, with MoEConfig::router_bias
///     experts.{e}.w_gate.weight     f × d    routed expert e (global id) — a SwiGLU's three projections
///     experts.{e}.w_up.weight       f × d
///     experts.{e}.w_down.weight     d × f
///     shared_experts.{s}.w_*.weight          shared expert s, same three
///     shared_expert_gate.weight     1 × d    the shared experts' sigmoid gate
///     experts.{e}.kappa_alpha       1 × f    a κ-SwiGLU expert's sharpness slope α and bias b
///     experts.{e}.kappa_bias        1 × f

#include <string>

#include "types.hpp"

namespace apex::state_names {

inline constexpr const char* kRouterPrefix = "router.";                  ///< + the Router's own "weight"
inline constexpr const char* kRouter = "router.weight";
inline constexpr const char* kRouterBias = "router.bias";                ///< a router's trained logit bias (gpt-oss)
inline constexpr const char* kSharedGate = "shared_expert_gate.weight";
inline constexpr const char* kRoutedPrefix = "experts.";                 ///< every routed expert's names start so
inline constexpr const char* kSharedPrefix = "shared_experts.";
inline constexpr const char* kGate = "w_gate.weight";                    ///< a SwiGLU's projections
inline constexpr const char* kUp = "w_up.weight";
inline constexpr const char* kDown = "w_down.weight";
inline constexpr const char* kKappaAlpha = "kappa_alpha";                ///< a κ-SwiGLU expert's α and b
inline constexpr const char* kKappaBias = "kappa_bias";

/// "experts.{e}." — the prefix of routed expert e's tensors (e its global id).
inline std::string routed_expert(Index e) { return kRoutedPrefix + std::to_string(e) + "."; }

/// "shared_experts.{s}." — the prefix of shared expert s's tensors.
inline std::string shared_expert(Index s) { return kSharedPrefix + std::to_string(s) + "."; }

/// True for a SwiGLU projection name ("w_gate.weight", "w_up.weight", "w_down.weight").
inline bool is_projection(const std::string& w) { return w == kGate || w == kUp || w == kDown; }

}  // namespace apex::state_names
