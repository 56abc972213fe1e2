#pragma once
/// \file io/gguf/writer.hpp
/// `Writer`: builds a GGUF v3 file — metadata in the order it is set,
/// tensors in the order they are added, laid out as ggml lays them out —
/// and writes it to a ByteSink or saves it atomically.
///
/// Exists so that the library can export what it packs in a form llama.cpp
/// and gguf-py read, and so that the tests can make any file they need.
/// It refuses at the call what the reader would refuse in the file
/// (duplicate keys or names, a byte count that does not match the type and
/// shape, a name ggml cannot hold), so a saved file always opens.
///
/// Metadata: `set(key, Value)` takes any value (Value::of, Value::array_of,
/// Value::array for nested arrays); the typed setters set_u8 … set_f64,
/// set_bool, set_string and set_array<T> are shorthands for it. An
/// alignment other than 32 is written as `general.alignment` (u32) first,
/// unless the caller sets that key itself (it must then equal the
/// alignment, as u32).

#include <cstdint>
#include <cstring>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "../../core/errors.hpp"
#include "../file/atomic_save.hpp"
#include "../file/bytes.hpp"
#include "parse.hpp"
#include "types.hpp"
#include "value.hpp"

namespace apex {
namespace gguf {

class Writer {
 public:
  /// ConfigError unless `alignment` is a power of two.
  explicit Writer(std::uint32_t alignment = kDefaultAlignment) : alignment_(alignment) {
    if (alignment == 0 || (alignment & (alignment - 1)) != 0)
      throw ConfigError("gguf::Writer: alignment " + std::to_string(alignment) + " is not a power of 2");
  }

  /// Adds `key` with `value` (its own key, if any, is replaced).
  /// ConfigError for an empty or duplicate key, or a general.alignment that
  /// is not this writer's alignment as u32.
  void set(std::string key, Value value) {
    if (key.empty()) throw ConfigError("gguf::Writer::set: the key is empty");
    if (!keys_.insert(key).second) throw ConfigError("gguf::Writer::set: key '" + key + "' is set twice");
    if (key == "general.alignment" && (value.type() != ValueType::u32 || value.bits() != alignment_)) {
      keys_.erase(key);
      throw ConfigError("gguf::Writer::set: 'general.alignment' must be u32 " + std::to_string(alignment_) +
                        ", this writer's alignment");
    }
    value.key_ = std::move(key);
    metadata_.push_back(std::move(value));
  }
  void set_u8(std::string k, std::uint8_t v) { set(std::move(k), Value::of(v)); }
  void set_i8(std::string k, std::int8_t v) { set(std::move(k), Value::of(v)); }
  void set_u16(std::string k, std::uint16_t v) { set(std::move(k), Value::of(v)); }
  void set_i16(std::string k, std::int16_t v) { set(std::move(k), Value::of(v)); }
  void set_u32(std::string k, std::uint32_t v) { set(std::move(k), Value::of(v)); }
  void set_i32(std::string k, std::int32_t v) { set(std::move(k), Value::of(v)); }
  void set_u64(std::string k, std::uint64_t v) { set(std::move(k), Value::of(v)); }
  void set_i64(std::string k, std::int64_t v) { set(std::move(k), Value::of(v)); }
  void set_f32(std::string k, float v) { set(std::move(k), Value::of(v)); }
  void set_f64(std::string k, double v) { set(std::move(k), Value::of(v)); }
  void set_bool(std::string k, bool v) { set(std::move(k), Value::of(v)); }
  void set_string(std::string k, std::string v) { set(std::move(k), Value::of(std::move(v))); }
  /// An array of `T` (one of the scalar C++ types, or std::string).
  template <class T>
  void set_array(std::string k, const std::vector<T>& v) {
    set(std::move(k), Value::array_of(v));
  }

