#pragma once
/// \file kernels/panel_bytes.hpp
/// `PanelBytes`: the bytes of a panel matrix's codes or scales, either owned
/// (zeroed, 64-byte aligned, large arrays on huge pages: kernels/panel_heap.hpp) or a
/// read-only view of 64-byte aligned bytes inside a memory mapping
/// (core/mapped_bytes.hpp: a mapped file, io/file/mapped_file.hpp), kept
/// alive by a shared pointer to the mapping. The kernels name no file type.
///
/// Exists so that a layer saved in the library's panel order (the pack-once
/// file, inference/files/pack_once/file.hpp) computes from the page cache
/// without a copy: a kernel asks for `data()` and cannot tell the two kinds
/// apart, so every kernel path runs unchanged on mapped weights.
///
/// Copies: an owned array is copied; a view is shared (the copy points at
/// the same mapped bytes and holds the mapping too), which is cheap and
/// correct since nothing writes through a view. Writes: `mutable_data` on a
/// view is a ConfigError naming the file — the mapping is PROT_READ, and a
/// silent copy-on-write would turn a 0-byte load into a full copy behind the
/// user's back. `to_owned()` makes the copy explicitly.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "../core/errors.hpp"
#include "../core/types.hpp"
#include "../core/mapped_bytes.hpp"
#include "panel_heap.hpp"

namespace apex::packed {

/// Owned or mapped bytes of one panel array (see the file comment).
class PanelBytes {
 public:
  static constexpr std::size_t kAlign = detail::AlignedArray<std::byte>::kAlign;

  PanelBytes() = default;
  /// n zeroed, owned bytes.
  explicit PanelBytes(Index n) : owned_(n), n_(n) {}

  /// The n bytes at `offset` of the mapping `file`, without a copy.
  /// FormatError naming `where`, `what` and the file if they are not all
  /// inside it or do not start on a 64-byte boundary (the kernels' aligned
  /// loads need one).
  static PanelBytes view(std::shared_ptr<const MappedBytes> file, std::uint64_t offset, Index n,
                         const std::string& where, const std::string& what) {
    if (!file) throw ConfigError(where + ": no mapping given for " + what);
    const std::uint64_t size = file->size();
    if (n < 0 || offset > size || std::uint64_t(n) > size - offset)
      throw FormatError(where + ": " + what + " (" + std::to_string(n) + " bytes at offset " + std::to_string(offset) +
                        ") is past the end of the " + std::to_string(size) + "-byte " + file->description());
    const unsigned char* p = file->data() + offset;
    if (n > 0 && reinterpret_cast<std::uintptr_t>(p) % kAlign != 0)
      throw FormatError(where + ": " + what + " starts at offset " + std::to_string(offset) + " of " +
                        file->description() + ", which is not on a " + std::to_string(kAlign) +
                        "-byte boundary; the kernels need aligned panels");
    PanelBytes out;
    out.view_ = reinterpret_cast<const std::byte*>(p);
    out.n_ = n;
    out.file_ = std::move(file);
    return out;
  }

  const std::byte* data() const { return file_ ? view_ : owned_.data(); }
  Index size() const { return n_; }
  /// True for a view into a mapping.
  bool mapped() const { return file_ != nullptr; }
  /// The mapping a view holds (null for owned bytes).
  const std::shared_ptr<const MappedBytes>& mapping() const { return file_; }

  /// The bytes for writing: owned only. ConfigError naming `where` for a
  /// view (read-only; call to_owned() first if a copy is what you want).
  std::byte* mutable_data(const char* where) {
    if (file_)
      throw ConfigError(std::string(where) + ": the weights are a read-only view of the mapped " +
                        file_->description() + "; copy them to owned storage (to_owned()) before changing them");
    return owned_.data();
  }

  /// Owned bytes equal to these (a copy out of the mapping for a view).
  PanelBytes to_owned() const {
    if (!file_) return *this;
    PanelBytes out(n_);
    if (n_) std::memcpy(out.owned_.data(), view_, std::size_t(n_));
    return out;
  }

 private:
  detail::PanelArray owned_;
  const std::byte* view_ = nullptr;  // into *file_, when mapped
  Index n_ = 0;
  std::shared_ptr<const MappedBytes> file_;
};

}  // namespace apex::packed
