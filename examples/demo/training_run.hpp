#pragma once
/// \file training_run.hpp
/// The demo's two training runs: the main run, logged step by step to
/// log.csv and scored on the start of the validation text as it goes, and
/// the contrast run of the same model with the balancer's bias updates off.

#include <apex/ffn/core/types.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "char_model.hpp"
#include "evaluate.hpp"
#include "progress.hpp"
#include "report.hpp"
#include "run_log.hpp"
#include "text_data.hpp"
#include "trainer.hpp"

namespace apex::demo {

/// What both training runs read: the text, the schedule and the padding id.
struct TrainingInput {
  const Corpus& corpus;
  const TrainOptions& topt;
  Index pad;
};

/// Indices of the model's MoE layers, in order.
inline std::vector<Index> moe_layer_indices(const CharModel<float>& model) {
  std::vector<Index> ids;
  for (Index l = 0; l < model.n_layers(); ++l)
    if (model.is_moe(l)) ids.push_back(l);
  return ids;
}

/// log.csv's header: the step's scalars, each MoE layer's max/mean load, each expert's share.
inline std::vector<std::string> log_columns(const std::vector<Index>& moe_layer_ids, std::size_t experts) {
  std::vector<std::string> columns = {"step", "lr", "U", "loss", "train_bpc", "kappa_reg", "skip_penalty",
                                      "grad_norm", "skip_rate", "val_bpc"};
  for (Index l : moe_layer_ids) columns.push_back("imbalance_layer" + std::to_string(l));
  for (Index l : moe_layer_ids)
    for (std::size_t e = 0; e < experts; ++e)
      columns.push_back("load_layer" + std::to_string(l) + "_expert" + std::to_string(e));
  return columns;
}

/// Step `s`'s row of log.csv, in log_columns' order (`val` NaN where not evaluated).
inline std::vector<double> log_row(long s, const StepStats& st, double bpc, double skip, double val) {
  std::vector<double> row = {double(s + 1), st.lr, st.U, st.loss, bpc, st.kappa_reg, st.skip_penalty, st.grad_norm,
                             skip, val};
  for (const auto& r : st.load) row.push_back(r.imbalance);
  for (const auto& r : st.load)
    for (double x : r.load) row.push_back(x);
  return row;
}

/// Appends step `s`'s statistics (bits per character `bpc`, `tokens` processed) to the log.
inline void record_step(RunLog& log, long s, const StepStats& st, double bpc, double tokens) {
  log.tokens += tokens;
  log.step.push_back(double(s + 1));
  log.bpc.push_back(bpc);
  log.loss.push_back(st.loss);
  log.lr.push_back(st.lr);
  log.U.push_back(st.U);
  log.grad_norm.push_back(st.grad_norm);
  log.skip.push_back(mean_of(st.skip_rate));
  log.add_load(st.load);
}

/// The main run: `topt.steps` steps on `model`, one row of `csv_path` each, the
/// first kQuickEvalTokens validation characters scored twelve times along the way.
inline RunLog train_main_run(CharModel<float>& model, const TrainingInput& in, const std::vector<Index>& moe_layer_ids,
                             const std::string& csv_path) {
  const std::size_t experts = std::size_t(model.config().preset.n_experts);
  CsvLog csv(csv_path, log_columns(moe_layer_ids, experts));
  RunLog log;
  log.init(moe_layer_ids.size(), experts);
  const long steps = in.topt.steps;
  const long eval_every = std::max<long>(1, steps / 12);
  const Index tokens_per_step = in.topt.chunks * in.topt.chunk_len;
  Trainer<float> trainer(model, in.corpus.train, in.topt, in.pad);
  ProgressBar bar(steps);
  double smooth = NAN;
  for (long s = 0; s < steps; ++s) {
    const StepStats st = trainer.step();
    const double bpc = st.main_loss / kLn2;
    smooth = std::isfinite(smooth) ? 0.95 * smooth + 0.05 * bpc : bpc;
    record_step(log, s, st, bpc, double(tokens_per_step));
    double val = NAN;
    if ((s + 1) % eval_every == 0 || s + 1 == steps) {
      val = evaluate(model, in.corpus.val, 0, kQuickEvalTokens, in.pad).bpc();
      log.val_step.push_back(double(s + 1));
      log.val_bpc.push_back(val);
    }
    csv.row(log_row(s, st, bpc, log.skip.back(), val));
    bar.update(s + 1, smooth, log.tokens);
  }
  csv.flush();
  log.seconds = bar.seconds();
  return log;
}

/// The contrast run: a model built as the main one (`cfg`, `seed`) trained on the
/// same batches and schedule for `steps` steps with the balancer's bias updates
/// off, logging the expert load only. Empty when `steps` is 0.
inline RunLog train_contrast_run(const CharModelConfig& cfg, std::uint64_t seed, int threads, const TrainingInput& in,
                                 long steps) {
  RunLog nolb;
  if (steps <= 0) return nolb;
  CharModel<float> plain(cfg, seed);
  plain.set_threads(threads);
  TrainOptions t = in.topt;
  t.balance = false;  // same seed, batches and schedule: only the balancer differs
  Trainer<float> tr(plain, in.corpus.train, t, in.pad);
  nolb.init(plain.moe_layers().size(), std::size_t(cfg.preset.n_experts));
  const Index tokens_per_step = in.topt.chunks * in.topt.chunk_len;
  ProgressBar cbar(steps, "no-balancer");
  for (long s = 0; s < steps; ++s) {
    const StepStats st = tr.step();
    nolb.add_load(st.load);
    nolb.tokens += double(tokens_per_step);
    cbar.update(s + 1, st.main_loss / kLn2, nolb.tokens);
  }
  return nolb;
}

}  // namespace apex::demo