  /// Adds a tensor of `type` with extents `ne` (ggml order: ne[0] is the
  /// row length) whose `nbytes` bytes start at `bytes`; they are not copied
  /// and must stay valid until the last write/save. ShapeError if `nbytes`
  /// is not what the type and shape take or the shape is one ggml refuses;
  /// ConfigError for a duplicate, empty or over-long name.
  void add_tensor(std::string name, TensorType type, std::vector<std::uint64_t> ne, const void* bytes,
                  std::size_t nbytes) {
    const std::string where = "gguf::Writer::add_tensor: tensor '" + name + "'";
    if (name.empty()) throw ConfigError("gguf::Writer::add_tensor: the name is empty");
    if (name.size() > Limits{}.max_tensor_name_bytes)
      throw ConfigError(where + " has a name of " + std::to_string(name.size()) + " bytes, ggml holds at most " +
                        std::to_string(Limits{}.max_tensor_name_bytes));
    if (ne.size() > 4) throw ShapeError(where + " has " + std::to_string(ne.size()) + " dimensions, at most 4");
    if (!is_known(static_cast<std::uint32_t>(type)))
      throw ConfigError(where + " has type id " + std::to_string(std::uint32_t(type)) + ", not a ggml type");
    if (names_.count(name)) throw ConfigError(where + " is added twice");
    std::uint64_t want = 0;
    try {
      TensorInfo probe;
      probe.ne = ne;
      want = tensor_nbytes(type, ne, "tensor '" + name + "' " + probe.shape_string());
    } catch (const FormatError& e) {
      throw ShapeError("gguf::Writer::add_tensor: " + std::string(e.what()).substr(6));
    }
    if (want != nbytes)
      throw ShapeError(where + " of type " + type_name(type) + " needs " + std::to_string(want) + " bytes, " +
                       std::to_string(nbytes) + " given");
    if (nbytes && !bytes) throw ConfigError(where + " has null data");
    TensorInfo t;
    t.name = std::move(name);
    t.ne = std::move(ne);
    t.type = type;
    t.nbytes = nbytes;
    t.offset = next_offset_;
    next_offset_ += pad(nbytes);
    names_.insert(t.name);
    tensors_.push_back(std::move(t));
    data_.push_back(static_cast<const unsigned char*>(bytes));
  }

  /// Writes the file: header, metadata, tensor infos, zeros to the
  /// alignment, then each tensor followed by zeros to the alignment.
  void write(io::ByteSink& sink) const {
    Out out{sink};
    out.raw("GGUF", 4);
    out.u32(3);
    out.u64(tensors_.size());
    const bool implicit = alignment_ != kDefaultAlignment && !keys_.count("general.alignment");
    out.u64(metadata_.size() + (implicit ? 1 : 0));
    if (implicit) {
      Value a = Value::of(alignment_);
      a.key_ = "general.alignment";
      out.kv(a);
    }
    for (const Value& v : metadata_) out.kv(v);
    for (const TensorInfo& t : tensors_) {
      out.str(t.name);
      out.u32(std::uint32_t(t.ne.size()));
      for (std::uint64_t n : t.ne) out.u64(n);
      out.u32(static_cast<std::uint32_t>(t.type));
      out.u64(t.offset);
    }
    out.zeros(pad(out.written) - out.written);
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      out.raw(data_[i], std::size_t(tensors_[i].nbytes));
      out.zeros(pad(tensors_[i].nbytes) - tensors_[i].nbytes);
    }
  }

  /// Writes the file to `path` atomically (temporary file, fsync, rename:
  /// io/file/atomic_save.hpp); on failure `path` is untouched.
  void save(const std::string& path) const {
    io::write_file_atomic("gguf", path, [this](io::ByteSink& s) { write(s); });
  }

  std::uint32_t alignment() const { return alignment_; }

 private:
  struct Out {
    io::ByteSink& sink;
    std::uint64_t written = 0;
    void raw(const void* p, std::size_t n) {
      if (n) sink.write(p, n);
      written += n;
    }
    void u32(std::uint32_t v) { raw(&v, 4); }
    void u64(std::uint64_t v) { raw(&v, 8); }
    void str(const std::string& s) {
      u64(s.size());
      raw(s.data(), s.size());
    }
    void zeros(std::uint64_t n) {
      static const unsigned char z[256] = {};
      for (; n > 0; n -= n < 256 ? n : 256) raw(z, std::size_t(n < 256 ? n : 256));
    }
    void payload(const Value& v) {
      switch (v.type()) {
        case ValueType::string: str(v.str_); break;
        case ValueType::array:
          u32(static_cast<std::uint32_t>(v.array_type_));
          u64(v.items_.size());
          for (const Value& e : v.items_) payload(e);  // an inner array: its own type and length, no tag
          break;
        default: raw(&v.bits_, value_type_size(v.type()));  // the low bytes: little-endian host
      }
    }
    void kv(const Value& v) {
      str(v.key());
      u32(static_cast<std::uint32_t>(v.type()));
      payload(v);
    }
  };

  std::uint64_t pad(std::uint64_t n) const { return (n + alignment_ - 1) / alignment_ * alignment_; }

  std::uint32_t alignment_;
  std::vector<Value> metadata_;
  std::unordered_set<std::string> keys_;
  std::vector<TensorInfo> tensors_;
  std::vector<const unsigned char*> data_;
  std::unordered_set<std::string> names_;
  std::uint64_t next_offset_ = 0;
};

}  // namespace gguf
}  // namespace apex
