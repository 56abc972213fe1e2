#pragma once
/// \file resident.hpp
/// The resident set of this process (VmRSS, as benchmarks/bench_common.hpp
/// reads it), for measuring what a part of the demo holds in memory: the
/// growth between two readings taken with `held_bytes`.
///
/// glibc keeps freed memory in its heap, so a plain reading after work that
/// freed temporaries counts them as held, and memory freed before the first
/// reading and reused after it never shows as growth. `held_bytes` first
/// returns the free heap pages to the system (malloc_trim), so each reading
/// is, to a page, what live allocations occupy: the growth between two is
/// what the code between them allocated and still holds. Elsewhere it is
/// the plain VmRSS.

#include <fstream>
#include <string>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace apex::demo {

/// VmRSS of this process in bytes (/proc/self/status), 0 where unknown.
inline double vm_rss() {
  std::ifstream f("/proc/self/status");
  std::string key;
  while (f >> key) {
    if (key == "VmRSS:") {
      double kb = 0;
      f >> kb;
      return kb * 1024.0;
    }
    std::getline(f, key);
  }
  return 0;
}

/// VmRSS after returning the allocator's free pages (see the file comment).
inline double held_bytes() {
#if defined(__GLIBC__)
  malloc_trim(0);
#endif
  return vm_rss();
}

}  // namespace apex::demo
