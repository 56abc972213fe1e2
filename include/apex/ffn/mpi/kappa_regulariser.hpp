#pragma once
/// \file mpi/kappa_regulariser.hpp
/// κ-SwiGLU's layer-wide regulariser for an expert-parallel layer.
///
/// `add_kappa_regularizer_grad` of mpi/kappa_regulariser.hpp averages over the experts
/// a layer object holds — on a rank, its shard — so under expert
/// parallelism it would give each rank a different, per-shard mean. This
/// version weighs every expert by 1/E (all experts of the layer), adds each
/// local expert's gradient, and sums the local values across ranks in rank
/// order, so every rank returns the single-process value. Collective.

#include "../layers/kappa_experts.hpp"
#include "expert_parallel_moe.hpp"
#include "fixed_order_sum.hpp"

namespace apex::mpi {

/// w·(mean(b²) + mean(α²)) over all E×f entries of the layer (every rank
/// returns it), with its gradient added into this rank's experts' α and b.
template <class T, class Expert>
T add_kappa_regularizer_grad(ExpertParallelMoE<T, Expert>& moe) {
  const T scale = T(1) / T(moe.config().n_experts);
  T total = T(0);
  for (auto& e : moe.experts()) total += e.add_regularizer_grad(scale);
  fixed_order_sum(moe.comm(), &total, 1);
  return total;
}

}  // namespace apex::mpi
