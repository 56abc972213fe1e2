#pragma once
/// \file adapters/lora_merge.hpp
/// The adapted layer as one plain layer: every adapted projection's weight
/// replaced by W + s·B·A (the frozen base's values: a packed base's
/// dequantized weights), the router as it trained, the balancing bias as
/// the balancer left it, the frozen float parts (κ's α and b, the clamped
/// biases) copied:
///
///  - `merged_float(layer)`: a `MoEFFN<T, Expert>` (a training layer again,
///    for further full fine-tuning or a float checkpoint);
///  - `merged_packed<Storage>(layer, types)`: a `PackedMoE<Storage, Expert>`
///    re-quantized in `types` (ggml's quantizers), built expert by expert so
///    only one expert is ever in float at a time;
///  - the same two for a dense `LoraSwiGLU`: a `SwiGLU<T>` and a `PackedSwiGLU<Storage>`.
///
/// The merged layer computes what the adapted one does up to the rounding of
/// W + s·B·A (and, re-quantized, the new blocks' quantization error).

#include <string>
#include <utility>
#include <vector>

#include "../core/types.hpp"
#include "../inference/engine/packed_moe.hpp"
#include "../moe/moe_ffn.hpp"
#include "lora_moe.hpp"
#include "lora_swiglu.hpp"

