#pragma once
/// \file adapters/peft_layers.hpp
/// One LoraMoE layer as an adapter file sees it: whether its expert kind
/// and block fit the file's layout (adapters/peft_names.hpp), which slots
/// it adapts, and the specs of its tensors, for a save from the layer or
/// for a load of an adapter whose config (adapters/peft_config.hpp) must
/// describe the same adapters: rank, α, rslora, and, in the stacked
/// layouts, the targeted expert parameters, whose set fixes peft's nesting
/// and so the names.

#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "../core/errors.hpp"
#include "../inference/engine/expert_kind.hpp"
#include "../io/family_names.hpp"
#include "../io/gpt_oss_layout.hpp"
#include "../moe/gpt_oss.hpp"
#include "frozen_layer.hpp"
#include "lora_adapter.hpp"
#include "lora_moe.hpp"
#include "peft_config.hpp"
#include "peft_names.hpp"

namespace apex {

/// A layer of a model and the index of its decoder layer (the {L} of the names).
template <class Base>
struct PeftLayerRef {
  Index index = 0;
  LoraMoE<Base>* layer = nullptr;
};
template <class Base>
PeftLayerRef<Base> peft_layer(Index index, LoraMoE<Base>& layer) {
  return {index, &layer};
}

namespace detail {

template <class Layer>
using PeftExpertOf = typename FrozenLayer<typename Layer::BaseType>::ExpertType;

/// The adapted slots of one expert's adapters, in slot order.
template <class T>
std::vector<LoraSlot> peft_slots(const LoraExpertAdapters<T>& v) {
  std::vector<LoraSlot> out;
  for (int s = 0; s < kLoraSlots; ++s)
    if (v.has(LoraSlot(s))) out.push_back(LoraSlot(s));
  return out;
}

/// ConfigError unless the layer's kind and block fit layout n; in the
/// stacked layouts the routed experts' gate and up cannot be adapted apart.
template <class Layer>
void check_peft_layer(const std::string& where, const Layer& layer, const PeftNames& n) {
  using Expert = PeftExpertOf<Layer>;
  using T = typename Layer::Scalar;
  using Kind = ExpertKind<Expert>;
  // peft's layouts call gpt-oss's experts by the model's layout
  const char* kind = std::is_same_v<Expert, GptOssExpert<T>> ? "clamped SwiGLU (gpt-oss)" : Kind::kLabel;
  if (n.layout == PeftLayout::family) {
    const FamilyTraits& row = family_traits(n.family, where.c_str());
    require_config(std::string(row.experts.name) == Kind::kName, where.c_str(),
                   std::string("the ") + row.model_type + " layout holds " + row.experts.label +
                       " experts, this layer's are " + kind + " (PeftNames::apex() names any kind)");
    check_family_fit(where.c_str(), layer.config(), n.family);
  } else if (n.layout == PeftLayout::gpt_oss) {
    require_config(std::is_same_v<Expert, GptOssExpert<T>>, where.c_str(),
                   std::string("the gpt_oss layout holds clamped SwiGLU experts, this layer's are ") + kind);
    check_gpt_oss_config(where.c_str(), layer.config());
  } else {
    return;
  }
  const LoraTargets& t = layer.options().targets;
  require_config(!(t.gate || t.up), where.c_str(),
                 "LoraOptions::targets.gate / targets.up adapt the routed experts' gate and up apart, but "
                 "transformers holds them as one fused gate_up_proj, which peft adapts with one (A, B): use "
                 "targets.gate_up, or PeftNames::apex()");
}

inline std::string peft_slot_list(const std::vector<const char*>& names) {
  std::string s;
  for (const char* n : names) s += std::string(s.empty() ? "" : ", ") + n;
  return "{" + s + "}";
}

/// The stacked parameters the routed slots are, in kPeftStackedParams order.
inline std::vector<const char*> peft_stacked_of(const std::vector<LoraSlot>& routed) {
  std::vector<const char*> out;
  for (int i = 0; i < 2; ++i)
    for (LoraSlot s : routed)
      if (s == kPeftStackedSlots[i]) out.push_back(kPeftStackedParams[i]);
  return out;
}

/// The stacked parameters of layer `index` that `c` targets (peft's matching).
inline std::vector<const char*> peft_stacked_targeted(const PeftAdapterConfig& c, const PeftNames& n, Index index) {
  std::vector<const char*> out;
  for (const char* p : kPeftStackedParams)
    if (peft_targets(c.target_parameters, n.block_path(index) + "experts." + p)) out.push_back(p);
  return out;
}

template <class Layer>
PeftWidths peft_widths(const Layer& l) {
  const MoEConfig& c = l.config();
  return {c.d_model, c.d_ffn, c.shared_ffn(), c.n_experts, l.options().rank};
}

template <class Layer>
std::vector<LoraSlot> peft_shared_slots(const Layer& l) {
  return l.shared_adapters().experts() > 0 ? peft_slots(l.shared_adapters().values(0)) : std::vector<LoraSlot>{};
}

/// The specs of the layer's tensors, as a save writes them.
template <class Layer>
std::vector<PeftTensorSpec> peft_save_specs(const Layer& layer, Index index, const PeftNames& n) {
  const std::vector<LoraSlot> routed = peft_slots(layer.routed_adapters().values(0));
  return peft_layer_specs(n, n.key_prefix(index), peft_widths(layer), routed, peft_stacked_of(routed),
                          peft_shared_slots(layer), layer.shared_adapters().experts());
}

/// The specs of the layer's tensors in an adapter of config `c`: ConfigError
/// naming the key if c's r, lora_alpha, use_rslora or (stacked layouts) its
/// targeted expert parameters are not the layer's.
template <class Layer>
std::vector<PeftTensorSpec> peft_load_specs(const std::string& where, const Layer& layer, Index index,
                                            const PeftNames& n, const PeftAdapterConfig& c) {
  const LoraOptions& o = layer.options();
  const std::string at = where + ": layer " + std::to_string(index) + ": adapter_config.json's ";
  if (c.rank != o.rank)
    throw ConfigError(at + "'r' is " + std::to_string(c.rank) + ", the layer's LoraOptions::rank " +
                      std::to_string(o.rank));
  if (c.alpha != o.alpha)
    throw ConfigError(at + "'lora_alpha' is " + std::to_string(c.alpha) + ", the layer's LoraOptions::alpha " +
                      std::to_string(o.alpha));
  if (c.rslora != o.rslora)
    throw ConfigError(at + "'use_rslora' is " + (c.rslora ? "true" : "false") + ", the layer's LoraOptions::rslora " +
                      (o.rslora ? "true" : "false"));
  const std::vector<LoraSlot> routed = peft_slots(layer.routed_adapters().values(0));
  std::vector<const char*> stacked = peft_stacked_of(routed);
  if (n.layout != PeftLayout::apex) {
    const std::vector<const char*> targeted = peft_stacked_targeted(c, n, index);
    if (targeted != stacked)
      throw ConfigError(at + "'target_parameters' adapt " + peft_slot_list(targeted) + " of '" + n.block_path(index) +
                        "experts', the layer's routed adapters are " + peft_slot_list(stacked) +
                        " (LoraOptions::targets: gate_up_proj is targets.gate_up, down_proj targets.down)");
  }
  return peft_layer_specs(n, n.key_prefix(index), peft_widths(layer), routed, stacked, peft_shared_slots(layer),
                          layer.shared_adapters().experts());
}

/// ConfigError unless `layers` is non-empty (one layer if n has no layer
/// path), every layer given, and the indices distinct and >= 0.
template <class Base>
void check_peft_layer_list(const std::string& where, const std::vector<PeftLayerRef<Base>>& layers,
                           const PeftNames& n) {
  require_config(!layers.empty(), where.c_str(), "no layers given");
  require_config(!n.layers.empty() || layers.size() == 1, where.c_str(),
                 "PeftNames::layers is empty: the names hold one block, not " + std::to_string(layers.size()) +
                     " layers");
  std::set<Index> seen;
  for (const auto& l : layers) {
    require_config(l.layer != nullptr, where.c_str(), "layer " + std::to_string(l.index) + " is a null pointer");
    require_config(l.index >= 0, where.c_str(), "layer index " + std::to_string(l.index) + " is negative");
    require_config(seen.insert(l.index).second, where.c_str(),
                   "layer index " + std::to_string(l.index) + " is given twice");
  }
}

}  // namespace detail
}  // namespace apex
