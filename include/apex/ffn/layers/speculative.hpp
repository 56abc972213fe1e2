#pragma once
/// \file layers/speculative.hpp
/// Speculative decoding with multi-token heads (docs/math.md#speculative-decoding):
/// the heads draft N tokens, the main model verifies them in one forward pass.
///
/// One decode step, given hidden state `h_t` whose main-head token `x_{t+1}`
/// is already chosen:
///   1. draft `d_0..d_{N−1}` for positions t+2..t+1+N from the heads at `h_t`
///      (`draft_greedy` / `draft_sample`);
///   2. run the main model once on `[x_{t+1}, d_0, …, d_{N−1}]`; its N+1
///      next-token distributions `p_0..p_N` are the targets: `p_i` is the
///      distribution of the position `d_i` occupies, `p_N` the one after the
///      last draft;
///   3. `verify_greedy` / `verify_sampling` emit the accepted drafts and then
///      one token of the main model's own (at the first rejection, or a bonus
///      token when all are accepted), so every step emits 1..N+1 tokens.
///
/// Greedy: accept the longest prefix with `d_i = argmax p_i`, then emit
/// `argmax p_a` (a = number accepted). The output equals greedy decoding with
/// the main model alone.
///
/// Sampling (Leviathan et al. 2023; Chen et al. 2023): accept `d_i` with
/// probability `min(1, p_i(d_i)/q_i(d_i))`, `q_i` the distribution it was
/// drawn from; at the first rejection emit a sample of
/// `normalise(max(0, p_i − q_i))` and stop; if all are accepted emit a sample
/// of `p_N`. The emitted sequence is distributed exactly as sampling from the
/// main model alone, whatever q is. (The APEX-1 code accepts with a uniform q
/// and resamples from p, which is biased toward the drafts.)
///
/// Nothing here depends on attention or on the model: callers pass the
/// heads' logits and the main model's distributions.

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

#include "cross_entropy.hpp"
#include "../core/errors.hpp"
#include "../core/init.hpp"
#include "../core/types.hpp"

namespace apex {

/// Tokens drafted by the heads for one decode step.
template <class T>
struct SpeculativeDraft {
  std::vector<Index> tokens;  ///< N drafts: tokens[i] from head i (position t+2+i)
  Matrix<T> probs;            ///< N × V: the distributions q_i they were sampled from (empty when greedy)
};

/// Outcome of verifying one draft.
struct VerifyResult {
  std::vector<Index> tokens;  ///< emitted: the accepted drafts, then one main-model token
  Index drafted = 0;          ///< N
  Index accepted = 0;         ///< drafts accepted, 0..N
  /// Tokens this main-model step produced: accepted + 1.
  Index emitted() const { return Index(tokens.size()); }
  /// True when every draft was accepted (the last token is the bonus token).
  bool all_accepted() const { return accepted == drafted; }
};

/// Running totals over decode steps, for measuring acceptance.
struct SpeculativeStats {
  Index steps = 0;     ///< main-model forward passes (verify calls)
  Index drafted = 0;   ///< Σ N
  Index accepted = 0;  ///< Σ accepted drafts
  Index emitted = 0;   ///< Σ emitted tokens
  std::vector<Index> accepted_histogram;  ///< [a]: steps that accepted exactly a drafts

