#pragma once
/// \file inference/files/checkpoint/source.hpp
/// `PackedSource`: the tensors a packed loader reads (inference/files/checkpoint/read.hpp),
/// from one safetensors file (a `safetensors::Reader`) or from a Hugging Face
/// sharded folder opened through mappings (`io::MappedShards`).
///
/// Exists so that the loader's checks — names, dtypes, shapes, a quantized
/// checkpoint's metadata, a family's names — and its expert-by-expert read
/// are written once, against "a set of tensors with names, dtypes and
/// shapes", whatever holds them. A sharded folder's set is the index's
/// weight map: a tensor a shard holds but the index does not name is not
/// there (as load_sharded_checkpoint ignores it), and MappedShards has
/// proven, when it opened the folder, that every name of the index is in
/// the shard the index gives. A read from a mapping decodes the tensor's
/// bytes in place (no copy of the shard, no chunk buffer); a Reader without
/// a mapping (pread, memory) reads through its bounded buffer as before.

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "../../../core/errors.hpp"
#include "../../../io/checkpoint.hpp"
#include "../../../io/mapped_shards.hpp"
#include "../../../io/name_maps.hpp"
#include "../../../io/safetensors.hpp"

namespace apex {
namespace detail::inference {

/// One file or a sharded folder, as the packed loaders see it (see the file comment).
class PackedSource {
 public:
  /// Both must outlive the source.
  explicit PackedSource(const safetensors::Reader& file) : file_(&file), description_(file.source().description()) {}
  PackedSource(const io::MappedShards& shards, const std::string& index_path)
      : shards_(&shards), description_("sharded checkpoint '" + index_path + "'") {
    for (const auto& [name, f] : shards.index().weight_map)  // each file's reader, once
      shard_list_.emplace(f, &shards.reader(name));
  }

  /// "file '…'" or "sharded checkpoint '…/model.safetensors.index.json'", for messages.
  const std::string& description() const { return description_; }
  bool sharded() const { return shards_ != nullptr; }

  /// The entry named `name`, or nullptr.
  const safetensors::TensorInfo* find(const std::string& name) const {
    if (file_) return file_->header().find(name);
    return shards_->index().weight_map.count(name) ? &shards_->info(name) : nullptr;
  }
  /// The entry named `name`; FormatError naming the source if there is none.
  const safetensors::TensorInfo& at(const std::string& name) const {
    if (const safetensors::TensorInfo* t = find(name)) return *t;
    throw FormatError("safetensors: " + description_ + " has no tensor " + safetensors::quote_name(name));
  }

  /// Every tensor name under `prefix`, in name order.
  std::vector<std::string> names_under(const std::string& prefix) const {
    std::vector<std::string> out;
    const auto take = [&](const std::string& n) { return n.compare(0, prefix.size(), prefix) == 0; };
    if (file_) {
      for (const auto& t : file_->tensors())
        if (take(t.name)) out.push_back(t.name);
    } else {
      const auto& map = shards_->index().weight_map;
      for (auto it = map.lower_bound(prefix); it != map.end() && take(it->first); ++it) out.push_back(it->first);
    }
    return out;
  }

  /// The `__metadata__` value of `key`: the file's, or the one value the
  /// shards holding it agree on (FormatError naming the key and two shards
  /// if they disagree: a quantized checkpoint's type must be one).
  std::optional<std::string> metadata_value(const std::string& key) const {
    if (file_) {
      const auto it = file_->metadata().find(key);
      return it == file_->metadata().end() ? std::nullopt : std::optional<std::string>(it->second);
    }
    std::optional<std::string> value;
    std::string first;
    for (const auto& [f, reader] : shard_list_) {
      const safetensors::Reader& r = *reader;
      const auto it = r.metadata().find(key);
      if (it == r.metadata().end()) continue;
      if (value && *value != it->second)
        throw FormatError("safetensors: the shards of " + description_ + " disagree on metadata " +
                          safetensors::quote_name(key) + ": '" + first + "' and '" + f + "'");
      if (!value) first = f;
      value = it->second;
    }
    return value;
  }

  /// Converts tensor `name` (F32, F64 or BF16) into `out` (numel() elements):
  /// decoded straight from a mapping where there is one.
  template <class T>
  void read(const std::string& name, T* out) const {
    const safetensors::Reader& r = reader_of(name);
    const safetensors::TensorInfo& t = r.at(name);
    const unsigned char* p = safetensors::is_float_convertible(t.dtype) ? r.mapped_bytes(t) : nullptr;
    if (p) return safetensors::detail::decode(t.dtype, p, std::size_t(t.numel()), out);
    r.read(t, out);  // a pread or memory source; or the dtype error
  }
  /// Copies the stored bytes of `name` (at(name).nbytes()) into `out`, unconverted.
  void read_bytes(const std::string& name, void* out) const {
    const safetensors::Reader& r = reader_of(name);
    r.read_bytes(r.at(name), out);
  }

  /// FormatError if the names under `prefix` are another family's, or a
  /// DeepSeek-V3 set lacks its correction bias (io/family_names.hpp's one rule).
  void check_family(const std::string& where, MoEFamily f, const std::string& prefix) const {
    if (file_) apex::detail::check_family_file(where, *file_, f, prefix);
    else apex::detail::check_family_index(where, shards_->index(), f, prefix);
  }

  /// Loads small float parameters (a sublayer's norm, its skip gate) with
  /// load_checkpoint's checks of names, dtypes and shapes; from a folder,
  /// each from the shard the index gives (a name it lacks is missing).
  void load_params(const ParamList<float>& params, const LoadOptions& options) const {
    if (file_) {
      load_checkpoint(*file_, params, options);
      return;
    }
    std::vector<std::string> missing;
    for (const auto& p : params) {
      if (!find(p.name)) {
        missing.push_back(p.name);
        continue;
      }
      LoadOptions one = options;
      one.allow_unexpected = true;  // the shard holds other tensors
      load_checkpoint(reader_of(p.name), ParamList<float>{p}, one);
    }
    if (!missing.empty() && !options.allow_missing)
      throw FormatError(description_ + ": the index does not name " + apex::detail::name_list(missing));
  }

 private:
  const safetensors::Reader& reader_of(const std::string& name) const {
    if (file_) return *file_;
    at(name);  // FormatError naming the folder for a name the index lacks
    return shards_->reader(name);
  }

  const safetensors::Reader* file_ = nullptr;
  const io::MappedShards* shards_ = nullptr;
  std::string description_;
  std::map<std::string, const safetensors::Reader*> shard_list_;  // a folder's file → its reader
};

}  // namespace detail::inference
}  // namespace apex
