#pragma once
/// \file adapters/peft_names.hpp
/// Which tensors of a peft adapter file hold which adapter of a LoraMoE
/// layer (docs/adapters.md#peft-adapter-files): one `PeftTensorSpec` per
/// tensor, naming it and saying where its rows and columns come from.
///
/// Every key starts `base_model.model.` + the block's path in the base
/// model, `model.layers.{L}.mlp.` (PeftNames: layers, block). Under it:
///
/// - family / gpt_oss layout (transformers 5 holds the routed experts as
///   3-D parameters of one module `experts`; peft wraps each targeted
///   parameter in a ParamWrapper, nested in the module's registration
///   order: gate_up_proj inside down_proj, so with both targeted
///   gate_up_proj's tensors are `experts.base_layer.lora_*`, down_proj's
///   `experts.lora_*`; with one targeted it is `experts.lora_*`):
///
///       lora_A  (r·E) × in     row e·r + k     = A_e row k
///       lora_B  out × (r·E)    column k·E + e  = B_e column k
///
///   gate_up_proj: in = d, out = 2f. Qwen/OLMoE/Mixtral/DeepSeek store it
///   (E, 2f, d), gate rows first, as the library's fused B; gpt-oss stores
///   (E, d, 2f) with gate and up interleaved (column 2j gate unit j, 2j+1 up
///   unit j), so lora_B row 2j is the library's B row j and row 2j+1 its
///   row f + j (A is the same). down_proj: in = f, out = d.
///   A shared expert (Qwen2-MoE `shared_expert`, DeepSeek-V3
///   `shared_experts`) is Linear layers: `shared_expert.gate_proj.lora_A.weight`
///   (r × d), `….lora_B.weight` (f_s × r), up_proj alike, down_proj A r × f_s,
///   B d × r.
/// - apex layout (any expert kind; the only one for κ-SwiGLU, which has no
///   Hugging Face model): the library's own modules, one Linear each,
///   `experts.{e}.w_gate.lora_A.weight` (r × d), `….w_up.…`, `….w_down.…`,
///   `shared_experts.{s}.w_*`, as peft names the adapters of a PyTorch
///   model whose state_dict is the library's (io/checkpoint.hpp).
///
/// A fused gate_up adapter (one A, B = [B_gate; B_up]) of a per-Linear
/// layout is written as the gate and the up projection's adapters, each
/// with the same A and its half of B: exact, and read back only if both
/// A are equal. Tied adapters are written into every expert's slot.

#include <cstring>
#include <string>
#include <vector>

#include "../core/errors.hpp"
#include "../core/types.hpp"
#include "../moe/families.hpp"
#include "lora_adapter.hpp"

namespace apex {

/// How an adapter file names the MoE block's adapters.
enum class PeftLayout {
  family,   ///< an open MoE family in transformers 5 (fused 3-D routed experts)
  gpt_oss,  ///< gpt-oss (fused, transposed, gate/up interleaved)
  apex,     ///< the library's own module names (any expert kind)
};

/// Names of one model's MoE blocks in its adapter files.
struct PeftNames {
  PeftLayout layout = PeftLayout::family;
  MoEFamily family = MoEFamily::Qwen3MoE;  ///< whose shared-expert names (layout family)
  std::string layers = "model.layers";     ///< the decoder layers' module path; "": one block, no layer index
  std::string block = "mlp";               ///< the MoE block's name in a decoder layer (transformers 5, every family);
                                           ///< "": the layer is the block (both "": a bare block, as peft wraps it alone)

