#pragma once
/// \file io/safetensors/files.hpp
/// The file layer (io/file/) under the format's names: the byte sources and
/// sinks the reader and writer take, and `MemorySource`, `FileSource` and
/// `write_file_atomic`, whose messages start with "safetensors:".
///
/// Exists so that safetensors files are opened, read and saved by the same
/// code as every other format's (io/file/: regular files only, never a
/// blocking open, atomic saves), while callers keep naming them
/// `safetensors::…` and every message names the format it came from.

#include <cstddef>
#include <functional>
#include <string>

#include "../file/atomic_save.hpp"
#include "../file/bytes.hpp"
#include "../file/posix_file.hpp"

namespace apex {
namespace safetensors {

using io::ByteSink;
using io::ByteSource;
using io::VectorSink;

/// Bytes in memory, not copied: they must outlive the source.
class MemorySource : public io::MemorySource {
 public:
  MemorySource(const void* data, std::size_t size) : io::MemorySource("safetensors", data, size) {}
};

/// A regular file, read with pread (io/file/posix_file.hpp: a FIFO, device,
/// directory or socket is a FormatError at once, never a blocking open).
class FileSource : public io::FileSource {
 public:
  explicit FileSource(const std::string& path) : io::FileSource("safetensors", path) {}
};

/// Writes the file `path` atomically (io/file/atomic_save.hpp): `produce`
/// writes the content, and a reader sees the old file or the new one.
inline void write_file_atomic(const std::string& path, const std::function<void(ByteSink&)>& produce) {
  io::write_file_atomic("safetensors", path, produce);
}

}  // namespace safetensors
}  // namespace apex
