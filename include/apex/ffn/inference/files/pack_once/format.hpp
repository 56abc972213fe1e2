#pragma once
/// \file inference/files/pack_once/format.hpp
/// The pack-once file's format: its metadata keys, the layout facts a
/// reader must share with the writer, and the tensor names and sizes of a
/// layer's panels. inference/files/pack_once/file.hpp saves and maps it.
///
/// A pack-once file is a standard safetensors file whose expert matrices
/// are stored in the library's panel order (kernels/packed_weights.hpp,
/// kernels/quant_layout.hpp) instead of the file-row order of a quantized
/// checkpoint (inference/files/checkpoint/save.hpp), so a load maps the bytes and the
/// kernels read them where they lie:
///
///     router.weight [E, d], expert_bias [E],
///     experts.{e}.kappa_alpha / kappa_bias [1, f], shared_expert_gate.weight [1, d]   F32
///     experts.{e}.gate_up.codes   U8 [panels, codes bytes a panel]
///     experts.{e}.gate_up.scales  U8 [panels, scale bytes a panel]   (block formats only)
///     experts.{e}.down.codes / .scales, shared_experts.{s}.…          the same
///     __pad.{i}                   U8 [n] zeros, so the next tensor is aligned
///
/// Alignment: 8 + N (the header) is a multiple of 4096, and every codes
/// array of 4096 bytes or more starts on a 4096-byte boundary (a page: an
/// expert's pages are then its own, so the residency of a mapping is the
/// touched experts' bytes), every other tensor on a 64-byte one (the
/// kernels' aligned loads). The padding tensors keep the data buffer fully
/// covered, as the safetensors rules (io/safetensors/parse.hpp) require.
///
/// The panel layout does not depend on the CPU: every kernel path (scalar,
/// AVX2, AVX-512) reads the same panels, so a file packed on one machine
/// maps on any little-endian one. What it depends on — the lanes of a
/// panel, the hidden units of a gate/up panel, the outputs of a down panel,
/// the byte order and each type's block geometry and code order — is
/// recorded and checked.

#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "../../../core/errors.hpp"
#include "../../../core/state_names.hpp"
#include "../../../io/safetensors.hpp"
#include "../../../kernels/packed_weights.hpp"
#include "../../../moe/config.hpp"
#include "../../engine/packed_types.hpp"

