#pragma once
/// \file packed_char_model.hpp
/// The demo model for inference on packed weights: a trained
/// `CharModel<float>` whose FFN sublayers — the dense SwiGLU and the κ-SwiGLU
/// MoE ones, skip gates included — are replaced by the library's inference
/// sublayers (`apex::pack_sublayer`, docs/inference.md), with the expert
/// weights in `Storage` = float or `apex::packed::bf16`:
///
///     auto bf16_model = apex::demo::pack_model<apex::packed::bf16>(trained);
///     evaluate(bf16_model, …);  speculative_generate(bf16_model, …);
///
/// It is the same CharModel class on other sublayer types, so forward, loss,
/// evaluation and decoding are the float model's code. What changes is only
/// what the packed layers change: the FFN products run on packed weights and
/// hold no gradients. The router, balancing bias, κ parameters, RMSNorms and
/// skip gates stay float (bit for bit the trained layers' decisions on equal
/// inputs); the embedding, final norm and heads are float copies.
///
/// A packed model is a snapshot: pack again after the trained model changes.

#include <apex/ffn/inference.hpp>

#include "char_model.hpp"

namespace apex::demo {

/// The inference sublayers on packed `Storage` weights, in place of
/// TrainingLayers<float>.
template <class Storage>
struct PackedLayers {
  using Dense = PackedSublayer<PackedSwiGLU<Storage>>;
  using Sparse = PackedSublayer<PackedMoE<Storage, KappaSwiGLU<float>>>;
  /// Forward only: made by pack_model from a trained model.
  static constexpr bool kTrainable = false;
};

/// The demo model on packed inference sublayers.
template <class Storage>
using PackedCharModel = CharModel<float, PackedLayers<Storage>>;

/// Packs every FFN sublayer of `trained` into `Storage` (float or
/// apex::packed::bf16; bf16 rounds each weight to nearest even). The result
/// is in inference mode: a forward with a cache fills skip statistics, and
/// skipped tokens never reach the FFN.
template <class Storage>
PackedCharModel<Storage> pack_model(const CharModel<float>& trained) {
  PackedCharModel<Storage> out(trained, [](const auto& sublayer) { return pack_sublayer<Storage>(sublayer); });
  out.set_mode(SublayerMode::inference);
  return out;
}

}  // namespace apex::demo
