#pragma once
// What the packed-layout fuzzer does with one input, shared by the
// libFuzzer target (fuzz_packed_layout.cpp) and the replay test
// (test_packed_load.cpp), so an input committed under
// tests/fuzz/regressions_packed/ replays the exact code path.
//
// Contract under test: any byte string, as a file, either opens or throws
// an apex::Error through both packed readers — map_packed_moe (the
// pack-once file: panels mapped in place) and load_packed_moe (the
// quantized checkpoint: ggml rows moved into panels) — for a small SwiGLU
// layer (d = f = 32: whole blocks of the 32-weight types; E = 2, K = 1). Anything
// else — a crash, a sanitizer report (a view past the mapping, a block read
// out of bounds), another exception type — is a bug. An accepted layer runs
// a forward of a finite batch, which reads every expert weight through the
// kernels.

#include <apex/ffn/inference.hpp>
#include <apex/ffn/inference/files/pack_once/file.hpp>
#include <apex/ffn/inference/files/checkpoint/load.hpp>
#include <apex/ffn/inference/files/checkpoint/save.hpp>

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>

namespace apex::fuzz {

inline MoEConfig fuzz_packed_config() {
  MoEConfig c;
  c.d_model = 32, c.d_ffn = 32, c.n_experts = 2, c.n_active = 1;
  return c;
}

/// The input as a file of its own (the pack-once reader maps a path).
inline std::string packed_input_path(const std::uint8_t* data, std::size_t size) {
  const std::string path = "/tmp/apex_fuzz_packed_" + std::to_string(::getpid()) + ".bin";
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(data), std::streamsize(size));
  return path;
}

template <class Layer>
void run_accepted(const Layer& layer) {
  const Matrix<float> x = Matrix<float>::Constant(3, layer.config().d_model, 0.25f);  // 3 × d
  (void)layer.forward(x);
}

/// How many of the two readers accepted the input.
inline int exercise_packed(const std::uint8_t* data, std::size_t size) {
  const std::string path = packed_input_path(data, size);
  const MoEConfig c = fuzz_packed_config();
  int accepted = 0;
  const auto quietly = [&](auto&& f) {
    try {
      f();
      ++accepted;
    } catch (const Error&) {
    }
  };
  quietly([&] { run_accepted(map_packed_moe<float>(path, c)); });
  quietly([&] {
    const auto file = safetensors::Reader::from_memory(data, size);
    run_accepted(load_packed_moe<float>(file, c));
  });
  std::remove(path.c_str());
  return accepted;
}

}  // namespace apex::fuzz
