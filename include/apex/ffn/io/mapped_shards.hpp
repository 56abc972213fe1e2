#pragma once
/// \file io/mapped_shards.hpp
/// `MappedShards`: a sharded checkpoint folder (a Hugging Face
/// `model.safetensors.index.json` and its shard files, io/shard_index.hpp)
/// opened through read-only mappings, so a model of any size opens by
/// reading its index and each shard's header, not its weights.
///
/// Every shard the index names is mapped and its header validated when the
/// folder is opened (io/safetensors/reader.hpp's checks, FormatError for a
/// bad one, before anything is returned); then `bytes(name)` hands out a
/// tensor's stored bytes inside its shard's mapping without a copy, and
/// `reader(name)` its shard's Reader for typed (copying) reads. The index
/// must agree with the shards: a name the index puts in a shard that lacks
/// it is a FormatError at open. Tensors a shard holds but the index does
/// not name are ignored (as load_sharded_checkpoint ignores them).

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "../core/errors.hpp"
#include "safetensors.hpp"
#include "shard_index.hpp"

namespace apex {
namespace io {

/// A sharded checkpoint folder opened through mappings (see the file comment).
class MappedShards {
 public:
  /// Opens `path` (the folder or its index file). FormatError for a bad
  /// index, a shard that cannot be mapped or validated, or a tensor the
  /// index places in a shard that does not hold it.
  explicit MappedShards(const std::string& path, const safetensors::Limits& limits = {})
      : index_path_(shard_index_path(path)), index_(read_shard_index(index_path_, limits)) {
    const std::filesystem::path folder = std::filesystem::path(index_path_).parent_path();
    for (const std::string& f : index_.files()) {
      apex::detail::check_shard_file_name("MappedShards('" + index_path_ + "')", f);
      shards_.emplace(f, std::make_unique<safetensors::Reader>(safetensors::Reader::map((folder / f).string(), limits)));
    }
    for (const auto& [name, f] : index_.weight_map)
      if (!shards_.at(f)->header().find(name))
        throw FormatError("MappedShards('" + index_path_ + "'): the index puts tensor " +
                          safetensors::quote_name(name) + " in '" + f + "', which does not hold it");
  }

  const ShardIndex& index() const { return index_; }
  /// The names of every tensor the index lists, in name order.
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& [name, f] : index_.weight_map) out.push_back(name);
    return out;
  }
  /// The shard holding `name`; FormatError if the index does not list it.
  const safetensors::Reader& reader(const std::string& name) const { return *shards_.at(file_of(name)); }
  const safetensors::TensorInfo& info(const std::string& name) const { return reader(name).at(name); }
  /// The stored bytes of `name` (info(name).nbytes() of them) in its
  /// shard's mapping, no copy: valid while this object or mapping(name) lives.
  const unsigned char* bytes(const std::string& name) const {
    const safetensors::Reader& r = reader(name);
    return r.mapped_bytes(r.at(name));
  }
  /// The mapping of the shard holding `name` (to keep its bytes alive).
  std::shared_ptr<const MappedFile> mapping(const std::string& name) const { return reader(name).mapping(); }

 private:
  const std::string& file_of(const std::string& name) const {
    const auto it = index_.weight_map.find(name);
    if (it == index_.weight_map.end())
      throw FormatError("MappedShards('" + index_path_ + "'): the index lists no tensor " +
                        safetensors::quote_name(name));
    return it->second;
  }

  std::string index_path_;
  ShardIndex index_;
  std::map<std::string, std::unique_ptr<safetensors::Reader>> shards_;  // file name → mapped reader
};

}  // namespace io
}  // namespace apex
