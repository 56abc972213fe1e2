#pragma once
/// \file safetensors.hpp
/// The safetensors file format: validated reading, writing, atomic saves.
///
/// Layout (https://github.com/huggingface/safetensors, "Format"):
///
///     [8 bytes]  N, unsigned 64-bit little-endian: length of the header
///     [N bytes]  JSON object, UTF-8, starting with '{', padded with spaces
///                so that 8 + N is a multiple of 8:
///                  { "__metadata__": {"key": "value", …},            (optional)
///                    "name": {"dtype": "F32", "shape": [r, c],
///                             "data_offsets": [begin, end]}, … }
///     [rest]     the data buffer; begin/end are byte offsets into it
///                (relative to its start, end exclusive), row-major,
///                little-endian.
///
/// The reader trusts nothing in a file. Before a single data byte is read it
/// checks that the header length fits the file and a cap (100 MB by default,
/// as the reference implementation), that the header is UTF-8 JSON of the
/// shape above (no duplicate keys, no unknown fields, nesting no deeper than
/// the format needs), that every dtype is known, every dimension a
/// non-negative integer whose product (times the element size) does not
/// overflow and equals `end − begin`, and that the tensors tile the data
/// buffer exactly: no gap, no overlap, nothing past its end. Any violation
/// throws `FormatError`. Data are then read through a bounded buffer, so
/// memory never exceeds what the validated header asks for.
///
/// The header is parsed with nlohmann/json (a dependency of this header only).

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#else
#error "apex/ffn/safetensors.hpp needs POSIX file I/O (open, pread, fsync, rename)"
#endif

#include "errors.hpp"
#include "types.hpp"

namespace apex {
namespace safetensors {

/// Element types of the format (byte-sized ones; sub-byte types are rejected).
enum class DType { BOOL, U8, I8, F8_E5M2, F8_E4M3, F8_E8M0, I16, U16, F16, BF16, I32, U32, F32, I64, U64, F64, C64 };

namespace detail {
struct DTypeInfo {
  DType dtype;
  const char* name;
  std::size_t size;
};
inline constexpr DTypeInfo kDTypes[] = {
    {DType::BOOL, "BOOL", 1},       {DType::U8, "U8", 1},   {DType::I8, "I8", 1},
    {DType::F8_E5M2, "F8_E5M2", 1}, {DType::F8_E4M3, "F8_E4M3", 1}, {DType::F8_E8M0, "F8_E8M0", 1},
    {DType::I16, "I16", 2},         {DType::U16, "U16", 2}, {DType::F16, "F16", 2},
    {DType::BF16, "BF16", 2},       {DType::I32, "I32", 4}, {DType::U32, "U32", 4},
    {DType::F32, "F32", 4},         {DType::I64, "I64", 8}, {DType::U64, "U64", 8},
    {DType::F64, "F64", 8},         {DType::C64, "C64", 8}};
}  // namespace detail

/// The format's spelling of `d` ("F32", "BF16", …).
inline const char* dtype_name(DType d) {
  for (const auto& i : detail::kDTypes)
    if (i.dtype == d) return i.name;
  return "?";
}

/// Bytes per element of `d`.
inline std::size_t dtype_size(DType d) {
  for (const auto& i : detail::kDTypes)
    if (i.dtype == d) return i.size;
  return 0;
}

/// The dtype spelled `name`; false if the format has no such (byte-sized) type.
inline bool parse_dtype(std::string_view name, DType& out) {
  for (const auto& i : detail::kDTypes)
    if (name == i.name) {
      out = i.dtype;
      return true;
    }
  return false;
}

/// The dtypes apex-ffn converts to and from its scalar types.
inline bool is_float_convertible(DType d) { return d == DType::F32 || d == DType::F64 || d == DType::BF16; }

/// The on-disk dtype that stores `T` exactly (F32 for float, F64 for double).
template <class T>
constexpr DType dtype_of() {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>, "safetensors: scalar must be float or double");
  return std::is_same_v<T, float> ? DType::F32 : DType::F64;
}

/// Free-form string pairs stored under `__metadata__`.
using Metadata = std::map<std::string, std::string>;

/// Resource caps applied while reading a file.
struct Limits {
  /// Largest accepted JSON header, in bytes (the reference implementation's
  /// cap). Parsing needs memory proportional to the header.
  std::uint64_t max_header_bytes = 100'000'000;
};

/// One tensor entry of a validated header.
struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  std::vector<std::uint64_t> shape;  ///< each ≤ INT64_MAX; empty = scalar
  std::uint64_t begin = 0;           ///< byte offset into the data buffer
  std::uint64_t end = 0;             ///< one past the last byte

