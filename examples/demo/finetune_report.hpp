#pragma once
/// \file finetune_report.hpp
/// The fine-tuning stage's results (finetune_run.hpp): console lines, its
/// section of report.md and its CSV log.

#include <cmath>
#include <string>
#include <vector>

#include "finetune_run.hpp"
#include "report.hpp"
#include "run_log.hpp"

namespace apex::demo {

inline double kib(double bytes) { return bytes / 1024.0; }

/// Bits/char difference a − b of two losses in nats.
inline double bpc_delta(double a, double b) { return (a - b) / kLn2; }

/// How much of the quantization's cost the fine-tuning won back, in words:
/// a share of the gap, or all of it and how far past the float model the
/// adapters went (they also train the model further on the training text).
inline std::string recovery_text(const FineTuneRun& r) {
  if (!(r.before.loss > r.float_loss)) return "the packed model was not worse than the float model to start with";
  if (r.after.loss <= r.float_loss)
    return fmt("all of the gap won back and %.4f bits/char more: the adapters also train the model further",
               bpc_delta(r.float_loss, r.after.loss));
  return fmt("%.0f%% of the gap won back", 100 * r.recovered());
}

/// The run as console lines.
inline std::string finetune_summary(const FineTuneRun& r) {
  if (!r.applicable) return fmt("LoRA fine-tuning on %s: not applicable: %s\n", r.type.c_str(), r.reason.c_str());
  const FineTuneMemory& m = r.memory;
  std::string out = fmt("LoRA fine-tuning on %s weights (rank %ld, %ld adapter parameters, %ld steps: %.1f s, %.1f s "
                        "with the evaluations):\n",
                        r.type.c_str(), long(r.lora.rank), long(r.adapter_params), r.opt.steps, r.train_seconds,
                        r.seconds);
  out += fmt("  validation: float %.4f bits/char, %s before %.4f (%+.4f), after %.4f (%+.4f): %s\n",
             r.float_loss / kLn2, r.type.c_str(), r.before.bpc(), bpc_delta(r.before.loss, r.float_loss),
             r.after.bpc(), bpc_delta(r.after.loss, r.float_loss), recovery_text(r).c_str());
  out += fmt("  step: %.1f ms fine-tuning vs %.1f ms float training (%.2fx, medians of %zu back-to-back pairs)\n",
             median_of(r.log.pair_lora_ms), median_of(r.log.pair_float_ms),
             median_of(r.log.pair_lora_ms) / median_of(r.log.pair_float_ms), r.log.pair_lora_ms.size());
  out += fmt("  resident: %.0f KiB (model %.0f + gradients and AdamW %.0f + a step's activations %.0f) for %.0f KiB of "
             "packed FFN weights, %.0f KiB of adapters; a float training copy: %.0f KiB\n",
             kib(m.total()), kib(m.model), kib(m.optimizer), kib(m.step), kib(double(m.packed)),
             kib(double(m.adapters)), kib(m.float_training));
  return out;
}

/// One row of finetune_<type>.csv per step.
inline void write_finetune_csv(const std::string& path, const FineTuneLog& log) {
  CsvLog csv(path, {"step", "lr", "train_bpc", "float_bpc", "base_bpc", "grad_norm", "step_ms", "val_bpc"});
  std::size_t v = 0;
  for (std::size_t i = 0; i < log.step.size(); ++i) {
    while (v < log.val_step.size() && log.val_step[v] < log.step[i]) ++v;
    const bool has_val = v < log.val_step.size() && log.val_step[v] == log.step[i];
    csv.row({log.step[i], log.lr[i], log.bpc[i], log.float_bpc[i], log.base_bpc[i], log.grad_norm[i], log.step_ms[i],
             has_val ? log.val_bpc[v] : NAN});
  }
  csv.flush();
}

/// The validation table: float, the packed inference copy (if the sweep scored it), before and after.
inline void report_finetune_losses(Markdown& md, const FineTuneRun& r, double inference_loss) {
  const auto row = [&](const std::string& name, double loss) {
    return std::vector<std::string>{name, fmt("%.6f", loss), fmt("%.4f", loss / kLn2),
                                    fmt("%+.4f", bpc_delta(loss, r.float_loss))};
  };
  std::vector<std::vector<std::string>> rows = {row("float model (training layers)", r.float_loss)};
  if (std::isfinite(inference_loss))
    rows.push_back(row("`" + r.type + "` inference layers (Q8 activations; the sweep's row)", inference_loss));
  rows.push_back(row("`" + r.type + "` + adapters, before fine-tuning (B = 0)", r.before.loss));
  rows.push_back(row(fmt("**`%s` + adapters, after %ld steps**", r.type.c_str(), r.opt.steps), r.after.loss));
  md.table({"model", "nats/char", "bits/char", "Δ vs float (bits/char)"}, rows);
  md.para(fmt("On the whole validation text, against the float model: %+.4f → %+.4f bits/char, %s; next-character "
              "accuracy %.2f%% → %.2f%%.",
              bpc_delta(r.before.loss, r.float_loss), bpc_delta(r.after.loss, r.float_loss), recovery_text(r).c_str(),
              100 * r.before.main_accuracy, 100 * r.after.main_accuracy));
}

/// Step time and resident memory.
inline void report_finetune_costs(Markdown& md, const FineTuneRun& r) {
  const FineTuneLog& l = r.log;
  const double lora = median_of(l.pair_lora_ms), flt = median_of(l.pair_float_ms);
  md.para(fmt("**Step time.** A fine-tuning step (forward, backward through the frozen packed weights, clipping and "
              "AdamW over the adapters, balancer) took %.1f ms against %.1f ms for a float training step of the same "
              "model (every weight's gradient and AdamW over all of them): %.2f×, medians of %zu pairs run back to "
              "back (median of all %zu fine-tuning steps: %.1f ms).",
              lora, flt, lora / flt, l.pair_lora_ms.size(), l.step_ms.size(), median_of(l.step_ms)));
  const FineTuneMemory& m = r.memory;
  md.table({"resident (VmRSS growth)", "KiB"},
           {{"the adapted model (packed weights, adapters, frozen float parts)", fmt("%.0f", kib(m.model))},
            {"+ gradients and AdamW's moments", fmt("%.0f", kib(m.optimizer))},
            {"+ one step (its activations, the kernels' scratch)", fmt("%.0f", kib(m.step))},
            {"**fine-tuning, total**", fmt("**%.0f**", kib(m.total()))},
            {"a float training copy of the model, measured the same way", fmt("%.0f", kib(m.float_training))}});
  md.para(fmt("Its parts: %.0f KiB of packed FFN weights, %.0f KiB of adapters (%ld parameters; their gradients and "
              "AdamW's two moments as much again each), %.0f KiB of frozen float parts (embedding, norms, skip gates, "
              "heads, with gradients the model's backward fills and nothing reads): %.0f KiB of weights, gradients "
              "and optimiser state, against %.0f KiB measured for the model and its optimiser. The rest is the "
              "activations of a %ld-token step, which the float training copy holds too.",
              kib(double(m.packed)), kib(double(m.adapters)), long(r.adapter_params), kib(double(m.frozen_float)),
              kib(m.state()), kib(m.model + m.optimizer), long(r.opt.chunks * r.opt.chunk_len)));
}

/// The stage's section of report.md: every run, applicable or not.
inline void report_finetune(Markdown& md, const std::vector<FineTuneRun>& runs, double inference_q4_0,
                            double inference_q4_k) {
  if (runs.empty()) return;
  md.heading(2, "LoRA fine-tuning on packed weights");
  for (const FineTuneRun& r : runs) {
    md.heading(3, "`" + r.type + "`");
    if (!r.applicable) {
      md.para("Not applicable: " + r.reason + ".");
      continue;
    }
    md.para(fmt("Every FFN sublayer packed in %s and frozen, with LoRA adapters (rank %ld, α = %g, on the fused "
                "gate/up and the down projection of every dense FFN, routed and shared expert) trained for %ld steps "
                "of %ld tokens: AdamW over the adapters only (peak lr %.0e, warmup %ld, cosine to %.0f%%, no weight "
                "decay), clipping at %.1f. The embedding, norms, skip gates, heads, routers and κ stay as trained; "
                "the balancers keep stepping their bias as in training. The steps took %.1f s with the reference losses "
                "and the paired float steps, the stage %.1f s with its evaluations.",
                r.type.c_str(), long(r.lora.rank), r.lora.alpha, r.opt.steps, long(r.opt.chunks * r.opt.chunk_len),
                r.opt.lr, r.opt.warmup, 100 * r.opt.lr_floor, r.opt.clip, r.train_seconds, r.seconds));
    report_finetune_losses(md, r, r.type == "q4_0" ? inference_q4_0 : inference_q4_k);
    report_finetune_costs(md, r);
    md.image("LoRA fine-tuning on " + r.type, "finetune_" + r.type + ".png");
  }
}

}  // namespace apex::demo
