#pragma once
/// \file kernels/aligned_array.hpp
/// The packed engine's owning arrays: zero-initialised, 64-byte aligned,
/// and offered to huge pages when large (why: below).

#include <cstddef>
#include <cstring>
#include <memory>
#include <new>
#include <utility>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "../core/types.hpp"

namespace apex::packed {

namespace detail {

/// Zero-initialised array of a trivial type on a 64-byte boundary (the
/// kernels' aligned loads need it; `std::vector` guarantees only 16).
///
/// Arrays of 2 MiB or more are placed on 2 MiB boundaries and, on Linux,
/// offered to transparent huge pages (`madvise`; a no-op where THP is off).
/// A decode step streams every expert's weights once: with 4 KiB pages that
/// is one TLB miss per 4 KiB, and hardware prefetchers stop at each 4 KiB
/// boundary, which costs a measurable share of the memory bandwidth.
template <class T>
class AlignedArray {
 public:
  static constexpr std::size_t kAlign = 64;
  static constexpr std::size_t kHugePage = std::size_t(2) << 20;
  AlignedArray() = default;
  explicit AlignedArray(Index n) : n_(n) {
    if (n == 0) return;
    const std::size_t bytes = std::size_t(n) * sizeof(T);
    const std::size_t align = bytes >= kHugePage ? kHugePage : kAlign;
    void* raw = ::operator new(bytes, std::align_val_t(align));
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (align == kHugePage) ::madvise(raw, bytes / kHugePage * kHugePage, MADV_HUGEPAGE);  // advice only
#endif
    p_ = std::unique_ptr<T, Free>(static_cast<T*>(raw), Free{align});
    std::uninitialized_value_construct_n(p_.get(), std::size_t(n));  // zeros
  }
  AlignedArray(const AlignedArray& o) : AlignedArray(o.n_) {
    if (n_) std::memcpy(p_.get(), o.p_.get(), std::size_t(n_) * sizeof(T));
  }
  AlignedArray(AlignedArray&& o) noexcept : p_(std::move(o.p_)), n_(std::exchange(o.n_, 0)) {}
  AlignedArray& operator=(AlignedArray o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    return *this;
  }
  T* data() { return p_.get(); }
  const T* data() const { return p_.get(); }
  Index size() const { return n_; }

 private:
  struct Free {
    std::size_t align = kAlign;
    void operator()(T* p) const { ::operator delete(p, std::align_val_t(align)); }
  };
  std::unique_ptr<T, Free> p_;
  Index n_ = 0;
};

/// buf's data, reallocated (zeroed) to at least n elements if it is smaller.
template <class T>
T* grow(AlignedArray<T>& buf, Index n) {
  if (buf.size() < n) buf = AlignedArray<T>(n);
  return buf.data();
}

}  // namespace detail

}  // namespace apex::packed
