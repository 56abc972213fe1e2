#pragma once
/// \file packed_run.hpp
/// The packed inference copy of the trained model (FFN weights in bf16 or
/// float), evaluated and decoded exactly as the float model was.

#include <apex/ffn/core/types.hpp>

#include <chrono>
#include <cstddef>
#include <cstdio>
#include <optional>
#include <string>
#include <type_traits>

#include "char_model.hpp"
#include "decode_runs.hpp"
#include "evaluate.hpp"
#include "packed_char_model.hpp"
#include "text_data.hpp"

namespace apex::demo {

/// The packed inference copy of the trained model, measured as the float one is.
struct PackedRun {
  std::string weights;  ///< "bf16" or "float"
  EvalResult eval;      ///< the whole validation text, skip gates as learned
  DecodeRuns decode;    ///< same prompts, lengths and sampling seed as the float model's
  std::size_t ffn_bytes = 0;  ///< packed FFN weights of all sublayers, padding included
  double seconds = 0;         ///< packing, evaluation and decoding
};

template <class Storage>
PackedRun run_packed(const CharModel<float>& trained, const Corpus& corpus, Index pad, int threads,
                     const DecodeSetup& decoding) {
  const auto t0 = std::chrono::steady_clock::now();
  PackedRun r;
  r.weights = std::is_same_v<Storage, float> ? "float" : "bf16";
  PackedCharModel<Storage> m = pack_model<Storage>(trained);
  m.set_threads(threads);
  for (auto& s : m.dense_layers()) r.ffn_bytes += s.ffn().bytes();
  for (auto& s : m.moe_layers()) r.ffn_bytes += s.ffn().expert_bytes();
  r.eval = evaluate(m, corpus.val, 0, Index(corpus.val.size()), pad);
  r.decode = decode_prompts(m, decoding, pad);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

/// The packed copy in `weights` ("bf16", "float"; "none": no copy), its
/// validation loss printed against the float model's `float_loss`.
inline std::optional<PackedRun> run_packed_copy(const std::string& weights, const CharModel<float>& trained,
                                                const Corpus& corpus, Index pad, int threads,
                                                const DecodeSetup& decoding, double float_loss) {
  if (weights == "none") return std::nullopt;
  std::printf("packing the FFN layers (%s) for inference, evaluating and decoding...\n", weights.c_str());
  std::fflush(stdout);
  std::optional<PackedRun> inf = weights == "bf16" ? run_packed<packed::bf16>(trained, corpus, pad, threads, decoding)
                                                   : run_packed<float>(trained, corpus, pad, threads, decoding);
  std::printf("  %s FFN weights: validation loss %.6f nats/char vs float %.6f (relative difference %+.2e)\n",
              inf->weights.c_str(), inf->eval.loss, float_loss, (inf->eval.loss - float_loss) / float_loss);
  std::fflush(stdout);
  return inf;
}

}  // namespace apex::demo
