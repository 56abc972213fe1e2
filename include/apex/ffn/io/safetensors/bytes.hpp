#pragma once
/// \file io/safetensors/bytes.hpp
/// Where the reader's bytes come from (`ByteSource`: a file or a memory
/// buffer) and where the writer's go (`ByteSink`), with the in-memory
/// implementations of both.
///
/// Exists so that validation and serialisation are written once against
/// these interfaces and tested (and fuzzed) in memory, while the POSIX file
/// implementations live in io/safetensors/posix_file.hpp.

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "../../core/errors.hpp"

namespace apex {
namespace safetensors {

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
class MemorySource : public ByteSource {
 public:
  MemorySource(const void* data, std::size_t size) : data_(static_cast<const unsigned char*>(data)), size_(size) {}
  std::uint64_t size() const override { return size_; }
  void read(std::uint64_t offset, void* dst, std::size_t n) const override {
    if (offset > size_ || n > size_ - offset)
      throw FormatError("safetensors: read of " + std::to_string(n) + " bytes at offset " + std::to_string(offset) +
                        " past the end of a " + std::to_string(size_) + "-byte " + description_);
    if (n) std::memcpy(dst, data_ + offset, n);
  }
  const std::string& description() const override { return description_; }

 private:
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

}  // namespace safetensors
}  // namespace apex
