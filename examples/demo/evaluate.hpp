#pragma once
/// \file evaluate.hpp
/// Held-out evaluation of the demo model: cross-entropy and bits per
/// character of the main head, accuracy of every multi-token head, and how
/// many tokens each skip gate dropped. Runs in inference mode, so skipped
/// tokens really skip their FFN.

#include <algorithm>
#include <cmath>
#include <vector>

#include "char_model.hpp"
#include "text_data.hpp"

namespace apex::demo {

/// Validation characters of the quick evaluations: during training, and of
/// the model reloaded from a checkpoint.
inline constexpr Index kQuickEvalTokens = 8192;

struct EvalResult {
  Index tokens = 0;               ///< positions scored by the main head
  double loss = 0;                ///< main head: mean cross-entropy, nats
  double bpc() const { return loss / std::log(2.0); }
  double main_accuracy = 0;       ///< main head: argmax = next character
  std::vector<double> head_accuracy;  ///< head i: argmax = character t+2+i
  std::vector<double> head_loss;      ///< head i: mean cross-entropy, nats
  std::vector<double> skip_rate;      ///< per layer: skipped share of the tokens
  double mean_skip_rate() const {
    double s = 0;
    for (double r : skip_rate) s += r;
    return skip_rate.empty() ? 0.0 : s / double(skip_rate.size());
  }
};

/// Scores positions `first … first + count − 1` of `text` (clipped to it) in
/// sequences of `chunk_len`, `chunks` sequences per forward pass. Any
/// CharModel: on the training layers or on packed inference layers.
template <class T, class Layers>
EvalResult evaluate(CharModel<T, Layers>& model, const std::vector<Index>& text, Index first, Index count, Index pad,
                    Index chunk_len = 256, Index chunks = 4) {
  const SublayerMode saved = model.mode();
  model.set_mode(SublayerMode::inference);
  count = std::min<Index>(count, Index(text.size()) - first);
  const Index n_chunks = count / chunk_len;  // whole chunks only: every batch has the same shape
  const Index heads = model.mtp().num_heads();
  EvalResult r;
  r.head_accuracy.assign(std::size_t(heads), 0.0);
  r.head_loss.assign(std::size_t(heads), 0.0);
  r.skip_rate.assign(std::size_t(model.n_layers()), 0.0);
  double loss_sum = 0, correct = 0;
  std::vector<double> head_sum(std::size_t(heads), 0.0), head_correct(std::size_t(heads), 0.0),
      head_count(std::size_t(heads), 0.0);
  typename CharModel<T, Layers>::Cache cache;
  Index batches = 0;
  for (Index c0 = 0; c0 < n_chunks; c0 += chunks) {
    std::vector<Index> starts;
    for (Index c = c0; c < std::min(n_chunks, c0 + chunks); ++c) starts.push_back(first + c * chunk_len);
    const Batch b = make_batch(text, starts, chunk_len, model.context(), heads, pad);
    const auto out = model.forward(b.context, &cache);
    const BatchLoss l = model.loss(out, b);
    loss_sum += l.main.loss * double(l.main.count);
    correct += double(l.main.correct);
    r.tokens += l.main.count;
    for (std::size_t i = 0; i < std::size_t(heads); ++i) {
      head_sum[i] += l.heads[i].loss * double(l.heads[i].count);
      head_correct[i] += double(l.heads[i].correct);
      head_count[i] += double(l.heads[i].count);
    }
    const std::vector<double> sr = model.skip_rates(cache);
    for (std::size_t j = 0; j < sr.size(); ++j) r.skip_rate[j] += sr[j] * double(b.rows());
    batches += b.rows();
  }
  if (r.tokens > 0) {
    r.loss = loss_sum / double(r.tokens);
    r.main_accuracy = correct / double(r.tokens);
  }
  for (std::size_t i = 0; i < std::size_t(heads); ++i)
    if (head_count[i] > 0) {
      r.head_loss[i] = head_sum[i] / head_count[i];
      r.head_accuracy[i] = head_correct[i] / head_count[i];
    }
  if (batches > 0)
    for (double& s : r.skip_rate) s /= double(batches);
  model.set_mode(saved);
  return r;
}

}  // namespace apex::demo
