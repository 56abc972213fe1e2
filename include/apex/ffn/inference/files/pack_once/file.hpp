#pragma once
/// \file inference/files/pack_once/file.hpp
/// The pack-once file: `save_packed_layout(path, layer)` stores a PackedMoE
/// in the library's panel order (inference/files/pack_once/format.hpp), and
/// `map_packed_moe<Storage, Expert>(path, config)` opens it again as a
/// mapping — the expert weights are read-only views into the file
/// (kernels/panel_bytes.hpp), no byte of them is read or copied at load,
/// and pages come in from the page cache when a forward first touches them.
///
/// Why a second format beside the quantized checkpoint (files/checkpoint/save.hpp):
/// that one stores ggml's file rows, which every tool reads but which must
/// be moved into panels at load (a full read and copy of the weights); this
/// one stores the panels themselves, so packing happens once per model and
/// a load costs the header and the small float parts (router, bias, κ's,
/// shared gate), which are read (copied) normally.
///
/// Why map_packed_moe and not a flag of load_packed_moe: a mapped layer is
/// a different contract (its weights are the file's pages, so the file must
/// not be truncated while mapped: io/file/mapped_file.hpp), and the function's
/// name says so where it is called. Every storage type and mix
/// (PackedTypes) saves; the layer's types are the file's (options.types,
/// when set, must equal them: ConfigError naming both).
///
/// Every check runs before the layer is built, and a rejected file is a
/// FormatError that leaves the caller's layer as it was (the function
/// returns a new one): a layout other than "panels", a version other than
/// "1", layout facts this build does not share, a shape other than
/// `config`'s, missing, unexpected or mistyped tensors, a tensor whose size
/// is not the panel bytes its matrix needs, one not on its 64-byte boundary
/// inside the mapping, a truncated file, a FIFO or device (at once, no hang).
/// A non-finite router weight or bias is a ValueError, as in load_packed_moe.

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "../../../io/file/mapped_file.hpp"
#include "format.hpp"
#include "../../engine/packed_moe.hpp"
#include "../checkpoint/read.hpp"  // PackedLoadOptions

