#pragma once
/// \file kernels/panel_heap.hpp
/// `PanelArray`: the owned bytes of a panel matrix (kernels/panel_bytes.hpp).
/// Arrays of 64 KiB or more are carved back to back out of 2 MiB-aligned
/// chunks offered to transparent huge pages; smaller ones are AlignedArrays.
///
/// Why: a decode step streams its experts' panels once, from DRAM. An
/// expert's matrix is often under 2 MiB (Qwen3-30B-A3B in Q4_K: gate and up
/// codes 1.5 MiB, down 0.75 MiB), and an array of its own under 2 MiB cannot
/// sit on a huge page (kernels/aligned_array.hpp offers only arrays of 2 MiB
/// or more), so each 4 KiB of weights cost a TLB miss and a new page for the
/// hardware prefetcher. Packed into chunks they share huge pages: one
/// Qwen3-30B-A3B MoE decode step, cold caches, Q4_K 1.23–1.35×, Q8_0
/// 1.05–1.13×, Q6_K 1.04–1.10× faster (docs/performance.md, "K-quant decode,
/// one prefetch a line, and panels on huge pages").
///
/// Lifetime: each array holds its chunk (shared ownership); a chunk is
/// unmapped when its last array goes. Space is handed out once, never
/// reused: fresh mappings read as zeros, so arrays need no clearing, and a
/// chunk's untouched tail is never resident (at most the one huge page it
/// ends in). An array released while its chunk lives gives its whole 4 KiB
/// pages back (`MADV_DONTNEED`, which splits the huge pages it touches), so
/// what stays resident is at most the two pages at its ends. Right for
/// weights, packed once and kept; scratch stays on AlignedArray.
///
/// Address-sanitizer builds and systems without `mmap` keep every array on
/// the ordinary heap, so the sanitizer still sees each array's bounds
/// (`-DAPEX_PANEL_HEAP=0` does the same anywhere). Under strict overcommit
/// (`vm.overcommit_memory=2`) each chunk is charged whole when mapped; an
/// array whose chunk cannot be mapped (that charge, an address-space limit,
/// the map count) goes to the ordinary heap, so the heap never fails an
/// allocation the ordinary heap would have served.
///
/// Fork: the heap's lock is taken around `fork` (`pthread_atfork`), so a
/// child forked while another thread takes an array (a data loader's
/// workers) finds it free, as the C library's malloc does.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <tuple>
#include <utility>

#include "aligned_array.hpp"

#if defined(__linux__)
#include <pthread.h>
#include <sys/mman.h>
#endif

#if !defined(APEX_PANEL_HEAP) && defined(__SANITIZE_ADDRESS__)
#define APEX_PANEL_HEAP 0
#endif
#if !defined(APEX_PANEL_HEAP) && defined(__has_feature)
#if __has_feature(address_sanitizer)
#define APEX_PANEL_HEAP 0
#endif
#endif
#if !defined(APEX_PANEL_HEAP)
#if defined(__linux__) && defined(MADV_HUGEPAGE)
#define APEX_PANEL_HEAP 1
#else
#define APEX_PANEL_HEAP 0
#endif
#endif

namespace apex::packed::detail {

#if APEX_PANEL_HEAP
/// One anonymous mapping on a 2 MiB boundary, advised for huge pages.
class HugeChunk {
 public:
  static constexpr std::size_t kHugePage = AlignedArray<std::byte>::kHugePage;
  /// bytes rounded up to whole huge pages; std::bad_alloc if the mapping fails.
  explicit HugeChunk(std::size_t bytes) : size_(rounded(bytes)) {
    // map a huge page more than asked, then trim to the 2 MiB boundary inside
    void* raw = ::mmap(nullptr, size_ + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED) throw std::bad_alloc();
    const std::uintptr_t start = reinterpret_cast<std::uintptr_t>(raw);
    const std::uintptr_t base = (start + kHugePage - 1) / kHugePage * kHugePage;
    if (base > start) ::munmap(raw, base - start);
    if (const std::uintptr_t tail = start + kHugePage - base; tail > 0)
      ::munmap(reinterpret_cast<void*>(base + size_), tail);
    base_ = reinterpret_cast<std::byte*>(base);
    ::madvise(base_, size_, MADV_HUGEPAGE);  // advice only: a no-op where THP is off
  }
  HugeChunk(const HugeChunk&) = delete;
  HugeChunk& operator=(const HugeChunk&) = delete;
  ~HugeChunk() { ::munmap(base_, size_); }
  std::byte* base() const { return base_; }
  std::size_t size() const { return size_; }

 private:
  static std::size_t rounded(std::size_t bytes) {
    if (bytes == 0 || bytes > (std::size_t(1) << 62)) throw std::bad_alloc();  // no wrap below
    return (bytes + kHugePage - 1) / kHugePage * kHugePage;
  }
  std::size_t size_;
  std::byte* base_ = nullptr;
};

/// The process's chunks being filled: one at a time, handed out in order.
class PanelHeap {
 public:
  /// Virtual size of a chunk. Resident is what its arrays touch, plus at
  /// most the rest of the huge page the last one ends in: ≤ 0.8 % of a full
  /// chunk (64 MiB chunks left 1.4–3.4 % over the weights of 32 Qwen3-30B-A3B
  /// experts; 256 MiB, 0.0–1.6 % for 32 and 128).
  static constexpr std::size_t kChunkBytes = std::size_t(256) << 20;
  /// Arrays above this get a chunk of their own.
  static constexpr std::size_t kOwnChunkBytes = kChunkBytes / 4;

