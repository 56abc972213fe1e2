#pragma once
// Checkpoint files as bytes, for the format, malformed-file and file-input
// tests: read and write a file whole, build one from a header text and a data
// buffer, serialise a parameter list as save_checkpoint would write it, open
// bytes in memory, and snapshot parameter values to prove that a rejected load
// changed nothing.

#include <apex/ffn/io/checkpoint.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace apex::test {

using Bytes = std::vector<std::uint8_t>;

inline Bytes read_bytes(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

inline void write_bytes(const std::filesystem::path& p, const Bytes& b) {
  std::ofstream f(p, std::ios::binary);
  f.write(reinterpret_cast<const char*>(b.data()), std::streamsize(b.size()));
}

/// A file from a header text and a data buffer (no padding added).
inline Bytes make_file(const std::string& header, const Bytes& data = {}) {
  // Sized once and filled: GCC 12 at -O3 reports a false -Warray-bounds on
  // inserting after an 8-byte vector.
  Bytes out(8 + header.size() + data.size());
  safetensors::detail::store_le(out.data(), header.size(), 8);
  std::copy(header.begin(), header.end(), out.begin() + 8);
  std::copy(data.begin(), data.end(), out.begin() + 8 + std::ptrdiff_t(header.size()));
  return out;
}

inline Bytes serialise(const ParamList<double>& params, const SaveOptions& o = {}) {
  safetensors::VectorSink sink;
  write_checkpoint(sink, params, o);
  return Bytes(sink.bytes.begin(), sink.bytes.end());
}

inline safetensors::Reader open_memory(const Bytes& b) { return safetensors::Reader::from_memory(b.data(), b.size()); }

/// Copies of every parameter value, to prove a rejected load changed nothing.
template <class T>
std::vector<Matrix<T>> snapshot(const ParamList<T>& ps) {
  std::vector<Matrix<T>> out;
  for (const auto& p : ps) out.push_back(p.value());
  return out;
}
template <class T>
bool unchanged(const ParamList<T>& ps, const std::vector<Matrix<T>>& before) {
  for (std::size_t i = 0; i < ps.size(); ++i)
    if (!(ps[i].value().array() == before[i].array()).all()) return false;
  return true;
}

}  // namespace apex::test
