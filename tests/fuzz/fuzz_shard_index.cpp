// libFuzzer target for the shard-index parser (see fuzz_index.hpp for the
// contract). Build and run with tests/fuzz/run.sh SECONDS.
#include <cstddef>
#include <cstdint>

#include "fuzz_index.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    apex::fuzz::exercise_index(data, size);
  } catch (const apex::FormatError&) {
    // A rejected input: the expected outcome for most of them.
  }
  return 0;
}
