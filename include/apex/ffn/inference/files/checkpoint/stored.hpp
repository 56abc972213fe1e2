#pragma once
/// \file inference/files/checkpoint/stored.hpp
/// Quantized checkpoints (the format: inference/files/checkpoint/save.hpp):
/// their metadata keys, how a weight type is spelled in them — its table
/// entry's safetensors dtype (kernels/weight_types.hpp: kFileDtype) for a
/// float tensor, U8 rows of its blocks with its name in the metadata
/// otherwise — and the load's side that read.hpp runs: the checks of a
/// file's stored tensors and their read into panel rows.

#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "../../../core/state_names.hpp"
#include "../../../io/safetensors.hpp"
#include "../../../kernels/weight_types.hpp"
#include "../../engine/packed_moe.hpp"
#include "source.hpp"

namespace apex::detail::inference {

/// The metadata keys of a quantized checkpoint: a U8 tensor's type is under
/// kQuantKey + its name; the version says how to read the rest.
inline constexpr const char* kQuantKey = "apex.quant.";
inline constexpr const char* kQuantVersionKey = "apex.quant.version";
inline constexpr const char* kQuantVersion = "1";

/// Whether a matrix of type `T` is stored as U8 rows with its type in the
/// metadata: every type safetensors has no dtype of its own for here (the
/// block formats, and f16, which the safetensors codec does not convert).
template <packed::Dtype T>
inline constexpr bool kStoredAsBytes = packed::WeightType<T>::kFileDtype == nullptr;

/// The type named `name` (packed::dtype_name's spelling) among those stored
/// as U8; empty for f32, bf16 or an unknown name.
inline std::optional<packed::Dtype> block_dtype_named(const std::string& name) {
  const std::optional<packed::Dtype> t = packed::dtype_named(name);
  if (!t || packed::file_dtype(*t)) return std::nullopt;
  return t;
}

/// "q8_0, q4_0, …": the types stored as U8, for error messages.
inline std::string block_dtype_names() {
  std::string s;
#define APEX_PACKED_BLOCK_NAME(t)                   \
  if (kStoredAsBytes<packed::Dtype::t>) \
    s += std::string(s.empty() ? "" : ", ") + packed::WeightType<packed::Dtype::t>::kName;
  APEX_PACKED_WEIGHT_TYPES(APEX_PACKED_BLOCK_NAME)
#undef APEX_PACKED_BLOCK_NAME
  return s;
}

/// The safetensors dtype of a matrix of type `t`: its table entry's
/// kFileDtype, or empty where the entry has none (U8 rows, the type in the
/// metadata).
inline std::optional<safetensors::DType> stored_file_dtype(packed::Dtype t) {
  const char* name = packed::file_dtype(t);
  if (!name) return std::nullopt;
  safetensors::DType d{};
  if (!safetensors::parse_dtype(name, d))
    throw ConfigError(std::string("quantized checkpoint: weight type ") + packed::dtype_name(t) +
                      " names the safetensors dtype '" + name + "', which the format does not have");
  return d;
}

/// The type a float tensor of dtype `d` keeps: the entry whose kFileDtype
/// spells d (F32 → f32, BF16 → bf16), else the entry storing float (F64,
/// which the reader narrows to float).
inline packed::Dtype float_tensor_type(safetensors::DType d) {
#define APEX_PACKED_FILE_TYPE(t)                                            \
  if (const char* name = packed::WeightType<packed::Dtype::t>::kFileDtype) \
    if (std::string(name) == safetensors::dtype_name(d)) return packed::Dtype::t;
  APEX_PACKED_WEIGHT_TYPES(APEX_PACKED_FILE_TYPE)
#undef APEX_PACKED_FILE_TYPE
  return packed::dtype_of<float>();
}

/// Weights a block of `t` holds (1 for f32 and bf16).
inline Index block_weights(packed::Dtype t) {
  return packed::visit_dtype(t, [](auto tag) { return packed::WeightType<decltype(tag)::value>::kBlockWeights; });
}

/// Bytes of one stored row of k weights of type `t` (k whole blocks): the
/// tensor's row in the file, which for bf16 lacks the panel row's padding
/// to an even k (PanelMatrix::row_bytes).
inline Index stored_row_bytes(packed::Dtype t, Index k) {
  return packed::visit_dtype(t, [&](auto tag) {
    using W = packed::WeightType<decltype(tag)::value>;
    return k / W::kBlockWeights * Index(sizeof(typename W::Block));
  });
}

/// A tensor a packed loader reads: its name in the file and its shape in
/// weights. `role` says which expert matrix it is (kRoutedGateUp …, -1 for
/// the router, bias, κ's and the shared gate); `stored` marks one whose
/// file tensor holds blocks (U8), checked by file_types instead of by
/// check_tensors.
struct Expected {
  std::string name;
  Index rows, cols;
  int role = -1;
  bool stored = false;
};
enum : int { kRoutedGateUp = 0, kRoutedDown = 1, kSharedGateUp = 2, kSharedDown = 3 };

/// FormatError (ConfigError for a width that is not whole blocks) unless
/// the U8 tensor `t` is `w.rows` rows of `type`'s blocks for `w.cols` weights.
inline void check_stored_shape(const std::string& where, const safetensors::TensorInfo& t, const Expected& w,
                               packed::Dtype type) {
  const Index b = block_weights(type);
  if (w.cols % b != 0)
    throw ConfigError(where + ": tensor " + safetensors::quote_name(w.name) + " holds " + packed::dtype_name(type) +
                      " blocks of " + std::to_string(b) + " weights, and the layer's rows of " + std::to_string(w.cols) +
                      " weights are not whole blocks");
  const std::vector<std::uint64_t> want{std::uint64_t(w.rows), std::uint64_t(stored_row_bytes(type, w.cols))};
  if (t.shape != want)
    throw FormatError(where + ": tensor " + safetensors::quote_name(w.name) + " is " + safetensors::shape_string(t.shape) +
                      " in the file; " + std::to_string(w.rows) + " rows of " + std::to_string(w.cols) + " " +
                      packed::dtype_name(type) + " weights are U8 " + safetensors::shape_string(want));
}

/// The experts' types a quantized checkpoint holds (U8 tensors: their
/// metadata type; F32 and F64: f32; BF16: bf16), marking its U8 tensors in
/// `want` as stored; empty for a file that is not one (no version key, no
/// U8 expert matrix), which loads as before. FormatError for a version but
/// "1", a U8 tensor without a block type, a type on a float tensor, and
/// types that differ where the layer needs one (the routed experts' gate/up,
/// their down; the same for the shared experts). Reads no tensor.
inline std::optional<PackedTypes> file_types(const std::string& where, const PackedSource& file,
                                             std::vector<Expected>& want) {
  using safetensors::DType;
  using safetensors::quote_name;
  const std::optional<std::string> version = file.metadata_value(kQuantVersionKey);
  bool quant = version.has_value();
  for (const auto& w : want)
    if (const auto* t = w.role >= 0 ? file.find(w.name) : nullptr) quant = quant || t->dtype == DType::U8;
  if (!quant) return std::nullopt;
  const auto bad_version = [&] {
    return FormatError(where + ": metadata " + quote_name(kQuantVersionKey) + " is " +
                       (!version ? std::string("missing") : quote_name(*version)) +
                       "; quantized checkpoints of version " + kQuantVersion + " load");
  };
  if (version && *version != kQuantVersion) throw bad_version();
  std::optional<packed::Dtype> types[4];
  std::string first[4];
  for (auto& w : want) {
    const auto* t = w.role >= 0 ? file.find(w.name) : nullptr;
    // missing, or of a dtype no loader takes: check_tensors names it
    if (!t || (t->dtype != DType::U8 && !safetensors::is_float_convertible(t->dtype))) continue;
    const std::optional<std::string> key = file.metadata_value(kQuantKey + w.name);
    packed::Dtype type = float_tensor_type(t->dtype);
    if (t->dtype == DType::U8) {
      if (!key)
        throw FormatError(where + ": tensor " + quote_name(w.name) + " is U8 but the metadata names no type for it (" +
                          quote_name(kQuantKey + w.name) + ")");
      const auto b = block_dtype_named(*key);
      if (!b)
        throw FormatError(where + ": tensor " + quote_name(w.name) + " has type " + quote_name(*key) +
                          " in the metadata, which is not a type stored as U8 (" + block_dtype_names() + ")");
      type = *b;
      w.stored = true;
      check_stored_shape(where, *t, w, type);
    } else if (key) {
      throw FormatError(where + ": tensor " + quote_name(w.name) + " is " + safetensors::dtype_name(t->dtype) +
                        " but the metadata gives it the type " + quote_name(*key) + "; blocks are stored as U8");
    }
    if (!types[w.role]) {
      types[w.role] = type;
      first[w.role] = w.name;
    } else if (*types[w.role] != type) {
      throw FormatError(where + ": tensor " + quote_name(w.name) + " is " + packed::dtype_name(type) + " but " +
                        quote_name(first[w.role]) + " is " + packed::dtype_name(*types[w.role]) +
                        ": a layer's routed (and its shared) experts share one type per matrix, gate and up alike");
    }
  }
  if (!version) throw bad_version();
  const auto pick = [&](int role, packed::Dtype fallback) { return types[role] ? *types[role] : fallback; };
  const packed::ExpertDtypes routed{pick(kRoutedGateUp, packed::Dtype::f32), pick(kRoutedDown, packed::Dtype::f32)};
  // Without shared experts the layer takes the routed types for them (PackedShared).
  return PackedTypes(routed, {pick(kSharedGateUp, routed.gate_up), pick(kSharedDown, routed.down)});
}

/// Bytes of a panel's file row of k weights of `t` (PanelMatrix::row_bytes:
/// k padded to whole groups, bf16's pairs).
inline Index panel_row_bytes(packed::Dtype t, Index k) {
  const Index group = packed::visit_dtype(t, [](auto tag) { return packed::WeightType<decltype(tag)::value>::kGroup; });
  return stored_row_bytes(t, k + (group - k % group) % group);
}

/// The matrix `name` (rows × k weights of type t) as panel file rows in
/// `out`: a U8 tensor's blocks as they are, a float tensor's values as t's
/// elements (WeightType::narrow: f32 as they are, BF16 → bf16 exact), rows
/// padded with zero weights to whole groups as packing pads them.
/// `staging` holds the floats of a float tensor.
inline void read_stored(const PackedSource& file, const std::string& name, packed::Dtype t, Index rows,
                        Index k, std::vector<std::byte>& out, std::vector<float>& staging) {
  const safetensors::TensorInfo& info = file.at(name);
  const Index row = panel_row_bytes(t, k);
  out.assign(std::size_t(rows * row), std::byte{0});
  if (info.dtype == safetensors::DType::U8) return file.read_bytes(name, out.data());  // stored row = panel row
  staging.resize(std::size_t(rows * k));
  file.read(name, staging.data());
  packed::visit_dtype(t, [&](auto tag) {
    using W = packed::WeightType<decltype(tag)::value>;
    if constexpr (W::kQuantized) {  // file_types types a float tensor by its dtype: unreachable
      throw FormatError("quantized checkpoint: tensor " + safetensors::quote_name(name) + " is " +
                        safetensors::dtype_name(info.dtype) + ", not the U8 blocks of " + W::kName);
    } else {  // the entry's element of each value (f32 as it is, bf16 rounded: exact from BF16)
      for (Index r = 0; r < rows; ++r)
        for (Index j = 0; j < k; ++j) {
          const typename W::Block v = W::narrow(staging[std::size_t(r * k + j)]);
          std::memcpy(out.data() + r * row + Index(sizeof v) * j, &v, sizeof v);
        }
    }
  });
}

/// One expert's panel rows, reused from expert to expert.
struct StoredStaging {
  std::vector<std::byte> gate, up, down;
  std::vector<float> floats;
};

/// The expert at `p` of a quantized checkpoint (file_types checked it):
/// its matrices' bits moved into the panels, not re-quantized.
template <class Name>
packed::PackedExpert read_stored_expert(const PackedSource& file, const Name& name, const std::string& p,
                                        Index d, Index f, packed::ExpertDtypes t, StoredStaging& s) {
  read_stored(file, name(p + state_names::kGate), t.gate_up, f, d, s.gate, s.floats);
  read_stored(file, name(p + state_names::kUp), t.gate_up, f, d, s.up, s.floats);
  read_stored(file, name(p + state_names::kDown), t.down, d, f, s.down, s.floats);
  return packed::PackedExpert::from_file_rows(d, f, t, s.gate.data(), s.up.data(), s.down.data());
}

}  // namespace apex::detail::inference
