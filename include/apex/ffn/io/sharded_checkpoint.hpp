#pragma once
/// \file io/sharded_checkpoint.hpp
/// Checkpoints split over several safetensors files with an index, the
/// Hugging Face convention (`model.safetensors.index.json`, read and written
/// by io/shard_index.hpp).
///
/// The expert-parallel layer writes one file per rank (mpi/expert_parallel_checkpoint.hpp);
/// this header needs no MPI, so a single-process layer loads such a
/// checkpoint — or any Hugging Face sharded checkpoint of matching names —
/// with `load_sharded_checkpoint(folder, params)`.
///
/// The index is the commit point of a sharded save: shard files get names
/// no earlier save used, and the index that points at them is written last,
/// atomically. A reader therefore sees the old index with the old files or
/// the new index with the new files.

#include <algorithm>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "checkpoint.hpp"
#include "../core/errors.hpp"
#include "../core/param.hpp"
#include "shard_index.hpp"

namespace apex {
namespace detail {

/// Whether `path` names a sharded checkpoint (its folder or its index file)
/// rather than one safetensors file: the rule of every sharded loader.
inline bool is_sharded_path(const std::string& path) {
  std::error_code ec;
  return std::filesystem::is_directory(path, ec) ||
         (path.size() >= 5 && path.compare(path.size() - 5, 5, ".json") == 0);
}


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
    // A tensor the index puts in this shard but the shard lacks is missing:
    // load_checkpoint rejects it unless allow_missing, and then lists it.
    LoadResult r = load_checkpoint((folder / file).string(), subset, per_file);
    result.loaded.insert(result.loaded.end(), r.loaded.begin(), r.loaded.end());
    result.missing.insert(result.missing.end(), r.missing.begin(), r.missing.end());
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
/// file). Every parameter must be in the weight map and in the shard the
/// map names (unless `options.allow_missing`, which leaves the others
/// unchanged and lists them in `missing`); tensors of the shards that no
/// parameter names are ignored (a shard holds other ranks' tensors too). All-or-nothing: every shard is read into a staging copy
/// first (transient memory: one copy of `params`), and the parameters are
/// written only when every shard loaded. Errors as load_checkpoint, and
/// FormatError for a bad index.
template <class T>
LoadResult load_sharded_checkpoint(const std::string& path, const ParamList<T>& params, const LoadOptions& options = {}) {
  const std::string index_path = shard_index_path(path);
  const ShardIndex index = read_shard_index(index_path, options.limits);
  const detail::Staged<T> staged(params);
  LoadResult result = detail::load_shards_into(index_path, index, staged.views, options);
  staged.commit(params, result.loaded);
  return result;
}

}  // namespace apex
