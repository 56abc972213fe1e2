#pragma once
/// \file validation.hpp
/// The trained model on the whole validation text — skip gates as learned
/// and forced open — next to the unigram and bigram baselines.

#include <apex/ffn/core/types.hpp>

#include <cmath>
#include <cstddef>
#include <vector>

#include "char_model.hpp"
#include "evaluate.hpp"
#include "text_data.hpp"

namespace apex::demo {

struct ValidationSummary {
  EvalResult learned;      ///< skip gates as learned
  EvalResult open;         ///< every skip gate forced open
  double bigram_nll = 0;   ///< bigram baseline, nats per character
  double unigram_nll = 0;  ///< the training text's character frequencies, nats per character
};

/// Mean negative log-likelihood (nats) of the first `tokens` validation
/// characters under the training text's character frequencies (add-0.1).
inline double unigram_nll(const Corpus& corpus, Index tokens) {
  std::vector<double> f(std::size_t(corpus.vocab.size()), 0.1);
  for (Index t : corpus.train) f[std::size_t(t)] += 1;
  double total = 0;
  for (double x : f) total += x;
  double nll = 0;
  for (Index i = 0; i < tokens; ++i) nll -= std::log(f[std::size_t(corpus.val[std::size_t(i)])] / total);
  return nll / double(tokens);
}

/// Scores every validation position with the gates as learned and forced
/// open (they are closed again after), and the baselines on the same positions.
inline ValidationSummary evaluate_on_validation(CharModel<float>& model, const Corpus& corpus, Index pad) {
  ValidationSummary v;
  const Index val_tokens = Index(corpus.val.size());
  v.learned = evaluate(model, corpus.val, 0, val_tokens, pad);
  model.set_gates_open(true);
  v.open = evaluate(model, corpus.val, 0, val_tokens, pad);
  model.set_gates_open(false);
  const BigramBaseline bigram(corpus.train, corpus.vocab.size());
  v.bigram_nll = bigram.mean_nll(corpus.val, 0, v.learned.tokens);
  v.unigram_nll = unigram_nll(corpus, v.learned.tokens);
  return v;
}

}  // namespace apex::demo
