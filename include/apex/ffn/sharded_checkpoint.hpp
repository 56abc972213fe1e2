#pragma once
/// \file sharded_checkpoint.hpp
/// Checkpoints split over several safetensors files with an index, the
/// Hugging Face convention (`model.safetensors.index.json`):
///
///     {"metadata": {"total_size": 123456, "format": "apex-ffn", …},
///      "weight_map": {"router.weight": "model-…-00001-of-00002.safetensors", …}}
///
/// The expert-parallel layer writes one file per rank (mpi/sharded_checkpoint.hpp);
/// this header needs no MPI, so a single-process layer loads such a
/// checkpoint — or any Hugging Face sharded checkpoint of matching names —
/// with `load_sharded_checkpoint(folder, params)`.
///
/// The index is the commit point of a sharded save: shard files get names
/// no earlier save used, and the index that points at them is written last,
/// atomically. A reader therefore sees the old index with the old files or
/// the new index with the new files. File names in an index must be plain
/// names in the index's folder (no '/', not "." or ".."): an index from
/// elsewhere cannot make a load read outside that folder.

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "checkpoint.hpp"
#include "errors.hpp"
#include "param.hpp"
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

namespace detail {

/// FormatError unless `file` is a plain file name (see the file comment).
inline void check_shard_file_name(const std::string& where, const std::string& file) {
  if (file.empty() || file == "." || file == ".." || file.find('/') != std::string::npos ||
      file.find('\0') != std::string::npos)
    throw FormatError(where + ": shard file name " + safetensors::quote_name(file) +
                      " is not a plain file name in the index's folder");
}

}  // namespace detail

/// The index path of `path`: `path` itself if it names a file, else
/// `path/model.safetensors.index.json`.
inline std::string shard_index_path(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  return fs::is_directory(path, ec) ? (fs::path(path) / kShardIndexName).string() : path;
}

/// Reads and validates an index. FormatError if it is unreadable, not JSON,
/// lacks a `weight_map` object of string values, or names a file outside
/// its folder.
inline ShardIndex read_shard_index(const std::string& path) {
  const std::string where = "read_shard_index('" + path + "')";
  std::ifstream in(path, std::ios::binary);
  if (!in) throw FormatError(where + ": cannot open the file");
  std::stringstream text;
  text << in.rdbuf();
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text.str());
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
  if (j.contains("metadata") && j["metadata"].is_object())
    for (const auto& [key, value] : j["metadata"].items()) {
      if (key == "total_size" && value.is_number_unsigned()) index.total_size = value.get<std::uint64_t>();
      else index.metadata[key] = value.is_string() ? value.get<std::string>() : value.dump();
    }
  return index;
}

/// Writes `index` to `path` atomically (safetensors::write_file_atomic).
inline void write_shard_index(const std::string& path, const ShardIndex& index) {
  nlohmann::json j;
  j["metadata"] = nlohmann::json::object();
  for (const auto& [key, value] : index.metadata) j["metadata"][key] = value;
  j["metadata"]["total_size"] = index.total_size;
  j["weight_map"] = nlohmann::json::object();
  for (const auto& [name, file] : index.weight_map) {
    detail::check_shard_file_name("write_shard_index", file);
    j["weight_map"][name] = file;
  }
  const std::string text = j.dump(2) + "\n";
  safetensors::write_file_atomic(path, [&](safetensors::ByteSink& out) { out.write(text.data(), text.size()); });
}

namespace detail {

/// Reads every parameter of `params` from its shard, file by file, straight
/// into the parameters (no staging: a failure can leave earlier shards
/// loaded). The checks of load_sharded_checkpoint.
template <class T>
LoadResult load_shards_into(const std::string& index_path, const ShardIndex& index, const ParamList<T>& params,
                            const LoadOptions& options) {
  namespace fs = std::filesystem;
  const fs::path folder = fs::path(index_path).parent_path();
  check_unique_names("load_sharded_checkpoint", params);
  LoadResult result;
  std::map<std::string, ParamList<T>> by_file;
  for (const auto& p : params) {
    auto it = index.weight_map.find(p.name);
    if (it == index.weight_map.end()) result.missing.push_back(p.name);
    else by_file[it->second].push_back(p);
  }
  if (!result.missing.empty() && !options.allow_missing)
    throw FormatError("load_sharded_checkpoint('" + index_path + "'): the index does not name " +
                      name_list(result.missing));
  LoadOptions per_file = options;
  per_file.allow_unexpected = true;  // a shard holds other ranks' or layers' tensors too
  for (const auto& [file, subset] : by_file) {
    LoadResult r = load_checkpoint((folder / file).string(), subset, per_file);
    result.loaded.insert(result.loaded.end(), r.loaded.begin(), r.loaded.end());
  }
  result.metadata = index.metadata;
  return result;
}

/// Staging copies of `params` (values) and views of them under the same names.
template <class T>
struct Staged {
  std::vector<Matrix<T>> values;
  ParamList<T> views;
  explicit Staged(const ParamList<T>& params) {
    values.reserve(params.size());
    for (const auto& p : params) {
      values.emplace_back(p.rows, p.cols);
      views.push_back(Param<T>{p.name, values.back().data(), nullptr, p.rows, p.cols});
    }
  }
  /// Copies the staged values named in `loaded` into `params`.
  void commit(const ParamList<T>& params, const std::vector<std::string>& loaded) const {
    for (std::size_t i = 0; i < params.size(); ++i)
      if (std::find(loaded.begin(), loaded.end(), params[i].name) != loaded.end()) params[i].value() = values[i];
  }
};

}  // namespace detail

/// Loads `params` from a sharded checkpoint (`path`: its folder or its index
/// file). Every parameter must be in the weight map (unless
/// `options.allow_missing`); tensors of the shards that no parameter names
/// are ignored. All-or-nothing: every shard is read into a staging copy
/// first (transient memory: one copy of `params`), and the parameters are
/// written only when every shard loaded. Errors as load_checkpoint, and
/// FormatError for a bad index.
template <class T>
LoadResult load_sharded_checkpoint(const std::string& path, const ParamList<T>& params, const LoadOptions& options = {}) {
  const std::string index_path = shard_index_path(path);
  const ShardIndex index = read_shard_index(index_path);
  const detail::Staged<T> staged(params);
  LoadResult result = detail::load_shards_into(index_path, index, staged.views, options);
  staged.commit(params, result.loaded);
  return result;
}

}  // namespace apex
