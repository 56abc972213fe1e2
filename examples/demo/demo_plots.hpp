#pragma once
/// \file demo_plots.hpp
/// The demo's charts: the loss curves, the expert load of the first MoE
/// layer over training, the load imbalance with and without the balancer,
/// and the LoRA fine-tuning of a packed model against the float one.

#include <apex/ffn/core/types.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <string>
#include <vector>

#include "plot.hpp"
#include "report.hpp"
#include "run_log.hpp"

namespace apex::demo {

/// Training bits per character (moving average), the quick validation scores and the bigram baseline.
inline void plot_loss(const std::string& path, const RunLog& log, double bigram_nll) {
  Series train{"train (moving avg 50)", log.step, moving_average(log.bpc, 50), palette(0)};
  Series val{"validation (first 8k chars)", log.val_step, log.val_bpc, palette(1), 3};
  Series base{"bigram baseline", {log.step.front(), log.step.back()}, {bigram_nll / kLn2, bigram_nll / kLn2},
              palette(7)};
  ChartOptions co;
  co.title = "Character-level LM: loss";
  co.x_label = "training step";
  co.y_label = "bits per character";
  co.y_min = 1.0;
  co.y_max = std::ceil(std::max(bigram_nll / kLn2, mean_of(log.bpc, 0, 10)) + 0.2);
  write_png(path, line_chart({train, val, base}, co));
}

/// Each expert's share of the first MoE layer (model layer `layer_id`) over training, balancer on.
inline void plot_expert_load(const std::string& path, const RunLog& log, Index layer_id) {
  std::vector<Series> s;
  const std::size_t layer = 0;  // the first MoE layer
  const std::size_t experts = log.load[layer].size();
  for (std::size_t e = 0; e < experts; ++e)
    s.push_back({"expert " + std::to_string(e), log.step, moving_average(log.load[layer][e], 50), palette(e)});
  s.push_back({"even share 1/E", {log.step.front(), log.step.back()}, {1.0 / double(experts), 1.0 / double(experts)},
               {120, 120, 120}, 1});
  ChartOptions co;
  co.title = "Expert load, MoE layer " + std::to_string(layer_id) + " (balancer on)";
  co.x_label = "training step";
  co.y_label = "share of routed slots (moving avg 50 steps)";
  co.y_min = 0;
  co.y_max = 0.5;
  write_png(path, line_chart(s, co));
}

/// Max/mean load averaged over the MoE layers for the first `steps` steps, with (`on`) and without (`off`) the balancer.
inline void plot_imbalance(const std::string& path, const RunLog& on_log, const RunLog& off_log, long steps) {
  const std::size_t layers = on_log.imbalance.size();
  std::vector<double> on(std::size_t(steps), 0.0), off(std::size_t(steps), 0.0), x;
  for (long i = 0; i < steps; ++i) {
    x.push_back(double(i + 1));
    for (std::size_t l = 0; l < layers; ++l) {
      on[std::size_t(i)] += on_log.imbalance[l][std::size_t(i)] / double(layers);
      off[std::size_t(i)] += off_log.imbalance[l][std::size_t(i)] / double(layers);
    }
  }
  std::vector<Series> s;
  s.push_back({"balancer on", x, moving_average(on, 25), palette(2)});
  s.push_back({"balancer off", x, moving_average(off, 25), palette(1)});
  ChartOptions co;
  co.title = "Load imbalance (max/mean), mean of MoE layers";
  co.x_label = "training step";
  co.y_label = "max load / mean load (moving avg 25 steps)";
  co.y_min = 1.0;
  write_png(path, line_chart(s, co));
}

/// LoRA fine-tuning of the model packed in `type`: each model's loss minus
/// the float model's on the same batch (moving average 25), so the float
/// model is the line at 0 and the packed model without adapters the
/// quantization's cost; the adapted model on the quick validation text
/// likewise, against the float model there. Batch-to-batch differences of
/// the losses themselves (±0.2 bits/char) would hide a 0.01 bits/char gap.
inline void plot_finetune(const std::string& path, const FineTuneLog& log, const std::string& type) {
  std::vector<double> lora(log.bpc.size()), base(log.bpc.size());
  for (std::size_t i = 0; i < log.bpc.size(); ++i) {
    lora[i] = log.bpc[i] - log.float_bpc[i];
    base[i] = log.base_bpc[i] - log.float_bpc[i];
  }
  std::vector<double> val(log.val_bpc.size());
  for (std::size_t i = 0; i < val.size(); ++i) val[i] = log.val_bpc[i] - log.float_val_bpc;
  const double x0 = log.step.front(), x1 = log.step.back();
  const double base_val = log.base_val_bpc - log.float_val_bpc;
  std::vector<Series> s;
  s.push_back({type + " + LoRA, training batches (avg 25)", log.step, moving_average(lora, 25), palette(0)});
  s.push_back({type + " alone, same batches (avg 25)", log.step, moving_average(base, 25), palette(1)});
  s.push_back({type + " + LoRA, validation (8k chars)", log.val_step, val, palette(2), 3});
  s.push_back({type + " alone, validation", {x0, x1}, {base_val, base_val}, palette(3), 1});
  s.push_back({"float model", {x0, x1}, {0.0, 0.0}, {120, 120, 120}, 1});
  double lo = 0, hi = 0;
  for (const Series& e : s)
    for (double y : e.y) lo = std::min(lo, y), hi = std::max(hi, y);
  ChartOptions co;
  co.title = "LoRA on frozen " + type + " weights";
  co.x_label = "fine-tuning step";
  co.y_label = "bits per character above the float model";
  co.y_min = lo - 0.05 * (hi - lo);
  co.y_max = hi + 0.6 * (hi - lo);  // the top for the legend
  write_png(path, line_chart(s, co));
}

}  // namespace apex::demo
