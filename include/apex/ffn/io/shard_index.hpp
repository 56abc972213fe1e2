#pragma once
/// \file io/shard_index.hpp
/// The index of a sharded checkpoint, `model.safetensors.index.json` (the
/// Hugging Face convention):
///
///     {"metadata": {"total_size": 123456, "format": "apex-ffn", …},
///      "weight_map": {"router.weight": "model-…-00001-of-00002.safetensors", …}}
///
/// Exists apart from the loader (io/sharded_checkpoint.hpp) because this is
/// where an index is trusted or not, so it stays one short file to audit:
/// `parse_shard_index` validates bytes (the function the fuzzer aims at),
/// `read_shard_index` is a thin layer that reads a file into it (regular
/// files only, never blocking, at most `Limits::max_index_bytes`), and
/// `write_shard_index` writes an index atomically.
///
/// What the parser refuses, before it builds anything from the offending
/// part: nesting deeper than kMaxShardIndexNesting (refused as the container
/// opens, so no input makes the parser or a later `dump()` recurse deeply —
/// 100,000 nested arrays used to overflow the stack), a key repeated in one
/// object (nlohmann/json would silently keep the last; the safetensors
/// header parser refuses the same), and file names that are not plain names
/// in the index's folder (no '/', not "." or ".."), so an index from
/// elsewhere cannot make a load read outside that folder.

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../core/errors.hpp"
#include "file/json_text.hpp"    // require_no_nul
#include "file/posix_file.hpp"  // io::FileSource
#include "safetensors.hpp"

namespace apex {

/// The file name of the index in a sharded checkpoint's folder.
inline constexpr const char* kShardIndexName = "model.safetensors.index.json";

/// A parsed `model.safetensors.index.json`.
struct ShardIndex {
  std::uint64_t total_size = 0;                   ///< metadata.total_size: bytes of tensor data
  std::map<std::string, std::string> metadata;    ///< other metadata entries, as strings
  std::map<std::string, std::string> weight_map;  ///< tensor name → file name in the folder

  /// The distinct files, in name order.
  std::vector<std::string> files() const {
    std::vector<std::string> out;
    for (const auto& [name, file] : weight_map)
      if (out.empty() || std::find(out.begin(), out.end(), file) == out.end()) out.push_back(file);
    std::sort(out.begin(), out.end());
    return out;
  }
};

/// Deepest nesting of arrays and objects an index may have (the root is
/// level 1). An index needs 2 (root → weight_map); metadata values may nest
/// a little, as Hugging Face tooling writes none deeper.
inline constexpr int kMaxShardIndexNesting = 16;

namespace detail {

/// Streaming checks while nlohmann/json parses a small JSON file of a model
/// folder (an index, a config.json): nesting beyond kMaxShardIndexNesting
/// and duplicate keys, in any object. Throws FormatError starting with
/// `where`; `what` names the file in messages ("the index").
class ShardIndexGuard {
 public:
  explicit ShardIndexGuard(std::string where, std::string what = "the index")
      : where_(std::move(where)), what_(std::move(what)) {}

  bool operator()(int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using E = nlohmann::json::parse_event_t;
    switch (event) {
      case E::object_start:
      case E::array_start:
        // `depth` counts the containers already open around this one.
        if (depth >= kMaxShardIndexNesting)
          throw FormatError(where_ + ": " + what_ + " nests arrays or objects deeper than " +
                            std::to_string(kMaxShardIndexNesting) + " levels");
        open_.push_back({{}, open_.empty() ? std::string() : open_.back().name});
        break;
      case E::key: {
        Open& o = open_.back();
        o.name = parsed.get_ref<const std::string&>();
        if (!o.keys.insert(o.name).second)
          throw FormatError(where_ + ": " + what_ + " repeats the key " + safetensors::quote_name(o.name) +
                            (open_.size() == 1 ? std::string(" at its top level")
                                               : " in " + safetensors::quote_name(open_[open_.size() - 2].name)));
        break;
      }
      case E::object_end:
      case E::array_end:
        open_.pop_back();
        break;
      case E::value:
        break;
    }
    return true;
  }

