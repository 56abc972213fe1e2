#pragma once
/// \file io/safetensors/writer.hpp
/// `write` serialises tensors to a `ByteSink`; `save` writes them to a file
/// atomically.
///
/// Exists so that the byte layout apex-ffn produces (header keys, offsets,
/// padding, data order) is decided in one place; the bytes of every saved
/// checkpoint are pinned by the tests and must not drift.

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "../../core/errors.hpp"
#include "atomic_save.hpp"
#include "element_bits.hpp"
#include "bytes.hpp"
#include "codec.hpp"
#include "dtype.hpp"
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

/// The header text for `tensors` stored as `dtype`, data contiguous from
/// offset 0 in the order given, padded with spaces so that 8 + N ≡ 0 (mod 8)
/// and the data start aligned. ValueError as `write` documents.
template <class T>
std::string header_text(const std::vector<TensorRef<T>>& tensors, DType dtype, const Metadata& metadata) {
  const std::size_t item = dtype_size(dtype);
  nlohmann::json h = nlohmann::json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  std::uint64_t offset = 0;
  for (const auto& t : tensors) {
    if (t.name == "__metadata__") throw ValueError("safetensors::write: '__metadata__' is reserved, not a tensor name");
    if (h.contains(t.name)) throw ValueError("safetensors::write: duplicate tensor name " + quote_name(t.name));
    std::uint64_t numel = 1, nbytes = 0;
    for (auto s : t.shape)
      if (mul_overflows(numel, s, numel))
        throw ValueError("safetensors::write: tensor " + quote_name(t.name) + " is too large");
    if (mul_overflows(numel, item, nbytes))
      throw ValueError("safetensors::write: tensor " + quote_name(t.name) + " is too large");
    h[t.name] = {{"dtype", dtype_name(dtype)}, {"shape", t.shape}, {"data_offsets", {offset, offset + nbytes}}};
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
  const std::string text = detail::header_text(tensors, dtype, metadata);
  unsigned char len[8];
  detail::store_le(len, text.size(), 8);
  out.write(len, 8);
  out.write(text.data(), text.size());

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

/// Writes `tensors` to `path` atomically (see write_file_atomic and write).
template <class T>
void save(const std::string& path, const std::vector<TensorRef<T>>& tensors, DType dtype,
          const Metadata& metadata = {}) {
  write_file_atomic(path, [&](ByteSink& out) { write(out, tensors, dtype, metadata); });
}

}  // namespace safetensors
}  // namespace apex
