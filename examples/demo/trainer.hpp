#pragma once
/// \file trainer.hpp
/// One training step of the demo model, and the loop state around it:
///
///  1. learning rate from the warmup + cosine schedule, κ-SwiGLU's U from
///     its ramp (1 → U_max over the first `U_ramp` of training);
///  2. forward on a sampled batch, multi-token loss, backward;
///  3. loss terms that live outside the logits: the κ regulariser of every
///     MoE layer and the skip gates' compute penalty (their gradients are
///     added by `add_kappa_regularizer_grad` and the gates' backward);
///  4. global-norm clipping, AdamW;
///  5. every MoE balancer counts the tokens it routed and updates its bias.

#include <apex/ffn/core/errors.hpp>
#include <apex/ffn/layers/kappa_swiglu.hpp>
#include <apex/ffn/moe/load_balancer.hpp>
#include <apex/ffn/optim/adamw.hpp>
#include <apex/ffn/optim/clip.hpp>
#include <apex/ffn/optim/schedule.hpp>

#include <cmath>
#include <string>
#include <vector>

#include "char_model.hpp"
#include "text_data.hpp"

namespace apex::demo {

struct TrainOptions {
  long steps = 2000;
  Index chunks = 8;          ///< sequences per batch
  Index chunk_len = 32;      ///< positions per sequence (batch = chunks·chunk_len tokens)
  double lr = 3e-3;          ///< peak learning rate
  double lr_floor = 0.1;     ///< final learning rate as a fraction of the peak
  long warmup = 100;         ///< linear warmup steps
  double clip = 1.0;         ///< max global gradient norm
  /// β₂ = 0.99 rather than PyTorch's 0.999: v then averages over ~100 steps,
  /// which suits a run of a few thousand; λ = 0.1 as in most LLM recipes.
  AdamWOptions adamw{0.9, 0.99, 1e-8, 0.1};
  double U_max = 4.0;        ///< κ-SwiGLU's final U
  double U_ramp = 0.5;       ///< fraction of the steps over which U rises from 1 to U_max
  bool balance = true;       ///< apply the MoE balancers' bias updates
  std::uint64_t seed = 1;    ///< batch sampling
};

/// What one step did.
struct StepStats {
  long step = 0;
  double loss = 0;          ///< the full objective: multi-token loss + κ regulariser + skip penalty
  double main_loss = 0;     ///< the main head's cross-entropy (nats)
  double kappa_reg = 0;
  double skip_penalty = 0;
  double grad_norm = 0;     ///< before clipping
  double lr = 0;
  double U = 1;
  std::vector<double> skip_rate;  ///< per layer
  std::vector<LoadReport> load;   ///< per MoE layer: this step's routing
};

template <class T>
class Trainer {
 public:
  Trainer(CharModel<T>& model, const std::vector<Index>& train, const TrainOptions& opt, Index pad)
      : model_(&model),
        opt_(opt),
        sampler_(train, opt.chunks, opt.chunk_len, model.context(), model.mtp().num_heads(), pad, opt.seed),
        adamw_(model.params(), opt.adamw),
        params_(model.params()) {
    detail::require_config(opt.steps > 0, "TrainOptions", "steps must be positive");
    detail::require_config(opt.chunks > 0 && opt.chunk_len > 0, "TrainOptions", "chunks and chunk_len must be positive");
    detail::require_config(opt.U_max >= 1, "TrainOptions", "U_max must be >= 1");
    detail::require_config(opt.clip > 0, "TrainOptions", "clip must be positive");
  }

  /// U of κ-SwiGLU at step `t`.
  double U_at(long t) const {
    const double ramp = opt_.U_ramp * double(opt_.steps);
    return kappa_ramp(ramp > 0 ? double(t) / ramp : 1.0, opt_.U_max);
  }

  /// Runs one step; throws ValueError if the loss stops being finite.
  StepStats step() {
    CharModel<T>& m = *model_;
    StepStats s;
    s.step = t_;
    s.lr = warmup_cosine(t_, opt_.steps, opt_.warmup, opt_.lr, opt_.lr_floor);
    s.U = U_at(t_);
    m.set_kappa_U(s.U);
    m.set_mode(SublayerMode::training);

    const Batch batch = sampler_.next();
    m.zero_grad();
    const auto out = m.forward(batch.context, &cache_);
    const BatchLoss l = m.loss(out, batch, &dlogits_, &dheads_);
    m.backward(dlogits_, dheads_, cache_);
    s.kappa_reg = m.add_kappa_regularizer_grad();
    s.skip_penalty = m.skip_penalty(cache_);
    s.main_loss = l.main.loss;
    s.loss = l.total + s.kappa_reg + s.skip_penalty;
    if (!std::isfinite(s.loss))
      throw ValueError("Trainer::step: the loss is not finite at step " + std::to_string(t_));
    s.grad_norm = clip_grad_norm(params_, opt_.clip);
    adamw_.step(s.lr);

    s.skip_rate = m.skip_rates(cache_);
    m.observe(cache_);
    s.load = m.update_balancers(opt_.balance);
    ++t_;
    return s;
  }

  long steps_done() const { return t_; }
  const TrainOptions& options() const { return opt_; }

 private:
  CharModel<T>* model_;
  TrainOptions opt_;
  BatchSampler sampler_;
  AdamW<T> adamw_;
  ParamList<T> params_;
  typename CharModel<T>::Cache cache_;
  Matrix<T> dlogits_, dheads_;
  long t_ = 0;
};

}  // namespace apex::demo