 private:
  struct Open {
    std::set<std::string> keys;  // of an object; empty for an array
    std::string name;            // the last key read in it, else the key it sits under
  };
  std::string where_, what_;
  std::vector<Open> open_;
};

/// FormatError unless `file` is a plain file name (see the file comment).
inline void check_shard_file_name(const std::string& where, const std::string& file) {
  if (file.empty() || file == "." || file == ".." || file.find('/') != std::string::npos ||
      file.find('\0') != std::string::npos)
    throw FormatError(where + ": shard file name " + safetensors::quote_name(file) +
                      " is not a plain file name in the index's folder");
}

/// `metadata` of an index into `index`: `total_size` must be a non-negative
/// integer (as the header's offsets must be), other values are kept as
/// strings, non-strings as their JSON text. The nesting bound keeps that
/// text's recursive dump() shallow.
inline void parse_index_metadata(const std::string& where, const nlohmann::json& metadata, ShardIndex& index) {
  if (!metadata.is_object()) throw FormatError(where + ": 'metadata' is not a JSON object");
  for (const auto& [key, value] : metadata.items()) {
    if (key != "total_size")
      index.metadata[key] = value.is_string() ? value.get<std::string>() : value.dump();
    else if (value.is_number_unsigned())
      index.total_size = value.get<std::uint64_t>();
    else
      throw FormatError(where + ": metadata 'total_size' must be a non-negative integer, got " +
                        value.dump().substr(0, 40));
  }
}

/// The text of a small JSON file of a model folder (an index, a
/// config.json), read as the safetensors reader opens a shard
/// (io::FileSource: non-blocking, then fstat on the descriptor), so a
/// FIFO, device, folder or socket is a FormatError at once instead of a
/// hang or a read without end, and one larger than
/// `limits.max_index_bytes` is refused before a byte is read. Messages
/// start with `where`, then the file layer's with "json:"; `what` names the
/// file ("the index").
inline std::string read_small_file(const std::string& where, const std::string& path, const std::string& what,
                                   const safetensors::Limits& limits) {
  std::string text;
  try {
    const io::FileSource file("json", path);
    if (file.size() > limits.max_index_bytes)
      throw FormatError(what + " has " + std::to_string(file.size()) + " bytes, more than the limit of " +
                        std::to_string(limits.max_index_bytes) + " (Limits::max_index_bytes)");
    text.resize(std::size_t(file.size()));
    file.read(0, text.data(), text.size());
  } catch (const FormatError& e) {
    throw FormatError(where + ": " + e.what());
  }
  return text;
}

}  // namespace detail

/// The index path of `path`: `path` itself if it names a file, else
/// `path/model.safetensors.index.json`.
inline std::string shard_index_path(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  return fs::is_directory(path, ec) ? (fs::path(path) / kShardIndexName).string() : path;
}

/// Validates the bytes of an index; `where` starts every message. FormatError
/// if they are not JSON, nest deeper than kMaxShardIndexNesting, repeat a
/// key in an object, lack a `weight_map` object of string values, name a
/// file outside the index's folder, or have a `metadata` that is not an
/// object or a `total_size` that is not a non-negative integer. Other keys
/// of the root are ignored.
inline ShardIndex parse_shard_index(std::string_view text, const std::string& where) {
  io::detail::require_no_nul(text, where);
  nlohmann::json j;
  try {
    detail::ShardIndexGuard guard(where);
    j = nlohmann::json::parse(text.begin(), text.end(), std::ref(guard));
  } catch (const nlohmann::json::exception& e) {
    throw FormatError(where + ": not valid JSON: " + e.what());
  }
  if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
    throw FormatError(where + ": expected an object with a 'weight_map' object");
  ShardIndex index;
  for (const auto& [name, file] : j["weight_map"].items()) {
    if (!file.is_string()) throw FormatError(where + ": weight_map entry " + safetensors::quote_name(name) + " is not a string");
    detail::check_shard_file_name(where, file.get<std::string>());
    index.weight_map[name] = file.get<std::string>();
  }
  if (j.contains("metadata")) detail::parse_index_metadata(where, j["metadata"], index);
  return index;
}

/// Reads and validates the index at `path` (parse_shard_index). The file is
/// opened as the safetensors reader opens a shard (io::FileSource:
/// non-blocking, then fstat on the descriptor), so a FIFO, device, folder
/// or socket is a FormatError at once instead of a hang or a read without
/// end, and one larger than `limits.max_index_bytes` is refused before a
/// byte is read.
inline ShardIndex read_shard_index(const std::string& path, const safetensors::Limits& limits = {}) {
  const std::string where = "read_shard_index('" + path + "')";
  return parse_shard_index(detail::read_small_file(where, path, "the index", limits), where);
}

/// The JSON text of `index`, as write_shard_index writes it. FormatError for
/// a file name that is not a plain name.
inline std::string shard_index_text(const ShardIndex& index) {
  nlohmann::json j;
  j["metadata"] = nlohmann::json::object();
  for (const auto& [key, value] : index.metadata) j["metadata"][key] = value;
  j["metadata"]["total_size"] = index.total_size;
  j["weight_map"] = nlohmann::json::object();
  for (const auto& [name, file] : index.weight_map) {
    detail::check_shard_file_name("write_shard_index", file);
    j["weight_map"][name] = file;
  }
  return j.dump(2) + "\n";
}

/// Writes `index` to `path` atomically (safetensors::write_file_atomic).
inline void write_shard_index(const std::string& path, const ShardIndex& index) {
  const std::string text = shard_index_text(index);
  safetensors::write_file_atomic(path, [&](safetensors::ByteSink& out) { out.write(text.data(), text.size()); });
}

}  // namespace apex
