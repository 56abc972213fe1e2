#pragma once
/// \file moe/moe_gradients.hpp
/// The gradients of an MoE layer's trainable parts — the router, the routed
/// experts, the shared experts and the shared-expert gate — allocated all at
/// once after one memory-fit check and zeroed together, for every layer that
/// holds such parts (MoEFFN; ExpertParallelMoE, a rank's share). Gradients
/// are lazy (core/param.hpp); a layer allocates them before its parallel
/// section, so no expert task allocates (moe/expert_contract.hpp).

#include <cstdint>
#include <string>
#include <vector>

#include "../core/memory_budget.hpp"
#include "../core/types.hpp"
#include "../layers/swiglu.hpp"
#include "expert_contract.hpp"
#include "router.hpp"

namespace apex::detail {

/// References to a layer's trainable parts.
template <class T, class Expert>
struct MoEGradientParts {
  Router<T>& router;
  std::vector<Expert>& experts;
  std::vector<SwiGLU<T>>& shared;
  Matrix<T>& shared_gate_grad;  ///< 1 × d once allocated with a shared gate, else 0 × 0
  Index gate_width;             ///< d with a shared gate, 0 without
};

/// Allocates every part's gradient, zeroed. `gradient_bytes`: all of them
/// (exact for any expert type when counted from param_values(), as every
/// parameter gets a gradient of its size), which is also the weights' bytes.
/// ConfigError (core/memory_budget.hpp) naming `what` if weights plus
/// gradients exceed physical memory; nothing is allocated then.
template <class T, class Expert>
void allocate_moe_gradients(const char* where, const std::string& what, std::uint64_t gradient_bytes,
                            const MoEGradientParts<T, Expert>& parts) {
  check_gradient_fit(where, what, gradient_bytes, gradient_bytes);
  parts.router.allocate_gradients();
  for (auto& e : parts.experts) allocate_gradients_of(e);
  for (auto& s : parts.shared) s.allocate_gradients();
  if (parts.gate_width > 0) parts.shared_gate_grad = Matrix<T>::Zero(1, parts.gate_width);
}

/// Zeroes every part's gradient; they must exist (allocate_moe_gradients).
template <class T, class Expert>
void zero_moe_gradients(const MoEGradientParts<T, Expert>& parts) {
  parts.router.zero_grad();
  for (auto& e : parts.experts) e.zero_grad();
  for (auto& s : parts.shared) s.zero_grad();
  parts.shared_gate_grad.setZero();
}

}  // namespace apex::detail
