#pragma once
// The committed inputs of a fuzz target (its seed corpus and past crashes),
// read for the tests that replay them through the target's body.

#include <cstddef>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <iterator>
#include <string>

namespace apex::fuzz {

/// Calls `use(path, bytes)` for every file of the folders `subs` of `tests`
/// (hidden files such as .gitkeep skipped); returns how many there were.
inline std::size_t for_each_committed_input(
    const std::filesystem::path& tests, std::initializer_list<const char*> subs,
    const std::function<void(const std::filesystem::path&, const std::string&)>& use) {
  std::size_t files = 0;
  for (const char* sub : subs)
    for (const auto& entry : std::filesystem::directory_iterator(tests / sub)) {
      if (!entry.is_regular_file() || entry.path().filename().string().front() == '.') continue;
      std::ifstream f(entry.path(), std::ios::binary);
      use(entry.path(), std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()));
      ++files;
    }
  return files;
}

}  // namespace apex::fuzz