  std::uint64_t nbytes() const { return end - begin; }
  /// Element count (validated: cannot overflow for a parsed header).
  std::uint64_t numel() const {
    std::uint64_t n = 1;
    for (auto s : shape) n *= s;
    return n;
  }
};

/// A validated header: metadata and the tensor table.
struct Header {
  Metadata metadata;
  std::vector<TensorInfo> tensors;  ///< sorted by name
  std::uint64_t header_bytes = 0;   ///< N
  std::uint64_t data_bytes = 0;     ///< size of the data buffer

  /// Offset of the data buffer in the file.
  std::uint64_t data_offset() const { return 8 + header_bytes; }

  /// The entry named `name`, or nullptr.
  const TensorInfo* find(std::string_view name) const {
    auto it = std::lower_bound(tensors.begin(), tensors.end(), name,
                               [](const TensorInfo& t, std::string_view n) { return t.name < n; });
    return it != tensors.end() && it->name == name ? &*it : nullptr;
  }
};

/// Shape as text, e.g. "[4, 8]".
inline std::string shape_string(const std::vector<std::uint64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

namespace detail {

/// `name` quoted and shortened for an error message (names come from files).
inline std::string quote(std::string_view name) {
  constexpr std::size_t kMax = 80;
  std::string s = "'";
  s += name.size() > kMax ? std::string(name.substr(0, kMax)) + "…" : std::string(name);
  return s + "'";
}

/// a·b, or false if it overflows 64 bits.
inline bool mul_overflows(std::uint64_t a, std::uint64_t b, std::uint64_t& out) {
  if (a != 0 && b > std::numeric_limits<std::uint64_t>::max() / a) return true;
  out = a * b;
  return false;
}

// Little-endian loads and stores written byte by byte: correct on any host,
// and compiled to single moves on little-endian ones.
inline std::uint64_t load_le(const unsigned char* p, int bytes) {
  std::uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
inline void store_le(unsigned char* p, std::uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i, v >>= 8) p[i] = static_cast<unsigned char>(v & 0xFF);
}

inline float bits_to_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline std::uint32_t float_to_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline double bits_to_double(std::uint64_t u) {
  double d;
  std::memcpy(&d, &u, 8);
  return d;
}
inline std::uint64_t double_to_bits(double d) {
  std::uint64_t u;
  std::memcpy(&u, &d, 8);
  return u;
}

/// double → float, round to nearest even, ±inf beyond the range. (A plain
/// cast of an out-of-range double is undefined behaviour in C++.)
inline float to_float(double d) {
  constexpr double kMax = double(std::numeric_limits<float>::max());
  // Halfway between FLT_MAX and 2^128: from here on, RNE gives infinity.
  constexpr double kOverflow = kMax + 0x1.0p103;
  if (std::isnan(d) || std::fabs(d) <= kMax) return static_cast<float>(d);
  const float big = std::fabs(d) >= kOverflow ? std::numeric_limits<float>::infinity() : std::numeric_limits<float>::max();
  return std::signbit(d) ? -big : big;
}

/// float → bfloat16 bits, round to nearest, ties to even: add 0x7FFF plus the
/// lowest kept bit, then truncate. NaN stays a (quiet) NaN.
inline std::uint16_t float_to_bf16(float f) {
  std::uint32_t u = float_to_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<std::uint16_t>((u >> 16) | 0x0040u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

/// double → bfloat16 bits, rounded once (to nearest even) from the double.
/// Going through a round-to-nearest float would round twice and can land on
/// the wrong side of a bf16 tie (1 + 2⁻⁸ + 2⁻³⁰ → 1 instead of 1 + 2⁻⁷).
/// Rounding to float by round-to-odd first (sticky last bit) keeps enough
/// information for the second rounding to be exact.
inline std::uint16_t double_to_bf16(double d) {
  if (std::isnan(d)) return std::signbit(d) ? 0xFFC0u : 0x7FC0u;
  float f = to_float(d);
  if (double(f) != d) {
    std::uint32_t u = float_to_bits(f);
    // f is one of the two floats around d; round-to-odd picks the odd one.
    if ((u & 1u) == 0) u = std::fabs(double(f)) > std::fabs(d) ? u - 1 : u + 1;
    f = bits_to_float(u);
  }
  return float_to_bf16(f);
}

inline float bf16_to_float(std::uint16_t b) { return bits_to_float(std::uint32_t(b) << 16); }

/// Decodes `count` little-endian elements of `dtype` (F32, F64 or BF16) into `out`.
template <class T>
void decode(DType dtype, const unsigned char* src, std::size_t count, T* out) {
  switch (dtype) {
    case DType::F32:
      for (std::size_t i = 0; i < count; ++i)
        out[i] = static_cast<T>(bits_to_float(static_cast<std::uint32_t>(load_le(src + 4 * i, 4))));
      break;
    case DType::F64:
      for (std::size_t i = 0; i < count; ++i) {
        const double v = bits_to_double(load_le(src + 8 * i, 8));
        if constexpr (std::is_same_v<T, float>)
          out[i] = to_float(v);
        else
          out[i] = v;
      }
      break;
    case DType::BF16:
      for (std::size_t i = 0; i < count; ++i)
        out[i] = static_cast<T>(bf16_to_float(static_cast<std::uint16_t>(load_le(src + 2 * i, 2))));
      break;
    default:
      throw FormatError(std::string("safetensors: cannot convert dtype ") + dtype_name(dtype));
  }
}

/// Encodes `count` values as little-endian `dtype` (F32, F64 or BF16) into `dst`.
template <class T>
void encode(DType dtype, const T* in, std::size_t count, unsigned char* dst) {
  switch (dtype) {
    case DType::F32:
      for (std::size_t i = 0; i < count; ++i) store_le(dst + 4 * i, float_to_bits(to_float(double(in[i]))), 4);
      break;
    case DType::F64:
      for (std::size_t i = 0; i < count; ++i) store_le(dst + 8 * i, double_to_bits(double(in[i])), 8);
      break;
    case DType::BF16:
      for (std::size_t i = 0; i < count; ++i) {
        const std::uint16_t b = std::is_same_v<T, float> ? float_to_bf16(float(in[i])) : double_to_bf16(double(in[i]));
        store_le(dst + 2 * i, b, 2);
      }
      break;
    default:
      throw ValueError(std::string("safetensors: cannot write dtype ") + dtype_name(dtype) +
                       "; choose F32, F64 or BF16");
  }
}

/// Chunk size of every bounded read and write buffer (a multiple of 8).
inline constexpr std::size_t kChunkBytes = std::size_t(1) << 16;

}  // namespace detail

// ───────────────────────────── sources and sinks ─────────────────────────────

/// Random-access bytes of known size: a file or a memory buffer.
class ByteSource {
 public:
  virtual ~ByteSource() = default;
  virtual std::uint64_t size() const = 0;
  /// Copies exactly `n` bytes at `offset` into `dst`; FormatError if they are not there.
  virtual void read(std::uint64_t offset, void* dst, std::size_t n) const = 0;
  /// "file 'x.safetensors'" or "memory buffer", for messages.
  virtual const std::string& description() const = 0;
};

/// A view of bytes in memory (not copied: they must outlive the source).
class MemorySource : public ByteSource {
 public:
  MemorySource(const void* data, std::size_t size) : data_(static_cast<const unsigned char*>(data)), size_(size) {}
  std::uint64_t size() const override { return size_; }
  void read(std::uint64_t offset, void* dst, std::size_t n) const override {
    if (offset > size_ || n > size_ - offset)
      throw FormatError("safetensors: read of " + std::to_string(n) + " bytes at offset " + std::to_string(offset) +
                        " past the end of a " + std::to_string(size_) + "-byte " + description_);
    if (n) std::memcpy(dst, data_ + offset, n);
  }
  const std::string& description() const override { return description_; }

 private:
  const unsigned char* data_;
  std::size_t size_;
  std::string description_ = "memory buffer";
};

/// A regular file, read with pread. The size is taken when it is opened; a
/// file that shrinks afterwards makes reads throw FormatError.
class FileSource : public ByteSource {
 public:
  explicit FileSource(const std::string& path) : description_("file '" + path + "'") {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) throw FormatError("safetensors: cannot open " + description_ + ": " + std::strerror(errno));
    struct stat st {};
    if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd_);
      throw FormatError("safetensors: " + description_ + " is not a regular file");
    }
    size_ = static_cast<std::uint64_t>(st.st_size);
  }
  ~FileSource() override { ::close(fd_); }
  FileSource(const FileSource&) = delete;
  FileSource& operator=(const FileSource&) = delete;

  std::uint64_t size() const override { return size_; }
  void read(std::uint64_t offset, void* dst, std::size_t n) const override {
    auto* p = static_cast<unsigned char*>(dst);
    while (n > 0) {
      const ssize_t got = ::pread(fd_, p, n, static_cast<off_t>(offset));
      if (got < 0 && errno == EINTR) continue;
      if (got < 0) throw FormatError("safetensors: cannot read " + description_ + ": " + std::strerror(errno));
      if (got == 0) throw FormatError("safetensors: " + description_ + " ended early (truncated while being read?)");
      p += got;
      n -= std::size_t(got);
      offset += std::uint64_t(got);
    }
  }
  const std::string& description() const override { return description_; }

 private:
  int fd_ = -1;
  std::uint64_t size_ = 0;
  std::string description_;
};

