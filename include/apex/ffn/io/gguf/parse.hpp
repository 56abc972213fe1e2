#pragma once
/// \file io/gguf/parse.hpp
/// The GGUF header parser and validator: `parse(bytes, size, description,
/// limits)` reads magic, version, counts, metadata and tensor infos out of
/// a byte range and checks everything ggml's `gguf_init_from_file_impl`
/// checks (and a little more), or throws FormatError naming the problem.
///
/// Exists apart from File so that validation is written once over plain
/// bytes — a mapping or a caller's buffer — and fuzzed in memory.
///
/// Hostile counts: every count in a file is checked against the bytes that
/// remain *before* anything is sized from it (an array of n strings needs
/// at least 8n more bytes, n tensor infos at least 24n), and against
/// `Limits`, so memory stays proportional to the file and bounded; strings
/// are copied only once their bytes are known to be there.

#include <cstdint>
#include <cstring>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "../../core/errors.hpp"
#include "types.hpp"
#include "value.hpp"

namespace apex {
namespace gguf {

// GGUF is little-endian and the parser reads its integers with memcpy.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "gguf: the reader and writer need a little-endian host");

/// Bounds on what a header may ask for. The defaults pass every real model
/// (a 256k-token vocabulary with its scores, types and merges is < 1M
/// elements) and bound memory to about 100 bytes per allowed element.
struct Limits {
  std::uint64_t max_kv = 1u << 20;                 ///< metadata pairs
  std::uint64_t max_tensors = 1u << 20;            ///< tensor infos
  std::uint64_t max_string_bytes = 1ull << 30;     ///< one key, value or name (ggml's cap)
  std::uint64_t max_array_elements = 8ull << 20;   ///< summed over every array in the file
  std::uint32_t max_depth = 4;                     ///< array nesting (an array of scalars is 1)
  std::uint64_t max_tensor_name_bytes = 63;        ///< ggml's GGML_MAX_NAME less its NUL
  /// general.alignment (ggml's default is 32; a page is 4096). A larger one
  /// would make a writer of the file pad its data section by up to that much.
  std::uint32_t max_alignment = 1u << 20;
};

/// One tensor of a validated file.
struct TensorInfo {
  std::string name;
  std::vector<std::uint64_t> ne;  ///< ggml order: ne[0] = row length (innermost); 0–4 entries
  TensorType type = TensorType::F32;
  std::uint64_t offset = 0;       ///< into the data section; aligned
  std::uint64_t nbytes = 0;

  std::uint64_t row_length() const { return ne.empty() ? 1 : ne[0]; }
  /// Product of ne[1..] (1 for a vector or scalar).
  std::uint64_t rows() const {
    std::uint64_t r = 1;
    for (std::size_t i = 1; i < ne.size(); ++i) r *= ne[i];
    return r;
  }
  /// "[4096, 14336]" (ggml order).
  std::string shape_string() const {
    std::string s = "[";
    for (std::size_t i = 0; i < ne.size(); ++i) s += (i ? ", " : "") + std::to_string(ne[i]);
    return s + "]";
  }
};

/// What `parse` found.
struct Header {
  std::uint32_t version = 3;
  std::uint64_t alignment = 32;
  std::uint64_t data_offset = 0;  ///< from the start of the bytes
  std::vector<Value> metadata;    ///< in file order
  std::vector<TensorInfo> tensors;  ///< in file order (= data order)
};

inline constexpr std::uint32_t kDefaultAlignment = 32;

namespace detail {

struct Parser {
  const unsigned char* p;
  std::uint64_t size;
  const std::string& desc;
  const Limits& lim;
  std::uint64_t pos = 0;
  std::uint64_t array_elements = 0;