  static PeftNames of(MoEFamily f) {
    PeftNames n;
    n.family = f;
    return n;
  }
  static PeftNames gpt_oss() {
    PeftNames n;
    n.layout = PeftLayout::gpt_oss;
    return n;
  }
  static PeftNames apex() {
    PeftNames n;
    n.layout = PeftLayout::apex;
    return n;
  }
  /// "model.layers.3.mlp." — the block of decoder layer `layer` in the base model.
  std::string block_path(Index layer) const {
    return (layers.empty() ? "" : layers + "." + std::to_string(layer) + ".") + (block.empty() ? "" : block + ".");
  }
  /// "base_model.model.model.layers.3.mlp." — the prefix of its adapter tensors.
  std::string key_prefix(Index layer) const { return "base_model.model." + block_path(layer); }
};

/// Which rows of a slot's B a lora_B holds, in which order.
enum class PeftRows {
  all,          ///< every row, in order
  gate_half,    ///< rows [0, f) of a fused gate_up B
  up_half,      ///< rows [f, 2f)
  interleaved,  ///< 2f rows: row 2j = row j, row 2j + 1 = row f + j (gpt-oss)
};

/// One tensor of an adapter file and the adapter it holds.
struct PeftTensorSpec {
  std::string name;  ///< the full key
  Index rows = 0, cols = 0;
  bool shared = false;  ///< the shared experts' adapters (else the routed experts')
  Index expert = -1;    ///< the (shared) expert of a per-Linear tensor; -1: all routed experts stacked
  LoraSlot slot = LoraSlot::down;
  bool is_b = false;  ///< lora_B (else lora_A)
  PeftRows rows_of = PeftRows::all;
};

/// The targetable 3-D parameters of transformers' `experts` module, in
/// registration order (what decides peft's nesting), and their slots.
inline constexpr const char* kPeftStackedParams[] = {"gate_up_proj", "down_proj"};
inline constexpr LoraSlot kPeftStackedSlots[] = {LoraSlot::gate_up, LoraSlot::down};

namespace detail {

/// Widths of the adapted layer: d, f (routed), f_s (shared), E, r.
struct PeftWidths {
  Index d, f, fs, experts, rank;
};

/// in × out of slot s of an expert of hidden width h.
inline void peft_slot_dims(LoraSlot s, Index d, Index h, Index& in, Index& out) {
  in = s == LoraSlot::down ? h : d;
  out = s == LoraSlot::down ? d : s == LoraSlot::gate_up ? 2 * h : h;
}

/// The A and B specs of one per-Linear adapter `module` (relative key, with
/// its trailing dot) holding slot s's A and rows `rows` of its B.
inline void add_linear_specs(std::vector<PeftTensorSpec>& out, const std::string& module, bool shared, Index expert,
                             LoraSlot s, PeftRows rows, Index in, Index b_rows, Index r) {
  out.push_back({module + "lora_A.weight", r, in, shared, expert, s, false, PeftRows::all});
  out.push_back({module + "lora_B.weight", b_rows, r, shared, expert, s, true, rows});
}

/// The Linear modules slot s of one expert is written as: (name, rows) pairs;
/// gate_up splits into the gate and the up projection.
inline std::vector<std::pair<std::string, PeftRows>> peft_linear_modules(LoraSlot s, const char* gate, const char* up,
                                                                          const char* down) {
  switch (s) {
    case LoraSlot::gate: return {{gate, PeftRows::all}};
    case LoraSlot::up: return {{up, PeftRows::all}};
    case LoraSlot::gate_up: return {{gate, PeftRows::gate_half}, {up, PeftRows::up_half}};
    case LoraSlot::down: return {{down, PeftRows::all}};
  }
  return {};
}

/// Specs of one expert's slots as per-Linear adapters under `module_prefix`.
inline void add_expert_specs(std::vector<PeftTensorSpec>& out, const std::string& module_prefix, bool shared,
                             Index expert, const std::vector<LoraSlot>& slots, const char* gate, const char* up,
                             const char* down, Index d, Index h, Index r) {
  for (LoraSlot s : slots) {
    Index in = 0, o = 0;
    peft_slot_dims(s, d, h, in, o);
    for (const auto& [module, rows] : peft_linear_modules(s, gate, up, down))
      add_linear_specs(out, module_prefix + module + ".", shared, expert, s, rows, in,
                       rows == PeftRows::all ? o : o / 2, r);
  }
}

/// A family's shared-expert Linear modules, relative to the block:
/// "shared_expert." and "gate_proj", "up_proj", "down_proj" (Qwen2-MoE).
struct PeftSharedNames {
  std::string module, gate, up, down;
};
inline PeftSharedNames peft_shared_names(const PeftNames& names) {
  const FamilyTensorNames& fn = family_traits(names.family, "PeftNames").names;
  if (!fn.shared_block)
    throw ConfigError(std::string("PeftNames: the ") + family_name(names.family) + " block has no shared experts");
  const auto stem = [](const char* w) { return std::string(w, std::strlen(w) - std::strlen(".weight")); };
  // the checkpoint names "mlp.shared_expert.", "gate_proj.weight" → "shared_expert.", "gate_proj"
  return {fn.shared_block + std::strlen(fn.block), stem(fn.gate_proj), stem(fn.up_proj), stem(fn.down_proj)};
}

}  // namespace detail

/// The tensor specs of one layer's adapters under `prefix` (the layer's
/// key_prefix). apex layout: the routed slots `routed` of each of the
/// w.experts experts. Stacked layouts: the targeted parameters `stacked`
/// (in kPeftStackedParams order, which fixes the nesting; the caller has
/// checked they are the layer's routed slots). Both: the `shared` slots of
/// each of `n_shared` shared experts.
inline std::vector<PeftTensorSpec> peft_layer_specs(const PeftNames& names, const std::string& prefix,
                                                    const detail::PeftWidths& w, const std::vector<LoraSlot>& routed,
                                                    const std::vector<const char*>& stacked,
                                                    const std::vector<LoraSlot>& shared, Index n_shared) {
  std::vector<PeftTensorSpec> out;
  const Index r = w.rank;
  if (names.layout == PeftLayout::apex) {
    for (Index e = 0; e < w.experts; ++e)
      detail::add_expert_specs(out, prefix + "experts." + std::to_string(e) + ".", false, e, routed, "w_gate", "w_up",
                               "w_down", w.d, w.f, r);
    for (Index s = 0; s < n_shared; ++s)
      detail::add_expert_specs(out, prefix + "shared_experts." + std::to_string(s) + ".", true, s, shared, "w_gate",
                               "w_up", "w_down", w.d, w.fs, r);
    return out;
  }
  for (std::size_t i = 0; i < stacked.size(); ++i) {
    std::string module = prefix + "experts.";
    for (std::size_t outer = i + 1; outer < stacked.size(); ++outer) module += "base_layer.";  // wrapped by the later ones
    const bool gate_up = std::strcmp(stacked[i], "gate_up_proj") == 0;
    const LoraSlot s = gate_up ? LoraSlot::gate_up : LoraSlot::down;
    Index in = 0, o = 0;
    detail::peft_slot_dims(s, w.d, w.f, in, o);
    const PeftRows rows = gate_up && names.layout == PeftLayout::gpt_oss ? PeftRows::interleaved : PeftRows::all;
    out.push_back({module + "lora_A.weight", r * w.experts, in, false, -1, s, false, PeftRows::all});
    out.push_back({module + "lora_B.weight", o, r * w.experts, false, -1, s, true, rows});
  }
  if (n_shared > 0) {
    const detail::PeftSharedNames sn = detail::peft_shared_names(names);
    detail::add_expert_specs(out, prefix + sn.module, true, 0, shared, sn.gate.c_str(), sn.up.c_str(), sn.down.c_str(),
                             w.d, w.fs, r);
  }
  return out;
}

/// Whether peft targets parameter `key` (a module path without
/// "base_model.model.") with `targets`: an entry equal to it or a suffix
/// after a dot, as peft matches target_parameters.
inline bool peft_targets(const std::vector<std::string>& targets, const std::string& key) {
  for (const auto& t : targets)
    if (key == t || (key.size() > t.size() && key.compare(key.size() - t.size(), t.size(), t) == 0 &&
                     key[key.size() - t.size() - 1] == '.'))
      return true;
  return false;
}

}  // namespace apex