  static PanelHeap& instance() {
    static PanelHeap& heap = *new PanelHeap;  // never destroyed: arrays may be made during exit
    return heap;
  }
  /// `bytes` (a multiple of 64) in a chunk, and the chunk that holds them.
  std::pair<std::shared_ptr<HugeChunk>, std::byte*> take(std::size_t bytes) {
    if (bytes > kOwnChunkBytes) {
      auto own = std::make_shared<HugeChunk>(bytes);
      return {own, own->base()};
    }
    std::lock_guard<std::mutex> lock(mutex_);
    std::shared_ptr<HugeChunk> chunk = current_.lock();  // expired once its arrays are all gone
    if (!chunk || used_ + bytes > chunk->size()) {
      chunk = std::make_shared<HugeChunk>(kChunkBytes);
      current_ = chunk;
      used_ = 0;
    }
    std::byte* p = chunk->base() + used_;
    used_ += bytes;
    return {std::move(chunk), p};
  }

 private:
  PanelHeap() {
    // Held across fork, released on both sides: the child's copy is free
    // whatever another thread of the parent was doing.
    ::pthread_atfork([] { instance().mutex_.lock(); }, [] { instance().mutex_.unlock(); },
                     [] { instance().mutex_.unlock(); });
  }
  std::mutex mutex_;
  std::weak_ptr<HugeChunk> current_;  // weak: the heap alone never keeps a chunk mapped
  std::size_t used_ = 0;
};

/// The heap is made before main, not on first use: a fork while another
/// thread was making it left the child waiting forever on the half-done
/// initialisation of instance()'s static (a test that forks while a thread
/// takes its first arrays hung in 7 of 20 runs).
inline PanelHeap& panel_heap_made_before_main = PanelHeap::instance();
#endif

/// Zeroed, 64-byte aligned bytes of one panel array (see the file comment).
class PanelArray {
 public:
  /// Arrays from this size on go to the chunks.
  static constexpr std::size_t kChunkedBytes = std::size_t(64) << 10;

  PanelArray() = default;
  /// n zeroed bytes; std::bad_alloc for n < 0 (as AlignedArray).
  explicit PanelArray(Index n) : n_(n) {
    if (n < 0) throw std::bad_alloc();
#if APEX_PANEL_HEAP
    const std::size_t bytes = (std::size_t(n) + 63) / 64 * 64;
    if (bytes >= kChunkedBytes) {
      try {
        std::tie(chunk_, p_) = PanelHeap::instance().take(bytes);
        return;
      } catch (const std::bad_alloc&) {  // no chunk could be mapped: the ordinary heap may still serve n
      }
    }
#endif
    small_ = AlignedArray<std::byte>(n);
  }
  ~PanelArray() { give_back(); }
  PanelArray(const PanelArray& o) : PanelArray(o.n_) {
    if (n_) std::memcpy(data(), o.data(), std::size_t(n_));
  }
  PanelArray(PanelArray&& o) noexcept
      : small_(std::move(o.small_)), chunk_(std::move(o.chunk_)), p_(std::exchange(o.p_, nullptr)),
        n_(std::exchange(o.n_, 0)) {}
  PanelArray& operator=(PanelArray o) noexcept {
    swap(o);
    return *this;
  }
  std::byte* data() { return chunked() ? p_ : small_.data(); }
  const std::byte* data() const { return chunked() ? p_ : small_.data(); }
  Index size() const { return n_; }
  /// True if the bytes are in a chunk (on huge pages where the system gives them).
  bool chunked() const { return p_ != nullptr; }
  /// The chunk holding the bytes (null if not chunked): arrays in one chunk lie back to back.
  const void* chunk() const { return chunk_.get(); }

 private:
  /// A chunked array's whole 4 KiB pages back to the system while others
  /// hold its chunk (they read as zeros again; the space is never handed
  /// out twice). The last holder unmaps the chunk instead.
  void give_back() noexcept {
#if APEX_PANEL_HEAP
    if (!p_ || chunk_.use_count() <= 1) return;
    constexpr std::uintptr_t page = 4096;
    const std::uintptr_t begin = (reinterpret_cast<std::uintptr_t>(p_) + page - 1) / page * page;
    const std::uintptr_t end = (reinterpret_cast<std::uintptr_t>(p_) + std::size_t(n_)) / page * page;
    if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
#endif
  }
  void swap(PanelArray& o) noexcept {
    std::swap(small_, o.small_);
    std::swap(chunk_, o.chunk_);
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
  }
  AlignedArray<std::byte> small_;
  std::shared_ptr<void> chunk_;  // the HugeChunk holding p_ (one layout whatever APEX_PANEL_HEAP says)
  std::byte* p_ = nullptr;       // into *chunk_, when chunked
  Index n_ = 0;
};

}  // namespace apex::packed::detail