/// Where serialised bytes go.
class ByteSink {
 public:
  virtual ~ByteSink() = default;
  virtual void write(const void* data, std::size_t n) = 0;
};

/// Collects the bytes in memory.
class VectorSink : public ByteSink {
 public:
  void write(const void* data, std::size_t n) override {
    const auto* p = static_cast<const unsigned char*>(data);
    bytes.insert(bytes.end(), p, p + n);
  }
  std::vector<unsigned char> bytes;
};

// ─────────────────────────────────── reading ─────────────────────────────────

namespace detail {

/// Streaming checks while nlohmann/json parses the header, so malformed input
/// is rejected before it can grow the document: nesting beyond the format's
/// (root object → tensor object → shape/offset array), duplicate keys,
/// unknown tensor fields, and over-long arrays.
class HeaderGuard {
 public:
  static constexpr std::size_t kMaxRank = 64;  ///< longest accepted shape

  bool operator()(int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using E = nlohmann::json::parse_event_t;
    switch (event) {
      case E::object_start:
        // Objects: the root (depth 0) and its values (depth 1).
        if (depth > 1) fail("nests an object deeper than the format allows");
        keys_.emplace_back();
        counts_.push_back(0);
        break;
      case E::array_start:
        // Arrays: only shape and data_offsets, inside a tensor entry (depth 2).
        if (depth != 2) fail("has an array where the format has none");
        keys_.emplace_back();
        counts_.push_back(0);
        break;
      case E::key: {
        const std::string& k = parsed.get_ref<const std::string&>();
        if (!keys_.back().insert(k).second) fail("repeats the key " + quote(k));
        if (depth == 1) {
          entry_ = k;
        } else if (entry_ != "__metadata__" && k != "dtype" && k != "shape" && k != "data_offsets") {
          fail("gives tensor " + quote(entry_) + " the unknown field " + quote(k));
        }
        break;
      }
      case E::value:
        // Elements of a shape or offsets array (depth 3) are counted.
        if (depth == 3 && ++counts_.back() > kMaxRank) fail("has an array longer than " + std::to_string(kMaxRank));
        break;
      case E::object_end:
      case E::array_end:
        keys_.pop_back();
        counts_.pop_back();
        break;
    }
    return true;
  }

