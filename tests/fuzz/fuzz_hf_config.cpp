// libFuzzer target: see fuzz_config.hpp for the contract. Build and run with
// tests/fuzz/run.sh SECONDS.
#include <cstddef>
#include <cstdint>

#include "fuzz_config.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    apex::fuzz::exercise_config(data, size);
  } catch (const apex::Error&) {
    // A rejected input: the expected outcome for most of them.
  }
  return 0;
}
