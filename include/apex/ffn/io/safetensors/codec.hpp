#pragma once
/// \file io/safetensors/codec.hpp
/// Arrays of elements to and from their on-disk bytes (F32, F64, BF16, all
/// little-endian), and the chunk size every bounded buffer uses.
///
/// Exists so that the reader and the writer share one definition of what a
/// stored F32, F64 or BF16 tensor means, whichever scalar type the caller
/// holds; a dtype that cannot convert is an error here, typed by direction.

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "../../core/errors.hpp"
#include "../file/bytes.hpp"
#include "element_bits.hpp"
#include "dtype.hpp"

namespace apex {
namespace safetensors {
namespace detail {

/// Chunk size of every bounded read and write buffer (io/file/bytes.hpp).
using io::detail::kChunkBytes;

/// Decodes `count` little-endian elements of `dtype` (F32, F64 or BF16) into
/// `out`; FormatError for any other dtype (it came from a file).
template <class T>
void decode(DType dtype, const unsigned char* src, std::size_t count, T* out) {
  switch (dtype) {
    case DType::F32:
      for (std::size_t i = 0; i < count; ++i)
        out[i] = static_cast<T>(bits_to_float(static_cast<std::uint32_t>(load_le(src + 4 * i, 4))));
      break;
    case DType::F64:
      for (std::size_t i = 0; i < count; ++i) {
        const double v = bits_to_double(load_le(src + 8 * i, 8));
        if constexpr (std::is_same_v<T, float>)
          out[i] = to_float(v);
        else
          out[i] = v;
      }
      break;
    case DType::BF16:
      for (std::size_t i = 0; i < count; ++i)
        out[i] = static_cast<T>(bf16_to_float(static_cast<std::uint16_t>(load_le(src + 2 * i, 2))));
      break;
    default:
      throw FormatError(std::string("safetensors: cannot convert dtype ") + dtype_name(dtype));
  }
}

/// Encodes `count` values as little-endian `dtype` (F32, F64 or BF16) into
/// `dst`; ValueError for any other dtype (the caller chose it).
template <class T>
void encode(DType dtype, const T* in, std::size_t count, unsigned char* dst) {
  switch (dtype) {
    case DType::F32:
      for (std::size_t i = 0; i < count; ++i) store_le(dst + 4 * i, float_to_bits(to_float(double(in[i]))), 4);
      break;
    case DType::F64:
      for (std::size_t i = 0; i < count; ++i) store_le(dst + 8 * i, double_to_bits(double(in[i])), 8);
      break;
    case DType::BF16:
      for (std::size_t i = 0; i < count; ++i) {
        const std::uint16_t b = std::is_same_v<T, float> ? float_to_bf16(float(in[i])) : double_to_bf16(double(in[i]));
        store_le(dst + 2 * i, b, 2);
      }
      break;
    default:
      throw ValueError(std::string("safetensors: cannot write dtype ") + dtype_name(dtype) +
                       "; choose F32, F64 or BF16");
  }
}

/// The `count` values at `in` as `dtype` (F32, F64 or BF16) stores them,
/// read back as T: what a load of the written file gets. A save checks
/// these where its load checks values: a double beyond float's range is
/// ±Inf once stored as F32 or BF16. ValueError for another dtype, as encode.
template <class T>
std::vector<T> as_stored(DType dtype, const T* in, std::size_t count) {
  std::vector<unsigned char> bytes(count * dtype_size(dtype));
  std::vector<T> out(count);
  encode(dtype, in, count, bytes.data());
  decode(dtype, bytes.data(), count, out.data());
  return out;
}

}  // namespace detail
}  // namespace safetensors
}  // namespace apex
