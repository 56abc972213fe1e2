#pragma once
/// \file io/safetensors/parse.hpp
/// The header parser and validator: the length prefix and the JSON header
/// of a `ByteSource` become a `Header` whose every entry has been checked.
///
/// Exists because this is where a file is trusted or not, so it stays one
/// short file to audit (and the one the fuzzer aims at). Before a single
/// data byte is read it checks that the header length fits the file and the
/// cap, that the header is UTF-8 JSON of the format's shape (no duplicate
/// keys, no unknown fields, nesting no deeper than the format needs), that
/// every dtype is known, every dimension a non-negative integer whose
/// product (times the element size) does not overflow and equals
/// `end − begin`, and that the tensors tile the data buffer exactly. Any
/// violation throws `FormatError`. The only header that needs nlohmann/json.

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "../../core/errors.hpp"
#include "../file/json_text.hpp"
#include "element_bits.hpp"
#include "files.hpp"
#include "dtype.hpp"
#include "header.hpp"

namespace apex {
namespace safetensors {
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
        open();
        break;
      case E::array_start:
        // Arrays: only shape and data_offsets, inside a tensor entry (depth 2).
        if (depth != 2) fail("has an array where the format has none");
        open();
        break;
      case E::key:
        key(depth, parsed.get_ref<const std::string&>());
        break;
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
  void open() {
    keys_.emplace_back();
    counts_.push_back(0);
  }
  void key(int depth, const std::string& k) {
    if (!keys_.back().insert(k).second) fail("repeats the key " + quote_name(k));
    if (depth == 1)
      entry_ = k;
    else if (entry_ != "__metadata__" && k != "dtype" && k != "shape" && k != "data_offsets")
      fail("gives tensor " + quote_name(entry_) + " the unknown field " + quote_name(k));
  }
  std::vector<std::set<std::string>> keys_;  // per open container
  std::vector<std::size_t> counts_;          // per open container
  std::string entry_;                        // current root key
};

inline std::uint64_t header_uint(const nlohmann::json& v, const std::string& what) {
  if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<std::int64_t>() >= 0))
    throw FormatError("safetensors: " + what + " must be a non-negative integer, got " + v.dump());
  return v.get<std::uint64_t>();
}

/// The shape of entry `where` into `t.shape`; returns its byte size.
inline std::uint64_t parse_shape(const nlohmann::json& shape, const std::string& where, TensorInfo& t) {
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
  return nbytes;
}

inline TensorInfo parse_entry(const std::string& name, const nlohmann::json& v) {
  const std::string where = "tensor " + quote_name(name);
  if (!v.is_object()) throw FormatError("safetensors: " + where + " is not a JSON object");
  for (const char* field : {"dtype", "shape", "data_offsets"})
    if (!v.contains(field)) throw FormatError("safetensors: " + where + " has no '" + field + "'");
  TensorInfo t;
  t.name = name;
  const auto& dt = v["dtype"];
  if (!dt.is_string() || !parse_dtype(dt.get_ref<const std::string&>(), t.dtype))
    throw FormatError("safetensors: " + where + " has unknown or unsupported dtype " + dt.dump().substr(0, 40));
  const std::uint64_t nbytes = parse_shape(v["shape"], where, t);
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

/// The tensors of `h` must tile [0, h.data_bytes) exactly: no gap, no
/// overlap, nothing past the end.
inline void check_tiling(const Header& h) {
  std::vector<const TensorInfo*> by_offset;
  for (const auto& t : h.tensors) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(), [](const TensorInfo* a, const TensorInfo* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  std::uint64_t expect = 0;
  for (const TensorInfo* t : by_offset) {
    if (t->begin < expect)
      throw FormatError("safetensors: tensor " + quote_name(t->name) + " overlaps the previous tensor's bytes");
    if (t->begin > expect)
      throw FormatError("safetensors: bytes " + std::to_string(expect) + ".." + std::to_string(t->begin) +
                        " of the data buffer belong to no tensor (before " + quote_name(t->name) + ")");
    if (t->end > h.data_bytes)
      throw FormatError("safetensors: tensor " + quote_name(t->name) + " ends at byte " + std::to_string(t->end) +
                        " of a " + std::to_string(h.data_bytes) + "-byte data buffer");
    expect = t->end;
  }
  if (expect != h.data_bytes)
    throw FormatError("safetensors: the tensors cover " + std::to_string(expect) + " bytes of a " +
                      std::to_string(h.data_bytes) + "-byte data buffer");
}

}  // namespace detail

/// Validates a header (`text`, the N bytes after the length) for a data
/// buffer of `data_bytes` bytes. Throws FormatError on any violation.
inline Header parse_header(std::string_view text, std::uint64_t data_bytes) {
  if (text.empty() || text.front() != '{') throw FormatError("safetensors: the header does not start with '{'");
  io::detail::require_no_nul(text, "safetensors: the header");  // serde_json, the reference, refuses it too
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
          throw FormatError("safetensors: '__metadata__' value of " + quote_name(mk) + " is not a string");
        h.metadata.emplace(mk, mv.get<std::string>());
      }
      continue;
    }
    h.tensors.push_back(detail::parse_entry(key, value));
  }
  // std::map iteration gave names in order already; keep the invariant explicit.
  std::sort(h.tensors.begin(), h.tensors.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  detail::check_tiling(h);
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

}  // namespace safetensors
}  // namespace apex
