// libFuzzer target: see fuzz_gpt_oss.hpp for the contract. Build and run with
// tests/fuzz/run.sh SECONDS.
#include <cstddef>
#include <cstdint>

#include "fuzz_gpt_oss.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    apex::fuzz::exercise_gpt_oss(data, size);
  } catch (const apex::Error&) {
    // A rejected input: the expected outcome for most of them.
  }
  return 0;
}
