#pragma once
/// \file finetune_run.hpp
/// The demo's fine-tuning stage: the trained model with every FFN sublayer
/// packed in a 4-bit type (q4_0; q4_k where the widths are whole 256-weight
/// blocks, else recorded as not applicable with the packing's reason) and
/// LoRA adapters trained on the frozen packed weights to win back what the
/// quantization cost. It measures
///  - the validation loss of the adapted model before (B = 0: the packed
///    weights alone) and after fine-tuning, against the float model's;
///  - per step, the main-head loss of the adapted model and, on the same
///    batch, of the float model and of the packed model without adapters
///    (the curves of finetune_<type>.png: differences on one batch are far
///    less noisy than the losses themselves);
///  - the resident memory of the fine-tuning model, stage by stage
///    (resident.hpp), against its parts, and of a float training copy of
///    the same model measured the same way;
///  - the time of a fine-tuning step against a float training step of the
///    same model, the two run back to back every few steps (medians of the
///    pairs, so both see the same machine load).

#include <apex/ffn/core/errors.hpp>
#include <apex/ffn/core/types.hpp>
#include <apex/ffn/kernels/dtype.hpp>
#include <apex/ffn/kernels/weight_types.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "char_model.hpp"
#include "evaluate.hpp"
#include "finetune.hpp"
#include "lora_char_model.hpp"
#include "progress.hpp"
#include "report.hpp"
#include "resident.hpp"
#include "run_log.hpp"
#include "storage_sweep.hpp"
#include "text_data.hpp"
#include "trainer.hpp"

namespace apex::demo {

/// What the stage reads from the demo.
struct FineTuneSetup {
  const Corpus& corpus;
  Index pad;
  const TrainOptions& topt;  ///< the float training step timed against
  FineTuneOptions opt;
  LoraOptions lora;
  std::uint64_t seed = 1;  ///< draws the adapters' A
  int threads = 1;
  double float_loss = 0;   ///< the float model on the whole validation text
  long pair_every = 4;     ///< a float training step after every this many fine-tuning steps
};

/// Resident growth of the fine-tuning model, stage by stage, and its parts (bytes).
struct FineTuneMemory {
  double model = 0;      ///< the adapted model built from the trained one
  double optimizer = 0;  ///< then the gradients params() allocates and AdamW's moments
  double step = 0;       ///< then one step: its activations and the kernels' scratch
  double float_training = 0;  ///< a float training copy measured the same way (model, AdamW, one step)
  std::size_t packed = 0;        ///< packed FFN weights, block scales included
  std::size_t adapters = 0;      ///< adapter values; their gradients and each AdamW moment as much again
  std::size_t frozen_float = 0;  ///< the float values params() lists besides: embedding, norms, gates, heads
  double total() const { return model + optimizer + step; }
  /// Weights, gradients and optimiser state: packed + 4 × adapters + 2 × frozen float parts.
  double state() const { return double(packed) + 4.0 * double(adapters) + 2.0 * double(frozen_float); }
};

/// One storage type's fine-tuning run.
struct FineTuneRun {
  std::string type;         ///< "q4_0", "q4_k"
  bool applicable = false;  ///< false: the widths are not whole blocks of the type
  std::string reason;       ///< why not
  FineTuneOptions opt;
  LoraOptions lora;
  Index adapter_params = 0;
  double float_loss = 0;    ///< the float model, whole validation text (nats/char)
  EvalResult before, after; ///< the adapted model at B = 0 and after the steps, same text
  FineTuneMemory memory;
  FineTuneLog log;
  double train_seconds = 0;  ///< the fine-tuning loop, references and paired float steps included
  double seconds = 0;        ///< the whole stage

