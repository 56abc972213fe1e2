#pragma once
/// \file inference/files/checkpoint/load_options.hpp
/// The options of the packed loaders (`load_packed_moe`, `load_packed_swiglu`,
/// `load_packed_sublayer`, `map_packed_moe`): where the layer's tensors are in
/// the file, under which names, in which storage types, with which expert
/// options, and the reader's caps.

#include <optional>
#include <string>

#include "../../../io/safetensors.hpp"
#include "../../../layers/clamped_swiglu.hpp"
#include "../../../layers/kappa_options.hpp"
#include "../../../moe/families.hpp"
#include "../../engine/packed_types.hpp"

namespace apex {

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
  /// shared experts; κ-SwiGLU experts, which no family has). Unset: the
  /// library's own names.
  std::optional<MoEFamily> family;
  /// Options of κ-SwiGLU experts (not stored in checkpoints).
  KappaOptions kappa;
  /// Options of clamped-SwiGLU (gpt-oss) experts (not stored in checkpoints).
  ClampedSwiGLUOptions clamped;
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
