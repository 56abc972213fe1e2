#pragma once
/// \file moe/family_traits.hpp
/// What one row of the family table (moe/families.hpp) holds: the family's
/// routing and published shapes, its Hugging Face tensor names, its
/// config.json keys, its llama.cpp architecture and its expert kind. Plain
/// data, so that every floor reads it — moe/ its routing, io/ its names,
/// keys and architecture, inference/ and adapters/ its expert kind — and
/// none of them needs a switch over families.

#include "config.hpp"
#include "routing_config.hpp"

namespace apex {

/// The MoE families whose FFN block MoEFFN computes exactly.
enum class MoEFamily { DeepSeekV3, Mixtral, Qwen2MoE, Qwen3MoE, OLMoE };

/// How a family or GGUF architecture row names the expert kind of its blocks:
/// the kind's `ExpertKind<E>::kName` (inference/engine/expert_kind.hpp) and
/// how messages call those experts.
struct ExpertKindName {
  const char* name;   ///< "swiglu"
  const char* label;  ///< "SwiGLU"
  const char* layer;  ///< how to load such a block, for messages: "a SwiGLU layer (the default expert type)"
};
/// Plain SwiGLU experts: every family's.
inline constexpr ExpertKindName kSwiGLUExperts{"swiglu", "SwiGLU", "a SwiGLU layer (the default expert type)"};

/// How a family's Hugging Face checkpoints name the tensors of one MoE block,
/// relative to the layer's prefix (e.g. "model.layers.3."). nullptr: the
/// family's block has no such tensor.
struct FamilyTensorNames {
  const char* block;         ///< "mlp." or "block_sparse_moe."; router `<block>gate.weight`, experts `<block>experts.e.`
  const char* gate_proj;     ///< the expert's gate projection, e.g. "gate_proj.weight" (Mixtral "w1.weight")
  const char* up_proj;       ///< up projection ("up_proj.weight", Mixtral "w3.weight")
  const char* down_proj;     ///< down projection ("down_proj.weight", Mixtral "w2.weight")
  const char* shared_block;  ///< the one shared MLP, e.g. "mlp.shared_experts."
  const char* shared_gate;   ///< the shared experts' sigmoid gate weight
  const char* bias;          ///< the selection bias, shape [E] (DeepSeek-V3's e_score_correction_bias)
  const char* file_kind;     ///< what detect_family reports for such a file (Qwen3-MoE and OLMoE share names)
};

/// Which shared experts a family's block holds.
enum class FamilySharedLayout {
  None,       ///< no shared experts
  OneMLP,     ///< at most one shared MLP of width d_shared_ffn, ungated (DeepSeek-V3)
  OneGated,   ///< exactly one shared expert behind a sigmoid gate (Qwen2-MoE)
};

/// A config.json key that, when present, must hold one value (ConfigError
/// "config.json's '<key>' must be "<value>" (<why>)" otherwise).
struct FamilyFixedKey {
  const char* key = nullptr;
  const char* value = nullptr;
  const char* why = nullptr;
};

/// Which keys of a family's config.json hold what, as io/hf_config.hpp reads
/// them (in this order; nullptr: the family has no such key). A missing
/// required key is a FormatError naming it; the optional ones default to
/// the family's preset.
struct FamilyConfigKeys {
  const char* d_ffn = nullptr;          ///< the routed experts' width (required)
  const char* n_experts = nullptr;      ///< their count (required)
  const char* n_experts_alt = nullptr;  ///< read instead when n_experts is absent and this one present
  const char* shared_count = nullptr;   ///< shared experts, held as one MLP of count × d_ffn units (optional, 0)
  bool groups = false;                  ///< n_group, topk_group, routed_scaling_factor (optional)
  const char* renormalize = nullptr;    ///< the renormalisation flag; nullptr: the routing's
  bool renormalize_default = false;     ///< its value when absent
  FamilyFixedKey fixed[2];              ///< what the library's block of the family requires
  const char* first_moe_layer = nullptr;  ///< blocks below it are dense (optional, 0)
  const char* moe_every = nullptr;        ///< an MoE block every n-th block (optional, 1)
  bool moe_every_from_zero = false;       ///< layer % n == 0 (DeepSeek-V3); else (layer + 1) % n == 0 (Qwen)
  const char* dense_layers = nullptr;     ///< a list of dense blocks (optional)
  const char* shared_width = nullptr;     ///< the one gated shared expert's width (required, > 0)
};

/// One family: everything the library knows of it.
struct FamilyTraits {
  MoEFamily family;
  const char* model_type;  ///< Hugging Face `model_type`
  const char* title;       ///< "Qwen2-MoE": how messages and docs call it
  RoutingConfig routing;   ///< for any shapes
  MoEConfig preset;        ///< one MoE layer of the published configuration (moe/families.hpp's table)
  FamilySharedLayout shared_layout;
  FamilyTensorNames names;
  FamilyConfigKeys config;         ///< its config.json
  const char* gguf_architecture;   ///< llama.cpp's `general.architecture` (io/gguf_architectures.hpp)
  ExpertKindName experts;          ///< the expert kind of its blocks
  /// detect_family tries the families in increasing rank: a file holding
  /// several families' own names is the lowest-ranked one's (io/family_names.hpp).
  int detection_rank = 0;
};

}  // namespace apex