 private:
  [[noreturn]] static void fail(const std::string& what) { throw FormatError("safetensors: the header " + what); }
  std::vector<std::set<std::string>> keys_;  // per open container
  std::vector<std::size_t> counts_;          // per open container
  std::string entry_;                        // current root key
};

inline std::uint64_t header_uint(const nlohmann::json& v, const std::string& what) {
  if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<std::int64_t>() >= 0))
    throw FormatError("safetensors: " + what + " must be a non-negative integer, got " + v.dump());
  return v.get<std::uint64_t>();
}

inline TensorInfo parse_entry(const std::string& name, const nlohmann::json& v) {
  const std::string where = "tensor " + quote(name);
  if (!v.is_object()) throw FormatError("safetensors: " + where + " is not a JSON object");
  for (const char* field : {"dtype", "shape", "data_offsets"})
    if (!v.contains(field)) throw FormatError("safetensors: " + where + " has no '" + field + "'");
  TensorInfo t;
  t.name = name;
  const auto& dt = v["dtype"];
  if (!dt.is_string() || !parse_dtype(dt.get_ref<const std::string&>(), t.dtype))
    throw FormatError("safetensors: " + where + " has unknown or unsupported dtype " + dt.dump().substr(0, 40));
  const auto& shape = v["shape"];
  if (!shape.is_array()) throw FormatError("safetensors: " + where + " has a 'shape' that is not an array");
  std::uint64_t numel = 1;
  for (const auto& s : shape) {
    const std::uint64_t dim = header_uint(s, where + " shape entry");
    if (dim > std::uint64_t(std::numeric_limits<std::int64_t>::max()))
      throw FormatError("safetensors: " + where + " has a dimension beyond 2^63 - 1");
    if (mul_overflows(numel, dim, numel))
      throw FormatError("safetensors: " + where + " has a shape whose element count overflows");
    t.shape.push_back(dim);
  }
  std::uint64_t nbytes = 0;
  if (mul_overflows(numel, dtype_size(t.dtype), nbytes))
    throw FormatError("safetensors: " + where + " has a shape whose byte size overflows");
  const auto& off = v["data_offsets"];
  if (!off.is_array() || off.size() != 2)
    throw FormatError("safetensors: " + where + " needs 'data_offsets' = [begin, end]");
  t.begin = header_uint(off[0], where + " data_offsets[0]");
  t.end = header_uint(off[1], where + " data_offsets[1]");
  if (t.end < t.begin) throw FormatError("safetensors: " + where + " has data_offsets with end < begin");
  if (t.end - t.begin != nbytes)
    throw FormatError("safetensors: " + where + " spans " + std::to_string(t.end - t.begin) + " bytes but " +
                      dtype_name(t.dtype) + " " + shape_string(t.shape) + " needs " + std::to_string(nbytes));
  return t;
}

}  // namespace detail

