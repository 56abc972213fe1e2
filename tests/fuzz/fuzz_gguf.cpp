// libFuzzer target for the GGUF reader and writer (see fuzz_gguf.hpp for the
// contract). Build and run with tests/fuzz/run.sh SECONDS.
#include <cstddef>
#include <cstdint>

#include "fuzz_gguf.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    apex::fuzz::exercise_gguf(data, size);
  } catch (const apex::FormatError&) {
    // A rejected input: the expected outcome for most of them.
  }
  return 0;
}
