#pragma once
/// \file io/file/bytes.hpp
/// Where a file reader's bytes come from (`ByteSource`: a file, a mapping or
/// a memory buffer) and where a writer's go (`ByteSink`), with the in-memory
/// implementations of both.
///
/// Exists so that a format's validation and serialisation are written once
/// against these interfaces and tested (and fuzzed) in memory, while the
/// POSIX file implementations live in io/file/posix_file.hpp and
/// io/file/mapped_file.hpp. Every source's messages start with the name of
/// the format it reads ("safetensors: …", "gguf: …"), given when it is made.

#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "../../core/errors.hpp"

namespace apex {
namespace io {
namespace detail {

/// Chunk size of every bounded read and write buffer of the file formats
/// (a multiple of 8).
inline constexpr std::size_t kChunkBytes = std::size_t(1) << 16;

}  // namespace detail

/// Random-access bytes of known size: a file or a memory buffer.
class ByteSource {
 public:
  virtual ~ByteSource() = default;
  virtual std::uint64_t size() const = 0;
  /// Copies exactly `n` bytes at `offset` into `dst`; FormatError if they are not there.
  virtual void read(std::uint64_t offset, void* dst, std::size_t n) const = 0;
  /// "file 'x.safetensors'" or "memory buffer", for messages.
  virtual const std::string& description() const = 0;
};

/// A view of bytes in memory (not copied: they must outlive the source).
/// Messages start with `format` (the reader's: "safetensors").
class MemorySource : public ByteSource {
 public:
  MemorySource(std::string format, const void* data, std::size_t size)
      : format_(std::move(format)), data_(static_cast<const unsigned char*>(data)), size_(size) {}
  std::uint64_t size() const override { return size_; }
  void read(std::uint64_t offset, void* dst, std::size_t n) const override {
    if (offset > size_ || n > size_ - offset)
      throw FormatError(format_ + ": read of " + std::to_string(n) + " bytes at offset " + std::to_string(offset) +
                        " past the end of a " + std::to_string(size_) + "-byte " + description_);
    if (n) std::memcpy(dst, data_ + offset, n);
  }
  const std::string& description() const override { return description_; }

 private:
  std::string format_;
  const unsigned char* data_;
  std::size_t size_;
  std::string description_ = "memory buffer";
};

/// Where serialised bytes go.
class ByteSink {
 public:
  virtual ~ByteSink() = default;
  virtual void write(const void* data, std::size_t n) = 0;
};

/// Collects the bytes in memory.
class VectorSink : public ByteSink {
 public:
  void write(const void* data, std::size_t n) override {
    const auto* p = static_cast<const unsigned char*>(data);
    bytes.insert(bytes.end(), p, p + n);
  }
  std::vector<unsigned char> bytes;
};

}  // namespace io
}  // namespace apex
