#pragma once
/// \file char_model_config.hpp
/// What a CharModel is built from: its shape (vocabulary, context window,
/// embedding width, the trunk's ModelPreset), the switches and weights of
/// each APEX-1 feature, and the configs of the library layers derived from
/// them. A plain value, kept apart from the model it configures.

#include <apex/ffn/core/errors.hpp>
#include <apex/ffn/layers/kappa_options.hpp>
#include <apex/ffn/layers/multi_token_heads.hpp>
#include <apex/ffn/layers/skip_gate.hpp>
#include <apex/ffn/moe/config.hpp>

#include <string>

namespace apex::demo {

/// Shape and feature switches of CharModel.
struct CharModelConfig {
  Index vocab = 0;                            ///< V
  Index context = 16;                         ///< c: characters the model sees
  Index embed = 16;                           ///< k: embedding width per character
  ModelPreset preset = ModelPreset::tiny();   ///< trunk widths, depth, experts
  Index mtp_heads = 4;                        ///< extra heads (tokens t+2 … t+1+N)
  double mtp_lambda = 0.1;                    ///< λ of L = L_main + λ·Σ_k L_k
  bool skip_gates = true;                     ///< a skip gate on every sublayer
  double skip_threshold = 0.15;               ///< τ
  double skip_penalty = 0.0;                  ///< λ_skip of the compute penalty λ_skip·mean(g)
  double balancer_alpha = 1e-3;               ///< bias step of every MoE layer's balancer
  KappaOptions kappa;                         ///< κ-SwiGLU options (U is then set by the trainer's ramp)

  void validate() const {
    detail::require_config(vocab > 0, "CharModelConfig", "vocab must be positive, got " + std::to_string(vocab));
    detail::require_config(context > 0, "CharModelConfig", "context must be positive");
    detail::require_config(embed > 0, "CharModelConfig", "embed must be positive");
    detail::require_config(preset.n_layers > 0, "CharModelConfig", "the preset needs at least one layer");
    preset.moe().validate("CharModelConfig.preset");
    kappa.validate("CharModelConfig.kappa");
  }
};

/// The skip gate of every sublayer (when `cfg.skip_gates`).
inline SkipGateConfig skip_gate_config(const CharModelConfig& cfg) {
  SkipGateConfig gc;
  gc.d_model = cfg.preset.d_model;
  gc.hidden = cfg.preset.skip_hidden;
  gc.threshold = cfg.skip_threshold;
  gc.penalty = cfg.skip_penalty;
  return gc;
}

/// Every MoE sublayer: the preset's, with the demo's balancer step.
inline MoEConfig moe_config(const CharModelConfig& cfg) {
  MoEConfig mc = cfg.preset.moe();
  mc.balancer_alpha = cfg.balancer_alpha;
  return mc;
}

/// The multi-token heads and their weight in the loss.
inline MultiTokenOptions mtp_options(const CharModelConfig& cfg) {
  MultiTokenOptions o;
  o.num_heads = cfg.mtp_heads;
  o.lambda = cfg.mtp_lambda;
  return o;
}

}  // namespace apex::demo
