#pragma once
/// \file mpi/rank_memory.hpp
/// What one rank of an ExpertParallelMoE holds, for its memory-fit checks
/// (core/memory_budget.hpp): the replicated router, bias, shared experts and
/// gate, and the routed experts of its shard.

#include <cstdint>
#include <string>

#include "../core/checked_size.hpp"
#include "../core/memory_budget.hpp"
#include "../moe/config.hpp"
#include "../moe/moe_ffn.hpp"

namespace apex::mpi::detail {

/// Bytes of one rank's weights: MoEFFN::weight_bytes of its `local` routed
/// experts, plus the router rows and bias entries of the other experts.
/// ConfigError naming `where` if a count overflows.
template <class T, class Expert>
std::uint64_t rank_weight_bytes(const MoEConfig& config, Index local, const char* where) {
  MoEConfig mine = config;
  mine.n_experts = local;
  const Index others = apex::detail::checked_product(where, "router size of the other experts",
                                                     {config.n_experts - local, config.d_model + 1});
  return MoEFFN<T, Expert>::weight_bytes(mine, where) + apex::detail::scalar_bytes<T>(where, "router bytes", others);
}

/// "a float expert-parallel MoE rank (d_model 2048, d_ffn 5504, 16 of 64 + 2
/// experts)", for the memory-fit messages.
template <class T>
std::string rank_description(const MoEConfig& config, Index local) {
  return std::string("a ") + (sizeof(T) == 4 ? "float" : sizeof(T) == 8 ? "double" : "") +
         " expert-parallel MoE rank (d_model " + std::to_string(config.d_model) + ", d_ffn " +
         std::to_string(config.d_ffn) + ", " + std::to_string(local) + " of " + std::to_string(config.n_experts) +
         " + " + std::to_string(config.n_shared) + " experts)";
}

}  // namespace apex::mpi::detail
