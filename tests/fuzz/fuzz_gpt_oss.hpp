#pragma once
// What the gpt-oss checkpoint fuzzer does with one input, shared by the
// libFuzzer target (fuzz_gpt_oss.cpp) and the replay test
// (test_gpt_oss_checkpoint.cpp), so an input committed under
// tests/fuzz/regressions_gpt_oss/ replays the exact code path.
//
// Contract under test: any byte string, read as a safetensors file and
// loaded by load_gpt_oss_checkpoint into a small gpt-oss block (d = f = 32,
// E = 2, K = 1: MXFP4 and dense forms both fit), either loads or throws an
// apex::Error. Anything else — a crash, a sanitizer report, another
// exception type — is a bug. Two properties, else std::logic_error (never
// an apex::Error): a rejected load leaves the layer bitwise as it was, and
// an accepted one holds finite weights only (the loader refuses NaN, Inf
// and MXFP4 blocks beyond float), so a forward of a finite batch runs.

#include <apex/ffn/io/gpt_oss_checkpoint.hpp>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

namespace apex::fuzz {

inline constexpr Index kGptOssD = 32, kGptOssF = 32, kGptOssE = 2;

inline MoEConfig fuzz_gpt_oss_config() { return gpt_oss_moe(kGptOssD, kGptOssF, kGptOssE, 1); }

inline std::vector<float> gpt_oss_values(GptOssMoE<float>& moe) {
  std::vector<float> all;
  for (auto& p : moe.param_values()) all.insert(all.end(), p.value().data(), p.value().data() + p.value().size());
  return all;
}

/// Whether a load (strict, else lenient) accepted the input.
inline bool exercise_gpt_oss(const std::uint8_t* data, std::size_t size) {
  const auto file = safetensors::Reader::from_memory(data, size);
  GptOssMoE<float> moe(fuzz_gpt_oss_config(), 7);
  const std::vector<float> before = gpt_oss_values(moe);
  LoadOptions lenient;
  lenient.allow_unexpected = true;
  for (const LoadOptions& options : {LoadOptions{}, lenient}) {
    try {
      (void)load_gpt_oss_checkpoint(file, moe, "", options);
    } catch (const Error&) {
      const std::vector<float> after = gpt_oss_values(moe);
      if (after.size() != before.size() || std::memcmp(after.data(), before.data(), after.size() * sizeof(float)) != 0)
        throw std::logic_error("a rejected gpt-oss load changed the layer");
      continue;
    }
    for (float v : gpt_oss_values(moe))
      if (!std::isfinite(v)) throw std::logic_error("an accepted gpt-oss load holds a non-finite weight");
    const Matrix<float> x = Matrix<float>::Constant(2, kGptOssD, 0.5f);  // 2 × d
    (void)moe.forward(x);
    return true;
  }
  return false;
}

}  // namespace apex::fuzz
