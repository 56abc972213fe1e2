#pragma once
/// \file core/workspace.hpp
/// Per-thread scratch matrices that keep their memory between calls.
///
/// A training step allocates the same large temporaries every time (sorted
/// copies of the batch, the gate/value gradients of every expert block). A
/// fresh buffer larger than glibc's mmap threshold (32 MB at most) is mapped
/// from the kernel and faulted in page by page on first touch, and the pages
/// are returned when it is freed, so every call pays the faults again — on a
/// virtual machine several percent of a layer's time. A workspace grows to the
/// largest size asked of it on its thread and is then reused.
///
/// Each `Tag` names one use; two workspaces that are alive at the same time
/// must have different tags. A workspace belongs to the calling thread, so
/// concurrent calls from different threads never share one. Views stay valid
/// until the same tag is requested again on the same thread.

#include <vector>

#include "types.hpp"

namespace apex::detail {

/// rows × cols row-major scratch of the calling thread for use `Tag`;
/// contents are unspecified.
template <class T, class Tag>
Eigen::Map<Matrix<T>, Eigen::AlignedMax> thread_workspace(Index rows, Index cols) {
  thread_local std::vector<T, Eigen::aligned_allocator<T>> storage;
  const auto size = static_cast<std::size_t>(rows * cols);
  if (storage.size() < size) {
    storage.clear();  // no copy of stale contents on growth
    storage.shrink_to_fit();
    storage.resize(size);
  }
  return Eigen::Map<Matrix<T>, Eigen::AlignedMax>(storage.data(), rows, cols);
}

}  // namespace apex::detail