namespace apex {

namespace detail {
/// One expert's frozen weights as dense T: [W_gate; W_up] (2f × d), W_down (d × f).
template <class T>
std::pair<Matrix<T>, Matrix<T>> dense_weights(const FrozenDenseExpert<T>& f) {
  return {f.weights->w_gate_up(), f.weights->w_down()};
}
inline std::pair<Matrix<float>, Matrix<float>> dense_weights(const FrozenPackedExpert& f) {
  Matrix<float> gu(2 * f.d_ffn(), f.d_model());  // 2f × d
  gu.topRows(f.d_ffn()) = f.weights->w_gate();
  gu.bottomRows(f.d_ffn()) = f.weights->w_up();
  return {std::move(gu), f.weights->w_down()};
}

/// W + s·B·A for every adapted slot of `ad`, into a SwiGLU's weights.
template <class T, class Frozen>
void merge_expert(const Frozen& frozen, const LoraExpertAdapters<T>& ad, T s, SwiGLU<T>& out) {
  auto [gu, down] = dense_weights(frozen);  // 2f × d, d × f
  const Index f = frozen.d_ffn();
  const auto delta = [&](LoraSlot slot) -> Matrix<T> { return s * (ad[slot].b * ad[slot].a); };  // out × in
  if (ad.has(LoraSlot::gate)) gu.topRows(f) += delta(LoraSlot::gate);
  if (ad.has(LoraSlot::up)) gu.bottomRows(f) += delta(LoraSlot::up);
  if (ad.has(LoraSlot::gate_up)) gu += delta(LoraSlot::gate_up);
  if (ad.has(LoraSlot::down)) down += delta(LoraSlot::down);
  out.w_gate() = gu.topRows(f);
  out.w_up() = gu.bottomRows(f);
  out.w_down() = down;
}
}  // namespace detail

/// The adapted layer as a training layer `MoEFFN<T, Expert>` (see the file comment).
template <class Base>
auto merged_float(const LoraMoE<Base>& layer) {
  using Frozen = FrozenLayer<Base>;
  using T = typename Frozen::Scalar;
  using Expert = typename Frozen::ExpertType;
  const MoEConfig& cfg = layer.config();
  const T s = T(layer.options().scale());
  MoEFFN<T, Expert> out(cfg, Rng(0));  // every weight below is overwritten
  static const LoraExpertAdapters<T> none;
  for (Index e = 0; e < cfg.n_experts; ++e) {
    Expert& x = out.experts()[std::size_t(e)];
    Frozen::activation(layer.base(), e).apply_to(x);
    detail::merge_expert(Frozen::routed(layer.base(), e, layer.isa()), layer.routed_adapters().values(e), s,
                         ExpertKind<Expert>::weights(x));
  }
  const LoraAdapterSet<T>& shared = layer.shared_adapters();
  for (Index j = 0; j < cfg.n_shared; ++j)
    detail::merge_expert(Frozen::shared(layer.base(), j, layer.isa()), shared.experts() > 0 ? shared.values(j) : none,
                         s, out.shared_experts()[std::size_t(j)]);
  out.router().weight() = layer.router().weight();
  if (cfg.router_bias) out.router().logit_bias() = layer.router().logit_bias();
  out.balancer().set_bias(layer.balancer().bias());
  for (auto& p : out.param_values())
    if (p.name == state_names::kSharedGate) p.value() = Frozen::shared_gate(layer.base());
  return out;
}

/// The adapted layer re-packed in `types` (see the file comment): one
/// expert in float at a time. ConfigError as PackedMoE::from for widths a
/// block type cannot hold.
template <class Storage, class Base>
auto merged_packed(const LoraMoE<Base>& layer, const PackedTypes& types = packed_dtype<Storage>()) {
  using Frozen = FrozenLayer<Base>;
  using T = typename Frozen::Scalar;
  using Expert = typename Frozen::ExpertType;
  static_assert(std::is_same_v<T, float>, "merged_packed: the packed engine holds float layers");
  using Out = PackedMoE<Storage, Expert>;
  const MoEConfig& cfg = layer.config();
  Out::check_fits("merged_packed", cfg, 0, types);
  const T s = T(layer.options().scale());
  SwiGLU<float> one(cfg.d_model, cfg.d_ffn, Rng(0));  // the expert being merged
  std::vector<packed::PackedExpert> experts, shared;
  std::vector<typename Out::Extra> extras;
  for (Index e = 0; e < cfg.n_experts; ++e) {
    detail::merge_expert(Frozen::routed(layer.base(), e, layer.isa()), layer.routed_adapters().values(e), s, one);
    experts.emplace_back(one.w_gate(), one.w_up(), one.w_down(), types.routed);
    if constexpr (Out::kHasExtra) extras.push_back(Frozen::packed_extra(layer.base(), e));
  }
  static const LoraExpertAdapters<T> none;
  const LoraAdapterSet<T>& sh = layer.shared_adapters();
  SwiGLU<float> one_shared(cfg.d_model, cfg.shared_ffn() > 0 ? cfg.shared_ffn() : 1, Rng(0));
  for (Index j = 0; j < cfg.n_shared; ++j) {
    detail::merge_expert(Frozen::shared(layer.base(), j, layer.isa()), sh.experts() > 0 ? sh.values(j) : none, s,
                         one_shared);
    shared.emplace_back(one_shared.w_gate(), one_shared.w_up(), one_shared.w_down(), types.shared);
  }
  Out out(cfg, layer.router().weight(), layer.balancer().bias(), std::move(experts), std::move(extras),
          std::move(shared), Frozen::shared_gate(layer.base()));
  if (cfg.router_bias) out.set_logit_bias(layer.router().logit_bias());
  return out;
}

/// The adapted dense layer as a training layer `SwiGLU<T>`: W + s·B·A.
template <class Base>
auto merged_float(const LoraSwiGLU<Base>& layer) {
  using T = typename LoraSwiGLU<Base>::Scalar;
  SwiGLU<T> out(layer.d_model(), layer.d_ffn(), Rng(0));  // every weight overwritten
  detail::merge_expert(detail::FrozenDense<Base>::frozen(layer.base(), layer.isa()), layer.adapters().values(0),
                       T(layer.options().scale()), out);
  return out;
}

/// The adapted dense layer re-packed in `types` (ConfigError for widths a block type cannot hold).
template <class Storage, class Base>
PackedSwiGLU<Storage> merged_packed(const LoraSwiGLU<Base>& layer,
                                    packed::ExpertDtypes types = packed_dtype<Storage>()) {
  static_assert(std::is_same_v<typename LoraSwiGLU<Base>::Scalar, float>, "merged_packed: the packed engine holds float layers");
  return PackedSwiGLU<Storage>::from(merged_float(layer), types);
}

}  // namespace apex
