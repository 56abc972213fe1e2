#pragma once
/// \file io/safetensors/header.hpp
/// What a validated header says: the tensor table (name, dtype, shape, byte
/// range), the `__metadata__` strings, the reader's resource caps, and the
/// two ways a file's content is spelled in error messages (`quote_name` for names,
/// `shape_string` shapes).
///
/// Exists apart from the parser so that code which only consumes a header —
/// the reader, checkpoint matching, a user listing tensors — does not need
/// nlohmann/json's parsing machinery to name its types, and so that every
/// message naming file content quotes and bounds it the same way.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "dtype.hpp"

namespace apex {
namespace safetensors {

/// Free-form string pairs stored under `__metadata__`.
using Metadata = std::map<std::string, std::string>;

/// Resource caps applied while reading a file.
struct Limits {
  /// Largest accepted JSON header, in bytes (the reference implementation's
  /// cap). Parsing needs memory proportional to the header.
  std::uint64_t max_header_bytes = 100'000'000;
  /// Largest accepted shard index (`model.safetensors.index.json`,
  /// io/shard_index.hpp), in bytes: it is read whole and parsed in memory, so
  /// it gets the header's cap.
  std::uint64_t max_index_bytes = 100'000'000;
};

/// One tensor entry of a validated header.
struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  std::vector<std::uint64_t> shape;  ///< each ≤ INT64_MAX; empty = scalar
  std::uint64_t begin = 0;           ///< byte offset into the data buffer
  std::uint64_t end = 0;             ///< one past the last byte

  std::uint64_t nbytes() const { return end - begin; }
  /// Element count (validated: cannot overflow for a parsed header).
  std::uint64_t numel() const {
    std::uint64_t n = 1;
    for (auto s : shape) n *= s;
    return n;
  }
};

/// A validated header: metadata and the tensor table.
struct Header {
  Metadata metadata;
  std::vector<TensorInfo> tensors;  ///< sorted by name
  std::uint64_t header_bytes = 0;   ///< N
  std::uint64_t data_bytes = 0;     ///< size of the data buffer

  /// Offset of the data buffer in the file.
  std::uint64_t data_offset() const { return 8 + header_bytes; }

  /// The entry named `name`, or nullptr.
  const TensorInfo* find(std::string_view name) const {
    auto it = std::lower_bound(tensors.begin(), tensors.end(), name,
                               [](const TensorInfo& t, std::string_view n) { return t.name < n; });
    return it != tensors.end() && it->name == name ? &*it : nullptr;
  }
};

/// Shape as text, e.g. "[4, 8]".
inline std::string shape_string(const std::vector<std::uint64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

/// `name` in single quotes for an error message, shortened to its first 80
/// bytes and "…": names come from files, and a message must stay bounded.
inline std::string quote_name(std::string_view name) {
  constexpr std::size_t kMax = 80;
  std::string s = "'";
  s += name.size() > kMax ? std::string(name.substr(0, kMax)) + "…" : std::string(name);
  return s + "'";
}

namespace detail {

/// a·b into `out`; true (and `out` untouched) if it overflows 64 bits.
inline bool mul_overflows(std::uint64_t a, std::uint64_t b, std::uint64_t& out) {
  if (a != 0 && b > std::numeric_limits<std::uint64_t>::max() / a) return true;
  out = a * b;
  return false;
}

}  // namespace detail
}  // namespace safetensors
}  // namespace apex
