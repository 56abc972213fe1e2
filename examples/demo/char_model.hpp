#pragma once
/// \file char_model.hpp
/// The demo's character-level language model, assembled from apex-ffn layers:
///
///     ids (N × c) ─ ContextEmbedding ─ x₀ (N × d)
///       x_{l+1} = x_l + m_l ⊙ FFN_l(RMSNorm(x_l))        l = 0 … L−1 (FFNSublayer, skip gate)
///                 FFN_l = SwiGLU                          on even l
///                 FFN_l = MoE of κ-SwiGLU experts         on odd l  (ModelPreset::is_moe_layer)
///       h = RMSNorm(x_L)
///       main logits = h·W_headᵀ          (N × V, token t+1)
///       head logits = MultiTokenHeads(h)  (N × 4V, tokens t+2 … t+5)
///
/// Widths, depth, experts and the skip gate's hidden width come from a
/// `ModelPreset` (`tiny` by default: d = 64, 6 layers, f = 128, 4 experts,
/// K = 2, 1 shared expert, gate hidden 16). There is no attention: the trunk
/// sees a fixed window of the last `c` characters, which is enough to show
/// every FFN feature of the library training end to end.
///
/// The sublayer types are a parameter (`Layers`): `TrainingLayers<T>`, the
/// default, are the trainable float/double layers built from a config and a
/// seed; a model on other sublayers is converted from a trained model and
/// runs this same forward and loss code, so evaluation and decoding are
/// written once for all: the packed inference layers (packed_char_model.hpp,
/// forward only) and the LoRA layers on frozen packed weights
/// (lora_char_model.hpp), whose backward is this model's too.

#include <apex/ffn/layers/cross_entropy.hpp>
#include <apex/ffn/layers/ffn_sublayer.hpp>
#include <apex/ffn/layers/kappa_swiglu.hpp>
#include <apex/ffn/moe/moe_ffn.hpp>
#include <apex/ffn/moe/config.hpp>
#include <apex/ffn/layers/multi_token_heads.hpp>
#include <apex/ffn/layers/rms_norm.hpp>
#include <apex/ffn/layers/skip_gate.hpp>
#include <apex/ffn/layers/swiglu.hpp>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "batch_loss.hpp"
#include "char_model_config.hpp"
#include "context_embedding.hpp"
#include "text_data.hpp"

namespace apex::demo {

/// The trainable sublayers: dense SwiGLU and a κ-SwiGLU MoE, each in an
/// FFNSublayer (norm, optional skip gate).
template <class T>
struct TrainingLayers {
  using Dense = FFNSublayer<T, SwiGLU<T>>;
  using Sparse = FFNSublayer<T, MoEFFN<T, KappaSwiGLU<T>>>;
  /// Built from a config and a seed, with gradients and backward.
  static constexpr bool kTrainable = true;
};

/// `Layers` names the dense and MoE sublayer types (`Layers::Dense`,
/// `Layers::Sparse`). Only a model on trainable layers has a seeded
/// constructor (`Layers::kTrainable`); backward, params() and the training
/// controls are members that compile only for sublayers that have them
/// (backward and params() for LoRA sublayers too, the κ controls only for
/// the training layers).
template <class T, class Layers = TrainingLayers<T>>
class CharModel {
 public:
  using Scalar = T;
  using Dense = typename Layers::Dense;
  using Sparse = typename Layers::Sparse;
  using MoE = typename Sparse::FFNType;

  /// Activations of one forward pass, owned by the caller.
  struct Cache {
    typename ContextEmbedding<T>::Cache embed;
    std::vector<typename Dense::Cache> dense;    ///< one per dense sublayer, in layer order
    std::vector<typename Sparse::Cache> sparse;  ///< one per MoE sublayer, in layer order
    typename RMSNorm<T>::Cache norm;
    typename MultiTokenHeads<T>::Cache mtp;
    Matrix<T> h;  ///< N × d: the final normalised hidden states
  };

  /// Logits of one forward pass.
  struct Output {
    Matrix<T> logits;       ///< N × V: the main head (token t+1)
    Matrix<T> head_logits;  ///< N × N_heads·V: the multi-token heads
  };

