#pragma once
/// \file io/gguf/value.hpp
/// `Value`: one metadata value of a GGUF file (a scalar, a string, or an
/// array of one element type; arrays may hold arrays), with checked access.
///
/// Exists so that every read of a metadata key goes through one conversion
/// rule instead of each loader guessing: llama.cpp's converters write the
/// same key as u32 in one file and i32 in another, so `as<T>()` for an
/// integer `T` takes any integer type whose value fits `T`; a float takes
/// f32 or f64; bool only bool; a string only a string. Anything else — or a
/// value out of `T`'s range — is a FormatError naming the key, the value and
/// `T`, never a silent wrap.
///
/// Storage: scalars keep their stored bits (an f32 NaN keeps its payload),
/// so a value read and written back is the same bytes. Array elements are
/// Values themselves (~100 bytes each), which is why parse.hpp's Limits
/// bound the total count of array elements in a file.

#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../../core/errors.hpp"

namespace apex {
namespace gguf {

enum class ValueType : std::uint32_t {
  u8 = 0,
  i8 = 1,
  u16 = 2,
  i16 = 3,
  u32 = 4,
  i32 = 5,
  f32 = 6,
  boolean = 7,
  string = 8,
  array = 9,
  u64 = 10,
  i64 = 11,
  f64 = 12,
};

inline bool is_value_type(std::uint32_t id) { return id <= 12; }

/// ggml's spelling of a value type ("u32", "str", …) for messages.
inline const char* value_type_name(ValueType t) {
  static const char* const names[] = {"u8", "i8", "u16", "i16", "u32", "i32", "f32",
                                      "bool", "string", "array", "u64", "i64", "f64"};
  const auto id = static_cast<std::uint32_t>(t);
  return id <= 12 ? names[id] : "unknown";
}

/// Bytes a scalar of type `t` occupies in a file (0 for string and array).
inline std::size_t value_type_size(ValueType t) {
  switch (t) {
    case ValueType::u8: case ValueType::i8: case ValueType::boolean: return 1;
    case ValueType::u16: case ValueType::i16: return 2;
    case ValueType::u32: case ValueType::i32: case ValueType::f32: return 4;
    case ValueType::u64: case ValueType::i64: case ValueType::f64: return 8;
    default: return 0;
  }
}

inline bool is_integer_type(ValueType t) {
  return t == ValueType::u8 || t == ValueType::i8 || t == ValueType::u16 || t == ValueType::i16 ||
         t == ValueType::u32 || t == ValueType::i32 || t == ValueType::u64 || t == ValueType::i64;
}
inline bool is_signed_type(ValueType t) {
  return t == ValueType::i8 || t == ValueType::i16 || t == ValueType::i32 || t == ValueType::i64;
}

namespace detail {

/// The GGUF type that stores a C++ scalar `T` exactly (used by the
/// constructors; `as<T>` accepts more, see above).
template <class T>
constexpr ValueType value_type_of() {
  using U = std::decay_t<T>;
  if constexpr (std::is_same_v<U, bool>) return ValueType::boolean;
  else if constexpr (std::is_same_v<U, std::string>) return ValueType::string;
  else if constexpr (std::is_same_v<U, float>) return ValueType::f32;
  else if constexpr (std::is_same_v<U, double>) return ValueType::f64;
  else {
    static_assert(std::is_integral_v<U> && (sizeof(U) == 1 || sizeof(U) == 2 || sizeof(U) == 4 || sizeof(U) == 8),
                  "gguf::Value: no GGUF type stores this C++ type");
    constexpr bool s = std::is_signed_v<U>;
    if constexpr (sizeof(U) == 1) return s ? ValueType::i8 : ValueType::u8;
    else if constexpr (sizeof(U) == 2) return s ? ValueType::i16 : ValueType::u16;
    else if constexpr (sizeof(U) == 4) return s ? ValueType::i32 : ValueType::u32;
    else return s ? ValueType::i64 : ValueType::u64;
  }
}

/// "u32", "i64", "f32", "bool", "string" for the C++ type asked of `as<T>`.
template <class T>
const char* cxx_type_name() {
  if constexpr (std::is_same_v<T, float>) return "f32";
  else if constexpr (std::is_same_v<T, double>) return "f64";
  else return value_type_name(value_type_of<T>());
}

}  // namespace detail

class Writer;
namespace detail { struct Parser; }

class Value {
 public:
  Value() = default;

  /// A scalar or string value (key set when it is added to a Writer).
  template <class T>
  static Value of(T v) {
    Value r;
    r.type_ = detail::value_type_of<T>();
    if constexpr (std::is_same_v<T, std::string>) r.str_ = std::move(v);
    else if constexpr (std::is_same_v<T, float>) {
      std::uint32_t b;
      std::memcpy(&b, &v, 4);
      r.bits_ = b;
    } else if constexpr (std::is_same_v<T, double>) std::memcpy(&r.bits_, &v, 8);
    else if constexpr (std::is_same_v<T, bool>) r.bits_ = v ? 1 : 0;
    else if constexpr (std::is_signed_v<T>) r.bits_ = std::uint64_t(std::int64_t(v));
    else r.bits_ = std::uint64_t(v);
    return r;
  }
  static Value of(const char* s) { return of(std::string(s)); }

  /// An array of scalars or strings.
  template <class T>
  static Value array_of(const std::vector<T>& items) {
    std::vector<Value> v;
    v.reserve(items.size());
    for (const auto& x : items) v.push_back(of(T(x)));
    return array(detail::value_type_of<T>(), std::move(v));
  }

