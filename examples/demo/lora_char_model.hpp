#pragma once
/// \file lora_char_model.hpp
/// The demo model for fine-tuning on frozen packed weights: a trained
/// `CharModel<float>` whose FFN sublayers are packed in `Storage` (q4_0,
/// q4_k, …) and carry low-rank adapters (docs/adapters.md):
///
///     dense l:  FFNSublayer<float, LoraSwiGLU<PackedSwiGLU<Storage>>>
///     MoE l:    FFNSublayer<float, LoraMoE<PackedMoE<Storage, KappaSwiGLU<float>>>>
///
///     auto m = apex::demo::adapt_model<LoraLayers<packed::q4_0>>(trained, lora_options, seed);
///     FineTuner tuner(m, …);  tuner.step();  evaluate(m, …);
///
/// It is the same CharModel class, so forward, loss, backward, evaluation
/// and decoding are the float model's code. Every adapter's B starts at
/// zero, so the adapted model starts as the packed one (with exact float
/// activations: the adapters' training forward, not the inference
/// products that quantize activations to Q8_0 / Q8_K). The embedding, the
/// norms, the skip gates, the heads, the routers and κ's parameters are
/// float copies of the trained model's and stay frozen: what trains are
/// the parameters named `…lora_A.weight` / `…lora_B.weight` (lora_parameters).
///
/// `AdapterLayers<T, DenseBase, MoEBase>` names the sublayers over any
/// frozen base; `LoraReferenceLayers<T>` puts the adapters over the
/// training layers themselves (SwiGLU<T>, MoEFFN<T, κ-SwiGLU>), which in
/// double is the model of the finite-difference checks (the packed engine
/// holds float weights only).

#include <apex/ffn/adapters.hpp>
#include <apex/ffn/inference.hpp>

#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "char_model.hpp"

namespace apex::demo {

/// LoRA sublayers over frozen bases `DenseBase` (a SwiGLU) and `MoEBase` (an MoE layer).
template <class T, class DenseBase_, class MoEBase_>
struct AdapterLayers {
  using DenseBase = DenseBase_;
  using MoEBase = MoEBase_;
  using Dense = FFNSublayer<T, LoraSwiGLU<DenseBase>>;
  using Sparse = FFNSublayer<T, LoraMoE<MoEBase>>;
  /// Converted from a trained model (adapt_model), never built from a seed.
  static constexpr bool kTrainable = false;
};

/// The fine-tuning layers: adapters on FFN weights packed in `Storage`.
template <class Storage>
using LoraLayers = AdapterLayers<float, PackedSwiGLU<Storage>, PackedMoE<Storage, KappaSwiGLU<float>>>;
template <class Storage>
using LoraCharModel = CharModel<float, LoraLayers<Storage>>;

/// Adapters on the training layers' own weights, in T (the reference).
template <class T>
using LoraReferenceLayers = AdapterLayers<T, SwiGLU<T>, MoEFFN<T, KappaSwiGLU<T>>>;

namespace adapt_detail {
/// The frozen base of a LoRA layer, made from a trained layer: packed in
/// Storage (ConfigError for widths that are not whole blocks of it), or a copy.
template <class Base>
struct FrozenBaseOf;
template <class Storage>
struct FrozenBaseOf<PackedSwiGLU<Storage>> {
  static PackedSwiGLU<Storage> from(const SwiGLU<float>& f) {
    return PackedSwiGLU<Storage>::from(f, packed_dtype<Storage>());
  }
};
template <class Storage, class Expert>
struct FrozenBaseOf<PackedMoE<Storage, Expert>> {
  static PackedMoE<Storage, Expert> from(const MoEFFN<float, Expert>& m) {
    return PackedMoE<Storage, Expert>::from(m, packed_dtype<Storage>());
  }
};
template <class T>
struct FrozenBaseOf<SwiGLU<T>> {
  static SwiGLU<T> from(const SwiGLU<T>& f) { return f; }
};
template <class T, class Expert>
struct FrozenBaseOf<MoEFFN<T, Expert>> {
  static MoEFFN<T, Expert> from(const MoEFFN<T, Expert>& m) { return m; }
};

/// `ffn` in a sublayer with src's norm and skip gate, in training mode.
template <class Sublayer, class Src, class FFN>
Sublayer adapted_sublayer(const Src& src, FFN ffn) {
  Sublayer out = src.skip_gate() ? Sublayer(src.d_model(), std::move(ffn), *src.skip_gate())
                                 : Sublayer(src.d_model(), std::move(ffn));
  out.norm() = src.norm();
  return out;
}
}  // namespace adapt_detail

/// `trained` with every FFN sublayer's FFN frozen as `Layers`' base and
/// adapted as `options` say (A drawn from `seed` layer by layer, B zero).
/// ConfigError if a base refuses the widths (a block format) or the
/// options do not fit them. The result is in training mode.
template <class Layers, class T>
CharModel<T, Layers> adapt_model(const CharModel<T>& trained, const LoraOptions& options, std::uint64_t seed) {
  using Dense = typename Layers::Dense;
  using Sparse = typename Layers::Sparse;
  using DenseLora = typename Dense::FFNType;
  using SparseLora = typename Sparse::FFNType;
  Rng rng(seed);
  const auto convert = [&](const auto& s) {
    using Src = std::decay_t<decltype(s)>;
    if constexpr (std::is_same_v<Src, typename TrainingLayers<T>::Dense>) {
      auto base = adapt_detail::FrozenBaseOf<typename Layers::DenseBase>::from(s.ffn());
      return adapt_detail::adapted_sublayer<Dense>(s, DenseLora(std::move(base), options, rng));
    } else {
      auto base = adapt_detail::FrozenBaseOf<typename Layers::MoEBase>::from(s.ffn());
      return adapt_detail::adapted_sublayer<Sparse>(s, SparseLora(std::move(base), options, rng));
    }
  };
  CharModel<T, Layers> out(trained, convert);
  out.set_mode(SublayerMode::training);
  return out;
}

/// Whether a parameter of an adapted model is an adapter's (A or B).
inline bool is_lora_parameter(const std::string& name) { return name.find("lora_") != std::string::npos; }

/// The adapters of `model`, with their gradients: what a fine-tuning step updates.
template <class T, class Layers>
ParamList<T> lora_parameters(CharModel<T, Layers>& model) {
  ParamList<T> out;
  for (auto& p : model.params())
    if (is_lora_parameter(p.name)) out.push_back(p);
  return out;
}

}  // namespace apex::demo
