#pragma once
/// \file core/memory_budget.hpp
/// Fail fast when a layer cannot fit in the machine's memory.
///
/// A layer too large for the machine (the `large` preset's MoE layer holds
/// ≈ 406 GB of float weights) would otherwise allocate for a minute and then
/// die of `std::bad_alloc`, or be killed by the kernel's OOM killer with no
/// message at all. Constructors that allocate weights call
/// `check_memory_fit` with the bytes they are about to hold, before the first
/// allocation, and get a `ConfigError` that states the bytes needed and the
/// bytes the machine has.
///
/// The budget is the machine's **physical memory**,
/// `sysconf(_SC_PHYS_PAGES) × sysconf(_SC_PAGE_SIZE)` — not /proc/meminfo's
/// MemAvailable. MemAvailable moves with every other process on the machine,
/// so a check against it would make the same construction succeed or fail
/// depending on what else happens to run; a layer larger than all of physical
/// memory can never run well anywhere on this machine. (The check is a floor,
/// not a guarantee: a layer that fits in physical memory can still fail when
/// other processes hold most of it.)
///
/// Override: set the environment variable `APEX_FFN_ALLOW_OVERCOMMIT=1` (for
/// machines with large swap, or layers whose pages are mostly never touched);
/// the check then does nothing. Where the physical size cannot be queried
/// (non-POSIX systems) the check passes.
///
/// The float training layers (SwiGLU, KappaSwiGLU, MultiTokenHeads, MoEFFN)
/// check their weight bytes in the constructor, before the first weight is
/// allocated, and their weights plus gradients when the gradients are first
/// allocated (they are allocated lazily, core/param.hpp): a layer that fits for
/// forward only still constructs and loads, and the first backward, params()
/// or zero_grad() is what fails. MoEFFN checks all of its gradients at once.

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

#include "checked_size.hpp"
#include "errors.hpp"
#include "types.hpp"

namespace apex {

/// The environment variable that disables check_memory_fit when set to "1".
inline constexpr const char* kAllowOvercommitEnv = "APEX_FFN_ALLOW_OVERCOMMIT";

/// Bytes of physical memory of this machine, or 0 where unknown.
inline std::uint64_t physical_memory_bytes() {
#if defined(_SC_PHYS_PAGES) && defined(_SC_PAGE_SIZE)
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  if (pages > 0 && page > 0) return std::uint64_t(pages) * std::uint64_t(page);
#endif
  return 0;
}

/// Whether `APEX_FFN_ALLOW_OVERCOMMIT=1` is set.
inline bool overcommit_allowed() {
  const char* v = std::getenv(kAllowOvercommitEnv);
  return v != nullptr && std::strcmp(v, "1") == 0;
}

namespace detail {

/// "8.60 GB (8600000000 bytes)".
inline std::string bytes_string(std::uint64_t bytes) {
  std::ostringstream s;
  s.setf(std::ios::fixed);
  s.precision(2);
  s << double(bytes) / 1e9 << " GB (" << bytes << " bytes)";
  return s.str();
}

/// ConfigError `where: <what> needs N GB (…), the machine has M GB (…) of
/// physical memory; set APEX_FFN_ALLOW_OVERCOMMIT=1 to <action> anyway`
/// when `needed > available` (available = 0: unknown, passes).
inline void require_memory_fit(const char* where, const std::string& what, std::uint64_t needed,
                               std::uint64_t available, const char* action = "construct it") {
  if (available == 0 || needed <= available) return;
  throw ConfigError(std::string(where) + ": " + what + " needs " + bytes_string(needed) + ", the machine has " +
                    bytes_string(available) + " of physical memory; set " + kAllowOvercommitEnv + "=1 to " + action +
                    " anyway");
}

/// Bytes of `count` scalars of T; ConfigError naming `what` if that exceeds
/// the index range.
template <class T>
std::uint64_t scalar_bytes(const char* where, const char* what, Index count) {
  return std::uint64_t(checked_product(where, what, {count, Index(sizeof(T))}));
}

}  // namespace detail

/// ConfigError (see detail::require_memory_fit) unless `needed` bytes fit in
/// physical memory or the override is set. `what` names what is allocated
/// ("weights", "weights and gradients").
inline void check_memory_fit(const char* where, const std::string& what, std::uint64_t needed) {
  if (overcommit_allowed()) return;
  detail::require_memory_fit(where, what, needed, physical_memory_bytes());
}

/// The check before a layer allocates its gradients: `weight_bytes` are held
/// already, `gradient_bytes` are about to be. ConfigError `where: <what> with
/// its gradients needs N GB …, the machine has M GB …; set
/// APEX_FFN_ALLOW_OVERCOMMIT=1 to allocate them anyway` unless both fit in
/// physical memory (equivalently: the gradients fit in what the weights leave).
inline void check_gradient_fit(const char* where, const std::string& what, std::uint64_t weight_bytes,
                               std::uint64_t gradient_bytes) {
  if (overcommit_allowed()) return;
  // Both terms come from checked products, each below 2^63, so a sum that
  // wrapped could only come from a caller's own counts: refuse it.
  if (gradient_bytes > std::numeric_limits<std::uint64_t>::max() - weight_bytes)
    throw ConfigError(std::string(where) + ": " + what + " with its gradients needs " + std::to_string(weight_bytes) +
                      " + " + std::to_string(gradient_bytes) + " bytes, which does not fit in 64 bits");
  detail::require_memory_fit(where, what + " with its gradients", weight_bytes + gradient_bytes,
                             physical_memory_bytes(), "allocate them");
}

}  // namespace apex