namespace apex::detail::inference {

inline constexpr const char* kLayoutKey = "apex.layout";
inline constexpr const char* kLayoutValue = "panels";
inline constexpr const char* kLayoutVersionKey = "apex.layout.version";
inline constexpr const char* kLayoutVersion = "1";
inline constexpr const char* kLayoutRoutedKey = "apex.layout.routed";  ///< "q4_k" or "q4_k/q6_k" (gate_up/down)
inline constexpr const char* kLayoutSharedKey = "apex.layout.shared";
inline constexpr const char* kPadPrefix = "__pad.";
inline constexpr std::uint64_t kLayoutPage = 4096;
inline constexpr std::uint64_t kLayoutAlign = 64;

/// The pair dtypes_name spells ("q4_k" or "q4_k/q6_k"); FormatError naming
/// `where` and `key` for anything else.
inline packed::ExpertDtypes parse_dtypes(const std::string& where, const std::string& key, const std::string& v) {
  const auto slash = v.find('/');
  const auto a = packed::dtype_named(v.substr(0, slash));
  const auto b = slash == std::string::npos ? a : packed::dtype_named(v.substr(slash + 1));
  if (!a || !b)
    throw FormatError(where + ": metadata " + safetensors::quote_name(key) + " is " + safetensors::quote_name(v) +
                      ", not a storage type or gate_up/down pair of them");
  return {*a, *b};
}

/// A weight type's panel layout when it is not the first one of its block
/// geometry (`W::kPanelLayout`, e.g. Q6_K's codes by group), else nullptr:
/// part of the type's layout fact, so a file packed before the change is
/// refused with the fact that differs instead of read as other codes.
template <class W, class = void>
inline constexpr const char* panel_layout_v = nullptr;
template <class W>
inline constexpr const char* panel_layout_v<W, std::void_t<decltype(W::kPanelLayout)>> = W::kPanelLayout;

/// The facts the panel layout depends on, as metadata entries: the
/// library's constants and the block geometry of each type `types` uses.
inline safetensors::Metadata layout_facts(const PackedTypes& types) {
  safetensors::Metadata m;
  m["apex.layout.lanes"] = std::to_string(packed::kPanelLanes);
  m["apex.layout.hidden_per_panel"] = std::to_string(packed::PackedExpert::kHiddenPerPanel);
  m["apex.layout.out_per_panel"] = std::to_string(packed::PackedExpert::kOutPerPanel);
  m["apex.layout.byte_order"] = "little";
  for (packed::Dtype t : {types.routed.gate_up, types.routed.down, types.shared.gate_up, types.shared.down})
    packed::visit_dtype(t, [&](auto tag) {
      using W = packed::WeightType<decltype(tag)::value>;
      m[std::string("apex.layout.block.") + W::kName] =
          std::to_string(W::kBlockWeights) + " weights, " + std::to_string(W::kBlockBytes) + " bytes, " +
          std::to_string(W::kScaleBytes) + " scale bytes, group " + std::to_string(W::kGroup) +
          (panel_layout_v<W> ? std::string(", ") + panel_layout_v<W> : std::string());
    });
  return m;
}

/// The expert types of a pack-once file's metadata `meta`. FormatError
/// naming `where` unless it says panels of version 1, names its types and
/// agrees with this build on every layout fact of them.
inline PackedTypes file_layout_types(const std::string& where, const safetensors::Metadata& meta) {
  const auto get = [&](const std::string& k) {
    const auto it = meta.find(k);
    return it == meta.end() ? std::string("missing") : "'" + it->second + "'";
  };
  if (get(kLayoutKey) != "'" + std::string(kLayoutValue) + "'")
    throw FormatError(where + ": metadata '" + kLayoutKey + "' is " + get(kLayoutKey) +
                      "; a pack-once file has 'panels' (a quantized or float checkpoint loads with load_packed_moe)");
  if (get(kLayoutVersionKey) != "'" + std::string(kLayoutVersion) + "'")
    throw FormatError(where + ": metadata '" + kLayoutVersionKey + "' is " + get(kLayoutVersionKey) +
                      "; this build maps pack-once files of version " + kLayoutVersion);
  for (const char* k : {kLayoutRoutedKey, kLayoutSharedKey})
    if (!meta.count(k)) throw FormatError(where + ": metadata '" + k + "' is missing; it names the experts' types");
  const PackedTypes types(parse_dtypes(where, kLayoutRoutedKey, meta.at(kLayoutRoutedKey)),
                          parse_dtypes(where, kLayoutSharedKey, meta.at(kLayoutSharedKey)));
  for (const auto& [k, v] : layout_facts(types))
    if (get(k) != "'" + v + "'")
      throw FormatError(where + ": metadata '" + k + "' is " + get(k) + " in the file but '" + v +
                        "' in this build: the panels were laid out for another geometry; pack the layer again");
  return types;
}

/// The layer shape a pack-once file records ("apex.layout.shape"), which a
/// map must match: expert kind (ExpertKind::kName), d, f, E, S, the
/// shared width and gate, and a router bias.
inline constexpr const char* kLayoutShapeKey = "apex.layout.shape";
inline std::string layout_shape(const apex::MoEConfig& c, const char* kind) {
  return std::string(kind) + " experts, d_model " + std::to_string(c.d_model) +
         ", d_ffn " + std::to_string(c.d_ffn) + ", E " + std::to_string(c.n_experts) + ", S " +
         std::to_string(c.n_shared) + " of width " + std::to_string(c.shared_ffn()) +
         (c.shared_expert_gate ? ", gated" : "") + (c.router_bias ? ", router bias" : "");
}

/// One panel array of a layer: its tensor name, the matrix geometry and
/// whether it is the codes (else the scales).
struct PanelTensor {
  std::string name;
  packed::Dtype dtype;
  Index k, panels;
  bool codes;
  /// Bytes of one panel's array (a 0-panel matrix computes it, allocating nothing).
  Index panel_bytes() const {
    const packed::PanelMatrix m(dtype, k, 0);
    return codes ? m.panel_code_bytes() : m.panel_scale_bytes();
  }
  Index bytes() const { return panels * panel_bytes(); }  // fits: PanelMatrix::bytes_for checked the sum
  /// Shape [panels, bytes a panel] (U8).
  std::vector<std::uint64_t> shape() const { return {std::uint64_t(panels), std::uint64_t(panel_bytes())}; }
};

/// The panel arrays of an expert under `q` ("experts.3."), d × f of `t`, in
/// file order; scale arrays only where the type has scales.
inline void add_panel_tensors(std::vector<PanelTensor>& out, const std::string& q, Index d, Index f,
                              packed::ExpertDtypes t) {
  const Index gu = (f + packed::PackedExpert::kHiddenPerPanel - 1) / packed::PackedExpert::kHiddenPerPanel;
  const Index dn = (d + packed::PackedExpert::kOutPerPanel - 1) / packed::PackedExpert::kOutPerPanel;
  for (const PanelTensor& p : {PanelTensor{q + "gate_up.codes", t.gate_up, d, gu, true},
                               PanelTensor{q + "gate_up.scales", t.gate_up, d, gu, false},
                               PanelTensor{q + "down.codes", t.down, f, dn, true},
                               PanelTensor{q + "down.scales", t.down, f, dn, false}})
    if (p.codes || p.bytes() > 0) out.push_back(p);
}

/// Every panel array of a layer of `c` in `types`, routed then shared.
inline std::vector<PanelTensor> layer_panel_tensors(const apex::MoEConfig& c, const PackedTypes& types) {
  std::vector<PanelTensor> out;
  for (Index e = 0; e < c.n_experts; ++e)
    add_panel_tensors(out, state_names::routed_expert(e), c.d_model, c.d_ffn, types.routed);
  for (Index s = 0; s < c.n_shared; ++s)
    add_panel_tensors(out, state_names::shared_expert(s), c.d_model, c.shared_ffn(), types.shared);
  return out;
}

/// Where a tensor of `n` bytes starts: a page for large codes, 64 bytes else.
inline std::uint64_t layout_alignment(bool codes, std::uint64_t n) {
  return codes && n >= kLayoutPage ? kLayoutPage : kLayoutAlign;
}

}  // namespace apex::detail::inference