  /// Share of the quantization loss the fine-tuning won back (1: all of it).
  double recovered() const { return (before.loss - after.loss) / (before.loss - float_loss); }
};

/// The median of `v` (NaN if empty).
inline double median_of(std::vector<double> v) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/// Milliseconds `fn` takes.
template <class Fn>
double time_ms(Fn&& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

/// The main head's loss of `m` on batch `b`, bits/char (a forward without cache: nothing kept).
template <class Model>
double main_bpc(const Model& m, const Batch& b) {
  return m.loss(m.forward(b.context), b).main.loss / kLn2;
}

/// A float training copy of the trained model, stepped only to be timed
/// (and measured in memory) against the fine-tuning step.
struct FloatStepper {
  CharModel<float> model;
  Trainer<float> trainer;
  FloatStepper(const CharModel<float>& trained, const FineTuneSetup& in)
      : model(trained), trainer(model, in.corpus.train, options(in), in.pad) {}
  static TrainOptions options(const FineTuneSetup& in) {
    TrainOptions t = in.topt;
    t.steps = in.opt.steps;
    t.U_ramp = 0;  // U stays at U_max, the trained model's
    t.lr = in.topt.lr * in.topt.lr_floor;
    t.warmup = 1;
    t.seed = in.opt.seed + 1;
    return t;
  }
};

/// The bytes of the fine-tuning model's parts (FineTuneMemory's packed, adapters, frozen_float).
template <class Model>
void count_parts(Model& m, FineTuneMemory& mem) {
  for (const auto& s : m.dense_layers()) mem.packed += s.ffn().base().bytes();
  for (const auto& s : m.moe_layers()) mem.packed += s.ffn().base().expert_bytes();
  for (const auto& p : m.params())
    (is_lora_parameter(p.name) ? mem.adapters : mem.frozen_float) += std::size_t(p.size()) * sizeof(float);
}

/// Appends step `st` (taking `ms`) on batch `b`, with the references' loss on `b`.
template <class Model, class Base>
void record_step(FineTuneLog& log, const FineTuneStep& st, double ms, const Batch& b, const CharModel<float>& trained,
                 const Base& base) {
  log.step.push_back(double(st.step + 1));
  log.lr.push_back(st.lr);
  log.bpc.push_back(st.main_loss / kLn2);
  log.grad_norm.push_back(st.grad_norm);
  log.step_ms.push_back(ms);
  log.float_bpc.push_back(main_bpc(trained, b));
  log.base_bpc.push_back(main_bpc(base, b));
}

/// The fine-tuning loop after the first step: every step scored against the
/// references, a float step after every `pair_every`-th, the quick
/// validation text scored ten times.
template <class Model>
void finetune_loop(FineTuneRun& r, Model& model, FineTuner<Model>& tuner, const Model& base,
                   const CharModel<float>& trained, FloatStepper& fl, const FineTuneSetup& in) {
  FineTuneLog& log = r.log;
  const long steps = in.opt.steps, eval_every = std::max<long>(1, steps / 10);
  const double tokens_per_step = double(in.opt.chunks * in.opt.chunk_len);
  const auto quick_eval = [&](long done) {
    log.val_step.push_back(double(done));
    log.val_bpc.push_back(evaluate(model, in.corpus.val, 0, kQuickEvalTokens, in.pad).bpc());
  };
  ProgressBar bar(steps, "finetune " + r.type);
  for (long s = 1; s < steps; ++s) {  // step 0 ran before: its memory was measured
    const Batch b = tuner.next_batch();
    FineTuneStep st;
    const double ms = time_ms([&] { st = tuner.step(b); });
    if (s % in.pair_every == 0) {
      log.pair_lora_ms.push_back(ms);
      log.pair_float_ms.push_back(time_ms([&] { fl.trainer.step(); }));
    }
    record_step<Model>(log, st, ms, b, trained, base);
    const long done = s + 1;
    if (done % eval_every == 0 || done == steps) quick_eval(done);
    bar.update(done, log.bpc.back(), double(done) * tokens_per_step);
  }
  if (steps == 1) quick_eval(1);
}

/// Packs `trained`'s FFN sublayers in `Storage`, adapts and fine-tunes them
/// (see the file comment); not applicable when the packing refuses the widths.
template <class Storage>
FineTuneRun run_finetune(CharModel<float>& trained, const FineTuneSetup& in) {
  using Model = LoraCharModel<Storage>;
  const auto t0 = std::chrono::steady_clock::now();
  FineTuneRun r;
  r.type = packed::WeightType<packed::dtype_of<Storage>()>::kName;
  r.opt = in.opt;
  r.lora = in.lora;
  r.float_loss = in.float_loss;
  FineTuneMemory& mem = r.memory;
  const ModelPreset& p = trained.config().preset;
  in.lora.validate("LoRA fine-tuning", p.d_model, p.d_ffn);  // so a ConfigError below is the packing's
  const double held0 = held_bytes();
  std::optional<Model> model;
  try {
    model.emplace(adapt_model<LoraLayers<Storage>>(trained, in.lora, in.seed));
  } catch (const ConfigError& e) {
    r.reason = config_reason(e);
    return r;
  }
  r.applicable = true;
  model->set_threads(in.threads);
  const double held1 = held_bytes();
  FineTuner<Model> tuner(*model, in.corpus.train, in.opt, in.pad);
  const double held2 = held_bytes();
  const Batch first = tuner.next_batch();
  FineTuneStep st;
  const double first_ms = time_ms([&] { st = tuner.step(first); });
  const double held3 = held_bytes();
  mem.model = held1 - held0;
  mem.optimizer = held2 - held1;
  mem.step = held3 - held2;
  count_parts(*model, mem);
  r.adapter_params = parameter_count(tuner.parameters());

  const double held4 = held_bytes();
  FloatStepper fl(trained, in);
  fl.trainer.step();
  mem.float_training = held_bytes() - held4;

  Model base = adapt_model<LoraLayers<Storage>>(trained, in.lora, in.seed);  // the start: B = 0
  base.set_threads(in.threads);
  const auto t1 = std::chrono::steady_clock::now();
  record_step<Model>(r.log, st, first_ms, first, trained, base);
  r.log.float_val_bpc = evaluate(trained, in.corpus.val, 0, kQuickEvalTokens, in.pad).bpc();
  r.log.base_val_bpc = evaluate(base, in.corpus.val, 0, kQuickEvalTokens, in.pad).bpc();
  r.log.val_step.push_back(0);
  r.log.val_bpc.push_back(r.log.base_val_bpc);
  finetune_loop(r, *model, tuner, base, trained, fl, in);
  r.train_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  r.before = evaluate(base, in.corpus.val, 0, Index(in.corpus.val.size()), in.pad);
  r.after = evaluate(*model, in.corpus.val, 0, Index(in.corpus.val.size()), in.pad);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

}  // namespace apex::demo