  /// An array whose elements are all of `element_type` (ValueType::array for
  /// an array of arrays; the inner arrays may differ in their element types).
  /// ConfigError if an element has another type.
  static Value array(ValueType element_type, std::vector<Value> items) {
    for (std::size_t i = 0; i < items.size(); ++i)
      if (items[i].type_ != element_type)
        throw ConfigError(std::string("gguf::Value::array: element ") + std::to_string(i) + " is " +
                          value_type_name(items[i].type_) + ", the array holds " + value_type_name(element_type));
    Value r;
    r.type_ = ValueType::array;
    r.array_type_ = element_type;
    r.items_ = std::move(items);
    return r;
  }

  ValueType type() const { return type_; }
  /// The key this value is stored under; empty for an array element.
  const std::string& key() const { return key_; }

  /// The value as `T` under the rule of the file comment; FormatError if
  /// the type does not convert or the value does not fit.
  template <class T>
  T as() const {
    if constexpr (std::is_same_v<T, std::string>) {
      if (type_ != ValueType::string) throw mismatch("string");
      return str_;
    } else if constexpr (std::is_same_v<T, bool>) {
      if (type_ != ValueType::boolean) throw mismatch("bool");
      return bits_ != 0;
    } else if constexpr (std::is_floating_point_v<T>) {
      if (type_ == ValueType::f32) return T(f32());
      if (type_ == ValueType::f64) return T(f64());
      throw mismatch(detail::cxx_type_name<T>());
    } else {
      static_assert(std::is_integral_v<T>, "gguf::Value::as: unsupported type");
      if (!is_integer_type(type_)) throw mismatch(detail::cxx_type_name<T>());
      return narrow<T>();
    }
  }

  /// The element type of an array (FormatError for a scalar).
  ValueType array_type() const {
    require_array();
    return array_type_;
  }
  std::size_t size() const {
    require_array();
    return items_.size();
  }
  const Value& operator[](std::size_t i) const {
    require_array();
    if (i >= items_.size())
      throw FormatError("gguf: " + where() + " has " + std::to_string(items_.size()) + " elements, index " +
                        std::to_string(i) + " asked");
    return items_[i];
  }
  const std::vector<Value>& items() const {
    require_array();
    return items_;
  }

  /// Every element as `T` (each under `as<T>`'s rule; the message names the
  /// key and the index of the first that fails).
  template <class T>
  std::vector<T> as_vector() const {
    require_array();
    std::vector<T> out;
    out.reserve(items_.size());
    for (std::size_t i = 0; i < items_.size(); ++i) {
      try {
        out.push_back(items_[i].as<T>());
      } catch (const FormatError& e) {
        throw FormatError("gguf: " + where() + " element " + std::to_string(i) + ": " +
                          std::string(e.what()).substr(6));
      }
    }
    return out;
  }

  /// The stored bits of a scalar (the integer, sign-extended; an f32's or
  /// f64's IEEE bits; 0/1 for bool), for writers and exact comparison.
  std::uint64_t bits() const { return bits_; }

  /// The same type, key, and stored bits (NaN equals a NaN of the same bits).
  friend bool operator==(const Value& a, const Value& b) {
    return a.type_ == b.type_ && a.key_ == b.key_ && a.bits_ == b.bits_ && a.str_ == b.str_ &&
           a.array_type_ == b.array_type_ && a.items_ == b.items_;
  }
  friend bool operator!=(const Value& a, const Value& b) { return !(a == b); }

 private:
  friend class Writer;
  friend struct detail::Parser;

  float f32() const {
    const auto b = std::uint32_t(bits_);
    float f;
    std::memcpy(&f, &b, 4);
    return f;
  }
  double f64() const {
    double d;
    std::memcpy(&d, &bits_, 8);
    return d;
  }
  std::string where() const { return key_.empty() ? std::string("array element") : "metadata key '" + key_ + "'"; }
  std::string describe() const {
    if (type_ == ValueType::array) return std::string("an array of ") + value_type_name(array_type_);
    if (type_ == ValueType::string) return "a string";
    std::string v;
    if (type_ == ValueType::f32) v = std::to_string(f32());
    else if (type_ == ValueType::f64) v = std::to_string(f64());
    else if (type_ == ValueType::boolean) v = bits_ ? "true" : "false";
    else if (is_signed_type(type_)) v = std::to_string(std::int64_t(bits_));
    else v = std::to_string(bits_);
    return std::string(value_type_name(type_)) + " " + v;
  }
  FormatError mismatch(const char* want) const {
    return FormatError("gguf: " + where() + " is " + describe() + ", expected " + want);
  }
  void require_array() const {
    if (type_ != ValueType::array) throw FormatError("gguf: " + where() + " is " + describe() + ", not an array");
  }
  template <class T>
  T narrow() const {
    using L = std::numeric_limits<T>;
    bool fits;
    if (is_signed_type(type_)) {
      const auto v = std::int64_t(bits_);
      fits = std::is_signed_v<T> ? (v >= std::int64_t(L::min()) && v <= std::int64_t(L::max()))
                                 : (v >= 0 && std::uint64_t(v) <= std::uint64_t(L::max()));
    } else {
      fits = bits_ <= std::uint64_t(L::max());
    }
    if (!fits)
      throw FormatError("gguf: " + where() + " is " + describe() + ", which does not fit " +
                        detail::cxx_type_name<T>());
    return is_signed_type(type_) ? T(std::int64_t(bits_)) : T(bits_);
  }

  std::string key_;
  ValueType type_ = ValueType::u8;
  ValueType array_type_ = ValueType::u8;
  std::uint64_t bits_ = 0;
  std::string str_;
  std::vector<Value> items_;
};

}  // namespace gguf
}  // namespace apex
