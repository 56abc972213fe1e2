#pragma once
/// \file kernels/weight_types.hpp
/// The table of storage types of packed expert weights: one `WeightType<T>`
/// entry per type, which every storage decision reads (panel layout and
/// bytes, packing from float, widening back, the name in errors and files),
/// and the per-(type, ISA) tile kernels `Tiles<T, Isa>`, specialised in
/// kernels/arch/<isa>.hpp.
///
/// The same division as ggml's `type_traits_cpu[]` (one row per type: block
/// size, `from_float`, the dot kernel) and Eigen's `packet_traits` (one
/// capability table per ISA, one generic kernel written against it): the MoE
/// and inference layers never name a type; they call `visit_dtype` and the
/// entry does the rest.
///
/// Layout vocabulary. A panel is K reduction steps × 32 lanes
/// (kernels/packed_weights.hpp). Along K, one lane's weights form *blocks* of
/// `kBlockWeights` weights sharing one scale (1 and no scale for f32 and
/// bf16; 32 or 256 with an fp16 or E8M0 scale for ggml's block formats).
/// `kBlockBytes` counts a block's codes and its scale; the scales live in
/// the panel's separate scale array (`kScaleBytes` of each block), so code
/// slabs stay 64-byte aligned. `kGroup` consecutive k of one lane are stored
/// side by side (bf16: the pair `vdpbf16ps` multiplies). K is padded to a
/// multiple of both with zero weights.
///
/// An entry also spells its type in files: `kName` (errors, the library's
/// metadata), `kFileDtype` (safetensors) and `kGgmlType`/`kGgmlName` (GGUF);
/// the loaders and writers look types up here, never switch over them.
///
/// Adding a type: one `X(name)` in APEX_PACKED_WEIGHT_TYPES (and its storage
/// tag, kernels/dtype.hpp), its `WeightType` entry and its `Tiles` per SIMD
/// path (docs/inference.md#the-weight-type-table lists the places). Every
/// dispatch over types is generated from the list, so a type without an
/// entry is a compile error (the primary templates are left undefined), and
/// one without tiles on a path a static_assert naming both (TilesOn), never
/// a silent default.

#include <cstddef>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "../core/checked_size.hpp"
#include "../core/errors.hpp"
#include "../core/types.hpp"
#include "dtype.hpp"
#include "float_types.hpp"
#include "quant_k_types.hpp"
#include "quant_types.hpp"

