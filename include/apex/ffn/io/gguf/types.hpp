#pragma once
/// \file io/gguf/types.hpp
/// The ggml tensor types a GGUF file can store (`TensorType`, numbered as
/// ggml.h numbers `enum ggml_type`) and their block geometry (`TypeTraits`),
/// and the byte size of a tensor of a given type and shape.
///
/// Exists apart from the parser because both the reader (to validate each
/// tensor's extent) and the writer (to validate what it is given) need the
/// same table, and a loader needs it to map a file's type to a kernel.
/// The table is ggml's `type_traits[]` (src/ggml.c) with the block structs'
/// sizes of src/ggml-common.h; ids ggml retired (4, 5, 31–33, 36–38) are
/// not types: a file naming them is rejected, as ggml rejects it.

#include <cstdint>
#include <string>
#include <vector>

#include "../../core/errors.hpp"

namespace apex {
namespace gguf {

enum class TensorType : std::uint32_t {
  F32 = 0,
  F16 = 1,
  Q4_0 = 2,
  Q4_1 = 3,
  Q5_0 = 6,
  Q5_1 = 7,
  Q8_0 = 8,
  Q8_1 = 9,
  Q2_K = 10,
  Q3_K = 11,
  Q4_K = 12,
  Q5_K = 13,
  Q6_K = 14,
  Q8_K = 15,
  IQ2_XXS = 16,
  IQ2_XS = 17,
  IQ3_XXS = 18,
  IQ1_S = 19,
  IQ4_NL = 20,
  IQ3_S = 21,
  IQ2_S = 22,
  IQ4_XS = 23,
  I8 = 24,
  I16 = 25,
  I32 = 26,
  I64 = 27,
  F64 = 28,
  IQ1_M = 29,
  BF16 = 30,
  TQ1_0 = 34,
  TQ2_0 = 35,
  MXFP4 = 39,
  NVFP4 = 40,
  Q1_0 = 41,
  Q2_0 = 42,
};

/// One past the largest id ggml defines (GGML_TYPE_COUNT).
inline constexpr std::uint32_t kTensorTypeCount = 43;

/// A type's block geometry: `block_elems` consecutive elements of a row are
/// stored as one block of `block_bytes` bytes (1 and the element size for
/// the plain types).
struct TypeTraits {
  const char* name;  ///< ggml's spelling: "f32", "q8_0", "q4_K", …
  std::uint32_t block_elems;
  std::uint32_t block_bytes;
};

namespace detail {

/// Indexed by id; block_elems == 0 marks an id that is not a type. A
/// constant, so the weight-type table's GGUF spelling is checked against
/// it at compile time (inference/files/gguf/plan.hpp).
inline constexpr TypeTraits kTypeTable[kTensorTypeCount] = {
    {"f32", 1, 4},          {"f16", 1, 2},        {"q4_0", 32, 18},     {"q4_1", 32, 20},
    {"(removed 4)", 0, 0},  {"(removed 5)", 0, 0}, {"q5_0", 32, 22},     {"q5_1", 32, 24},
    {"q8_0", 32, 34},       {"q8_1", 32, 36},     {"q2_K", 256, 84},    {"q3_K", 256, 110},
    {"q4_K", 256, 144},     {"q5_K", 256, 176},   {"q6_K", 256, 210},   {"q8_K", 256, 292},
    {"iq2_xxs", 256, 66},   {"iq2_xs", 256, 74},  {"iq3_xxs", 256, 98}, {"iq1_s", 256, 50},
    {"iq4_nl", 32, 18},     {"iq3_s", 256, 110},  {"iq2_s", 256, 82},   {"iq4_xs", 256, 136},
    {"i8", 1, 1},           {"i16", 1, 2},        {"i32", 1, 4},        {"i64", 1, 8},
    {"f64", 1, 8},          {"iq1_m", 256, 56},   {"bf16", 1, 2},       {"(removed 31)", 0, 0},
    {"(removed 32)", 0, 0}, {"(removed 33)", 0, 0}, {"tq1_0", 256, 54}, {"tq2_0", 256, 66},
    {"(removed 36)", 0, 0}, {"(removed 37)", 0, 0}, {"(removed 38)", 0, 0}, {"mxfp4", 32, 17},
    {"nvfp4", 64, 36},      {"q1_0", 128, 18},    {"q2_0", 64, 18},
};
inline const TypeTraits* type_table() { return kTypeTable; }

}  // namespace detail

/// Whether `id` names a tensor type ggml defines (and has not retired).
inline bool is_known(std::uint32_t id) {
  return id < kTensorTypeCount && detail::type_table()[id].block_elems != 0;
}

/// The geometry of `t`; FormatError for an id ggml does not define (a value
/// cast from a file's bytes).
inline const TypeTraits& traits(TensorType t) {
  const auto id = static_cast<std::uint32_t>(t);
  if (!is_known(id)) throw FormatError("gguf: tensor type id " + std::to_string(id) + " is not a type ggml defines");
  return detail::type_table()[id];
}

inline const char* type_name(TensorType t) { return traits(t).name; }

/// The bytes of a tensor of type `t` and extents `ne` (ggml order, ne[0] the
/// row length), or a FormatError naming `what` when ggml would refuse it:
/// an extent above INT64_MAX, an element count that overflows int64, a row
/// length that is not a whole number of blocks, or a byte size past 2^64.
inline std::uint64_t tensor_nbytes(TensorType t, const std::vector<std::uint64_t>& ne, const std::string& what) {
  const TypeTraits& tr = traits(t);
  constexpr std::uint64_t kMax = std::uint64_t(INT64_MAX);
  std::uint64_t elems = 1;
  bool overflow = false, empty = false;
  for (std::uint64_t n : ne) {
    if (n > kMax) throw FormatError("gguf: " + what + " has an extent " + std::to_string(n) + " above INT64_MAX");
    if (n == 0) empty = true;
    else if (elems > kMax / n) overflow = true;
    else elems *= n;
  }
  // An extent 0 makes the tensor empty whatever the others are.
  if (empty) elems = 0;
  else if (overflow) throw FormatError("gguf: " + what + " has more than INT64_MAX elements");
  const std::uint64_t row = ne.empty() ? 1 : ne[0];
  if (row % tr.block_elems != 0)
    throw FormatError("gguf: " + what + " of type " + tr.name + " has rows of " + std::to_string(row) +
                      " elements, not a multiple of its block of " + std::to_string(tr.block_elems));
  const std::uint64_t blocks = elems / tr.block_elems;
  if (blocks > UINT64_MAX / tr.block_bytes)
    throw FormatError("gguf: " + what + " has a size in bytes above 2^64");
  return blocks * tr.block_bytes;
}

}  // namespace gguf
}  // namespace apex
