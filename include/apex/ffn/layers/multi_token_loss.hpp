#pragma once
/// \file layers/multi_token_loss.hpp
/// The multi-token prediction loss from logits already computed
/// (docs/math.md#multi-token-prediction):
///
///     L = L_main + w · Σ_{k=1..N} L_k,    w = λ (default 0.1), or λ/N with `average_heads`
///
/// each term the mean cross-entropy over the positions that have a target;
/// head i = k − 1 predicts the token at t+2+i. The heads themselves are
/// layers/multi_token_heads.hpp.

#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

#include "../core/errors.hpp"
#include "../core/scalar_range.hpp"
#include "../core/types.hpp"
#include "cross_entropy.hpp"

namespace apex {

/// Configuration of MultiTokenHeads and of `multi_token_loss`.
struct MultiTokenOptions {
  Index num_heads = 4;                ///< N ≥ 0 extra heads (0: the loss is L_main alone)
  double lambda = 0.1;                ///< λ ≥ 0, weight of the heads' losses
  bool average_heads = false;         ///< false: λ·Σ_k L_k; true: λ·(1/N)·Σ_k L_k (the APEX-1 code's choice)
  /// Label meaning "no target"; must lie outside [0, V) (ConfigError).
  /// Stricter than `cross_entropy`, which accepts any value: the labels here
  /// are the token stream itself, each read by the main head and by N heads
  /// at other offsets, and the loss also uses the ignore index for positions
  /// whose target lies past the labels. A real token id there would silently
  /// drop that token from all N + 1 terms; mark padding with −100 instead.
  Index ignore_index = kIgnoreIndex;
};

/// Value and parts of the multi-token loss.
struct MultiTokenLoss {
  double total = 0;                      ///< L = L_main + w·Σ_k L_k
  double head_weight = 0;                ///< w: λ, or λ/N with average_heads
  CrossEntropyStats main;                ///< the main head (token t+1)
  std::vector<CrossEntropyStats> heads;  ///< heads[i]: head i = k − 1 (token t+2+i)
};

namespace detail {

/// ConfigError for options out of range; λ (and the gradient weights λ/count
/// derived from it) is converted to T, so it must fit T.
template <class T>
void check_mtp_options(const char* where, const MultiTokenOptions& opt, Index vocab) {
  require_config(opt.num_heads >= 0, where, "num_heads must be >= 0, got " + std::to_string(opt.num_heads));
  require_config(std::isfinite(opt.lambda) && opt.lambda >= 0, where,
                 "lambda must be finite and >= 0, got " + std::to_string(opt.lambda));
  require_fits<T>(where, "lambda", opt.lambda);
  require_config(opt.ignore_index < 0 || opt.ignore_index >= vocab, where,
                 "ignore_index " + std::to_string(opt.ignore_index) + " is a real token id in [0, " +
                     std::to_string(vocab) + ")");
}

}  // namespace detail

/// The multi-token loss from logits already computed.
///
/// - `main_logits`: n × V, the main head's logits at positions 0..n−1.
/// - `head_logits`: n × N·V, head i's logits in columns [i·V, (i+1)·V)
///   (the output of MultiTokenHeads::forward).
/// - `labels`: m ≥ n next-token labels, `labels[t]` = the token at position
///   t+1 (or the ignore index). The main head's target at t is `labels[t]`;
///   head i's (k = i+1) is `labels[t+k]`, the token at t+1+k, when t+k < m,
///   else none. Usually m = n (`labels` = the input shifted left by one);
///   m > n supplies look-ahead tokens past the window, so the last positions'
///   heads have targets too.
///
/// If `dmain` / `dheads` are given they are resized (n × V / n × N·V) and
/// receive ∂L/∂main_logits and ∂L/∂head_logits. Pass `dheads` to
/// MultiTokenHeads::backward, and `dmain` to the main head's backward.
/// Either may be the matrix its logits argument refers to (the gradient then
/// overwrites the logits). Throws ShapeError (including `main_logits`
/// without columns), ValueError (label out of range, non-finite logits) or
/// ConfigError (options).
template <class D1, class D2>
MultiTokenLoss multi_token_loss(const Eigen::MatrixBase<D1>& main_logits, const Eigen::MatrixBase<D2>& head_logits,
                                const ConstTokenRef& labels, const MultiTokenOptions& opt,
                                Matrix<typename D1::Scalar>* dmain = nullptr,
                                Matrix<typename D1::Scalar>* dheads = nullptr) {
  using T = typename D1::Scalar;
  static_assert(std::is_same<T, typename D2::Scalar>::value, "main and head logits must share a scalar type");
  constexpr const char* where = "multi_token_loss";
  const ConstMatrixRef<T> zm(main_logits);  // n × V
  const ConstMatrixRef<T> zh(head_logits);  // n × N·V
  const Index n = zm.rows(), vocab = zm.cols(), heads = opt.num_heads, m = labels.rows();
  detail::check_vocab(where, "main_logits", vocab);
  detail::check_mtp_options<T>(where, opt, vocab);
  detail::check_shape(where, "head_logits", zh, n, heads * vocab);
  if (m < n) detail::check_shape(where, "labels", m, 1, n, 1);  // fewer labels than positions
  const Index ignore = opt.ignore_index;
  for (Index j = 0; j < m; ++j) detail::check_token(where, "labels", j, labels(j), vocab, ignore);

  MultiTokenLoss out;
  out.head_weight = heads == 0 ? 0.0 : (opt.average_heads ? opt.lambda / double(heads) : opt.lambda);
  if (dmain && (dmain->rows() != n || dmain->cols() != vocab)) dmain->resize(n, vocab);
  if (dheads && (dheads->rows() != n || dheads->cols() != heads * vocab)) dheads->resize(n, heads * vocab);

  // Main head: target of position t is labels[t] (the token t+1).
  {
    Index count = 0;
    for (Index t = 0; t < n; ++t) count += labels(t) != ignore ? 1 : 0;
    double sum = 0;
    auto target = [&](Index t) { return labels(t); };
    detail::cross_entropy_rows<T>(where, zm, target, ignore, count, 1.0, dmain, sum, out.main.correct);
    out.main.count = count;
    out.main.loss = count > 0 ? sum / double(count) : 0.0;
  }
  out.total = out.main.loss;

  // Head i (k = i + 1): target of position t is labels[t + k] (the token
  // t+1+k), none when t + k runs past the labels.
  out.heads.resize(std::size_t(heads));
  for (Index i = 0; i < heads; ++i) {
    const Index k = i + 1;
    auto target = [&](Index t) { return t + k < m ? labels(t + k) : ignore; };
    Index count = 0;
    for (Index t = 0; t < n; ++t) count += target(t) != ignore ? 1 : 0;
    const auto block = zh.middleCols(i * vocab, vocab);  // n × V
    double sum = 0;
    CrossEntropyStats& s = out.heads[std::size_t(i)];
    if (dheads) {
      auto g = dheads->middleCols(i * vocab, vocab);  // n × V
      detail::cross_entropy_rows<T>(where, block, target, ignore, count, out.head_weight, &g, sum, s.correct);
    } else {
      Matrix<T>* none = nullptr;
      detail::cross_entropy_rows<T>(where, block, target, ignore, count, out.head_weight, none, sum, s.correct);
    }
    s.count = count;
    s.loss = count > 0 ? sum / double(count) : 0.0;
    out.total += out.head_weight * s.loss;
  }
  return out;
}

}  // namespace apex
