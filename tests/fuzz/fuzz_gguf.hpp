#pragma once
// What the fuzzer does with one input, shared by the libFuzzer target
// (fuzz_gguf.cpp) and the replay test (test_gguf.cpp), so an input committed
// under tests/fuzz/regressions_gguf/ replays the exact code path.
//
// Contract under test: any byte string either opens as a gguf::File or
// throws apex::FormatError. Anything else — a crash, a sanitizer report,
// another exception type, an allocation far beyond the input's size — is a
// bug. For an accepted input, one property is checked: its metadata and
// tensors, written back by gguf::Writer, read back identical (else
// std::logic_error, which is never an apex::Error).

#include <apex/ffn/io/gguf.hpp>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace apex::fuzz {

// Touches every value through the conversions a loader uses; a mismatch is
// a FormatError, which is fine.
inline void touch_values(const gguf::Value& v) {
  const auto quiet = [](auto&& f) {
    try {
      f();
    } catch (const FormatError&) {
    }
  };
  quiet([&] { (void)v.as<std::uint32_t>(); });
  quiet([&] { (void)v.as<std::int64_t>(); });
  quiet([&] { (void)v.as<double>(); });
  quiet([&] { (void)v.as<bool>(); });
  quiet([&] { (void)v.as<std::string>(); });
  if (v.type() == gguf::ValueType::array) {
    quiet([&] { (void)v.as_vector<std::int32_t>(); });
    for (std::size_t i = 0; i < v.size(); ++i) touch_values(v[i]);
  }
}

inline void exercise_gguf(const std::uint8_t* data, std::size_t size) {
  const auto file = gguf::File::from_memory(data, size);
  for (const auto& v : file.metadata()) touch_values(v);

  gguf::Writer w(std::uint32_t(file.alignment()));
  for (const auto& v : file.metadata()) w.set(v.key(), v);
  for (const auto& t : file.tensors()) w.add_tensor(t.name, t.type, t.ne, file.data(t), std::size_t(t.nbytes));
  io::VectorSink sink;
  w.write(sink);
  const auto back = gguf::File::from_memory(sink.bytes.data(), sink.bytes.size());
  if (back.metadata() != file.metadata() || back.alignment() != file.alignment())
    throw std::logic_error("gguf round trip: the metadata changed");
  if (back.tensors().size() != file.tensors().size()) throw std::logic_error("gguf round trip: tensors lost");
  for (std::size_t i = 0; i < file.tensors().size(); ++i) {
    const auto& a = file.tensors()[i];
    const auto& b = back.tensors()[i];
    if (a.name != b.name || a.ne != b.ne || a.type != b.type || a.offset != b.offset || a.nbytes != b.nbytes ||
        (a.nbytes && std::memcmp(file.data(a), back.data(b), std::size_t(a.nbytes)) != 0))
      throw std::logic_error("gguf round trip: tensor '" + a.name + "' changed");
  }
}

}  // namespace apex::fuzz