  void add(const VerifyResult& r) {
    ++steps;
    drafted += r.drafted;
    accepted += r.accepted;
    emitted += r.emitted();
    if (Index(accepted_histogram.size()) <= r.accepted) accepted_histogram.resize(std::size_t(r.accepted) + 1, 0);
    ++accepted_histogram[std::size_t(r.accepted)];
  }
  /// accepted / drafted (0 before any draft).
  double acceptance_rate() const { return drafted > 0 ? double(accepted) / double(drafted) : 0.0; }
  /// emitted / steps: tokens per main-model forward pass (1 without speculation).
  double tokens_per_step() const { return steps > 0 ? double(emitted) / double(steps) : 0.0; }
};

namespace detail {

/// Tolerance on |Σ_j p_j − 1| for a probability row.
template <class T>
constexpr double probability_tolerance() {
  return std::is_same<T, float>::value ? 1e-3 : 1e-6;
}

/// Throws ValueError unless every row of `p` is finite, non-negative and sums to 1.
template <class T>
void check_probabilities(const char* where, const char* arg, const ConstMatrixRef<T>& p) {
  for (Index r = 0; r < p.rows(); ++r) {
    const auto row = p.row(r);
    std::string what;
    if (!row.allFinite())
      what = "contains NaN or Inf";
    else if (row.size() > 0 && row.minCoeff() < T(0))
      what = "has a negative entry";
    else if (std::abs(double(row.sum()) - 1.0) > probability_tolerance<T>())
      what = "sums to " + std::to_string(double(row.sum())) + ", not 1";
    if (!what.empty())
      throw ValueError(std::string(where) + ": argument '" + arg + "' row " + std::to_string(r) + " " + what +
                       " (expected a probability distribution)");
  }
}

/// Draws j with probability weight(j) / total, `total` = Σ_j weight(j)
/// summed in the same order; weights ≥ 0. Returns −1 when total is 0.
template <class Weight>
Index sample_weighted(Index n, const Weight& weight, double total, Rng& rng) {
  const double u = rng.uniform() * total;
  double cum = 0;
  Index last = -1;
  for (Index j = 0; j < n; ++j) {
    const double w = weight(j);
    if (w <= 0) continue;
    cum += w;
    last = j;
    if (u < cum) return j;
  }
  return last;  // u rounded up to the total: the last token with positive weight
}

/// Throws ValueError unless every draft token is in [0, vocab) (drafts have no ignore index).
inline void check_draft(const char* where, const std::vector<Index>& draft, Index vocab) {
  for (std::size_t i = 0; i < draft.size(); ++i)
    if (draft[i] < 0 || draft[i] >= vocab)
      throw ValueError(std::string(where) + ": argument 'draft' has token id " + std::to_string(draft[i]) +
                       " at position " + std::to_string(i) + ", expected a value in [0, " + std::to_string(vocab) +
                       ")");
}

}  // namespace detail

/// Greedy draft: `tokens[i] = argmax` of row i of `head_logits` (N × V, e.g.
/// MultiTokenHeads::draft_logits), ties to the lower id. `probs` stays empty.
template <class Derived>
SpeculativeDraft<typename Derived::Scalar> draft_greedy(const Eigen::MatrixBase<Derived>& head_logits) {
  constexpr const char* where = "draft_greedy";
  detail::check_vocab(where, "head_logits", head_logits.cols());
  detail::check_finite(where, "head_logits", head_logits);
  SpeculativeDraft<typename Derived::Scalar> out;
  out.tokens.resize(std::size_t(head_logits.rows()));
  for (Index i = 0; i < head_logits.rows(); ++i) out.tokens[std::size_t(i)] = detail::argmax(head_logits.row(i));
  return out;
}

/// Sampled draft: `probs` = row-wise softmax of `head_logits` (N × V), and
/// `tokens[i]` drawn from row i with `rng`. Scale the logits by 1/temperature
/// first for a tempered draft; verification uses `probs` as q.
template <class Derived>
SpeculativeDraft<typename Derived::Scalar> draft_sample(const Eigen::MatrixBase<Derived>& head_logits, Rng& rng) {
  constexpr const char* where = "draft_sample";
  detail::check_vocab(where, "head_logits", head_logits.cols());
  // Checked here, not only inside softmax_rows, so the message names this
  // function and its argument.
  detail::check_finite(where, "head_logits", head_logits);
  SpeculativeDraft<typename Derived::Scalar> out;
  out.probs = softmax_rows(head_logits);  // N × V
  const Index vocab = out.probs.cols();
  out.tokens.resize(std::size_t(out.probs.rows()));
  for (Index i = 0; i < out.probs.rows(); ++i) {
    const auto q = out.probs.row(i);
    const double total = q.template cast<double>().sum();
    out.tokens[std::size_t(i)] = detail::sample_weighted(vocab, [&](Index j) { return double(q(j)); }, total, rng);
  }
  return out;
}

/// Greedy verification. `target_scores`: (N+1) × V main-model logits (or
/// probabilities: only the argmax is used) at the drafted positions, row i
/// for draft i, row N for the position after the last draft.
/// Accepts the longest prefix with draft i = argmax row i, then emits the
/// argmax of the first mismatching row (or of row N: the bonus token).
template <class Derived>
VerifyResult verify_greedy(const std::vector<Index>& draft, const Eigen::MatrixBase<Derived>& target_scores) {
  constexpr const char* where = "verify_greedy";
  const Index n = Index(draft.size());
  detail::check_shape(where, "target_scores", target_scores, n + 1, detail::kAny);
  detail::check_vocab(where, "target_scores", target_scores.cols());
  detail::check_finite(where, "target_scores", target_scores);
  detail::check_draft(where, draft, target_scores.cols());
  VerifyResult out;
  out.drafted = n;
  out.tokens.reserve(std::size_t(n) + 1);
  for (Index i = 0; i <= n; ++i) {
    const Index best = detail::argmax(target_scores.row(i));
    out.tokens.push_back(best);  // the draft when it matches, else the main model's correction/bonus
    if (i == n || draft[std::size_t(i)] != best) break;
    ++out.accepted;
  }
  return out;
}

/// Speculative-sampling verification.
/// - `draft`: N tokens, draft i drawn from row i of `draft_probs`;
/// - `draft_probs`: N × V, the heads' distributions q_i (SpeculativeDraft::probs);
/// - `target_probs`: (N+1) × V, the main model's distributions p_i at the
///   drafted positions (row N: after the last draft). Temperature, top-k or
///   top-p belong in p and q before the call.
/// Accept draft i with probability min(1, p_i(x)/q_i(x)); at the first
/// rejection emit a sample of normalise(max(0, p_i − q_i)) and stop; after N
/// acceptances emit a sample of p_N. The emitted tokens are distributed as
/// sampling from p alone. Rows must be probability distributions
/// (ValueError otherwise), and q_i(draft i) > 0 (a draft q could not produce
/// is a caller error).
template <class D1, class D2>
VerifyResult verify_sampling(const std::vector<Index>& draft, const Eigen::MatrixBase<D1>& draft_probs,
                             const Eigen::MatrixBase<D2>& target_probs, Rng& rng) {
  using T = typename D1::Scalar;
  static_assert(std::is_same<T, typename D2::Scalar>::value, "draft and target probabilities must share a scalar type");
  constexpr const char* where = "verify_sampling";
  const Index n = Index(draft.size());
  const ConstMatrixRef<T> q(draft_probs);   // N × V
  const ConstMatrixRef<T> p(target_probs);  // (N+1) × V
  detail::check_shape(where, "target_probs", p, n + 1, detail::kAny);
  detail::check_vocab(where, "target_probs", p.cols());
  const Index vocab = p.cols();
  detail::check_shape(where, "draft_probs", q, n, vocab);
  detail::check_probabilities<T>(where, "draft_probs", q);
  detail::check_probabilities<T>(where, "target_probs", p);
  detail::check_draft(where, draft, vocab);

  VerifyResult out;
  out.drafted = n;
  out.tokens.reserve(std::size_t(n) + 1);
  for (Index i = 0; i < n; ++i) {
    const Index x = draft[std::size_t(i)];
    const double qx = double(q(i, x)), px = double(p(i, x));
    if (!(qx > 0))
      throw ValueError(std::string(where) + ": draft token " + std::to_string(x) + " at position " +
                       std::to_string(i) + " has draft probability 0: it cannot have been drawn from q");
    // Accept with probability min(1, p(x)/q(x)):  u < p/q  ⇔  u·q < p  (u ∈ [0, 1)).
    if (rng.uniform() * qx < px) {
      out.tokens.push_back(x);
      ++out.accepted;
      continue;
    }
    // Rejected: the residual r = max(0, p − q) carries exactly the mass of p
    // the draft under-proposes, so accept-or-resample reproduces p.
    auto residual = [&](Index j) { return std::max(0.0, double(p(i, j)) - double(q(i, j))); };
    double total = 0;
    for (Index j = 0; j < vocab; ++j) total += residual(j);
    Index y = detail::sample_weighted(vocab, residual, total, rng);
    if (y < 0) {
      // Σ max(0, p − q) = 0 means p = q up to rounding, where a rejection has
      // probability 0; p itself is then the residual distribution.
      auto pi = [&](Index j) { return double(p(i, j)); };
      double ptotal = 0;
      for (Index j = 0; j < vocab; ++j) ptotal += pi(j);
      y = detail::sample_weighted(vocab, pi, ptotal, rng);
    }
    out.tokens.push_back(y);
    return out;
  }
  // All accepted: one bonus token from p_N.
  auto pn = [&](Index j) { return double(p(n, j)); };
  double total = 0;
  for (Index j = 0; j < vocab; ++j) total += pn(j);
  out.tokens.push_back(detail::sample_weighted(vocab, pn, total, rng));
  return out;
}

}  // namespace apex
