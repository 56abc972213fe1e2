#pragma once
// GGUF files written field by field, independently of gguf::Writer, for the
// tests that check the reader against the format definition (and the writer
// against these bytes).

#include <apex/ffn/io/gguf.hpp>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace apex::test {

/// Little-endian fields appended one by one.
struct GgufBytes {
  std::string b;
  GgufBytes& u8(std::uint8_t v) {
    b.push_back(char(v));
    return *this;
  }
  GgufBytes& u32(std::uint32_t v) {
    for (int i = 0; i < 4; ++i) b.push_back(char((v >> (8 * i)) & 0xFF));
    return *this;
  }
  GgufBytes& u64(std::uint64_t v) {
    for (int i = 0; i < 8; ++i) b.push_back(char((v >> (8 * i)) & 0xFF));
    return *this;
  }
  GgufBytes& str(const std::string& s) {
    u64(s.size());
    b += s;
    return *this;
  }
  GgufBytes& raw(const std::string& s) {
    b += s;
    return *this;
  }
  GgufBytes& pad_to(std::size_t a) {
    while (b.size() % a) b.push_back('\0');
    return *this;
  }
};

inline std::string kv_u32(const std::string& key, std::uint32_t v) {
  return GgufBytes().str(key).u32(4).u32(v).b;
}
inline std::string kv_str(const std::string& key, const std::string& v) {
  return GgufBytes().str(key).u32(8).str(v).b;
}
/// A tensor info: name, n_dims, ne…, type, offset.
inline std::string tensor_info(const std::string& name, const std::vector<std::uint64_t>& ne, std::uint32_t type,
                               std::uint64_t offset) {
  GgufBytes g;
  g.str(name).u32(std::uint32_t(ne.size()));
  for (auto n : ne) g.u64(n);
  return g.u32(type).u64(offset).b;
}

/// A whole file: header (version, counts), the pairs and infos as given,
/// zeros to `align`, then `data`.
inline std::string gguf_file(std::uint64_t n_tensors, std::uint64_t n_kv, const std::string& kvs,
                             const std::string& infos, const std::string& data, std::size_t align = 32,
                             std::uint32_t version = 3) {
  GgufBytes g;
  g.raw("GGUF").u32(version).u64(n_tensors).u64(n_kv).raw(kvs).raw(infos).pad_to(align).raw(data);
  return g.b;
}

/// A small valid file: an architecture key, an f32 [2, 3] tensor "a" and
/// a q8_0 [32] tensor "b" (at offset 32, after a's 24 bytes and 8 of
/// padding). `data_bytes` of data follow; 24 + 8 + 34 = 66 make it whole.
inline std::string small_gguf() {
  std::string data(66, '\0');
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = char(i * 7 + 1);
  for (std::size_t i = 24; i < 32; ++i) data[i] = 0;
  return gguf_file(2, 1, kv_str("general.architecture", "llama"),
                   tensor_info("a", {2, 3}, 0, 0) + tensor_info("b", {32}, 8, 32), data);
}

inline gguf::File open_bytes(const std::string& bytes) { return gguf::File::from_memory(bytes.data(), bytes.size()); }

}  // namespace apex::test
