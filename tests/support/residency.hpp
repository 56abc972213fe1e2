#pragma once
// Resident memory of one mapping of this process, for the tests of mapped
// weights and files: what a load or a forward made resident, as a fact of
// the process (Rss of the mapping's own entry in /proc/self/smaps), not of
// the page cache (which mincore would report).

#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>

namespace apex::test {

/// Rss in bytes of this process's mapping that starts at `base`, and the
/// part of it mapped as huge pages (a tmpfs mounted huge=always, or a file
/// system with large folios, maps file pages 2 MiB at a time); rss -1 if
/// there is no such mapping (or no smaps: not Linux).
struct Resident {
  long long rss = -1, huge = 0;
};

inline Resident mapping_rss(const void* base) {
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool in = false;
  Resident r;
  const auto kb = [&](std::size_t skip) { return std::stoll(line.substr(skip)) * 1024; };  // "Rss:   123 kB"
  while (std::getline(smaps, line)) {
    unsigned long long start = 0, end = 0;
    char dash = 0;
    std::istringstream head(line);
    if (head >> std::hex >> start >> dash >> end && dash == '-') {
      if (in) break;
      in = start == reinterpret_cast<std::uintptr_t>(base);
    } else if (in && line.rfind("Rss:", 0) == 0) {
      r.rss = kb(4);
    } else if (in && (line.rfind("FilePmdMapped:", 0) == 0 || line.rfind("ShmemPmdMapped:", 0) == 0)) {
      r.huge += kb(line.find(':') + 1);
    }
  }
  return r;
}

}  // namespace apex::test
