#pragma once
/// \file core/mapped_bytes.hpp
/// `MappedBytes`: read-only bytes that something else has mapped into
/// memory and keeps there (a memory-mapped file, io/file/mapped_file.hpp),
/// with a description of them for messages ("file 'model.safetensors'").
///
/// Exists so that a view into mapped bytes (kernels/panel_bytes.hpp) can
/// hold them alive and name them without knowing what maps them: the
/// kernels sit below the files. A view holds a
/// `std::shared_ptr<const MappedBytes>`; the owner derives from this class
/// and sets the range once, when it has mapped it, and unmaps it when the
/// last view is gone.

#include <cstdint>
#include <string>
#include <utility>

namespace apex {

/// A read-only range of mapped bytes, alive as long as its owner (see the
/// file comment). Not copyable; the owner's type is the derived class's.
class MappedBytes {
 public:
  MappedBytes(const MappedBytes&) = delete;
  MappedBytes& operator=(const MappedBytes&) = delete;

  /// The first of size() bytes (null for an empty range).
  const unsigned char* data() const { return data_; }
  std::uint64_t size() const { return size_; }
  /// What the bytes are, for messages: "file 'x.gguf'".
  const std::string& description() const { return description_; }

 protected:
  explicit MappedBytes(std::string description) : description_(std::move(description)) {}
  ~MappedBytes() = default;  // owned through the derived type (std::shared_ptr keeps it)

  const unsigned char* data_ = nullptr;
  std::uint64_t size_ = 0;

 private:
  std::string description_;
};

}  // namespace apex
