#pragma once
/// \file io/safetensors/dtype.hpp
/// The element types of the safetensors format and their spellings.
///
/// Exists so that the one table of dtypes (name, byte size) is shared by the
/// header parser, which must recognise every type a file may hold, and the
/// codec and writer, which convert only F32, F64 and BF16.

#include <cstddef>
#include <string_view>
#include <type_traits>

namespace apex {
namespace safetensors {

/// Element types of the format (byte-sized ones; sub-byte types are rejected).
enum class DType { BOOL, U8, I8, F8_E5M2, F8_E4M3, F8_E8M0, I16, U16, F16, BF16, I32, U32, F32, I64, U64, F64, C64 };

namespace detail {
struct DTypeInfo {
  DType dtype;
  const char* name;
  std::size_t size;
};
inline constexpr DTypeInfo kDTypes[] = {
    {DType::BOOL, "BOOL", 1},       {DType::U8, "U8", 1},   {DType::I8, "I8", 1},
    {DType::F8_E5M2, "F8_E5M2", 1}, {DType::F8_E4M3, "F8_E4M3", 1}, {DType::F8_E8M0, "F8_E8M0", 1},
    {DType::I16, "I16", 2},         {DType::U16, "U16", 2}, {DType::F16, "F16", 2},
    {DType::BF16, "BF16", 2},       {DType::I32, "I32", 4}, {DType::U32, "U32", 4},
    {DType::F32, "F32", 4},         {DType::I64, "I64", 8}, {DType::U64, "U64", 8},
    {DType::F64, "F64", 8},         {DType::C64, "C64", 8}};
}  // namespace detail

/// The format's spelling of `d` ("F32", "BF16", …).
inline const char* dtype_name(DType d) {
  for (const auto& i : detail::kDTypes)
    if (i.dtype == d) return i.name;
  return "?";
}

/// Bytes per element of `d`.
inline std::size_t dtype_size(DType d) {
  for (const auto& i : detail::kDTypes)
    if (i.dtype == d) return i.size;
  return 0;
}

/// The dtype spelled `name`; false if the format has no such (byte-sized) type.
inline bool parse_dtype(std::string_view name, DType& out) {
  for (const auto& i : detail::kDTypes)
    if (name == i.name) {
      out = i.dtype;
      return true;
    }
  return false;
}

/// The dtypes apex-ffn converts to and from its scalar types.
inline bool is_float_convertible(DType d) { return d == DType::F32 || d == DType::F64 || d == DType::BF16; }

/// The on-disk dtype that stores `T` exactly (F32 for float, F64 for double).
template <class T>
constexpr DType dtype_of() {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>, "safetensors: scalar must be float or double");
  return std::is_same_v<T, float> ? DType::F32 : DType::F64;
}

}  // namespace safetensors
}  // namespace apex