  CharModel(const CharModelConfig& cfg, std::uint64_t seed) : cfg_((cfg.validate(), cfg)), rng_(seed),
      embed_(cfg.vocab, cfg.context, cfg.embed, cfg.preset.d_model, rng_), norm_(cfg.preset.d_model),
      mtp_(cfg.preset.d_model, cfg.vocab, mtp_options(cfg), rng_) {
    static_assert(Layers::kTrainable, "CharModel: only trainable layers are built from a seed; convert a trained "
                                      "model instead (packed_char_model.hpp)");
    const ModelPreset& p = cfg.preset;
    const SkipGateConfig gc = skip_gate_config(cfg);
    for (Index l = 0; l < p.n_layers; ++l) {
      if (ModelPreset::is_moe_layer(l)) {
        MoE ffn(moe_config(cfg), rng_);
        for (auto& e : ffn.experts()) e.set_options(cfg.kappa);
        order_.push_back({true, Index(sparse_.size())});
        if (cfg.skip_gates)
          sparse_.emplace_back(p.d_model, std::move(ffn), SkipGate<T>(gc, rng_));
        else
          sparse_.emplace_back(p.d_model, std::move(ffn));
      } else {
        SwiGLU<T> ffn(p.d_model, p.d_ffn, rng_);
        order_.push_back({false, Index(dense_.size())});
        if (cfg.skip_gates)
          dense_.emplace_back(p.d_model, std::move(ffn), SkipGate<T>(gc, rng_));
        else
          dense_.emplace_back(p.d_model, std::move(ffn));
      }
    }
    head_.resize(cfg.vocab, p.d_model);
    init_linear(head_, rng_);
    head_grad_ = Matrix<T>::Zero(cfg.vocab, p.d_model);
  }

  /// The model `src` with each of its FFN sublayers replaced by
  /// `convert(sublayer)` (an overload set taking src's Dense and Sparse
  /// sublayers), e.g. packed for inference. Everything else — embedding,
  /// final norm, heads, layer order, mode — is copied, so the converted
  /// model computes what src does up to the converted layers. The main
  /// head gets a zeroed gradient (V × d) as the other parts keep theirs, so
  /// a model on sublayers with a backward (LoRA) runs backward too.
  template <class SrcLayers, class Convert>
  CharModel(const CharModel<T, SrcLayers>& src, const Convert& convert)
      : cfg_(src.cfg_), rng_(src.rng_), embed_(src.embed_), order_(src.order_), norm_(src.norm_),
        head_(src.head_), head_grad_(Matrix<T>::Zero(src.head_.rows(), src.head_.cols())), mtp_(src.mtp_),
        mode_(src.mode_) {
    dense_.reserve(src.dense_.size());
    sparse_.reserve(src.sparse_.size());
    for (const auto& s : src.dense_) dense_.push_back(convert(s));
    for (const auto& s : src.sparse_) sparse_.push_back(convert(s));
  }

  const CharModelConfig& config() const { return cfg_; }
  Index vocab() const { return cfg_.vocab; }
  Index context() const { return cfg_.context; }
  Index n_layers() const { return Index(order_.size()); }
  bool is_moe(Index layer) const { return order_[std::size_t(layer)].first; }

  /// Training mode computes every sublayer's FFN for skipped tokens too (the
  /// straight-through estimator needs it); inference mode skips that work.
  void set_mode(SublayerMode mode) { mode_ = mode; }
  SublayerMode mode() const { return mode_; }

  /// ids: N × c → logits. With a cache (and training mode) backward can follow.
  Output forward(const ContextIds& ids, Cache* cache = nullptr) const {
    Output out;
    Matrix<T> x = embed_.forward(ids, cache ? &cache->embed : nullptr);  // N × d
    if (cache) {
      cache->dense.resize(dense_.size());
      cache->sparse.resize(sparse_.size());
    }
    for (const auto& [moe, i] : order_) {
      if (moe)
        x = sparse_[std::size_t(i)].forward(x, mode_, cache ? &cache->sparse[std::size_t(i)] : nullptr);
      else
        x = dense_[std::size_t(i)].forward(x, mode_, cache ? &cache->dense[std::size_t(i)] : nullptr);
    }
    Matrix<T> h = norm_.forward(x, cache ? &cache->norm : nullptr);  // N × d
    out.logits.resize(h.rows(), vocab());
    detail::linear_nt(h, head_, out.logits, false);  // N × V
    out.head_logits = mtp_.forward(h, cache ? &cache->mtp : nullptr);
    if (cache) cache->h = std::move(h);
    return out;
  }

  /// The multi-token loss of `out` on `batch` (batch_loss.hpp); with
  /// `dlogits`/`dheads`, writes ∂L/∂logits.
  BatchLoss loss(const Output& out, const Batch& batch, Matrix<T>* dlogits = nullptr, Matrix<T>* dheads = nullptr) const {
    return batch_loss(mtp_, out.logits, out.head_logits, batch, dlogits, dheads);
  }

  /// Backward from ∂L/∂logits and ∂L/∂head_logits; adds into every gradient.
  void backward(const ConstMatrixRef<T>& dlogits, const ConstMatrixRef<T>& dheads, const Cache& cache) {
    // ∂L/∂W_head += dZᵀ·h (V × d);  ∂L/∂h = dZ·W_head + heads' share
    head_grad_.noalias() += dlogits.transpose() * cache.h;
    Matrix<T> dh = mtp_.backward(dheads, cache.mtp);  // N × d
    dh.noalias() += dlogits * head_;
    Matrix<T> dx = norm_.backward(dh, cache.norm);
    for (auto it = order_.rbegin(); it != order_.rend(); ++it) {
      const auto [moe, i] = *it;
      if (moe)
        dx = sparse_[std::size_t(i)].backward(dx, cache.sparse[std::size_t(i)]);
      else
        dx = dense_[std::size_t(i)].backward(dx, cache.dense[std::size_t(i)]);
    }
    embed_.backward(dx, cache.embed);
  }

