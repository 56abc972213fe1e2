#pragma once
/// \file run_log.hpp
/// The per-step records of one training run — loss, schedule, gradient norm,
/// skip rate, every MoE layer's expert load — and the load of a window of
/// its steps.

#include <apex/ffn/moe/load_balancer.hpp>
#include <apex/ffn/core/types.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

#include "report.hpp"

namespace apex::demo {

/// Nats per bit: a loss in nats over this is in bits.
inline constexpr double kLn2 = 0.6931471805599453;

/// Per-step records of one training run.
struct RunLog {
  std::vector<double> step, bpc, loss, lr, U, grad_norm, skip, val_step, val_bpc;
  std::vector<std::vector<double>> imbalance;               ///< [moe layer][step]
  std::vector<std::vector<std::vector<double>>> load;       ///< [moe layer][expert][step]
  std::vector<std::vector<Index>> counts;                   ///< [moe layer][expert]: whole run
  std::vector<Index> tokens_routed;                         ///< [moe layer]
  double seconds = 0, tokens = 0;

  void init(std::size_t layers, std::size_t experts) {
    imbalance.assign(layers, {});
    load.assign(layers, std::vector<std::vector<double>>(experts));
    counts.assign(layers, std::vector<Index>(experts, 0));
    tokens_routed.assign(layers, 0);
  }
  void add_load(const std::vector<LoadReport>& reports) {
    for (std::size_t l = 0; l < reports.size(); ++l) {
      imbalance[l].push_back(reports[l].imbalance);
      for (std::size_t e = 0; e < reports[l].load.size(); ++e) {
        load[l][e].push_back(reports[l].load[e]);
        counts[l][e] += reports[l].counts[e];
      }
      tokens_routed[l] += reports[l].tokens;
    }
  }
  /// Mean over MoE layers of the per-step imbalance, steps [0, n).
  double mean_imbalance(std::size_t n) const {
    double s = 0;
    for (const auto& v : imbalance) s += mean_of(v, 0, n);
    return imbalance.empty() ? NAN : s / double(imbalance.size());
  }
};

/// Per-step records of a LoRA fine-tuning run (finetune_run.hpp): the
/// adapted model's main-head loss on each batch and, on the same batch, the
/// float model's and the packed model's without adapters, in bits/char.
struct FineTuneLog {
  std::vector<double> step, lr, bpc, float_bpc, base_bpc, grad_norm, step_ms;
  std::vector<double> val_step, val_bpc;  ///< the adapted model on the quick validation text
  double float_val_bpc = 0, base_val_bpc = 0;  ///< the float and the unadapted packed model on it
  /// Paired timings: a fine-tuning step and, right after it, a float
  /// training step of the same model (milliseconds).
  std::vector<double> pair_lora_ms, pair_float_ms;
};

/// Mean per-expert load of one MoE layer over steps [first, last) (each step's load has equal weight).
inline LoadReport window_load(const RunLog& log, std::size_t layer, std::size_t first, std::size_t last) {
  LoadReport r;
  const auto& per_expert = log.load[layer];
  r.load.resize(per_expert.size());
  double mx = 0;
  for (std::size_t e = 0; e < per_expert.size(); ++e) {
    r.load[e] = mean_of(per_expert[e], first, last);
    mx = std::max(mx, r.load[e]);
  }
  r.imbalance = mx * double(per_expert.size());
  return r;
}

}  // namespace apex::demo
