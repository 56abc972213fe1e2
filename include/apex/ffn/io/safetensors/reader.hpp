#pragma once
/// \file io/safetensors/reader.hpp
/// `Reader`: a validated file or memory buffer and typed access to its
/// tensors.
///
/// Exists as the one entry point for reading: it validates the whole header
/// when constructed (io/safetensors/parse.hpp), so every later read is of a
/// byte range already proven to lie inside the source, and it converts
/// through a bounded buffer, so memory never exceeds what the validated
/// header asks for.

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../../core/errors.hpp"
#include "../../core/types.hpp"
#include "../file/mapped_file.hpp"
#include "codec.hpp"
#include "header.hpp"
#include "files.hpp"
#include "parse.hpp"

namespace apex {
namespace safetensors {

/// A validated safetensors file (or buffer) and typed access to its tensors.
class Reader {
 public:
  /// Opens and validates `path`. Throws FormatError (also, at once, for a
  /// path that is not a regular file: a FIFO, device, directory, socket).
  explicit Reader(const std::string& path, const Limits& limits = {})
      : Reader(std::make_unique<FileSource>(path), limits) {}
  explicit Reader(std::unique_ptr<ByteSource> src, const Limits& limits = {})
      : src_(std::move(src)), header_(read_header(*src_, limits)) {}
  /// Validates `size` bytes at `data`, which must outlive the reader.
  static Reader from_memory(const void* data, std::size_t size, const Limits& limits = {}) {
    return Reader(std::make_unique<MemorySource>(data, size), limits);
  }

  /// Maps `path` read-only (io/file/mapped_file.hpp) and validates it: the
  /// header is read out of the mapping, tensors are not read at all until
  /// asked for, and mapped_bytes() hands out a tensor's bytes without a copy.
  /// FormatError as the constructor (a FIFO or device at once).
  static Reader map(const std::string& path, const Limits& limits = {}) {
    return Reader(std::make_unique<io::MappedSource>("safetensors", path), limits);
  }

  /// The mapping under this reader (null unless it was opened by map() or
  /// over an io::MappedSource).
  std::shared_ptr<const io::MappedFile> mapping() const {
    const auto* m = dynamic_cast<const io::MappedSource*>(src_.get());
    return m ? m->file() : nullptr;
  }
  /// The stored bytes of `t` inside the mapping, without a copy (valid while
  /// the mapping lives: hold mapping()); nullptr for a reader that does not
  /// read through a mapping (the pread and memory sources).
  const unsigned char* mapped_bytes(const TensorInfo& t) const {
    const auto* m = dynamic_cast<const io::MappedSource*>(src_.get());
    return m ? m->bytes(header_.data_offset() + t.begin, t.nbytes()) : nullptr;
  }

  const Header& header() const { return header_; }
  const Metadata& metadata() const { return header_.metadata; }
  const std::vector<TensorInfo>& tensors() const { return header_.tensors; }
  const ByteSource& source() const { return *src_; }

  /// The entry named `name`; FormatError if the file has none.
  const TensorInfo& at(std::string_view name) const {
    if (const TensorInfo* t = header_.find(name)) return *t;
    throw FormatError("safetensors: " + src_->description() + " has no tensor " + quote_name(name));
  }

  /// Converts the `t.numel()` elements of `t` (F32, F64 or BF16) into `out`.
  /// F64 → float rounds to nearest even; the others are exact.
  template <class T>
  void read(const TensorInfo& t, T* out) const {
    if (!is_float_convertible(t.dtype))
      throw FormatError("safetensors: tensor " + quote_name(t.name) + " in " + src_->description() + " is " +
                        dtype_name(t.dtype) + "; only F32, F64 and BF16 convert to floating point");
    const std::size_t item = dtype_size(t.dtype);
    std::vector<unsigned char> buf(std::size_t(std::min<std::uint64_t>(t.nbytes(), detail::kChunkBytes)));
    for (std::uint64_t done = 0; done < t.nbytes();) {
      const std::size_t n = std::size_t(std::min<std::uint64_t>(t.nbytes() - done, detail::kChunkBytes));
      src_->read(header_.data_offset() + t.begin + done, buf.data(), n);
      detail::decode(t.dtype, buf.data(), n / item, out + done / item);
      done += n;
    }
  }

  /// Copies the `t.nbytes()` stored bytes of `t` (any dtype) into `out`
  /// unconverted: for data the library keeps in its file form, such as
  /// quantized blocks held as U8. The range was proven inside the source
  /// when the header was validated; the source checks it again on the read.
  void read_bytes(const TensorInfo& t, void* out) const {
    src_->read(header_.data_offset() + t.begin, out, std::size_t(t.nbytes()));
  }

  /// The tensor `name` of rank ≤ 2 as a matrix: `[r, c]` → r × c, `[n]` →
  /// 1 × n, `[]` → 1 × 1. ShapeError for higher ranks.
  template <class T>
  Matrix<T> matrix(std::string_view name) const {
    const TensorInfo& t = at(name);
    if (t.shape.size() > 2)
      throw ShapeError("safetensors: tensor " + quote_name(name) + " has shape " + shape_string(t.shape) +
                       ", expected rank 0, 1 or 2");
    const Index rows = t.shape.size() == 2 ? Index(t.shape[0]) : 1;
    const Index cols = t.shape.empty() ? 1 : Index(t.shape.back());
    Matrix<T> m(rows, cols);
    read(t, m.data());
    return m;
  }

 private:
  std::unique_ptr<ByteSource> src_;
  Header header_;
};

}  // namespace safetensors
}  // namespace apex
