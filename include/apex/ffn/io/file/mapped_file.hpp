#pragma once
/// \file io/file/mapped_file.hpp
/// `MappedFile`: a regular file mapped read-only into memory, and
/// `MappedSource`, the byte source that reads through such a mapping.
///
/// Exists so that a model file is opened without a read: the kernels and the
/// loaders address its bytes where the kernel's page cache holds them. Pages
/// are read from disk when first touched, are shared by every process that
/// maps the same file, and can be evicted and read again under memory
/// pressure, so a layer larger than memory still runs (paging).
///
/// The rules, and why:
/// - The path is opened non-blocking and must be a regular file
///   (io/file/posix_file.hpp's `open_regular_file`): a FIFO or device
///   is a FormatError at once, never a hang. Every message starts with the
///   name of the format being read ("gguf: cannot open file 'x.gguf': …"),
///   which the caller gives when it opens the file.
/// - The mapping is `PROT_READ`, `MAP_SHARED`: nothing in this library can
///   write through it, and the memory is the page cache itself, not a copy.
/// - The size is taken when the file is opened and every loader validates
///   against it before touching a byte. A file truncated by another process
///   while mapped makes later accesses beyond its new end raise SIGBUS; that
///   is the contract of every memory-mapped reader (llama.cpp's included) and
///   is documented in docs/model_files.md. Replace model files by renaming a
///   new file over the old one (what this library's saves do): a mapping
///   keeps the old file's pages alive.
/// - An empty file maps to no memory (`mmap` of 0 bytes is an error).

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include <sys/mman.h>
#include <unistd.h>

#include "../../core/errors.hpp"
#include "../../core/mapped_bytes.hpp"
#include "bytes.hpp"
#include "posix_file.hpp"

namespace apex {
namespace io {

/// A read-only mapping of a whole regular file. Not copyable; share it by
/// `std::shared_ptr`: every view into it holds one (to its MappedBytes,
/// core/mapped_bytes.hpp), so the mapping lives as long as the last layer
/// that computes from it.
class MappedFile : public MappedBytes {
 public:
  /// Maps `path`. FormatError starting with `format` (the format read:
  /// "safetensors", "gguf") if it cannot be opened, is not a regular file,
  /// or cannot be mapped; nothing is left open then.
  static std::shared_ptr<const MappedFile> open(const std::string& format, const std::string& path) {
    return std::shared_ptr<const MappedFile>(new MappedFile(format, path));
  }
  ~MappedFile() {
    if (base_) ::munmap(base_, std::size_t(size_));
  }

  // data(), size(), description(): MappedBytes'.
  const std::string& path() const { return path_; }
  /// The format the file was opened as, which starts every message.
  const std::string& format() const { return format_; }

  /// Advises the kernel that `[offset, offset + n)` will be read soon
  /// (`MADV_WILLNEED`, read-ahead) or will be read in random order
  /// (`MADV_RANDOM`, no read-ahead: a decode step touches few experts).
  /// Advice only: failures are ignored. The range is clipped to the file.
  void will_need(std::uint64_t offset, std::uint64_t n) const { advise(offset, n, MADV_WILLNEED); }
  void random_access() const { advise(0, size_, MADV_RANDOM); }

 private:
  MappedFile(const std::string& format, const std::string& path)
      : MappedBytes("file '" + path + "'"), format_(format), path_(path) {
    const int fd = detail::open_regular_file(format_, path, description(), size_);
    if (size_ > 0) {
      if (size_ > std::uint64_t(SIZE_MAX)) {
        ::close(fd);
        throw FormatError(format_ + ": " + description() + " is larger than the address space");
      }
      void* p = ::mmap(nullptr, std::size_t(size_), PROT_READ, MAP_SHARED, fd, 0);
      if (p == MAP_FAILED) {
        const int err = errno;
        ::close(fd);
        throw FormatError(format_ + ": cannot map " + description() + ": " + std::strerror(err));
      }
      base_ = p;
      data_ = static_cast<const unsigned char*>(p);
    }
    ::close(fd);  // the mapping keeps the file open
  }

  void advise(std::uint64_t offset, std::uint64_t n, int advice) const {
    if (!base_ || offset >= size_) return;
    const std::uint64_t page = std::uint64_t(::sysconf(_SC_PAGESIZE));
    const std::uint64_t begin = offset / page * page;
    const std::uint64_t end = n > size_ - offset ? size_ : offset + n;
    ::madvise(static_cast<unsigned char*>(base_) + begin, std::size_t(end - begin), advice);
  }

  std::string format_;
  std::string path_;
  void* base_ = nullptr;  // data_, writable for munmap and madvise
};

/// The bytes of a mapped file as a `ByteSource`: reads are bounds-checked
/// copies out of the mapping, and `bytes()` hands out the mapping itself for
/// a range the caller has validated. Messages start with the file's format.
class MappedSource : public ByteSource {
 public:
  explicit MappedSource(std::shared_ptr<const MappedFile> file) : file_(std::move(file)) {}
  MappedSource(const std::string& format, const std::string& path) : file_(MappedFile::open(format, path)) {}

  std::uint64_t size() const override { return file_->size(); }
  void read(std::uint64_t offset, void* dst, std::size_t n) const override {
    const unsigned char* p = bytes(offset, n);
    if (n) std::memcpy(dst, p, n);
  }
  const std::string& description() const override { return file_->description(); }

  /// The `n` mapped bytes at `offset`, without a copy; FormatError if they
  /// are not all inside the file.
  const unsigned char* bytes(std::uint64_t offset, std::uint64_t n) const {
    if (offset > file_->size() || n > file_->size() - offset)
      throw FormatError(file_->format() + ": " + std::to_string(n) + " bytes at offset " + std::to_string(offset) +
                        " are past the end of the " + std::to_string(file_->size()) + "-byte " +
                        file_->description());
    return file_->data() + offset;
  }
  const std::shared_ptr<const MappedFile>& file() const { return file_; }

 private:
  std::shared_ptr<const MappedFile> file_;
};

}  // namespace io
}  // namespace apex
