#pragma once
/// \file finetune.hpp
/// One LoRA fine-tuning step of an adapted demo model (lora_char_model.hpp):
/// what trainer.hpp does, less what does not apply to frozen layers.
///
///  1. learning rate from the warmup + cosine schedule;
///  2. forward on a batch (training mode), the multi-token loss, backward
///     through the whole model: the frozen layers pass ∂L/∂x on, the
///     adapters add into their gradients;
///  3. global-norm clipping and the library's AdamW over the adapters only
///     (the parameters named `…lora_A/B.weight`); everything else keeps the
///     trained values;
///  4. every MoE balancer counts the tokens it routed and, with `balance`,
///     steps its bias as in training.
///
/// Not done, because it acts on frozen parameters: κ-SwiGLU's regulariser
/// (its gradient is α's and b's) and the ramp of its ceiling U (U stays at
/// the trained model's final value, packed with the experts). The skip
/// gates' penalty is reported as part of the loss but has no adapter
/// gradient. Backward still fills the gradients of the frozen float parts
/// (embedding, norms, gates, heads): the model's code is the training
/// model's, and those buffers are read by nothing here.

#include <apex/ffn/core/errors.hpp>
#include <apex/ffn/moe/load_balancer.hpp>
#include <apex/ffn/optim/adamw.hpp>
#include <apex/ffn/optim/clip.hpp>
#include <apex/ffn/optim/schedule.hpp>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "char_model.hpp"
#include "lora_char_model.hpp"
#include "text_data.hpp"

namespace apex::demo {

struct FineTuneOptions {
  long steps = 300;
  Index chunks = 16;      ///< sequences per batch
  Index chunk_len = 32;   ///< positions per sequence
  double lr = 2e-3;       ///< peak learning rate
  double lr_floor = 0.1;  ///< final learning rate as a fraction of the peak
  long warmup = 20;       ///< linear warmup steps
  double clip = 1.0;      ///< max global norm of the adapters' gradient
  /// No weight decay: it would pull the adapters towards 0, i.e. towards
  /// the quantized model the fine-tuning moves away from.
  AdamWOptions adamw{0.9, 0.99, 1e-8, 0.0};
  bool balance = true;      ///< apply the MoE balancers' bias updates
  std::uint64_t seed = 2;   ///< batch sampling

  /// ConfigError naming the field.
  void validate() const {
    detail::require_config(steps > 0, "FineTuneOptions", "steps must be positive, got " + std::to_string(steps));
    detail::require_config(chunks > 0 && chunk_len > 0, "FineTuneOptions", "chunks and chunk_len must be positive");
    detail::require_config(std::isfinite(lr) && lr > 0, "FineTuneOptions", "lr must be finite and > 0");
    detail::require_config(clip > 0, "FineTuneOptions", "clip must be positive");
  }
};

/// What one fine-tuning step did.
struct FineTuneStep {
  long step = 0;
  double loss = 0;        ///< the multi-token loss + the skip penalty
  double main_loss = 0;   ///< the main head's cross-entropy (nats)
  double grad_norm = 0;   ///< of the adapters, before clipping
  double lr = 0;
  std::vector<LoadReport> load;  ///< per MoE layer: this step's routing
};

/// Fine-tunes the adapters of `Model` (a CharModel on LoRA sublayers).
template <class Model>
class FineTuner {
 public:
  using T = typename Model::Scalar;

  /// ConfigError for invalid options or a model without adapters.
  FineTuner(Model& model, const std::vector<Index>& train, const FineTuneOptions& opt, Index pad)
      : model_(&model),
        opt_((opt.validate(), opt)),
        sampler_(train, opt.chunks, opt.chunk_len, model.context(), model.mtp().num_heads(), pad, opt.seed),
        params_(lora_parameters(model)),
        adamw_(params_, opt.adamw) {
    detail::require_config(!params_.empty(), "FineTuner", "the model has no adapter parameters (named lora_A/lora_B)");
  }

  /// One step on the next sampled batch.
  FineTuneStep step() { return step(sampler_.next()); }
  /// The next sampled batch, for a caller that also scores it (step(batch) then trains on it).
  Batch next_batch() { return sampler_.next(); }

  /// One step on `batch`; ValueError if the loss is not finite (nothing changed then).
  FineTuneStep step(const Batch& batch) {
    Model& m = *model_;
    FineTuneStep s;
    s.step = t_;
    s.lr = warmup_cosine(t_, opt_.steps, opt_.warmup, opt_.lr, opt_.lr_floor);
    m.set_mode(SublayerMode::training);
    m.zero_grad();
    const auto out = m.forward(batch.context, &cache_);
    const BatchLoss l = m.loss(out, batch, &dlogits_, &dheads_);
    s.main_loss = l.main.loss;
    s.loss = l.total + m.skip_penalty(cache_);
    if (!std::isfinite(s.loss))
      throw ValueError("FineTuner::step: the loss is not finite at step " + std::to_string(t_));
    m.backward(dlogits_, dheads_, cache_);
    s.grad_norm = clip_grad_norm(params_, opt_.clip);
    adamw_.step(s.lr);
    m.observe(cache_);
    s.load = m.update_balancers(opt_.balance);
    ++t_;
    return s;
  }

  long steps_done() const { return t_; }
  const FineTuneOptions& options() const { return opt_; }
  /// The adapters it updates.
  const ParamList<T>& parameters() const { return params_; }
  /// The activations of the last step (what a step keeps resident).
  const typename Model::Cache& cache() const { return cache_; }

 private:
  Model* model_;
  FineTuneOptions opt_;
  BatchSampler sampler_;
  ParamList<T> params_;
  AdamW<T> adamw_;
  typename Model::Cache cache_;
  Matrix<T> dlogits_, dheads_;
  long t_ = 0;
};

}  // namespace apex::demo
