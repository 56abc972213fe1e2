#pragma once
/// \file io/file/json_text.hpp
/// What the file readers check in JSON text before nlohmann/json parses it:
/// safetensors headers (io/safetensors/parse.hpp), config.json and shard
/// indexes (io/shard_index.hpp, io/hf_config.hpp), adapter configs.
///
/// Exists because nlohmann/json takes a NUL byte as the end of its input:
/// "{…}\0<more>" parses as the object alone and the rest goes unread, so a
/// file the reference readers refuse (serde_json in safetensors: "trailing
/// characters") would load here as something else.

#include <string>
#include <string_view>

#include "../../core/errors.hpp"

namespace apex {
namespace io {
namespace detail {

/// FormatError if `text` holds a NUL byte: JSON text never holds one (a
/// string escapes it as \u0000). The message starts with `where`.
inline void require_no_nul(std::string_view text, const std::string& where) {
  const std::size_t at = text.find('\0');
  if (at != std::string_view::npos)
    throw FormatError(where + ": not valid JSON: a NUL byte at offset " + std::to_string(at));
}

}  // namespace detail
}  // namespace io
}  // namespace apex