namespace apex::packed {

/// f(DtypeTag<t>{}) for the runtime type t; instantiated for every type of
/// the list. ConfigError for a value outside the enumerators (an integer
/// cast), which would otherwise read as some type's bytes.
template <class F>
decltype(auto) visit_dtype(Dtype t, F&& f) {
  switch (t) {
#define APEX_PACKED_VISIT_CASE(name) \
  case Dtype::name: return f(DtypeTag<Dtype::name>{});
    APEX_PACKED_WEIGHT_TYPES(APEX_PACKED_VISIT_CASE)
#undef APEX_PACKED_VISIT_CASE
  }
  throw ConfigError("packed weights: dtype " + std::to_string(int(t)) + " is not in the weight-type table");
}

/// The name a type has in errors and files ("f32", "bf16").
inline const char* dtype_name(Dtype t) {
  return visit_dtype(t, [](auto tag) { return WeightType<decltype(tag)::value>::kName; });
}

/// Bytes per weight, scales included (a block format's is fractional).
inline double bytes_per_weight(Dtype t) {
  return visit_dtype(t, [](auto tag) {
    using W = WeightType<decltype(tag)::value>;
    return double(W::kBlockBytes) / double(W::kBlockWeights);
  });
}

/// Every weight type's name, ", "-separated (for error messages).
inline std::string dtype_names() {
  std::string s;
#define APEX_PACKED_NAME(name) s += std::string(s.empty() ? "" : ", ") + WeightType<Dtype::name>::kName;
  APEX_PACKED_WEIGHT_TYPES(APEX_PACKED_NAME)
#undef APEX_PACKED_NAME
  return s;
}

/// The type whose name (dtype_name's spelling) is `name`; empty for none.
inline std::optional<Dtype> dtype_named(const std::string& name) {
#define APEX_PACKED_NAMED(t) \
  if (name == WeightType<Dtype::t>::kName) return Dtype::t;
  APEX_PACKED_WEIGHT_TYPES(APEX_PACKED_NAMED)
#undef APEX_PACKED_NAMED
  return std::nullopt;
}

/// The safetensors spelling of a tensor of type t (kFileDtype: "F32",
/// "BF16"), or null where a file holds its blocks as U8 bytes.
inline const char* file_dtype(Dtype t) {
  return visit_dtype(t, [](auto tag) { return WeightType<decltype(tag)::value>::kFileDtype; });
}

/// Every entry's kFileDtype, in table order; the block formats have none
/// (a safetensors file holds their blocks as U8 bytes).
inline std::vector<const char*> file_dtypes() {
  std::vector<const char*> out;
#define APEX_PACKED_FILE(name) \
  if (WeightType<Dtype::name>::kFileDtype) out.push_back(WeightType<Dtype::name>::kFileDtype);
  APEX_PACKED_WEIGHT_TYPES(APEX_PACKED_FILE)
#undef APEX_PACKED_FILE
  return out;
}

/// The Dtype whose entry stores `Storage` (float → f32, bf16 → bf16); a
/// compile error for a type no entry stores.
template <class Storage>
constexpr Dtype dtype_of() {
  constexpr int hits = 0
#define APEX_PACKED_HIT(name) +int(std::is_same_v<Storage, typename WeightType<Dtype::name>::Storage>)
      APEX_PACKED_WEIGHT_TYPES(APEX_PACKED_HIT)
#undef APEX_PACKED_HIT
      ;
  static_assert(hits == 1, "packed layers: Storage must be the Storage of one entry of kernels/weight_types.hpp "
                           "(float, apex::packed::bf16, or a block-format tag such as apex::packed::q8_0)");
  Dtype t{};
#define APEX_PACKED_PICK(name) \
  if (std::is_same_v<Storage, typename WeightType<Dtype::name>::Storage>) t = Dtype::name;
  APEX_PACKED_WEIGHT_TYPES(APEX_PACKED_PICK)
#undef APEX_PACKED_PICK
  return t;
}

namespace detail {
/// Whether the table has tiles of T on SIMD path I (Tiles<T, I> is defined).
template <Dtype T, Isa I, class = void>
struct HasTiles : std::false_type {};
template <Dtype T, Isa I>
struct HasTiles<T, I, std::void_t<decltype(sizeof(Tiles<T, I>))>> : std::true_type {};

/// `TilesOn<T, I>::check()`: true, or a static_assert naming T and I where
/// the table has no Tiles<T, I>. Every path's kernels ask it before they
/// use a type's tiles, so a type missing a tile is a compile error that
/// says which, never another type's code. One specialisation per type of
/// the list and SIMD path with tiles (avx512_bf16 runs the others').
template <Dtype T, Isa I>
struct TilesOn;
#define APEX_PACKED_TILES_ON(name, path)                                                                       \
  template <>                                                                                                  \
  struct TilesOn<Dtype::name, Isa::path> {                                                                     \
    template <Dtype T = Dtype::name>                                                                           \
    static constexpr bool check() {                                                                            \
      static_assert(HasTiles<T, Isa::path>::value, "weight type " #name " has no tiles on path " #path        \
                    ": specialise apex::packed::detail::Tiles<Dtype::" #name ", Isa::" #path "> (kernels/arch/)"); \
      return true;                                                                                             \
    }                                                                                                          \
  };
#define APEX_PACKED_TILES_ON_PATHS(name) \
  APEX_PACKED_TILES_ON(name, avx2) APEX_PACKED_TILES_ON(name, avx512) APEX_PACKED_TILES_ON(name, avx512_vnni)
APEX_PACKED_WEIGHT_TYPES(APEX_PACKED_TILES_ON_PATHS)
#undef APEX_PACKED_TILES_ON_PATHS
#undef APEX_PACKED_TILES_ON

/// K rounded up to whole groups and blocks of type T: K + (−K mod step),
/// ConfigError naming `where` past the index range. A block format holds
/// whole blocks only (a GGUF row is whole blocks, and padding would change
/// the block a file's weights sit in): ConfigError for another K.
template <Dtype T>
Index padded_k(const char* where, Index k) {
  using W = WeightType<T>;
  if constexpr (W::kQuantized) {
    apex::detail::require_config(k % W::kBlockWeights == 0, where,
                                 "reduction length " + std::to_string(k) + " is not a multiple of " +
                                     std::to_string(W::kBlockWeights) + ", the " + W::kName +
                                     " block: quantized weights hold whole blocks");
    return k;
  }
  constexpr Index step = W::kGroup > W::kBlockWeights ? W::kGroup : W::kBlockWeights;
  static_assert(step % W::kGroup == 0 && step % W::kBlockWeights == 0, "group and block must nest");
  return step == 1 ? k : apex::detail::checked_sum(where, "padded width", k, (step - k % step) % step);
}
}  // namespace detail

}  // namespace apex::packed
