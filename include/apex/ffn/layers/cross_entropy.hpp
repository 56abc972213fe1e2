#pragma once
/// \file layers/cross_entropy.hpp
/// Fused, numerically stable softmax and cross-entropy over rows of logits.
///
/// For one row of logits `z ∈ R^V` and target `y`:
///
///     m      = max_j z_j
///     lse(z) = m + log Σ_j exp(z_j − m)          (log-sum-exp)
///     CE     = lse(z) − z_y = (m − z_y) + log Σ_j exp(z_j − m)
///     ∂CE/∂z = softmax(z) − onehot(y),  softmax(z)_j = exp(z_j − m) / Σ exp(z_i − m)
///
/// Every exponent is ≤ 0 and the sum is ≥ 1, so nothing overflows and the log
/// is finite: logits of magnitude 1e4 give finite losses and gradients in
/// float and double. The loss reported over a batch is the mean over the
/// rows that have a target; a row whose target is the ignore index (PyTorch's
/// default −100) contributes neither loss nor gradient.

#include <cmath>
#include <string>

#include "../core/errors.hpp"
#include "../core/scalar_range.hpp"
#include "../core/types.hpp"

namespace apex {

/// Integer token ids, one per position (labels, targets).
using TokenIds = Eigen::Matrix<Index, Eigen::Dynamic, 1>;
/// Token ids by reference: binds a TokenIds, a segment of one, or an
/// `Eigen::Map<const TokenIds>` over a `std::vector<Index>`, without a copy.
using ConstTokenRef = Eigen::Ref<const TokenIds>;

/// The target that marks "no target here" (PyTorch's default `ignore_index`).
inline constexpr Index kIgnoreIndex = -100;

/// Mean cross-entropy of one term and how often its argmax was right.
struct CrossEntropyStats {
  double loss = 0;    ///< mean CE over the `count` rows with a target; 0 when there are none
  Index count = 0;    ///< rows with a target
  Index correct = 0;  ///< rows whose argmax (ties to the lower id) equals the target
  /// correct / count, 0 when there is no target.
  double accuracy() const { return count > 0 ? double(correct) / double(count) : 0.0; }
};

/// Options of `cross_entropy`.
///
/// `ignore_index` may be any value, as in PyTorch's
/// `F.cross_entropy(ignore_index=…)`, including a real token id in [0, V)
/// such as a padding id: rows whose target equals it contribute neither loss
/// nor gradient and are not counted in the mean's denominator. The id stays a
/// class of the softmax — its column is part of every other row's
/// normalisation and receives their gradient. (`multi_token_loss` instead
/// rejects an ignore index inside [0, V); see MultiTokenOptions.)
struct CrossEntropyOptions {
  Index ignore_index = kIgnoreIndex;  ///< rows with this target are skipped (any value, see above)
  double grad_scale = 1.0;            ///< the gradient written is that of `grad_scale · loss`
};

namespace detail {

/// Throws ShapeError unless a logits or probability argument has at least
/// one column (a vocabulary of ≥ 1 token).
inline void check_vocab(const char* where, const char* arg, Index cols) {
  if (cols < 1)
    throw ShapeError(std::string(where) + ": argument '" + arg + "' has 0 columns, expected a vocabulary of >= 1");
}

/// Throws ValueError unless `id` is a token in [0, vocab) or the ignore index.
inline void check_token(const char* where, const char* arg, Index pos, Index id, Index vocab, Index ignore_index) {
  if (id == ignore_index || (id >= 0 && id < vocab)) return;
  throw ValueError(std::string(where) + ": argument '" + arg + "' has token id " + std::to_string(id) +
                   " at position " + std::to_string(pos) + ", expected a value in [0, " + std::to_string(vocab) +
                   ") or the ignore index " + std::to_string(ignore_index));
}

/// Index of the largest entry of a row, ties to the lower index.
template <class Row>
Index argmax(const Row& z) {
  Index best = 0;
  for (Index j = 1; j < z.size(); ++j)
    if (z(j) > z(best)) best = j;
  return best;
}

/// Fused softmax + cross-entropy over the rows of `logits` (n × V).
///
/// `target(t)` gives row t's target (already validated: in [0, V) or
/// `ignore`); `count` is the number of rows whose target is not `ignore`.
/// With `grad` (n × V, may be the very storage of `logits`: every element is
/// read before it is written), writes ∂(scale·mean CE)/∂logits into it:
/// (scale/count)·(softmax − onehot) on rows with a target, 0 elsewhere.
/// Adds the summed (not averaged) CE to `loss_sum` and the number of correct
/// argmaxes to `correct`.
template <class T, class Target, class Grad>
void cross_entropy_rows(const char* where, const ConstMatrixRef<T>& logits, const Target& target, Index ignore,
                        Index count, double scale, Grad* grad, double& loss_sum, Index& correct) {
  const Index n = logits.rows();
  // c = scale / count: every row's gradient is c·(softmax − onehot).
  const T c = count > 0 ? T(scale / double(count)) : T(0);
  for (Index t = 0; t < n; ++t) {
    const Index y = target(t);
    if (y == ignore) {
      if (grad) grad->row(t).setZero();
      continue;
    }
    const auto z = logits.row(t);  // 1 × V
    if (!z.allFinite())
      throw ValueError(std::string(where) + ": logits of row " + std::to_string(t) + " contain NaN or Inf");
    const Index best = argmax(z);
    const T m = z(best);
    const T zy = z(y);
    correct += best == y ? 1 : 0;
    T s;  // Σ_j exp(z_j − m) ∈ [1, V]
    if (grad) {
      auto g = grad->row(t);
      g.array() = (z.array() - m).exp();  // elementwise: safe when g aliases z
      s = g.sum();
      // ∂(c·CE)/∂z_j = c·(exp(z_j − m)/s − 1[j = y])
      g *= c / s;
      g(y) -= c;
    } else {
      s = (z.array() - m).exp().sum();
    }
    // CE = (m − z_y) + log s: both terms finite, no cancellation of large values.
    loss_sum += double(m - zy) + std::log(double(s));
  }
}

}  // namespace detail

/// Row-wise softmax of `logits` (n × V), shifted by each row's max so no
/// exponential overflows. Throws ValueError on NaN/Inf.
template <class Derived>
Matrix<typename Derived::Scalar> softmax_rows(const Eigen::MatrixBase<Derived>& logits) {
  using T = typename Derived::Scalar;
  detail::check_finite("softmax_rows", "logits", logits);
  Matrix<T> p(logits.rows(), logits.cols());  // n × V
  for (Index t = 0; t < logits.rows(); ++t) {
    if (logits.cols() == 0) break;
    const T m = logits.row(t).maxCoeff();
    p.row(t).array() = (logits.row(t).array() - m).exp();
    p.row(t) /= p.row(t).sum();
  }
  return p;
}

/// Mean softmax cross-entropy of `logits` (n × V) against `targets` (n ids in
/// [0, V) or `opt.ignore_index`), fused and stable (see the file comment).
///
/// If `dlogits` is given it is resized to n × V and receives
/// ∂(opt.grad_scale · loss)/∂logits; it may be the matrix `logits` refers to
/// (the gradient then overwrites the logits, saving an n × V buffer).
/// Throws ShapeError if `targets` does not have n entries, ValueError on an
/// out-of-range id or non-finite logits of a row with a target.
/// A column-major `logits` is copied into a row-major temporary.
template <class Derived>
CrossEntropyStats cross_entropy(const Eigen::MatrixBase<Derived>& logits, const ConstTokenRef& targets,
                                Matrix<typename Derived::Scalar>* dlogits = nullptr,
                                const CrossEntropyOptions& opt = {}) {
  using T = typename Derived::Scalar;
  constexpr const char* where = "cross_entropy";
  const ConstMatrixRef<T> z(logits);  // n × V
  const Index n = z.rows(), vocab = z.cols();
  detail::check_shape(where, "targets", targets.rows(), 1, n, 1);
  detail::require_config(std::isfinite(opt.grad_scale), where, "grad_scale must be finite");
  detail::require_fits<T>(where, "grad_scale", opt.grad_scale);  // c = grad_scale / count is a T
  Index count = 0;
  for (Index t = 0; t < n; ++t) {
    detail::check_token(where, "targets", t, targets(t), vocab, opt.ignore_index);
    count += targets(t) != opt.ignore_index ? 1 : 0;
  }
  if (dlogits && (dlogits->rows() != n || dlogits->cols() != vocab)) dlogits->resize(n, vocab);
  CrossEntropyStats out;
  double sum = 0;
  auto target = [&](Index t) { return targets(t); };
  detail::cross_entropy_rows<T>(where, z, target, opt.ignore_index, count, opt.grad_scale, dlogits, sum, out.correct);
  out.count = count;
  out.loss = count > 0 ? sum / double(count) : 0.0;
  return out;
}

}  // namespace apex