namespace apex {
namespace detail::inference {

/// A tensor to write: bytes at `data` under `name`.
struct LayoutItem {
  std::string name;
  safetensors::DType dtype;
  std::vector<std::uint64_t> shape;
  const void* data;
  std::uint64_t bytes;
};

/// Appends `t`, preceded by a zero padding tensor when `offset` (the data
/// buffer's end so far) is not on `align`.
inline void add_aligned(std::vector<LayoutItem>& items, std::uint64_t& offset, LayoutItem t, std::uint64_t align) {
  static const unsigned char zeros[kLayoutPage] = {};
  if (const std::uint64_t pad = (align - offset % align) % align) {
    items.push_back({kPadPrefix + std::to_string(items.size()), safetensors::DType::U8, {pad}, zeros, pad});
    offset += pad;
  }
  offset += t.bytes;
  items.push_back(std::move(t));
}

/// The tensors of `layer` in file order, with padding (see the format).
template <class Layer>
std::vector<LayoutItem> layout_items(const Layer& layer) {
  using safetensors::DType;
  const MoEConfig& c = layer.config();
  const auto u = [](Index n) { return std::uint64_t(n); };
  std::vector<LayoutItem> items;
  std::uint64_t off = 0;
  const auto f32 = [&](std::string name, std::vector<std::uint64_t> shape, const float* p, Index n) {
    add_aligned(items, off, {std::move(name), DType::F32, std::move(shape), p, u(n) * 4}, kLayoutAlign);
  };
  f32(state_names::kRouter, {u(c.n_experts), u(c.d_model)}, layer.router().weight().data(), c.n_experts * c.d_model);
  f32("expert_bias", {u(c.n_experts)}, layer.bias().data(), c.n_experts);
  if (c.router_bias) f32(state_names::kRouterBias, {u(c.n_experts)}, layer.router().logit_bias().data(), c.n_experts);
  if constexpr (Layer::kHasExtra)
    for (Index e = 0; e < c.n_experts; ++e) {
      using Kind = typename Layer::Kind;
      const auto rows = Kind::extra_rows(layer.extras()[std::size_t(e)]);
      const auto tensors = Kind::extra_tensors(c.d_model, c.d_ffn);
      for (std::size_t i = 0; i < tensors.size(); ++i)
        f32(state_names::routed_expert(e) + tensors[i].name, {1, u(tensors[i].cols)}, rows[i]->data(), tensors[i].cols);
    }
  if (c.shared_expert_gate)
    f32(state_names::kSharedGate, {1, u(c.d_model)}, layer.shared_gate_weight().data(), c.d_model);
  // The panel arrays, in layer_panel_tensors' order (which the map reads).
  std::vector<const packed::PanelMatrix*> mats;
  for (const auto* list : {&layer.experts(), &layer.shared_experts()})
    for (const auto& e : *list) mats.insert(mats.end(), {&e.gate_up(), &e.down()});
  std::size_t m = 0;
  for (const PanelTensor& t : layer_panel_tensors(c, layer.types())) {
    const packed::PanelMatrix& pm = *mats[t.codes ? m++ : m - 1];
    const std::uint64_t n = u(t.bytes());
    add_aligned(items, off, {t.name, DType::U8, t.shape(), t.codes ? pm.codes_data() : pm.scales_data(), n},
                layout_alignment(t.codes, n));
  }
  return items;
}

/// The safetensors header of `items` with `meta`, padded with spaces so
/// that the data buffer starts on a page (8 + N ≡ 0 mod 4096).
inline std::string layout_header(const std::vector<LayoutItem>& items, const safetensors::Metadata& meta) {
  std::vector<safetensors::detail::EntryInfo> entries;
  entries.reserve(items.size());
  for (const auto& t : items) entries.push_back({t.name, t.dtype, t.shape});
  std::string text = safetensors::detail::header_json(entries, meta);
  text.append(std::size_t((kLayoutPage - (8 + text.size()) % kLayoutPage) % kLayoutPage), ' ');
  return text;
}

}  // namespace detail::inference

/// Serialises `layer` as a pack-once file (inference/files/pack_once/format.hpp)
/// to `out`. A layer that is itself mapped saves from its mapping.
template <class Storage, class Expert, class Activation>
void write_packed_layout(safetensors::ByteSink& out, const PackedMoE<Storage, Expert, Activation>& layer) {
  namespace inf = detail::inference;
  using Layer = PackedMoE<Storage, Expert, Activation>;
  const auto items = inf::layout_items(layer);
  safetensors::Metadata meta = inf::layout_facts(layer.types());
  meta[inf::kLayoutKey] = inf::kLayoutValue;
  meta[inf::kLayoutVersionKey] = inf::kLayoutVersion;
  meta[inf::kLayoutRoutedKey] = packed::dtypes_name(layer.types().routed);
  meta[inf::kLayoutSharedKey] = packed::dtypes_name(layer.types().shared);
  meta[inf::kLayoutShapeKey] = inf::layout_shape(layer.config(), Layer::Kind::kName);
  safetensors::detail::write_header(out, inf::layout_header(items, meta));
  for (const auto& t : items)
    if (t.bytes) out.write(t.data, std::size_t(t.bytes));
}

/// Saves `layer` to `path` atomically (safetensors::write_file_atomic): a
/// reader, or a process that has the old file mapped, sees the old file or
/// the new one, never a mix; a failed save leaves `path` as it was.
template <class Storage, class Expert, class Activation>
void save_packed_layout(const std::string& path, const PackedMoE<Storage, Expert, Activation>& layer) {
  safetensors::write_file_atomic(path, [&](safetensors::ByteSink& out) { write_packed_layout(out, layer); });
}

}  // namespace apex

#include "map.hpp"  // map_packed_moe: the read side
