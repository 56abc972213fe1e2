#pragma once
// Plain references for the multi-token tests: token ids from a list or a
// seeded draw, cross-entropy and argmax written the plain way, and the
// multi-token loss of docs/math.md#multi-token-prediction position by
// position, for the fused implementations to be checked against.

#include <apex/ffn/core/init.hpp>
#include <apex/ffn/core/types.hpp>
#include <apex/ffn/layers/cross_entropy.hpp>
#include <apex/ffn/layers/multi_token_heads.hpp>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <vector>

namespace apex::test {

inline TokenIds ids(std::initializer_list<Index> v) {
  TokenIds t(Index(v.size()));
  Index i = 0;
  for (Index x : v) t(i++) = x;
  return t;
}

inline TokenIds random_labels(Index n, Index vocab, std::uint64_t seed) {
  Rng rng(seed);
  TokenIds t(n);
  for (Index i = 0; i < n; ++i) t(i) = Index(rng.index(std::uint64_t(vocab)));
  return t;
}

// −log softmax(z)_y written the plain way: log Σ exp(z) − z_y (fine for the
// small logits it is used with).
inline double plain_ce(const Matrix<double>& z, Index row, Index y) {
  double s = 0;
  for (Index j = 0; j < z.cols(); ++j) s += std::exp(z(row, j));
  return std::log(s) - z(row, y);
}

inline bool plain_correct(const Matrix<double>& z, Index row, Index y) {
  Index best = 0;
  for (Index j = 1; j < z.cols(); ++j)
    if (z(row, j) > z(row, best)) best = j;
  return best == y;
}

// The loss of docs/math.md#multi-token-prediction, position by position: main
// target labels[t]; head k's target labels[t + k] (the token t+1+k) when it exists.
struct PlainLoss {
  double total = 0, main = 0;
  std::vector<double> heads, acc;
  std::vector<Index> counts;
};

inline PlainLoss plain_mtp_loss(const Matrix<double>& zm, const Matrix<double>& zh, const TokenIds& labels, Index heads,
                         double lambda, bool average, Index ignore = kIgnoreIndex) {
  const Index n = zm.rows(), vocab = zm.cols();
  PlainLoss out;
  double sum = 0;
  Index count = 0;
  for (Index t = 0; t < n; ++t)
    if (labels(t) != ignore) {
      sum += plain_ce(zm, t, labels(t));
      ++count;
    }
  out.main = count ? sum / double(count) : 0;
  out.total = out.main;
  for (Index k = 1; k <= heads; ++k) {
    const Matrix<double> block = zh.middleCols((k - 1) * vocab, vocab);
    double s = 0;
    Index c = 0, right = 0;
    for (Index t = 0; t < n; ++t) {
      if (t + k >= labels.size() || labels(t + k) == ignore) continue;
      s += plain_ce(block, t, labels(t + k));
      right += plain_correct(block, t, labels(t + k)) ? 1 : 0;
      ++c;
    }
    out.heads.push_back(c ? s / double(c) : 0);
    out.acc.push_back(c ? double(right) / double(c) : 0);
    out.counts.push_back(c);
    out.total += (average ? lambda / double(heads) : lambda) * out.heads.back();
  }
  return out;
}

}  // namespace apex::test
