#pragma once
/// \file io/gguf/file.hpp
/// `File`: a validated GGUF file — its metadata, its tensor table, and the
/// tensors' bytes in place (in a read-only mapping, or in a caller's buffer).
///
/// Opening validates the whole header (parse.hpp) and every tensor's byte
/// range against the file's size; nothing is read from the data section, so
/// opening a 100 GB model touches only its header's pages. After that,
/// `data(t)` is a pointer into the mapping that the kernels can read
/// directly; `mapping()` hands out the shared mapping so that a layer built
/// from the file keeps it alive after the File is gone.

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "../../core/errors.hpp"
#include "../file/mapped_file.hpp"
#include "parse.hpp"

namespace apex {
namespace gguf {

static_assert(sizeof(void*) == 8, "gguf: 64-bit offsets are addressed in place, which needs a 64-bit host");

class File {
 public:
  /// Maps `path` read-only and validates it. FormatError if the path is not
  /// a regular file (a FIFO, device or folder is refused at once, never
  /// waited on) or the file is not valid GGUF; nothing stays open then.
  static File open(const std::string& path, const Limits& limits = {}) {
    auto map = io::MappedFile::open("gguf", path);
    return File(map, map->data(), map->size(), map->description(), limits);
  }

  /// Validates the GGUF bytes `[data, data + size)`, which are not copied
  /// and must outlive the File (and every pointer `data(t)` returned).
  static File from_memory(const void* data, std::size_t size, const Limits& limits = {}) {
    return File(nullptr, static_cast<const unsigned char*>(data), size, "memory buffer", limits);
  }

  std::uint32_t version() const { return header_.version; }
  std::uint64_t alignment() const { return header_.alignment; }
  /// Where the data section starts, from the start of the file.
  std::uint64_t data_offset() const { return header_.data_offset; }
  std::uint64_t size() const { return size_; }
  const std::string& description() const { return description_; }

  const std::vector<Value>& metadata() const { return header_.metadata; }
  const Value* find(std::string_view key) const {
    const auto it = keys_.find(std::string(key));
    return it == keys_.end() ? nullptr : &header_.metadata[it->second];
  }
  /// The value under `key`; FormatError naming the key and the file if absent.
  const Value& at(std::string_view key) const {
    if (const Value* v = find(key)) return *v;
    throw FormatError("gguf: " + description_ + " has no metadata key '" + std::string(key) + "'");
  }
  /// `at(key).as<T>()`, the message naming the file too.
  template <class T>
  T get(std::string_view key) const {
    return convert<T>(at(key));
  }
  /// The value under `key` as `T`, or `fallback` when the key is absent. A
  /// key that is present but does not convert is still a FormatError: a
  /// wrong value must not read as the default.
  template <class T>
  T get_or(std::string_view key, T fallback) const {
    const Value* v = find(key);
    return v ? convert<T>(*v) : fallback;
  }
  /// `general.architecture` ("llama", "qwen3moe", …), which prefixes the
  /// model's other keys; FormatError if absent or not a string.
  std::string architecture() const {
    if (!find("general.architecture"))
      throw FormatError("gguf: " + description_ + " has no 'general.architecture' key, so its model is unknown");
    return get<std::string>("general.architecture");
  }

  const std::vector<TensorInfo>& tensors() const { return header_.tensors; }
  const TensorInfo* find_tensor(std::string_view name) const {
    const auto it = tensors_.find(std::string(name));
    return it == tensors_.end() ? nullptr : &header_.tensors[it->second];
  }
  const TensorInfo& tensor(std::string_view name) const {
    if (const TensorInfo* t = find_tensor(name)) return *t;
    throw FormatError("gguf: " + description_ + " has no tensor '" + std::string(name) + "'");
  }

  /// The first of `t.nbytes` bytes of `t` (validated to be in the file at
  /// open). `t` must be one of this File's tensors.
  const unsigned char* data(const TensorInfo& t) const {
    if (&t < header_.tensors.data() || &t >= header_.tensors.data() + header_.tensors.size())
      throw ConfigError("gguf::File::data: tensor '" + t.name + "' is not one of " + description_ + "'s tensors");
    return base_ + header_.data_offset + t.offset;
  }

  /// The mapping the bytes live in; null for `from_memory`.
  std::shared_ptr<const io::MappedFile> mapping() const { return map_; }

 private:
  File(std::shared_ptr<const io::MappedFile> map, const unsigned char* base, std::uint64_t size, std::string desc,
       const Limits& limits)
      : map_(std::move(map)), base_(base), size_(size), description_(std::move(desc)) {
    if (!base_ && size_ != 0) throw ConfigError("gguf::File::from_memory: null data with a nonzero size");
    static const unsigned char kEmpty = 0;
    header_ = parse(base_ ? base_ : &kEmpty, size_, description_, limits);
    keys_.reserve(header_.metadata.size());
    for (std::size_t i = 0; i < header_.metadata.size(); ++i) keys_.emplace(header_.metadata[i].key(), i);
    tensors_.reserve(header_.tensors.size());
    for (std::size_t i = 0; i < header_.tensors.size(); ++i) tensors_.emplace(header_.tensors[i].name, i);
  }

  template <class T>
  T convert(const Value& v) const {
    try {
      return v.as<T>();
    } catch (const FormatError& e) {
      throw FormatError(std::string(e.what()) + " (in " + description_ + ")");
    }
  }

  std::shared_ptr<const io::MappedFile> map_;
  const unsigned char* base_;
  std::uint64_t size_;
  std::string description_;
  Header header_;
  std::unordered_map<std::string, std::size_t> keys_;
  std::unordered_map<std::string, std::size_t> tensors_;
};

}  // namespace gguf
}  // namespace apex
