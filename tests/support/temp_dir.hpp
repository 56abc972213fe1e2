#pragma once
// A scratch folder for tests that write files: fresh (named by the process
// and a counter, so parallel test processes never share one) and removed
// with everything in it at scope exit, even if a test left it unwritable.

#include <unistd.h>

#include <cstddef>
#include <filesystem>
#include <iterator>
#include <string>
#include <system_error>

namespace apex::test {

/// A fresh folder, removed with everything in it at scope exit.
struct TempDir {
  std::filesystem::path path;
  TempDir() {
    namespace fs = std::filesystem;
    static int n = 0;
    path = fs::temp_directory_path() / ("apex_test_" + std::to_string(::getpid()) + "_" + std::to_string(n++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    namespace fs = std::filesystem;
    std::error_code ec;
    fs::permissions(path, fs::perms::owner_all, fs::perm_options::add, ec);
    fs::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string operator/(const std::string& name) const { return (path / name).string(); }
  std::size_t entries() const {
    namespace fs = std::filesystem;
    return std::size_t(std::distance(fs::directory_iterator(path), fs::directory_iterator()));
  }
};

}  // namespace apex::test
