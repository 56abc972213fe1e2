#pragma once
/// \file decode.hpp
/// Text generation with the demo model: plain autoregressive decoding (one
/// main-model forward per character) and speculative decoding, where the
/// multi-token heads draft the next N characters and one main-model forward
/// over N+1 context windows verifies them (`layers/speculative.hpp`).
///
/// The model has no attention and no key/value cache: "running the main
/// model on [x_{t+1}, d_0, …, d_{N−1}]" is one forward pass over the N+1
/// context windows that end at each of those tokens — one batched step, as a
/// transformer's verification pass would be.
///
/// Both work on any CharModel: the training layers or packed inference
/// layers (packed_char_model.hpp).

#include <apex/ffn/layers/cross_entropy.hpp>
#include <apex/ffn/core/init.hpp>
#include <apex/ffn/layers/speculative.hpp>

#include <cmath>
#include <vector>

#include "char_model.hpp"

namespace apex::demo {

/// Context windows (one per row) that end after `seq` followed by the first
/// `i` drafts, for i = 0 … drafts.size().
inline ContextIds draft_windows(const std::vector<Index>& seq, const std::vector<Index>& drafts, Index context,
                                Index pad) {
  const Index rows = Index(drafts.size()) + 1;
  ContextIds ids(rows, context);
  for (Index i = 0; i < rows; ++i) {
    // window of the sequence seq ++ drafts[0..i): its last `context` tokens
    const Index len = Index(seq.size()) + i;
    for (Index j = 0; j < context; ++j) {
      const Index q = len - context + j;
      ids(i, j) = q < 0 ? pad : (q < Index(seq.size()) ? seq[std::size_t(q)] : drafts[std::size_t(q - Index(seq.size()))]);
    }
  }
  return ids;
}

/// Draws a token from softmax(z / temperature) of one row of logits.
template <class Row>
Index sample_logits(const Row& z, double temperature, Rng& rng) {
  const Eigen::ArrayXd w = ((z.template cast<double>().array() - double(z.maxCoeff())) / temperature).exp();
  double u = rng.uniform() * w.sum();
  for (Index j = 0; j < w.size(); ++j) {
    u -= w(j);
    if (u < 0) return j;
  }
  return w.size() - 1;
}

/// Plain decoding: `n` tokens after `prompt`, each from one forward pass;
/// greedy when temperature ≤ 0.
template <class T, class Layers>
std::vector<Index> generate(const CharModel<T, Layers>& model, std::vector<Index> seq, Index n, double temperature, Rng& rng,
                            Index pad) {
  std::vector<Index> out;
  for (Index s = 0; s < n; ++s) {
    const auto o = model.forward(draft_windows(seq, {}, model.context(), pad));
    const Index next = temperature > 0 ? sample_logits(o.logits.row(0), temperature, rng) : detail::argmax(o.logits.row(0));
    seq.push_back(next);
    out.push_back(next);
  }
  return out;
}

struct SpeculativeRun {
  std::vector<Index> tokens;  ///< the generated tokens
  SpeculativeStats stats;     ///< verification steps, drafts, acceptances
};

/// Speculative decoding of at least `n` tokens after `prompt`. Greedy
/// (temperature ≤ 0) reproduces `generate(…, 0, …)` exactly; sampled
/// (temperature > 0) is distributed as plain sampling from the main model at
/// that temperature, with the heads' own tempered softmax as the draft
/// distribution q. One prefill forward picks the first token; every further
/// main-model forward is one verification step in `stats`.
template <class T, class Layers>
SpeculativeRun speculative_generate(const CharModel<T, Layers>& model, std::vector<Index> seq, Index n, double temperature,
                                    Rng& rng, Index pad) {
  const bool sample = temperature > 0;
  const double inv_t = sample ? 1.0 / temperature : 1.0;
  SpeculativeRun run;
  // Prefill: the main head picks x_{t+1}, the heads draft from the same h_t.
  auto o = model.forward(draft_windows(seq, {}, model.context(), pad));
  Index next = sample ? sample_logits(o.logits.row(0), temperature, rng) : detail::argmax(o.logits.row(0));
  auto draft_from = [&](const typename CharModel<T, Layers>::Output& out, Index row) {
    const Matrix<T> z = model.mtp().draft_logits(out.head_logits, row) * T(inv_t);  // N × V
    return sample ? draft_sample(z, rng) : draft_greedy(z);
  };
  SpeculativeDraft<T> draft = draft_from(o, 0);
  while (Index(run.tokens.size()) < n) {
    seq.push_back(next);
    run.tokens.push_back(next);
    // One main-model step over the windows ending at next, d_0, …, d_{N−1}.
    o = model.forward(draft_windows(seq, draft.tokens, model.context(), pad));  // (N+1) rows
    VerifyResult v;
    if (sample) {
      const Matrix<T> p = softmax_rows(o.logits * T(inv_t));  // (N+1) × V
      v = verify_sampling(draft.tokens, draft.probs, p, rng);
    } else {
      v = verify_greedy(draft.tokens, o.logits);
    }
    run.stats.add(v);
    // Accepted drafts join the sequence; the step's own token is the next x_{t+1},
    // and row `accepted` (the window ending at the last accepted token) drafts again.
    for (Index i = 0; i < v.accepted; ++i) {
      seq.push_back(v.tokens[std::size_t(i)]);
      run.tokens.push_back(v.tokens[std::size_t(i)]);
    }
    next = v.tokens.back();
    draft = draft_from(o, v.accepted);
  }
  return run;
}

}  // namespace apex::demo
