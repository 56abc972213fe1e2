#pragma once
// What the fuzzer does with one input, shared by the libFuzzer target
// (fuzz_safetensors.cpp) and the regression test (test_malformed_files.cpp), so a
// crashing input committed under tests/fuzz/regressions/ replays the exact
// code path.
//
// Contract under test: any byte string either loads or throws an
// apex::Error (FormatError, ShapeError, …). Anything else — a crash, a
// sanitizer report, another exception type, a leak, an allocation beyond the
// input's size — is a bug. `exercise` also checks one property of accepted
// input: what was read, written back, reads back the same (else it throws
// std::logic_error, which is never an apex::Error).

#include <apex/ffn/io/checkpoint.hpp>
#include <apex/ffn/layers/swiglu.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace apex::fuzz {

inline bool same_value(double a, double b) { return (std::isnan(a) && std::isnan(b)) || a == b; }

inline void exercise(const std::uint8_t* data, std::size_t size) {
  const auto file = safetensors::Reader::from_memory(data, size);

  // Every floating-point tensor converts into both scalar types.
  std::vector<std::vector<double>> values;
  for (const auto& t : file.tensors()) {
    if (!safetensors::is_float_convertible(t.dtype)) continue;
    std::vector<double> d(t.numel());
    std::vector<float> f(t.numel());
    file.read(t, d.data());
    file.read(t, f.data());
    values.push_back(std::move(d));
  }

  // Loading into a layer: strict first (usually rejected), then lenient.
  SwiGLU<double> ffn(2, 3, std::uint64_t(0));
  try {
    load_checkpoint(file, ffn.param_values());
  } catch (const Error&) {
  }
  LoadOptions lenient;
  lenient.allow_missing = lenient.allow_unexpected = true;
  try {
    load_checkpoint(file, ffn.param_values(), lenient);
  } catch (const ShapeError&) {
  } catch (const FormatError&) {
  }

  // Round trip: an accepted file's float tensors, written back as F64,
  // read back bit for bit (NaNs as NaNs) with the same names, shapes and
  // metadata. A failure here is a bug, not a malformed input.
  std::vector<safetensors::TensorRef<double>> refs;
  std::size_t k = 0;
  for (const auto& t : file.tensors())
    if (safetensors::is_float_convertible(t.dtype)) refs.push_back({t.name, t.shape, values[k++].data()});
  safetensors::VectorSink sink;
  safetensors::write(sink, refs, safetensors::DType::F64, file.metadata());
  try {
    const auto again = safetensors::Reader::from_memory(sink.bytes.data(), sink.bytes.size());
    if (again.tensors().size() != refs.size() || again.metadata() != file.metadata())
      throw std::logic_error("round trip changed the tensor table or metadata");
    for (std::size_t i = 0; i < refs.size(); ++i) {
      const auto& t = again.at(refs[i].name);
      if (t.shape != refs[i].shape) throw std::logic_error("round trip changed a shape");
      std::vector<double> back(t.numel());
      again.read(t, back.data());
      for (std::size_t j = 0; j < back.size(); ++j)
        if (!same_value(back[j], refs[i].data[j])) throw std::logic_error("round trip changed a value");
    }
  } catch (const Error& e) {
    throw std::logic_error(std::string("a file written by safetensors::write was rejected: ") + e.what());
  }
}

}  // namespace apex::fuzz