  /// \name Feature controls
  ///@{
  /// Sets κ-SwiGLU's sharpness ceiling U on every routed expert.
  void set_kappa_U(double U) {
    for (auto& s : sparse_) apex::set_kappa_U(s.ffn(), U);
  }
  /// Adds the κ regulariser's gradient of every MoE layer and returns its value (summed over layers).
  double add_kappa_regularizer_grad() {
    double r = 0;
    for (auto& s : sparse_) r += double(apex::add_kappa_regularizer_grad(s.ffn()));
    return r;
  }
  /// The skip gates' compute penalty of a forward pass (summed over layers).
  double skip_penalty(const Cache& cache) const {
    double p = 0;
    for (const auto& c : cache.dense) p += double(c.penalty);
    for (const auto& c : cache.sparse) p += double(c.penalty);
    return p;
  }
  /// Skipped share of the tokens, per layer, of a forward pass.
  std::vector<double> skip_rates(const Cache& cache) const {
    std::vector<double> r;
    for (const auto& [moe, i] : order_)
      r.push_back(moe ? cache.sparse[std::size_t(i)].skip_rate() : cache.dense[std::size_t(i)].skip_rate());
    return r;
  }
  /// Adds the routing of a forward pass to every MoE balancer's counts.
  void observe(const Cache& cache) {
    for (std::size_t i = 0; i < sparse_.size(); ++i) sparse_[i].observe(cache.sparse[i]);
  }
  /// Updates every MoE balancer's bias (if `apply`) and returns each layer's
  /// load over the window observed since the last call.
  std::vector<LoadReport> update_balancers(bool apply = true) {
    std::vector<LoadReport> r;
    for (auto& s : sparse_) {
      auto& b = s.ffn().balancer();
      if (apply) {
        r.push_back(b.update());
      } else {
        r.push_back(b.report());
        const double a = b.alpha();
        b.set_alpha(0);  // update() with α = 0 clears the window and leaves the bias
        b.update();
        b.set_alpha(a);
      }
    }
    return r;
  }
  /// Forces every skip gate open (τ = 0: g ≥ 0 always holds) or restores τ.
  void set_gates_open(bool open) {
    const T tau = open ? T(0) : T(cfg_.skip_threshold);
    for (auto& s : dense_)
      if (auto* g = s.skip_gate()) g->set_threshold(tau);
    for (auto& s : sparse_)
      if (auto* g = s.skip_gate()) g->set_threshold(tau);
  }
  /// Threads for the MoE dispatch (0: OpenMP's default).
  void set_threads(int threads) {
    for (auto& s : sparse_) s.ffn().set_threads(threads);
  }
  ///@}

  std::vector<Sparse>& moe_layers() { return sparse_; }
  const std::vector<Sparse>& moe_layers() const { return sparse_; }
  std::vector<Dense>& dense_layers() { return dense_; }
  const std::vector<Dense>& dense_layers() const { return dense_; }
  const MultiTokenHeads<T>& mtp() const { return mtp_; }

  /// Every parameter, named as a PyTorch state_dict: `embed.…`,
  /// `layers.{l}.norm.weight`, `layers.{l}.ffn.…`, `layers.{l}.skip_gate.…`,
  /// `norm.weight`, `head.weight`, `mtp.heads.{i}.weight`.
  ParamList<T> params() {
    ParamList<T> out;
    detail::append_prefixed(out, "embed.", embed_.params());
    for (std::size_t l = 0; l < order_.size(); ++l) {
      const auto [moe, i] = order_[l];
      detail::append_prefixed(out, "layers." + std::to_string(l) + ".",
                              moe ? sparse_[std::size_t(i)].params() : dense_[std::size_t(i)].params());
    }
    detail::append_prefixed(out, "norm.", norm_.params());
    out.push_back(detail::make_param<T>("head.weight", head_, head_grad_));
    detail::append_prefixed(out, "mtp.", mtp_.params());
    return out;
  }
  void zero_grad() {
    embed_.zero_grad();
    for (auto& s : dense_) s.zero_grad();
    for (auto& s : sparse_) s.zero_grad();
    norm_.zero_grad();
    head_grad_.setZero();
    mtp_.zero_grad();
  }

 private:
  template <class, class>
  friend class CharModel;  // the converting constructor reads its source's parts

  CharModelConfig cfg_;
  Rng rng_;  ///< draws the initial weights, in construction order
  ContextEmbedding<T> embed_;
  std::vector<Dense> dense_;
  std::vector<Sparse> sparse_;
  std::vector<std::pair<bool, Index>> order_;  ///< per layer: (is MoE, index into dense_/sparse_)
  RMSNorm<T> norm_;
  Matrix<T> head_;       ///< V × d
  Matrix<T> head_grad_;  ///< V × d
  MultiTokenHeads<T> mtp_;
  SublayerMode mode_ = SublayerMode::training;
};

}  // namespace apex::demo
