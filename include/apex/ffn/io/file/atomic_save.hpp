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
#include <vector>

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
/// fsyncs and closes it. On any failure the temporary file is closed and
/// removed and the exception propagates.
inline void fill_temp(const std::string& format, const ScopedFd& dir, int fd, const std::string& tmp,
                      const std::string& tmp_path, const std::function<void(ByteSink&)>& produce) {
  try {
    FdSink sink(format, fd, "temporary file '" + tmp_path + "'");
    produce(sink);
    sink.flush();
    if (::fsync(fd) != 0) throw FormatError(format + ": cannot fsync '" + tmp_path + "': " + std::strerror(errno));
    const int rc = ::close(fd);
    fd = -1;
    if (rc != 0) throw FormatError(format + ": cannot close '" + tmp_path + "': " + std::strerror(errno));
  } catch (...) {
    if (fd >= 0) ::close(fd);
    ::unlinkat(dir.fd, tmp.c_str(), 0);
    throw;
  }
}

/// Renames the complete temporary file `tmp` over `name`; if that fails,
/// removes it and throws FormatError.
inline void rename_temp(const std::string& format, const ScopedFd& dir, const std::string& tmp,
                        const std::string& tmp_path, const std::string& name, const std::string& path) {
  if (::renameat(dir.fd, tmp.c_str(), dir.fd, name.c_str()) == 0) return;
  const int err = errno;
  ::unlinkat(dir.fd, tmp.c_str(), 0);
  throw FormatError(format + ": cannot rename '" + tmp_path + "' to '" + path + "': " + std::strerror(err));
}

}  // namespace detail

/// One file of a save: its path and what writes its content.
struct AtomicFile {
  std::string path;
  std::function<void(ByteSink&)> produce;
};

/// Writes files of one folder that belong together (an adapter's tensors
/// and its config) as write_file_atomic writes one, except that every file
/// is first written whole to its temporary file (flushed, fsync'ed,
/// closed), and only then are they renamed over their targets, in order,
/// and the folder fsync'ed. So a failure while any file is produced or
/// written (`produce` throws, the disk is full) leaves every target
/// untouched, never a new file beside an old one. Only the renames are not
/// one step: a crash, or a rename that fails, between two of them leaves
/// the earlier files new and the later ones old (a rename that fails says
/// which). FormatError for I/O errors and for paths in different folders.
inline void write_files_atomic(const std::string& format, const std::vector<AtomicFile>& files) {
  namespace fs = std::filesystem;
  if (files.empty()) return;
  const fs::path first(files.front().path);
  const fs::path dir = first.has_parent_path() ? first.parent_path() : fs::path(".");
  std::vector<std::string> names;
  for (const AtomicFile& f : files) {
    const fs::path target(f.path);
    if (target.filename().empty()) throw FormatError(format + ": '" + f.path + "' does not name a file");
    if ((target.has_parent_path() ? target.parent_path() : fs::path(".")) != dir)
      throw FormatError(format + ": '" + f.path + "' is not in the folder '" + dir.string() +
                        "' of the files saved with it");
    names.push_back(target.filename().string());
  }

  detail::ScopedFd folder{::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)};
  const auto cannot_create = [&](int err, const std::string& path) {
    return FormatError(format + ": cannot create a temporary file in '" + dir.string() + "' to save '" + path +
                       "': " + std::strerror(err));
  };
  if (folder.fd < 0) throw cannot_create(errno, files.front().path);
  const std::size_t name_max = detail::folder_name_max(folder.fd);
  for (std::size_t i = 0; i < files.size(); ++i)
    if (names[i].size() > name_max)
      throw FormatError(format + ": cannot save '" + files[i].path + "': its file name has " +
                        std::to_string(names[i].size()) + " bytes, more than the " + std::to_string(name_max) +
                        " its folder allows");

  // Every file complete under its temporary name before any target changes.
  std::vector<std::string> temps;
  const auto remove_temps = [&](std::size_t from) {
    for (std::size_t i = from; i < temps.size(); ++i) ::unlinkat(folder.fd, temps[i].c_str(), 0);
  };
  try {
    for (std::size_t i = 0; i < files.size(); ++i) {
      std::string tmp;
      const int fd = detail::create_temp(folder, names[i], name_max, tmp);
      if (fd < 0) throw cannot_create(errno, files[i].path);
      detail::fill_temp(format, folder, fd, tmp, (dir / tmp).string(), files[i].produce);  // removes tmp on failure
      temps.push_back(tmp);
    }
  } catch (...) {
    remove_temps(0);
    throw;
  }
  for (std::size_t i = 0; i < files.size(); ++i) {
    try {
      detail::rename_temp(format, folder, temps[i], (dir / temps[i]).string(), names[i], files[i].path);
    } catch (const FormatError& e) {
      remove_temps(i + 1);
      if (i == 0) throw;
      std::string saved;
      for (std::size_t j = 0; j < i; ++j) saved += (j ? ", '" : "'") + files[j].path + "'";
      throw FormatError(std::string(e.what()) + "; already replaced: " + saved);
    }
  }

  // The new files are in place; make the directory entries durable too.
  const int rc = ::fsync(folder.fd);
  const int err = errno;
  // Some file systems cannot fsync a directory (EINVAL); the renames stand.
  if (rc != 0 && err != EINVAL)
    throw FormatError(format + ": saved '" + files.back().path + "' but cannot fsync its folder: " +
                      std::strerror(err));
}

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
  write_files_atomic(format, {{path, produce}});
}

}  // namespace io
}  // namespace apex
