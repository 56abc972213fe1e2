#pragma once
/// \file safetensors/atomic_save.hpp
/// `write_file_atomic`: a file is written under a temporary name in its
/// folder, made durable, and renamed over the target, so a reader sees the
/// old file or the new one, never a mix.
///
/// Exists apart from the writer because the guarantees live in the order of
/// system calls, not in the format: the temporary file is created with
/// `O_EXCL` (never a stranger's file), fsync'ed and closed before the
/// rename, removed on any failure, and the folder is fsync'ed after it.

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>

#include "../errors.hpp"
#include "bytes.hpp"
#include "posix_file.hpp"

namespace apex {
namespace safetensors {
namespace detail {

/// Creates a fresh temporary file for `target` in `dir`; `tmp` receives its
/// path. Hidden, unique per process and call; O_EXCL never clobbers a
/// stranger's file.
inline int create_temp(const std::filesystem::path& dir, const std::filesystem::path& target, std::string& tmp) {
  static std::atomic<unsigned> counter{0};
  int fd = -1;
  for (int attempt = 0; attempt < 100 && fd < 0; ++attempt) {
    tmp = (dir / ("." + target.filename().string() + ".tmp." + std::to_string(::getpid()) + "." +
                  std::to_string(counter++)))
              .string();
    fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0 && errno != EEXIST) break;
  }
  return fd;
}

/// Runs `produce` into the new file `fd` (at `tmp`), flushes, fsyncs and
/// closes it, and renames it over `path`. On any failure the temporary file
/// is closed and removed and the exception propagates.
inline void fill_and_rename(int fd, const std::string& tmp, const std::string& path,
                            const std::function<void(ByteSink&)>& produce) {
  try {
    FdSink sink(fd, "temporary file '" + tmp + "'");
    produce(sink);
    sink.flush();
    if (::fsync(fd) != 0) throw FormatError("safetensors: cannot fsync '" + tmp + "': " + std::strerror(errno));
    const int rc = ::close(fd);
    fd = -1;
    if (rc != 0) throw FormatError("safetensors: cannot close '" + tmp + "': " + std::strerror(errno));
    if (::rename(tmp.c_str(), path.c_str()) != 0)
      throw FormatError("safetensors: cannot rename '" + tmp + "' to '" + path + "': " + std::strerror(errno));
  } catch (...) {
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
}

}  // namespace detail

/// Writes a file atomically: `produce` writes the content to a temporary file
/// in the same folder, which is flushed, fsync'ed, closed and renamed over
/// `path`; then the folder is fsync'ed so the rename itself is durable.
/// Readers see the old file or the new one, never a mix. If anything fails
/// before the rename (cannot create, a write fails, `produce` throws, the
/// disk is full, the rename fails) the temporary file is removed, `path` is
/// untouched, and the exception propagates (FormatError for I/O errors).
inline void write_file_atomic(const std::string& path, const std::function<void(ByteSink&)>& produce) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  if (target.filename().empty()) throw FormatError("safetensors: '" + path + "' does not name a file");
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  std::string tmp;
  const int fd = detail::create_temp(dir, target, tmp);
  if (fd < 0)
    throw FormatError("safetensors: cannot create a temporary file in '" + dir.string() + "' to save '" + path +
                      "': " + std::strerror(errno));
  detail::fill_and_rename(fd, tmp, path, produce);

  // The new file is in place; make the directory entry durable too.
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) throw FormatError("safetensors: saved '" + path + "' but cannot open its folder to fsync it");
  const int rc = ::fsync(dfd);
  const int err = errno;
  ::close(dfd);
  // Some file systems cannot fsync a directory (EINVAL); the rename stands.
  if (rc != 0 && err != EINVAL)
    throw FormatError("safetensors: saved '" + path + "' but cannot fsync its folder: " + std::strerror(err));
}

}  // namespace safetensors
}  // namespace apex
