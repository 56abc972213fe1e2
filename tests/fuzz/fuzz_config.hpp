#pragma once
// What the config.json fuzzer does with one input, shared by the libFuzzer
// target (fuzz_hf_config.cpp) and the replay test (test_hf_config.cpp), so
// an input committed under tests/fuzz/regressions_config/ replays the exact
// code path.
//
// Contract under test: any byte string, read as a config.json by
// parse_hf_config and by parse_gpt_oss_config, either gives a configuration
// or throws an apex::Error (FormatError for malformed text or a missing or
// mistyped key, ConfigError for a value the layer cannot take). Anything
// else — a crash, a sanitizer report (signed overflow of a width), another
// exception type — is a bug. One property of accepted input: what the
// readers return is what the float layers accept (their validate_for<float>
// and RMSNorm's ε rule), else std::logic_error, which is never an
// apex::Error.

#include <apex/ffn/io/hf_config.hpp>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

namespace apex::fuzz {

// The layer-side checks of an accepted reading; a failure is a reader bug.
inline void check_accepted(const MoEConfig& moe, double rms_eps, const char* reader) {
  try {
    moe.validate_for<float>("fuzz");
    (void)moe.shared_ffn();
  } catch (const Error& e) {
    throw std::logic_error(std::string(reader) + " returned a config the float layer refuses: " + e.what());
  }
  if (!(rms_eps > 0) || !(float(rms_eps) > 0) || !(rms_eps <= 3.4028234663852886e38))
    throw std::logic_error(std::string(reader) + " returned an rms_norm_eps RMSNorm<float> refuses");
}

inline void exercise_config(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const HfModelConfig c = parse_hf_config(text, "fuzz");
    check_accepted(c.moe, c.rms_eps, "parse_hf_config");
    for (Index layer = -1; layer <= c.n_layers && layer < 64; ++layer) (void)c.is_moe_layer(layer);
  } catch (const Error&) {
  }
  const GptOssModelConfig g = parse_gpt_oss_config(text, "fuzz");
  check_accepted(g.moe, g.rms_eps, "parse_gpt_oss_config");
  try {
    g.experts.validate_for<float>("fuzz");
  } catch (const Error& e) {
    throw std::logic_error(std::string("parse_gpt_oss_config returned options the float layer refuses: ") + e.what());
  }
}

}  // namespace apex::fuzz
