#pragma once
/// \file moe/moe_parts.hpp
/// `MoEParts<T, Expert>`: the trainable parts of an MoE layer — router,
/// balancer, routed experts, shared experts, shared-expert gate — and their
/// lazy gradients, held once for every layer that trains them (MoEFFN, and
/// each rank of ExpertParallelMoE with its shard of the routed experts).
///
/// Weights are drawn in one order whatever the shard: router, every routed
/// expert (a rank keeps its own and discards the others' draws), shared
/// experts, shared gate — so a rank's experts are the single-process layer's
/// for the same seed. Gradients are lazy (core/param.hpp): all of them at
/// once after one memory-fit check, before any parallel section, so no
/// expert task allocates (moe/expert_contract.hpp) and a failed allocation
/// leaves none half made.

#include <cstdint>
#include <string>
#include <vector>

#include "../core/init.hpp"
#include "../core/memory_budget.hpp"
#include "../core/param.hpp"
#include "../core/state_names.hpp"
#include "../core/types.hpp"
#include "../layers/swiglu.hpp"
#include "config.hpp"
#include "expert_contract.hpp"
#include "load_balancer.hpp"
#include "router.hpp"

namespace apex::detail {

template <class T, class Expert>
struct MoEParts {
  Router<T> router;                 ///< W_router: E × d
  LoadBalancer<T> balancer;         ///< the balancing bias b: 1 × E (selection only, no gradient)
  std::vector<Expert> experts;      ///< the routed experts held here: all E, or a rank's shard
  std::vector<SwiGLU<T>> shared;    ///< S shared experts, d × shared_ffn()
  Matrix<T> shared_gate;            ///< 1 × d with shared_expert_gate (Qwen2-MoE), else 0 × 0
  Matrix<T> shared_gate_grad;       ///< 1 × d with shared_expert_gate, once allocated; else 0 × 0
  bool has_gradients = false;       ///< allocate_gradients ran

  /// The parts of a layer of `config` (validated by the caller), keeping the
  /// routed experts [first, last) of the E it draws.
  MoEParts(const MoEConfig& config, Rng& rng, Index first, Index last)
      : router(config.d_model, config.n_experts, config.n_active, rng, config.router_bias),
        balancer(config.n_experts, config.n_active, config.balancer_alpha) {
    router.set_routing(config.routing);
    experts.reserve(std::size_t(last - first));
    for (Index e = 0; e < config.n_experts; ++e) {
      if (e >= first && e < last) experts.emplace_back(config.d_model, config.d_ffn, rng);
      else Expert(config.d_model, config.d_ffn, rng);  // the same draws, discarded
    }
    shared.reserve(std::size_t(config.n_shared));
    for (Index s = 0; s < config.n_shared; ++s) shared.emplace_back(config.d_model, config.shared_ffn(), rng);
    if (config.shared_expert_gate) {  // drawn last
      shared_gate.resize(1, config.d_model);
      init_linear(shared_gate, rng);
    }
  }

  /// `router.weight`, `experts.{e}.…` (e from first_expert on), `shared_experts.{s}.…`,
  /// `shared_expert_gate.weight` in state_dict order, values only: never
  /// allocates gradients (core/param.hpp).
  ParamList<T> param_values(Index first_expert) {
    ParamList<T> out;
    append_prefixed(out, state_names::kRouterPrefix, router.param_values());
    for (std::size_t j = 0; j < experts.size(); ++j)
      append_prefixed(out, state_names::routed_expert(first_expert + Index(j)), param_values_of(experts[j]));
    for (std::size_t s = 0; s < shared.size(); ++s)
      append_prefixed(out, state_names::shared_expert(s), shared[s].param_values());
    if (shared_gate.size() > 0) out.push_back(make_value_param<T>(state_names::kSharedGate, shared_gate));
    return out;
  }

  /// The same tensors with their gradients, which must exist (allocate_gradients).
  ParamList<T> params(Index first_expert) {
    ParamList<T> out;
    append_prefixed(out, state_names::kRouterPrefix, router.params());
    for (std::size_t j = 0; j < experts.size(); ++j)
      append_prefixed(out, state_names::routed_expert(first_expert + Index(j)), experts[j].params());
    append_shared_params(out);
    return out;
  }

  /// The parts every rank of an expert-parallel layer holds a replica of
  /// (router, shared experts, shared gate), with their gradients, which must exist.
  ParamList<T> replicated_params() {
    ParamList<T> out;
    append_prefixed(out, state_names::kRouterPrefix, router.params());
    append_shared_params(out);
    return out;
  }

  /// Allocates every gradient, zeroed, unless done already. ConfigError
  /// (core/memory_budget.hpp) naming `what` and the bytes if the weights
  /// plus the gradients exceed physical memory; nothing is allocated then.
  void allocate_gradients(const char* where, const std::string& what) {
    if (has_gradients) return;
    // Every parameter gets a gradient of its size: exact for any expert type.
    const std::uint64_t bytes = scalar_bytes<T>(where, "gradient bytes", parameter_count(param_values(0)));
    check_gradient_fit(where, what, bytes, bytes);
    router.allocate_gradients();
    for (auto& e : experts) allocate_gradients_of(e);
    for (auto& s : shared) s.allocate_gradients();
    if (shared_gate.size() > 0) shared_gate_grad = Matrix<T>::Zero(1, shared_gate.cols());
    has_gradients = true;
  }

  /// Zeroes every gradient (allocating them, zeroed, if not yet).
  void zero_grad(const char* where, const std::string& what) {
    if (!has_gradients) return allocate_gradients(where, what);
    router.zero_grad();
    for (auto& e : experts) e.zero_grad();
    for (auto& s : shared) s.zero_grad();
    shared_gate_grad.setZero();
  }

 private:
  void append_shared_params(ParamList<T>& out) {
    for (std::size_t s = 0; s < shared.size(); ++s)
      append_prefixed(out, state_names::shared_expert(s), shared[s].params());
    if (shared_gate.size() > 0)
      out.push_back(make_param<T>(state_names::kSharedGate, shared_gate, shared_gate_grad));
  }
};

}  // namespace apex::detail