/// Validates a header (`text`, the N bytes after the length) for a data
/// buffer of `data_bytes` bytes. Throws FormatError on any violation.
inline Header parse_header(std::string_view text, std::uint64_t data_bytes) {
  if (text.empty() || text.front() != '{') throw FormatError("safetensors: the header does not start with '{'");
  nlohmann::json root;
  try {
    detail::HeaderGuard guard;
    root = nlohmann::json::parse(text.begin(), text.end(), std::ref(guard));
  } catch (const nlohmann::json::exception& e) {
    // Covers syntax errors, invalid UTF-8 and trailing garbage.
    throw FormatError(std::string("safetensors: the header is not valid JSON: ") + e.what());
  }
  if (!root.is_object()) throw FormatError("safetensors: the header is not a JSON object");
  Header h;
  h.header_bytes = text.size();
  h.data_bytes = data_bytes;
  for (const auto& [key, value] : root.items()) {
    if (key == "__metadata__") {
      if (!value.is_object()) throw FormatError("safetensors: '__metadata__' is not a JSON object");
      for (const auto& [mk, mv] : value.items()) {
        if (!mv.is_string())
          throw FormatError("safetensors: '__metadata__' value of " + detail::quote(mk) + " is not a string");
        h.metadata.emplace(mk, mv.get<std::string>());
      }
      continue;
    }
    h.tensors.push_back(detail::parse_entry(key, value));
  }
  // std::map iteration gave names in order already; keep the invariant explicit.
  std::sort(h.tensors.begin(), h.tensors.end(), [](const auto& a, const auto& b) { return a.name < b.name; });

  // The tensors must tile [0, data_bytes) exactly.
  std::vector<const TensorInfo*> by_offset;
  for (const auto& t : h.tensors) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(), [](const TensorInfo* a, const TensorInfo* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  std::uint64_t expect = 0;
  for (const TensorInfo* t : by_offset) {
    if (t->begin < expect)
      throw FormatError("safetensors: tensor " + detail::quote(t->name) + " overlaps the previous tensor's bytes");
    if (t->begin > expect)
      throw FormatError("safetensors: bytes " + std::to_string(expect) + ".." + std::to_string(t->begin) +
                        " of the data buffer belong to no tensor (before " + detail::quote(t->name) + ")");
    if (t->end > data_bytes)
      throw FormatError("safetensors: tensor " + detail::quote(t->name) + " ends at byte " + std::to_string(t->end) +
                        " of a " + std::to_string(data_bytes) + "-byte data buffer");
    expect = t->end;
  }
  if (expect != data_bytes)
    throw FormatError("safetensors: the tensors cover " + std::to_string(expect) + " bytes of a " +
                      std::to_string(data_bytes) + "-byte data buffer");
  return h;
}

/// Reads the length prefix and header of `src` and validates them.
inline Header read_header(const ByteSource& src, const Limits& limits = {}) {
  const std::uint64_t size = src.size();
  if (size < 8)
    throw FormatError("safetensors: " + src.description() + " has " + std::to_string(size) +
                      " bytes, fewer than the 8-byte header length");
  unsigned char len_bytes[8];
  src.read(0, len_bytes, 8);
  const std::uint64_t n = detail::load_le(len_bytes, 8);
  if (n > limits.max_header_bytes)
    throw FormatError("safetensors: " + src.description() + " declares a " + std::to_string(n) +
                      "-byte header, more than the limit of " + std::to_string(limits.max_header_bytes));
  if (n > size - 8)
    throw FormatError("safetensors: " + src.description() + " declares a " + std::to_string(n) +
                      "-byte header but has only " + std::to_string(size - 8) + " bytes after the length");
  std::string text(static_cast<std::size_t>(n), '\0');
  src.read(8, text.data(), text.size());
  try {
    return parse_header(text, size - 8 - n);
  } catch (const FormatError& e) {
    throw FormatError(std::string(e.what()) + " (in " + src.description() + ")");
  }
}

/// A validated safetensors file (or buffer) and typed access to its tensors.
class Reader {
 public:
  /// Opens and validates `path`. Throws FormatError.
  explicit Reader(const std::string& path, const Limits& limits = {})
      : Reader(std::make_unique<FileSource>(path), limits) {}
  explicit Reader(std::unique_ptr<ByteSource> src, const Limits& limits = {})
      : src_(std::move(src)), header_(read_header(*src_, limits)) {}
  /// Validates `size` bytes at `data`, which must outlive the reader.
  static Reader from_memory(const void* data, std::size_t size, const Limits& limits = {}) {
    return Reader(std::make_unique<MemorySource>(data, size), limits);
  }

  const Header& header() const { return header_; }
  const Metadata& metadata() const { return header_.metadata; }
  const std::vector<TensorInfo>& tensors() const { return header_.tensors; }
  const ByteSource& source() const { return *src_; }

  /// The entry named `name`; FormatError if the file has none.
  const TensorInfo& at(std::string_view name) const {
    if (const TensorInfo* t = header_.find(name)) return *t;
    throw FormatError("safetensors: " + src_->description() + " has no tensor " + detail::quote(name));
  }

  /// Converts the `t.numel()` elements of `t` (F32, F64 or BF16) into `out`.
  /// F64 → float rounds to nearest even; the others are exact.
  template <class T>
  void read(const TensorInfo& t, T* out) const {
    if (!is_float_convertible(t.dtype))
      throw FormatError("safetensors: tensor " + detail::quote(t.name) + " in " + src_->description() + " is " +
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

  /// The tensor `name` of rank ≤ 2 as a matrix: `[r, c]` → r × c, `[n]` →
  /// 1 × n, `[]` → 1 × 1. ShapeError for higher ranks.
  template <class T>
  Matrix<T> matrix(std::string_view name) const {
    const TensorInfo& t = at(name);
    if (t.shape.size() > 2)
      throw ShapeError("safetensors: tensor " + detail::quote(name) + " has shape " + shape_string(t.shape) +
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

// ─────────────────────────────────── writing ─────────────────────────────────

/// An in-memory tensor to write: `shape` row-major values at `data`.
template <class T>
struct TensorRef {
  std::string name;
  std::vector<std::uint64_t> shape;
  const T* data;
};

/// Serialises `tensors` (stored as `dtype`: F32, F64 or BF16; BF16 rounds to
/// nearest even) and `metadata` to `out`, data in the order given. Throws
/// ValueError for a dtype it cannot write, a duplicate or reserved name, or
/// a name or metadata string that is not valid UTF-8.
template <class T>
void write(ByteSink& out, const std::vector<TensorRef<T>>& tensors, DType dtype, const Metadata& metadata = {}) {
  if (!is_float_convertible(dtype))
    throw ValueError(std::string("safetensors::write: cannot write dtype ") + dtype_name(dtype) +
                     "; choose F32, F64 or BF16");
  const std::size_t item = dtype_size(dtype);
  nlohmann::json h = nlohmann::json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  std::uint64_t offset = 0;
  for (const auto& t : tensors) {
    if (t.name == "__metadata__") throw ValueError("safetensors::write: '__metadata__' is reserved, not a tensor name");
    if (h.contains(t.name)) throw ValueError("safetensors::write: duplicate tensor name " + detail::quote(t.name));
    std::uint64_t numel = 1, nbytes = 0;
    for (auto s : t.shape)
      if (detail::mul_overflows(numel, s, numel))
        throw ValueError("safetensors::write: tensor " + detail::quote(t.name) + " is too large");
    if (detail::mul_overflows(numel, item, nbytes))
      throw ValueError("safetensors::write: tensor " + detail::quote(t.name) + " is too large");
    h[t.name] = {{"dtype", dtype_name(dtype)}, {"shape", t.shape}, {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  std::string text;
  try {
    text = h.dump();
  } catch (const nlohmann::json::exception& e) {
    throw ValueError(std::string("safetensors::write: a name or metadata string is not valid UTF-8: ") + e.what());
  }
  text.append((8 - text.size() % 8) % 8, ' ');  // 8 + N ≡ 0 (mod 8): the data start aligned
  unsigned char len[8];
  detail::store_le(len, text.size(), 8);
  out.write(len, 8);
  out.write(text.data(), text.size());

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

namespace detail {

/// Unbuffered-by-stdio writes to a file descriptor, through a fixed buffer.
class FdSink : public ByteSink {
 public:
  FdSink(int fd, std::string description) : fd_(fd), description_(std::move(description)) { buf_.reserve(kChunkBytes); }
  void write(const void* data, std::size_t n) override {
    const auto* p = static_cast<const unsigned char*>(data);
    while (n > 0) {
      const std::size_t take = std::min(n, kChunkBytes - buf_.size());
      buf_.insert(buf_.end(), p, p + take);
      p += take;
      n -= take;
      if (buf_.size() == kChunkBytes) flush();
    }
  }
  void flush() {
    const unsigned char* p = buf_.data();
    std::size_t n = buf_.size();
    while (n > 0) {
      const ssize_t put = ::write(fd_, p, n);
      if (put < 0 && errno == EINTR) continue;
      if (put <= 0) throw FormatError("safetensors: cannot write " + description_ + ": " + std::strerror(errno));
      p += put;
      n -= std::size_t(put);
    }
    buf_.clear();
  }

 private:
  int fd_;
  std::string description_;
  std::vector<unsigned char> buf_;
};

}  // namespace detail

/// Writes a file atomically: `produce` writes the content to a temporary file
/// in the same folder, which is flushed, fsync'ed, closed and renamed over
/// `path`; then the folder is fsync'ed so the rename itself is durable.
/// Readers see the old file or the new one, never a mix. If anything fails
/// before the rename (cannot create, a write fails, `produce` throws, the
/// disk is full, the rename fails) the temporary file is removed, `path` is
/// untouched, and the exception propagates (FormatError for I/O errors).
inline void write_file_atomic(const std::string& path, const std::function<void(ByteSink&)>& produce) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  if (target.filename().empty()) throw FormatError("safetensors: '" + path + "' does not name a file");
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");

  // Hidden, unique per process and call; O_EXCL never clobbers a stranger's file.
  static std::atomic<unsigned> counter{0};
  std::string tmp;
  int fd = -1;
  for (int attempt = 0; attempt < 100 && fd < 0; ++attempt) {
    tmp = (dir / ("." + target.filename().string() + ".tmp." + std::to_string(::getpid()) + "." +
                  std::to_string(counter++)))
              .string();
    fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0)
    throw FormatError("safetensors: cannot create a temporary file in '" + dir.string() + "' to save '" + path +
                      "': " + std::strerror(errno));
  try {
    detail::FdSink sink(fd, "temporary file '" + tmp + "'");
    produce(sink);
    sink.flush();
    if (::fsync(fd) != 0) throw FormatError("safetensors: cannot fsync '" + tmp + "': " + std::strerror(errno));
    const int rc = ::close(fd);
    fd = -1;
    if (rc != 0) throw FormatError("safetensors: cannot close '" + tmp + "': " + std::strerror(errno));
    if (::rename(tmp.c_str(), path.c_str()) != 0)
      throw FormatError("safetensors: cannot rename '" + tmp + "' to '" + path + "': " + std::strerror(errno));
  } catch (...) {
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  // The new file is in place; make the directory entry durable too.
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) throw FormatError("safetensors: saved '" + path + "' but cannot open its folder to fsync it");
  const int rc = ::fsync(dfd);
  const int err = errno;
  ::close(dfd);
  // Some file systems cannot fsync a directory (EINVAL); the rename stands.
  if (rc != 0 && err != EINVAL)
    throw FormatError("safetensors: saved '" + path + "' but cannot fsync its folder: " + std::strerror(err));
}

/// Writes `tensors` to `path` atomically (see write_file_atomic and write).
template <class T>
void save(const std::string& path, const std::vector<TensorRef<T>>& tensors, DType dtype,
          const Metadata& metadata = {}) {
  write_file_atomic(path, [&](ByteSink& out) { write(out, tensors, dtype, metadata); });
}

}  // namespace safetensors
}  // namespace apex
