#pragma once
/// \file inference/files/checkpoint/load_options.hpp
/// The options of the packed loaders (`load_packed_moe`, `load_packed_swiglu`,
/// `load_packed_sublayer`, `map_packed_moe`, `load_packed_gpt_oss`): where the
/// layer's tensors are in the file, under which names, in which storage
/// types, with which expert options, and the reader's caps.

#include <any>
#include <map>
#include <optional>
#include <string>

#include "../../../io/safetensors.hpp"
#include "../../../moe/families.hpp"
#include "../../engine/expert_kind.hpp"
#include "../../engine/expert_kinds.hpp"
#include "../../engine/packed_types.hpp"

namespace apex {

/// The options of any expert kinds a load may meet, one slot per kind keyed
/// by its expert type (`ExpertKind<Expert>::Options`, not stored in files):
///
///     o.expert_options.of<KappaSwiGLU<float>>().U = 2;        // κ's U, c, ρ
///     o.expert_options.of<ClampedSwiGLU<float>>() = cfg.experts;  // gpt-oss's α, L
///
/// A kind never set reads its Options' defaults; a slot of a kind the loaded
/// layer does not have is not read.
class ExpertOptionSlots {
 public:
  /// Kind `Expert`'s slot, made at the kind's defaults on first use.
  template <class Expert>
  ExpertOptions<Expert>& of() {
    std::any& slot = slots_[&kKey<Expert>];
    if (!slot.has_value()) slot = ExpertOptions<Expert>{};
    return std::any_cast<ExpertOptions<Expert>&>(slot);
  }
  /// Kind `Expert`'s options: those set, else its defaults.
  template <class Expert>
  ExpertOptions<Expert> get() const {
    const auto it = slots_.find(&kKey<Expert>);
    return it == slots_.end() ? ExpertOptions<Expert>{} : std::any_cast<const ExpertOptions<Expert>&>(it->second);
  }

 private:
  template <class Expert>
  static constexpr char kKey = 0;  ///< one address per kind: the slot's key
  std::map<const void*, std::any> slots_;
};

/// How the packed loaders read a file.
struct PackedLoadOptions {
  /// Prefix of the layer's names in the file (e.g. "layers.3.ffn."). Only
  /// tensors under it are the layer's; others are ignored.
  std::string prefix;
  /// Ignore tensors under the prefix that the layer does not name.
  bool allow_unexpected = false;
  /// Name (under the prefix) of the optional balancing-bias tensor; empty:
  /// none. Ignored under a family's names (see `family`).
  std::string bias_name = "expert_bias";
  /// Read the MoE layer under the Hugging Face names of this open MoE family
  /// (io/name_maps.hpp; the prefix is still prepended, e.g. "model.layers.3."),
  /// with the checks of load_family_checkpoint: FormatError for another
  /// family's file or a DeepSeek-V3 file without its correction bias,
  /// ConfigError for a configuration the family's block cannot hold (its
  /// shared experts; experts of a kind the family's rows have no names for,
  /// κ-SwiGLU's). Unset: the library's own names.
  std::optional<MoEFamily> family;
  /// The experts' options, per kind (not stored in checkpoints).
  ExpertOptionSlots expert_options;
  /// Storage types of the experts, quantized from the file's F32/BF16/F64
  /// weights expert by expert as they are read (routed and shared, gate/up
  /// and down each their own). Unset: the layer's Storage for every matrix.
  /// A quantized checkpoint (inference/files/checkpoint/save.hpp) has its own types:
  /// set, they must be the file's (ConfigError naming both otherwise).
  std::optional<PackedTypes> types;
  /// Caps applied while reading the file.
  safetensors::Limits limits;
};

}  // namespace apex
