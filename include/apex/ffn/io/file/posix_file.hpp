#pragma once
/// \file io/file/posix_file.hpp
/// Files through POSIX descriptors: `FileSource` reads a regular file with
/// `pread`, `detail::FdSink` writes one through a fixed buffer.
///
/// Exists to keep the system calls of every file format in a few small
/// headers (this one, io/file/atomic_save.hpp and io/file/mapped_file.hpp),
/// each stating the file-type and error rules it enforces. Each takes the
/// name of the format whose file it opens and starts its messages with it
/// ("gguf: cannot open file 'x.gguf': …"). The rule here: a path is opened non-blocking
/// and must be a regular file (checked with `fstat` on the opened
/// descriptor, so nothing can swap the file between check and use) before
/// a single blocking call is made on it. `open()` of a FIFO without
/// O_NONBLOCK waits for a writer, possibly forever; a device may block or
/// have side effects; a directory or socket is no checkpoint.

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#else
#error "apex/ffn/io/file needs POSIX file I/O (open, pread, mmap, fsync, rename)"
#endif

#include "../../core/errors.hpp"
#include "bytes.hpp"

namespace apex {
namespace io {
namespace detail {

/// Opens `path` for reading and returns the descriptor (blocking again) and
/// the file's size in `size`. FormatError starting with `format` (the
/// format read: "safetensors", "gguf") and naming the file by
/// `description`, with nothing left open, if it cannot be opened or is not
/// a regular file. O_NONBLOCK makes the open of
/// a FIFO or device return at once instead of waiting for the other end;
/// once `fstat` has shown a regular file the flag is cleared (it means
/// nothing for regular files on Linux, but must not leak into the reads).
inline int open_regular_file(const std::string& format, const std::string& path, const std::string& description,
                             std::uint64_t& size) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
  if (fd < 0) throw FormatError(format + ": cannot open " + description + ": " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw FormatError(format + ": " + description + " is not a regular file");
  }
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    const int err = errno;
    ::close(fd);
    throw FormatError(format + ": cannot open " + description + ": " + std::strerror(err));
  }
  size = static_cast<std::uint64_t>(st.st_size);
  return fd;
}

}  // namespace detail

/// A regular file, read with pread. The size is taken when it is opened; a
/// file that shrinks afterwards makes reads throw FormatError. A path that
/// is not a regular file (a FIFO, device, directory, socket) is rejected
/// with FormatError when the source is constructed, without blocking.
/// Messages start with `format`, the format read ("safetensors").
class FileSource : public ByteSource {
 public:
  FileSource(std::string format, const std::string& path)
      : format_(std::move(format)),
        description_("file '" + path + "'"),
        fd_(detail::open_regular_file(format_, path, description_, size_)) {}
  ~FileSource() override { ::close(fd_); }
  FileSource(const FileSource&) = delete;
  FileSource& operator=(const FileSource&) = delete;

  std::uint64_t size() const override { return size_; }
  void read(std::uint64_t offset, void* dst, std::size_t n) const override {
    auto* p = static_cast<unsigned char*>(dst);
    while (n > 0) {
      const ssize_t got = ::pread(fd_, p, n, static_cast<off_t>(offset));
      if (got < 0 && errno == EINTR) continue;
      if (got < 0) throw FormatError(format_ + ": cannot read " + description_ + ": " + std::strerror(errno));
      if (got == 0) throw FormatError(format_ + ": " + description_ + " ended early (truncated while being read?)");
      p += got;
      n -= std::size_t(got);
      offset += std::uint64_t(got);
    }
  }
  const std::string& description() const override { return description_; }

 private:
  std::string format_;       // format_ and description_ are declared before
  std::string description_;  // fd_: the open names them in messages
  std::uint64_t size_ = 0;
  int fd_ = -1;
};

namespace detail {

/// Unbuffered-by-stdio writes to a file descriptor, through a fixed buffer.
/// Messages start with `format`, the format written.
class FdSink : public ByteSink {
 public:
  FdSink(std::string format, int fd, std::string description)
      : format_(std::move(format)), fd_(fd), description_(std::move(description)) {
    buf_.reserve(kChunkBytes);
  }
  void write(const void* data, std::size_t n) override {
    const auto* p = static_cast<const unsigned char*>(data);
    while (n > 0) {
      const std::size_t take = std::min(n, kChunkBytes - buf_.size());
      buf_.insert(buf_.end(), p, p + take);
      p += take;
      n -= take;
      if (buf_.size() == kChunkBytes) flush();
    }
  }
  void flush() {
    const unsigned char* p = buf_.data();
    std::size_t n = buf_.size();
    while (n > 0) {
      const ssize_t put = ::write(fd_, p, n);
      if (put < 0 && errno == EINTR) continue;
      if (put <= 0) throw FormatError(format_ + ": cannot write " + description_ + ": " + std::strerror(errno));
      p += put;
      n -= std::size_t(put);
    }
    buf_.clear();
  }

 private:
  std::string format_;
  int fd_;
  std::string description_;
  std::vector<unsigned char> buf_;
};

}  // namespace detail
}  // namespace io
}  // namespace apex
