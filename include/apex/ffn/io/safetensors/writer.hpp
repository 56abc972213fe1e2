#pragma once
/// \file io/safetensors/writer.hpp
/// `write` serialises tensors to a `ByteSink`; `save` writes them to a file
/// atomically; `write_raw` / `save_raw` do the same for tensors given as
/// their stored bytes, each of its own dtype (quantized blocks as U8, say).
///
/// Exists so that the byte layout apex-ffn produces (header keys, offsets,
/// padding, data order) is decided in one place; the bytes of every saved
/// checkpoint are pinned by the tests and must not drift.

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "../../core/errors.hpp"
#include "element_bits.hpp"
#include "codec.hpp"
#include "dtype.hpp"
#include "files.hpp"
#include "header.hpp"

namespace apex {
namespace safetensors {

/// An in-memory tensor to write: `shape` row-major values at `data`.
template <class T>
struct TensorRef {
  std::string name;
  std::vector<std::uint64_t> shape;
  const T* data;
};

namespace detail {

/// One header entry: what header_json needs of a tensor.
struct EntryInfo {
  const std::string& name;
  DType dtype;
  const std::vector<std::uint64_t>& shape;
};

/// The header text for `entries`, data contiguous from offset 0 in the
/// order given, padded with spaces so that 8 + N ≡ 0 (mod 8) and the data
/// start aligned. ValueError as `write` documents. One function for every
/// writer, so a file of raw tensors has the same layout rules as any other.
inline std::string header_json(const std::vector<EntryInfo>& entries, const Metadata& metadata) {
  nlohmann::json h = nlohmann::json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  std::uint64_t offset = 0;
  for (const auto& t : entries) {
    if (t.name == "__metadata__") throw ValueError("safetensors::write: '__metadata__' is reserved, not a tensor name");
    if (h.contains(t.name)) throw ValueError("safetensors::write: duplicate tensor name " + quote_name(t.name));
    std::uint64_t numel = 1, nbytes = 0;
    for (auto s : t.shape)
      if (mul_overflows(numel, s, numel))
        throw ValueError("safetensors::write: tensor " + quote_name(t.name) + " is too large");
    if (mul_overflows(numel, dtype_size(t.dtype), nbytes))
      throw ValueError("safetensors::write: tensor " + quote_name(t.name) + " is too large");
    h[t.name] = {{"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  std::string text;
  try {
    text = h.dump();
  } catch (const nlohmann::json::exception& e) {
    throw ValueError(std::string("safetensors::write: a name or metadata string is not valid UTF-8: ") + e.what());
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

/// The header text for `tensors` stored as `dtype` (see header_json).
template <class T>
std::string header_text(const std::vector<TensorRef<T>>& tensors, DType dtype, const Metadata& metadata) {
  std::vector<EntryInfo> entries;
  entries.reserve(tensors.size());
  for (const auto& t : tensors) entries.push_back({t.name, dtype, t.shape});
  return header_json(entries, metadata);
}

/// The 8-byte length and the header text.
inline void write_header(ByteSink& out, const std::string& text) {
  unsigned char len[8];
  store_le(len, text.size(), 8);
  out.write(len, 8);
  out.write(text.data(), text.size());
}

/// Passes bytes on and counts them, so write_raw can hold each tensor's
/// producer to the size its header entry promised.
class CountingSink : public ByteSink {
 public:
  explicit CountingSink(ByteSink& out) : out_(out) {}
  void write(const void* data, std::size_t n) override {
    out_.write(data, n);
    count += n;
  }
  std::uint64_t count = 0;

 private:
  ByteSink& out_;
};

}  // namespace detail

/// Serialises `tensors` (stored as `dtype`: F32, F64 or BF16; BF16 rounds to
/// nearest even) and `metadata` to `out`, data in the order given. Throws
/// ValueError for a dtype it cannot write, a duplicate or reserved name, or
/// a name or metadata string that is not valid UTF-8.
template <class T>
void write(ByteSink& out, const std::vector<TensorRef<T>>& tensors, DType dtype, const Metadata& metadata = {}) {
  if (!is_float_convertible(dtype))
    throw ValueError(std::string("safetensors::write: cannot write dtype ") + dtype_name(dtype) +
                     "; choose F32, F64 or BF16");
  detail::write_header(out, detail::header_text(tensors, dtype, metadata));

  const std::size_t item = dtype_size(dtype);
  std::vector<unsigned char> buf(detail::kChunkBytes);
  const std::size_t per_chunk = detail::kChunkBytes / item;
  for (const auto& t : tensors) {
    std::uint64_t numel = 1;
    for (auto s : t.shape) numel *= s;
    for (std::uint64_t done = 0; done < numel;) {
      const std::size_t n = std::size_t(std::min<std::uint64_t>(numel - done, per_chunk));
      detail::encode(dtype, t.data + done, n, buf.data());
      out.write(buf.data(), n * item);
      done += n;
    }
  }
}

/// A tensor of any dtype given as its stored bytes: `bytes` writes exactly
/// numel × dtype_size bytes (row-major, little-endian) to the sink when the
/// tensor's turn comes, so a caller can produce a large tensor piecewise
/// instead of holding a copy of it. For data already laid out in memory, see
/// raw_tensor.
struct RawTensor {
  std::string name;
  DType dtype = DType::U8;
  std::vector<std::uint64_t> shape;
  std::function<void(ByteSink&)> bytes;
};

/// A RawTensor whose bytes are those at `data` (which must outlive the write).
inline RawTensor raw_tensor(std::string name, DType dtype, std::vector<std::uint64_t> shape, const void* data) {
  std::uint64_t n = dtype_size(dtype);
  for (auto s : shape) n *= s;  // an overflow is refused by the header check before any byte is written
  return {std::move(name), dtype, std::move(shape), [data, n](ByteSink& out) { out.write(data, std::size_t(n)); }};
}

/// Serialises `tensors` (each its own dtype, bytes as given) and `metadata`
/// to `out` with write's layout rules. ValueError as write, and if a
/// tensor's producer writes another number of bytes than its shape needs.
inline void write_raw(ByteSink& out, const std::vector<RawTensor>& tensors, const Metadata& metadata = {}) {
  std::vector<detail::EntryInfo> entries;
  entries.reserve(tensors.size());
  for (const auto& t : tensors) entries.push_back({t.name, t.dtype, t.shape});
  detail::write_header(out, detail::header_json(entries, metadata));
  for (const auto& t : tensors) {
    std::uint64_t want = dtype_size(t.dtype);
    for (auto s : t.shape) want *= s;  // checked by header_json
    detail::CountingSink counted(out);
    if (t.bytes) t.bytes(counted);
    if (counted.count != want)
      throw ValueError("safetensors::write_raw: tensor " + quote_name(t.name) + " wrote " +
                       std::to_string(counted.count) + " bytes, its shape " + shape_string(t.shape) + " of " +
                       dtype_name(t.dtype) + " needs " + std::to_string(want));
  }
}

/// Writes raw `tensors` to `path` atomically (see write_file_atomic and write_raw).
inline void save_raw(const std::string& path, const std::vector<RawTensor>& tensors, const Metadata& metadata = {}) {
  write_file_atomic(path, [&](ByteSink& out) { write_raw(out, tensors, metadata); });
}

/// Writes `tensors` to `path` atomically (see write_file_atomic and write).
template <class T>
void save(const std::string& path, const std::vector<TensorRef<T>>& tensors, DType dtype,
          const Metadata& metadata = {}) {
  write_file_atomic(path, [&](ByteSink& out) { write(out, tensors, dtype, metadata); });
}

}  // namespace safetensors
}  // namespace apex