  FormatError fail(const std::string& what) const {
    return FormatError("gguf: " + desc + ": " + what);
  }
  std::uint64_t remaining() const { return size - pos; }
  void need(std::uint64_t n, const char* what) const {
    if (n > remaining())
      throw fail(std::string(what) + " (" + std::to_string(n) + " bytes at offset " + std::to_string(pos) +
                 ") is past the end of the " + std::to_string(size) + "-byte file");
  }
  template <class T>
  T scalar(const char* what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, p + pos, sizeof(T));  // a little-endian host (static_assert above)
    pos += sizeof(T);
    return v;
  }
  std::string string(const char* what, std::uint64_t max) {
    const auto n = scalar<std::uint64_t>(what);
    if (n > max)
      throw fail(std::string(what) + " at offset " + std::to_string(pos - 8) + " has length " + std::to_string(n) +
                 ", above the limit of " + std::to_string(max));
    need(n, what);
    std::string s(reinterpret_cast<const char*>(p + pos), std::size_t(n));
    pos += n;
    return s;
  }

  Value value(ValueType t, const std::string& key, std::uint32_t depth);
  Value array(const std::string& key, std::uint32_t depth);
  void kv(Header& h, std::unordered_set<std::string>& keys);
  TensorInfo tensor(std::unordered_set<std::string>& names);
  void alignment(Header& h) const;
  void layout(Header& h) const;
};

inline Value Parser::value(ValueType t, const std::string& key, std::uint32_t depth) {
  Value v;
  v.type_ = t;
  switch (t) {
    case ValueType::u8: case ValueType::i8: v.bits_ = scalar<std::uint8_t>("a value"); break;
    case ValueType::u16: case ValueType::i16: v.bits_ = scalar<std::uint16_t>("a value"); break;
    case ValueType::u32: case ValueType::i32: case ValueType::f32: v.bits_ = scalar<std::uint32_t>("a value"); break;
    case ValueType::u64: case ValueType::i64: case ValueType::f64: v.bits_ = scalar<std::uint64_t>("a value"); break;
    case ValueType::boolean:
      v.bits_ = scalar<std::uint8_t>("a value");
      // The spec: "0 is false and 1 is true. Anything else is invalid".
      if (v.bits_ > 1) throw fail("key '" + key + "' has a bool of byte value " + std::to_string(v.bits_));
      break;
    case ValueType::string: v.str_ = string("a string value", lim.max_string_bytes); break;
    case ValueType::array: return array(key, depth + 1);
  }
  // Sign-extend the signed types so bits() is the integer itself.
  if (t == ValueType::i8) v.bits_ = std::uint64_t(std::int64_t(std::int8_t(v.bits_)));
  if (t == ValueType::i16) v.bits_ = std::uint64_t(std::int64_t(std::int16_t(v.bits_)));
  if (t == ValueType::i32) v.bits_ = std::uint64_t(std::int64_t(std::int32_t(v.bits_)));
  return v;
}

inline Value Parser::array(const std::string& key, std::uint32_t depth) {
  if (depth > lim.max_depth)
    throw fail("key '" + key + "' nests arrays deeper than the limit of " + std::to_string(lim.max_depth));
  const auto et = scalar<std::uint32_t>("an array's element type");
  if (!is_value_type(et)) throw fail("key '" + key + "' is an array of unknown value type " + std::to_string(et));
  const auto n = scalar<std::uint64_t>("an array's length");
  const auto type = static_cast<ValueType>(et);
  // Each element takes at least this many bytes, so n is bounded by the file.
  const std::uint64_t least = type == ValueType::string ? 8 : type == ValueType::array ? 12 : value_type_size(type);
  if (n > remaining() / least)
    throw fail("key '" + key + "' is an array of " + std::to_string(n) + " " + value_type_name(type) +
               " elements, more than the " + std::to_string(remaining()) + " remaining bytes can hold");
  if (n > lim.max_array_elements - array_elements)
    throw fail("key '" + key + "' brings the file's array elements above the limit of " +
               std::to_string(lim.max_array_elements));
  array_elements += n;
  Value v;
  v.type_ = ValueType::array;
  v.array_type_ = type;
  v.items_.reserve(std::size_t(n));  // bounded just above
  for (std::uint64_t i = 0; i < n; ++i) v.items_.push_back(value(type, key, depth));
  return v;
}

inline void Parser::kv(Header& h, std::unordered_set<std::string>& keys) {
  std::string key = string("a metadata key", lim.max_string_bytes);
  if (key.empty()) throw fail("metadata key " + std::to_string(h.metadata.size()) + " is empty");
  if (!keys.insert(key).second) throw fail("metadata key '" + key + "' appears twice");
  const auto t = scalar<std::uint32_t>("a value type");
  if (!is_value_type(t)) throw fail("key '" + key + "' has unknown value type " + std::to_string(t));
  Value v = value(static_cast<ValueType>(t), key, 0);
  v.key_ = std::move(key);
  h.metadata.push_back(std::move(v));
}

inline void Parser::alignment(Header& h) const {
  for (const Value& v : h.metadata) {
    if (v.key_ != "general.alignment") continue;
    if (v.type_ != ValueType::u32)
      throw fail(std::string("key 'general.alignment' must be u32, is ") + value_type_name(v.type_));
    if (v.bits_ == 0 || (v.bits_ & (v.bits_ - 1)) != 0)
      throw fail("alignment " + std::to_string(v.bits_) + " is not a power of 2");
    if (v.bits_ > lim.max_alignment)
      throw fail("alignment " + std::to_string(v.bits_) + " exceeds the limit of " + std::to_string(lim.max_alignment) +
                 " (Limits::max_alignment)");
    h.alignment = v.bits_;
  }
}

inline TensorInfo Parser::tensor(std::unordered_set<std::string>& names) {
  TensorInfo t;
  t.name = string("a tensor name", lim.max_string_bytes);
  // ggml does not check this, but a tensor no name can find is no tensor
  // (and gguf::Writer could not write it back).
  if (t.name.empty()) throw fail("tensor " + std::to_string(names.size()) + " has an empty name");
  if (t.name.size() > lim.max_tensor_name_bytes)
    throw fail("tensor name '" + t.name.substr(0, 80) + "' has " + std::to_string(t.name.size()) +
               " bytes, above the limit of " + std::to_string(lim.max_tensor_name_bytes));
  if (!names.insert(t.name).second) throw fail("tensor '" + t.name + "' appears twice");
  const auto n_dims = scalar<std::uint32_t>("a tensor's dimension count");
  if (n_dims > 4) throw fail("tensor '" + t.name + "' has " + std::to_string(n_dims) + " dimensions, at most 4");
  for (std::uint32_t j = 0; j < n_dims; ++j) t.ne.push_back(scalar<std::uint64_t>("a tensor extent"));
  const auto type = scalar<std::uint32_t>("a tensor type");
  if (!is_known(type)) throw fail("tensor '" + t.name + "' has unknown ggml type " + std::to_string(type));
  t.type = static_cast<TensorType>(type);
  try {
    t.nbytes = tensor_nbytes(t.type, t.ne, "tensor '" + t.name + "' " + t.shape_string());
  } catch (const FormatError& e) {
    throw fail(std::string(e.what()).substr(6));
  }
  t.offset = scalar<std::uint64_t>("a tensor offset");
  return t;
}

/// The data section and every tensor's place in it, as ggml lays them out:
/// the section starts at the first multiple of the alignment after the
/// infos, and each tensor's offset is the running sum of its predecessors'
/// sizes, each padded to the alignment. The tensor's own bytes must be in
/// the file; the padding after the last one need not be (llama.cpp's
/// mapped loader asks no more).
inline void Parser::layout(Header& h) const {
  const std::uint64_t a = h.alignment;
  const auto align_up = [a](std::uint64_t x, bool& ok) {
    ok = x <= UINT64_MAX - (a - 1);
    return ok ? (x + a - 1) / a * a : 0;
  };
  bool ok = true;
  h.data_offset = pos;
  if (!h.tensors.empty()) {
    h.data_offset = align_up(pos, ok);
    if (!ok || h.data_offset > size)
      throw fail("the data section (aligned to " + std::to_string(a) + ") would start past the end of the " +
                 std::to_string(size) + "-byte file");
  }
  std::uint64_t expected = 0;
  for (const TensorInfo& t : h.tensors) {
    if (t.offset != expected) {
      const char* why = t.offset % a != 0 ? "is not a multiple of the alignment"
                        : t.offset < expected ? "overlaps the tensor before it" : "leaves a gap after the tensor before it";
      throw fail("tensor '" + t.name + "' has offset " + std::to_string(t.offset) + ", expected " +
                 std::to_string(expected) + ": it " + why + " (alignment " + std::to_string(a) + ")");
    }
    const std::uint64_t room = size - h.data_offset;
    if (t.offset > room || t.nbytes > room - t.offset)
      throw fail("tensor '" + t.name + "' (" + std::to_string(t.nbytes) + " bytes at data offset " +
                 std::to_string(t.offset) + ") extends past the end of the " + std::to_string(size) + "-byte file");
    expected = align_up(t.offset + t.nbytes, ok);  // cannot overflow: bounded by the file size
    if (!ok) throw fail("tensor '" + t.name + "' ends beyond 2^64 once padded");
  }
}

}  // namespace detail

/// Parses and validates the GGUF file in `[data, data + size)`; `description`
/// ("file 'x.gguf'", "memory buffer") names it in messages. Versions 2 and 3
/// are accepted (the same layout, 64-bit counts); version 1 (32-bit counts),
/// later versions and big-endian files are refused with a message saying so.
inline Header parse(const unsigned char* data, std::uint64_t size, const std::string& description,
                    const Limits& limits = {}) {
  detail::Parser ps{data, size, description, limits};
  Header h;
  ps.need(4, "the magic");
  if (std::memcmp(data, "GGUF", 4) != 0) {
    std::string got;
    for (int i = 0; i < 4; ++i) got += (data[i] >= 32 && data[i] < 127) ? char(data[i]) : '?';
    throw ps.fail("magic is '" + got + "', expected 'GGUF'");
  }
  ps.pos = 4;
  h.version = ps.scalar<std::uint32_t>("the version");
  if (h.version != 0 && (h.version & 0xFFFFu) == 0)
    throw ps.fail("version " + std::to_string(h.version) +
                  " reads as a byte-swapped small number: the file is big-endian, which this reader does not support");
  if (h.version == 1) throw ps.fail("GGUF version 1 (32-bit counts) is not supported; convert the file to version 3");
  if (h.version != 2 && h.version != 3)
    throw ps.fail("GGUF version " + std::to_string(h.version) + " is not supported (versions 2 and 3 are)");
  const auto n_tensors = ps.scalar<std::uint64_t>("the tensor count");
  const auto n_kv = ps.scalar<std::uint64_t>("the metadata count");
  if (n_kv > limits.max_kv)
    throw ps.fail(std::to_string(n_kv) + " metadata pairs, above the limit of " + std::to_string(limits.max_kv));
  if (n_tensors > limits.max_tensors)
    throw ps.fail(std::to_string(n_tensors) + " tensors, above the limit of " + std::to_string(limits.max_tensors));
  // The least bytes a pair (8-byte key length, 1-byte key, type, 1-byte
  // value) and an info (name length, n_dims, type, offset) take.
  if (n_kv > ps.remaining() / 14 || n_tensors > (ps.remaining() - 14 * n_kv) / 24)
    throw ps.fail(std::to_string(n_kv) + " metadata pairs and " + std::to_string(n_tensors) +
                  " tensors cannot fit in the " + std::to_string(ps.remaining()) + " bytes that follow");
  std::unordered_set<std::string> seen;
  h.metadata.reserve(std::size_t(n_kv));
  for (std::uint64_t i = 0; i < n_kv; ++i) ps.kv(h, seen);
  ps.alignment(h);
  seen.clear();
  h.tensors.reserve(std::size_t(n_tensors));
  for (std::uint64_t i = 0; i < n_tensors; ++i) h.tensors.push_back(ps.tensor(seen));
  ps.layout(h);
  return h;
}

}  // namespace gguf
}  // namespace apex
