#pragma once
/// \file inference/files/gguf/plan.hpp
/// What the GGUF MoE loaders (inference/files/gguf/load.hpp) check before they build
/// anything: the architecture (io/gguf_architectures.hpp), the layer
/// configuration from its metadata keys, every tensor's presence, type and
/// ggml shape, the storage types the experts go into, and memory. Also the
/// row decoder that widens any supported tensor type to float.
///
/// Storage of the file's types: a tensor of a ggml type that the
/// weight-type table (kernels/weight_types.hpp) has an entry for — the
/// entry's kGgmlType: F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q6_K, MXFP4 — is
/// moved into packed panels of that type byte for byte; the mapping both
/// ways and the decoder are generated from the table, and its spelling is
/// checked against io/gguf/types.hpp at compile time. Gate and up share one
/// packed panel (kernels/packed_weights.hpp), so they must have one type;
/// down may differ, and the shared expert has its own pair.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "../../../core/errors.hpp"
#include "../../../core/types.hpp"
#include "../../../io/gguf.hpp"
#include "../../../io/gguf_architectures.hpp"
#include "../../../kernels/weight_types.hpp"
#include "../../engine/packed_types.hpp"

namespace apex::detail::gguf_moe {

using gguf::TensorInfo;
using gguf::TensorType;

/// The packed type a GGUF tensor type goes into: the weight-type table's
/// entry whose ggml type id it is (kernels/weight_types.hpp: kGgmlType);
/// empty for a type the table has no storage for.
inline std::optional<packed::Dtype> packed_type_of(TensorType t) {
#define APEX_GGUF_PACKED_TYPE(name) \
  if (std::uint32_t(t) == packed::WeightType<packed::Dtype::name>::kGgmlType) return packed::Dtype::name;
  APEX_PACKED_WEIGHT_TYPES(APEX_GGUF_PACKED_TYPE)
#undef APEX_GGUF_PACKED_TYPE
  return std::nullopt;
}

/// "f32, bf16, q8_0, …": the GGUF types with storage, ggml's spelling, for messages.
inline std::string packed_type_names() {
  std::string s;
#define APEX_GGUF_TYPE_NAME(name) \
  s += std::string(s.empty() ? "" : ", ") + packed::WeightType<packed::Dtype::name>::kGgmlName;
  APEX_PACKED_WEIGHT_TYPES(APEX_GGUF_TYPE_NAME)
#undef APEX_GGUF_TYPE_NAME
  return s;
}

/// The GGUF tensor type that stores packed type `t` (the writer's choice):
/// its table entry's; ConfigError for a value outside the table.
inline TensorType file_type_of(packed::Dtype t) {
  return packed::visit_dtype(t, [](auto tag) { return TensorType(packed::WeightType<decltype(tag)::value>::kGgmlType); });
}

namespace spelling {
constexpr bool same(const char* a, const char* b) {
  while (*a != 0 && *a == *b) ++a, ++b;
  return *a == *b;
}
/// The table's GGUF spelling of each type is a type of io/gguf/types.hpp
/// with that name and that block geometry (weights, bytes of a file block).
#define APEX_GGUF_SPELLING_AGREES(t)                                                                            \
  static_assert(packed::WeightType<packed::Dtype::t>::kGgmlType < gguf::kTensorTypeCount &&                      \
                    same(gguf::detail::kTypeTable[packed::WeightType<packed::Dtype::t>::kGgmlType].name,        \
                         packed::WeightType<packed::Dtype::t>::kGgmlName) &&                                     \
                    gguf::detail::kTypeTable[packed::WeightType<packed::Dtype::t>::kGgmlType].block_elems ==    \
                        packed::WeightType<packed::Dtype::t>::kBlockWeights &&                                  \
                    gguf::detail::kTypeTable[packed::WeightType<packed::Dtype::t>::kGgmlType].block_bytes ==    \
                        sizeof(packed::WeightType<packed::Dtype::t>::Block),                                     \
                "the GGUF spelling of weight type " #t " (kGgmlType, kGgmlName) is not the ggml type of "        \
                "io/gguf/types.hpp with its name, block weights and block bytes");
APEX_PACKED_WEIGHT_TYPES(APEX_GGUF_SPELLING_AGREES)
#undef APEX_GGUF_SPELLING_AGREES
}  // namespace spelling

/// "Q5_K (type 13)": a tensor type for messages.
inline std::string type_label(TensorType t) {
  return std::string(gguf::type_name(t)) + " (type " + std::to_string(unsigned(t)) + ")";
}

/// Widens `rows` rows of `cols` weights of type `t` at `src` (ggml row
/// layout, whole blocks) into rows × cols floats at `dst`, as t's entry of
/// the weight-type table decodes them: a float type's elements widened
/// exactly, a block format's blocks through ggml's dequantizer. A block
/// whose values would not be finite (WeightType::check_file_block: an fp16
/// scale Inf or NaN, an MXFP4 exponent whose largest code overflows) is
/// refused as the packed loaders refuse it: ValueError "`what` row R: block
/// B of a … row: …", R counted from `row0`. FormatError naming `what` for a
/// type without an entry (plan() refused those already).
inline void decode_rows(TensorType t, const std::byte* src, Index rows, Index cols, float* dst, const std::string& what,
                        Index row0) {
  const std::optional<packed::Dtype> dtype = packed_type_of(t);
  if (!dtype)
    throw FormatError(what + " is of type " + type_label(t) + ", which cannot be decoded (types with storage: " +
                      packed_type_names() + ")");
  packed::visit_dtype(*dtype, [&](auto tag) {
    using W = packed::WeightType<decltype(tag)::value>;
    using Block = typename W::Block;
    const Index blocks = cols / W::kBlockWeights;  // per row
    const std::size_t row_bytes = std::size_t(blocks) * sizeof(Block);
    std::vector<Block> tmp(static_cast<std::size_t>(blocks));  // an aligned copy: mapped bytes may be unaligned for Block
    for (Index r = 0; r < rows; ++r) {
      std::memcpy(tmp.data(), src + std::size_t(r) * row_bytes, row_bytes);
      float* d = dst + r * cols;
      if constexpr (W::kQuantized) {
        try {
          for (Index b = 0; b < blocks; ++b) W::check_file_block(tmp[std::size_t(b)], b);
        } catch (const ValueError& e) {
          throw ValueError(what + " row " + std::to_string(row0 + r) + ": " + e.what());
        }
        W::dequantize(tmp.data(), d, cols);
      } else {
        for (Index c = 0; c < cols; ++c) d[c] = W::widen(tmp[std::size_t(c)]);
      }
    }
  });
}

/// One tensor of the layer: its info and the packed type it goes into.
struct Tensor {
  const TensorInfo* info = nullptr;
  packed::Dtype dtype = packed::Dtype::f32;
};

/// Everything a load needs, checked: the architecture, the configuration,
/// the tensors (shared and optional ones have info == nullptr when absent).
struct Plan {
  const gguf::Architecture* arch = nullptr;
  Index layer = 0;
  MoEConfig config;
  double rms_eps = 0;  ///< 0: the file has no `attention.layer_norm_rms_epsilon`
  Tensor router, gate, up, down, shared_gate_w, shared_up, shared_down, shared_gate, bias, norm;
  Tensor router_bias;          ///< `ffn_gate_inp.bias` (architecture.router_bias), else absent
  std::vector<Tensor> extras;  ///< the experts' float parts (the kind's Gguf::extra_tensors order)
  std::vector<std::string> extra_names;  ///< their parameter names under `experts.{e}.` (the same order)
  PackedTypes types = packed::Dtype::f32;
};

}  // namespace apex::detail::gguf_moe
