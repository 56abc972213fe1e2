#pragma once
/// \file io/file/atomic_save.hpp
/// `write_file_atomic`: a file is written under a temporary name in its
/// folder, made durable, and renamed over the target, so a reader sees the
/// old file or the new one, never a mix.
///
/// Exists apart from the writer because the guarantees live in the order of
/// system calls, not in the format. The rules it enforces: the folder is
/// opened once (`O_DIRECTORY`) and every later step — create, rename,
/// unlink, fsync — goes through that descriptor, so all of them act on the
/// same folder; the temporary file is created with `O_EXCL` (never a
/// stranger's file, never a FIFO or device); and its name is bounded: it
/// fits the folder's name limit whenever the target's name does. Messages
/// start with the name of the format saved ("safetensors", "gguf").

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <string>

#include "../../core/errors.hpp"
#include "bytes.hpp"
#include "posix_file.hpp"

namespace apex {
namespace io {
namespace detail {

/// The temporary name standing in for `name` while it is written:
/// ".<name>.tmp.<pid>.<n>" — hidden, unique per process (`pid`) and call
/// (`n`). Where that would exceed `name_max` bytes, `name` is shortened (at
/// a UTF-8 character boundary) until it fits: uniqueness comes from pid and
/// counter alone, the name only tells a person whose leftover it is. The
/// result fits `name_max` whenever ".tmp.<pid>.<n>" plus the dot does, i.e.
/// for any real limit (POSIX guarantees at least 14, Linux has 255).
inline std::string temp_name(const std::string& name, unsigned long long pid, unsigned long long n,
                             std::size_t name_max) {
  const std::string suffix = ".tmp." + std::to_string(pid) + "." + std::to_string(n);
  std::size_t keep = name.size();
  if (1 + keep + suffix.size() > name_max) {
    keep = name_max > 1 + suffix.size() ? name_max - 1 - suffix.size() : 0;
    while (keep > 0 && (static_cast<unsigned char>(name[keep]) & 0xC0u) == 0x80u) --keep;  // not mid-character
  }
  return "." + name.substr(0, keep) + suffix;
}

/// The longest name (in bytes) the folder open as `dfd` accepts; no bound
/// if the file system states none.
inline std::size_t folder_name_max(int dfd) {
  const long limit = ::fpathconf(dfd, _PC_NAME_MAX);
  return limit > 0 ? std::size_t(limit) : std::numeric_limits<std::size_t>::max();
}

/// A descriptor closed at scope exit.
struct ScopedFd {
  explicit ScopedFd(int f) : fd(f) {}
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  ~ScopedFd() {
    if (fd >= 0) ::close(fd);
  }
  int fd;
};

/// Creates a fresh temporary file for `name` in the folder `dir.fd`, its
/// name at most `name_max` bytes; `tmp` receives the name. O_EXCL never
/// clobbers a stranger's file (nor opens a FIFO or device someone put there).
inline int create_temp(const ScopedFd& dir, const std::string& name, std::size_t name_max, std::string& tmp) {
  static std::atomic<unsigned> counter{0};
  int fd = -1;
  for (int attempt = 0; attempt < 100 && fd < 0; ++attempt) {
    tmp = temp_name(name, static_cast<unsigned long long>(::getpid()), counter++, name_max);
    fd = ::openat(dir.fd, tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0 && errno != EEXIST) break;
  }
  return fd;
}

/// Runs `produce` into the new file `fd` (named `tmp` in `dir`), flushes,
/// fsyncs and closes it, and renames it over `name`. On any failure the
/// temporary file is closed and removed and the exception propagates.
inline void fill_and_rename(const std::string& format, const ScopedFd& dir, int fd, const std::string& tmp,
                            const std::string& tmp_path, const std::string& name, const std::string& path,
                            const std::function<void(ByteSink&)>& produce) {
  try {
    FdSink sink(format, fd, "temporary file '" + tmp_path + "'");
    produce(sink);
    sink.flush();
    if (::fsync(fd) != 0) throw FormatError(format + ": cannot fsync '" + tmp_path + "': " + std::strerror(errno));
    const int rc = ::close(fd);
    fd = -1;
    if (rc != 0) throw FormatError(format + ": cannot close '" + tmp_path + "': " + std::strerror(errno));
    if (::renameat(dir.fd, tmp.c_str(), dir.fd, name.c_str()) != 0)
      throw FormatError(format + ": cannot rename '" + tmp_path + "' to '" + path + "': " + std::strerror(errno));
  } catch (...) {
    if (fd >= 0) ::close(fd);
    ::unlinkat(dir.fd, tmp.c_str(), 0);
    throw;
  }
}

}  // namespace detail

/// Writes a file atomically: `produce` writes the content to a temporary file
/// in the same folder, which is flushed, fsync'ed, closed and renamed over
/// `path`; then the folder is fsync'ed so the rename itself is durable.
/// Readers see the old file or the new one, never a mix. If anything fails
/// before the rename (the folder cannot be opened, the name is longer than
/// the folder allows, a write fails, `produce` throws, the disk is full, the
/// rename fails) the temporary file is removed, `path` is untouched, and the
/// exception propagates (FormatError for I/O errors). The temporary file is
/// ".<name>.tmp.<pid>.<n>", <name> shortened where that would not fit the
/// folder's name limit (see temp_name), so any name that fits saves.
/// Messages start with `format`, the format of the file saved.
inline void write_file_atomic(const std::string& format, const std::string& path,
                              const std::function<void(ByteSink&)>& produce) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  if (target.filename().empty()) throw FormatError(format + ": '" + path + "' does not name a file");
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  const std::string name = target.filename().string();

  detail::ScopedFd folder{::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)};
  const auto cannot_create = [&](int err) {
    return FormatError(format + ": cannot create a temporary file in '" + dir.string() + "' to save '" + path +
                       "': " + std::strerror(err));
  };
  if (folder.fd < 0) throw cannot_create(errno);
  const std::size_t name_max = detail::folder_name_max(folder.fd);
  if (name.size() > name_max)
    throw FormatError(format + ": cannot save '" + path + "': its file name has " + std::to_string(name.size()) +
                      " bytes, more than the " + std::to_string(name_max) + " its folder allows");
  std::string tmp;
  const int fd = detail::create_temp(folder, name, name_max, tmp);
  if (fd < 0) throw cannot_create(errno);
  detail::fill_and_rename(format, folder, fd, tmp, (dir / tmp).string(), name, path, produce);

  // The new file is in place; make the directory entry durable too.
  const int rc = ::fsync(folder.fd);
  const int err = errno;
  // Some file systems cannot fsync a directory (EINVAL); the rename stands.
  if (rc != 0 && err != EINVAL)
    throw FormatError(format + ": saved '" + path + "' but cannot fsync its folder: " + std::strerror(err));
}

}  // namespace io
}  // namespace apex
