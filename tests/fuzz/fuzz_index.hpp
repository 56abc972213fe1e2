#pragma once
// What the shard-index fuzzer does with one input, shared by the libFuzzer
// target (fuzz_shard_index.cpp) and the replay test (test_file_inputs.cpp),
// so an input committed under tests/fuzz/regressions_index/ replays the
// exact code path.
//
// Contract under test: any byte string either parses as an index or throws
// FormatError. Anything else — a crash, a stack overflow, a sanitizer
// report, another exception type, a leak — is a bug. `exercise_index` also
// checks one property of accepted input: the text write_shard_index would
// write parses back to the same index (else it throws std::logic_error,
// which is never an apex::Error).

#include <apex/ffn/io/shard_index.hpp>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

namespace apex::fuzz {

inline void exercise_index(const std::uint8_t* data, std::size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  const ShardIndex index = parse_shard_index(bytes, "fuzz");
  (void)index.files();
  try {
    const ShardIndex again = parse_shard_index(shard_index_text(index), "round trip");
    if (again.total_size != index.total_size || again.metadata != index.metadata ||
        again.weight_map != index.weight_map)
      throw std::logic_error("an index written back parsed to another index");
  } catch (const Error& e) {
    throw std::logic_error(std::string("an index written by shard_index_text was rejected: ") + e.what());
  }
}

}  // namespace apex::fuzz
