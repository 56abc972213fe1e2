#pragma once
/// \file layers/skip_decision.hpp
/// Which tokens the FFN of an FFN sublayer (layers/ffn_sublayer.hpp) sees:
/// the keep decision m_t = 1[g(x_t) ≥ τ] of the skip gate (every token
/// without a gate), as the kept and skipped token lists the sublayer gathers
/// rows by (docs/math.md#ffn-sublayer). Kept apart from the sublayer so the
/// decision reads on its own, beside the running of the FFN on its result.

#include <cstddef>
#include <optional>
#include <vector>

#include "../core/types.hpp"
#include "skip_gate.hpp"

namespace apex::detail::sublayer {

/// Which tokens the FFN sees: m_t = 1[g_t ≥ τ] (every token without a gate).
template <class T>
struct Decision {
  std::vector<Index> kept;                ///< ascending tokens with m = 1
  std::vector<Index> skipped;             ///< ascending tokens with m = 0
  typename SkipGate<T>::Cache gate;       ///< g of every token (all fields in training)
};

/// x: N × d → the decision for its N tokens; `train` keeps the gate's
/// activations (the straight-through backward reads them).
template <class T>
Decision<T> decide(const std::optional<SkipGate<T>>& gate, const ConstMatrixRef<T>& x, bool train) {
  const Index n = x.rows();
  Decision<T> d;
  if (!gate) {
    d.kept.resize(std::size_t(n));
    for (Index t = 0; t < n; ++t) d.kept[std::size_t(t)] = t;
    return d;
  }
  // Training keeps the gate's activations for the straight-through backward.
  if (train)
    gate->forward(x, &d.gate);
  else
    d.gate.g = gate->forward(x, nullptr);
  for (Index t = 0; t < n; ++t) (gate->keep(d.gate.g(t)) ? d.kept : d.skipped).push_back(t);
  return d;
}

}  // namespace apex::detail::sublayer
