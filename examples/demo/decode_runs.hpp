#pragma once
/// \file decode_runs.hpp
/// The demo's decoding experiment: greedy and sampled speculative decoding
/// after each prompt, with plain greedy decoding alongside to check that
/// speculation changes nothing, on any CharModel (float or packed).

#include <apex/ffn/core/init.hpp>
#include <apex/ffn/layers/speculative.hpp>
#include <apex/ffn/core/types.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "char_model.hpp"
#include "decode.hpp"
#include "text_data.hpp"

namespace apex::demo {

/// The prompts and sampling settings every decoding of a demo run uses.
struct DecodeSetup {
  std::vector<std::string> prompts;
  std::vector<std::vector<Index>> prompt_ids;  ///< the prompts, encoded
  Index gen_tokens = 300;                      ///< characters generated after each prompt
  double temperature = 0.8;                    ///< of the sampled runs
  std::uint64_t seed = 0;                      ///< prompt i samples from a stream seeded seed + i
};

/// The demo's three prompts, encoded with `vocab`; sampling seeded from `seed`.
inline DecodeSetup demo_decode_setup(const Vocabulary& vocab, std::uint64_t seed) {
  DecodeSetup d;
  d.prompts = {"And God said", "And the LORD spake unto Moses, saying,", "In the beginning"};
  for (const auto& prompt : d.prompts) d.prompt_ids.push_back(vocab.encode(prompt));
  d.seed = seed + 2000;
  return d;
}

/// Greedy and sampled speculative decoding after each prompt.
struct DecodeRuns {
  SpeculativeStats greedy, sampled;
  std::vector<std::vector<Index>> greedy_tokens, sampled_tokens;  ///< per prompt
  bool greedy_matches = true;  ///< speculative greedy == plain greedy on every prompt
};

inline void accumulate(SpeculativeStats& total, const SpeculativeStats& s) {
  total.steps += s.steps;
  total.drafted += s.drafted;
  total.accepted += s.accepted;
  total.emitted += s.emitted;
}

/// Prompt i samples from its own stream, seeded `seed + i` (greedy draws
/// nothing), so two models decoded with the same seed see the same random
/// numbers on every prompt, even after one prompt's texts have diverged.
template <class M>
DecodeRuns decode_prompts(const M& model, const std::vector<std::vector<Index>>& prompts, Index n, double temperature,
                          std::uint64_t seed, Index pad) {
  DecodeRuns d;
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    const std::vector<Index>& ids = prompts[i];
    Rng rng(seed + i);
    const SpeculativeRun g = speculative_generate(model, ids, n, 0.0, rng, pad);
    const std::vector<Index> plain = generate(model, ids, Index(g.tokens.size()), 0.0, rng, pad);
    d.greedy_matches = d.greedy_matches && plain == g.tokens;
    accumulate(d.greedy, g.stats);
    d.greedy_tokens.push_back(g.tokens);
    const SpeculativeRun r = speculative_generate(model, ids, n, temperature, rng, pad);
    accumulate(d.sampled, r.stats);
    d.sampled_tokens.push_back(r.tokens);
  }
  return d;
}

/// `decode_prompts` with the settings of `d`.
template <class M>
DecodeRuns decode_prompts(const M& model, const DecodeSetup& d, Index pad) {
  return decode_prompts(model, d.prompt_ids, d.gen_tokens, d.temperature, d.seed, pad);
}

/// Decodes the trained float model in inference mode (skipped tokens skip
/// their FFN), then returns it to training mode.
inline DecodeRuns decode_trained(CharModel<float>& model, const DecodeSetup& d, Index pad) {
  model.set_mode(SublayerMode::inference);
  DecodeRuns runs = decode_prompts(model, d, pad);
  model.set_mode(SublayerMode::training);
  return runs;
}

/// How many of the first `n` tokens two decodings share before they differ.
inline Index common_prefix(const std::vector<Index>& a, const std::vector<Index>& b, Index n) {
  Index i = 0;
  while (i < n && std::size_t(i) < a.size() && std::size_t(i) < b.size() && a[std::size_t(i)] == b[std::size_t(i)]) ++i;
  return i;
}

}  // namespace apex::demo
