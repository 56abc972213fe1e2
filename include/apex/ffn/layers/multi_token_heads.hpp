#pragma once
/// \file layers/multi_token_heads.hpp
/// Multi-token prediction heads (docs/math.md#multi-token-prediction); their
/// loss is layers/multi_token_loss.hpp.
///
/// The main head (the caller's, a `V × d` weight) predicts token `t+1` from
/// the hidden state `h_t`. Extra heads `k = 1..N` (default N = 4),
///
///     head_k(h) = h·W_kᵀ,   W_k ∈ R^{V×d},
///
/// predict token `t+1+k`. An offset of `t+k` would make head 1 a second copy
/// of the main head (docs/math.md#errata).
///
/// In code heads are numbered from 0: head `i = k − 1` predicts `t+2+i`. Its
/// weight is stored in PyTorch layout (`V × d`, an `nn.Linear(d, V,
/// bias=False)`) under the state_dict name `heads.<i>.weight`. All N weights
/// live in one `N·V × d` buffer (head 0's rows first), so the forward pass is
/// a single product `H·W_allᵀ` whose `n × N·V` output holds head i's logits
/// in columns `[i·V, (i+1)·V)`.
///
/// Loss:
///
///     L = L_main + w · Σ_{k=1..N} L_k,    w = λ (default 0.1), or λ/N with `average_heads`
///
/// each term the mean cross-entropy over the positions that have a target.

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "multi_token_loss.hpp"
#include "../core/checked_size.hpp"
#include "../core/errors.hpp"
#include "../core/init.hpp"
#include "linear.hpp"
#include "../core/memory_budget.hpp"
#include "../core/param.hpp"
#include "../core/types.hpp"

namespace apex {

/// N linear multi-token prediction heads over the hidden states (the layer
/// contract of GUIDE.md: const forward into a caller-owned cache, backward
/// returns dH and adds into the weight gradients).
template <class T>
class MultiTokenHeads {
 public:
  using Scalar = T;

  /// Activations kept for backward.
  struct Cache {
    Matrix<T> h;  ///< n × d: the hidden states
  };

  /// Heads for `d_model`-wide hidden states over a `vocab`-token vocabulary,
  /// initialised as `nn.Linear` (U(−1/√d, 1/√d)) from `rng`.
  MultiTokenHeads(Index d_model, Index vocab, const MultiTokenOptions& opt, Rng& rng)
      : d_(d_model), v_(vocab), opt_(opt) {
    constexpr const char* where = "MultiTokenHeads";
    detail::require_config(d_model > 0, where, "d_model must be positive, got " + std::to_string(d_model));
    detail::require_config(vocab > 0, where, "vocab must be positive, got " + std::to_string(vocab));
    detail::check_mtp_options<T>(where, opt, vocab);
    (void)detail::checked_product(where, "num_heads x vocab x d_model (head weights)", {opt.num_heads, vocab, d_model});
    const Index rows = opt.num_heads * v_;  // fits: the product above did
    check_memory_fit(where, description(), weight_bytes(where));
    w_.resize(rows, d_);
    init_linear(w_, rng);  // its gradient: allocate_gradients() (core/param.hpp)
  }
  MultiTokenHeads(Index d_model, Index vocab, const MultiTokenOptions& opt, Rng&& rng)
      : MultiTokenHeads(d_model, vocab, opt, rng) {}
  /// Weights drawn from `Rng(seed)`.
  MultiTokenHeads(Index d_model, Index vocab, const MultiTokenOptions& opt = {}, std::uint64_t seed = 0)
      : MultiTokenHeads(d_model, vocab, opt, Rng(seed)) {}

  Index d_model() const { return d_; }
  Index vocab() const { return v_; }
  Index num_heads() const { return opt_.num_heads; }
  const MultiTokenOptions& options() const { return opt_; }
  /// Changes λ (e.g. a schedule). Throws ConfigError unless finite and ≥ 0.
  void set_lambda(double lambda) {
    MultiTokenOptions o = opt_;
    o.lambda = lambda;
    detail::check_mtp_options<T>("MultiTokenHeads::set_lambda", o, v_);
    opt_ = o;
  }
  void set_average_heads(bool average) { opt_.average_heads = average; }

  /// h: n × d → logits n × N·V (head i in columns [i·V, (i+1)·V)).
  Matrix<T> forward(const ConstMatrixRef<T>& h, Cache* cache = nullptr) const {
    Matrix<T> y(h.rows(), w_.rows());
    forward_into(h, y, cache);
    return y;
  }

  /// As `forward`, writing into a caller-owned n × N·V buffer (decode loops
  /// reuse one buffer instead of allocating per step).
  void forward_into(const ConstMatrixRef<T>& h, MatrixRef<T> y, Cache* cache = nullptr) const {
    detail::check_shape("MultiTokenHeads::forward", "h", h, detail::kAny, d_);
    detail::check_shape("MultiTokenHeads::forward", "y", y, h.rows(), w_.rows());
    if (cache) cache->h = h;
    // Y = H·W_allᵀ   (n × N·V)
    detail::linear_nt(h, w_, y, false);
  }

  /// dy = ∂L/∂logits: n × N·V → dH: n × d; adds into every W_k's gradient.
  /// The main head's contribution dmain·W_main is the caller's to add.
  Matrix<T> backward(const ConstMatrixRef<T>& dy, const Cache& cache) {
    detail::check_shape("MultiTokenHeads::backward", "dy", dy, cache.h.rows(), w_.rows());
    detail::check_shape("MultiTokenHeads::backward", "cache.h", cache.h, detail::kAny, d_);
    // ∂L/∂W_all += dYᵀ·H (N·V × d);  ∂L/∂H = dY·W_all (n × d)
    allocate_gradients();
    Matrix<T> dh(dy.rows(), d_);
    detail::linear_nt_backward(dy, cache.h, w_, w_grad_, dh);
    return dh;
  }

  /// The multi-token loss with this layer's options (see `multi_token_loss`).
  MultiTokenLoss loss(const ConstMatrixRef<T>& main_logits, const ConstMatrixRef<T>& head_logits,
                      const ConstTokenRef& labels, Matrix<T>* dmain = nullptr, Matrix<T>* dheads = nullptr) const {
    detail::check_shape("MultiTokenHeads::loss", "main_logits", main_logits, detail::kAny, v_);
    return multi_token_loss(main_logits, head_logits, labels, opt_, dmain, dheads);
  }

  /// Head logits of position `t` of a forward output `y` (n × N·V) viewed as
  /// N × V (row i = head i): the input of `draft_greedy` / `draft_sample`.
  Eigen::Map<const Matrix<T>> draft_logits(const Matrix<T>& y, Index t) const {
    detail::check_shape("MultiTokenHeads::draft_logits", "y", y, detail::kAny, w_.rows());
    if (t < 0 || t >= y.rows())
      throw ValueError("MultiTokenHeads::draft_logits: position " + std::to_string(t) + " outside [0, " +
                       std::to_string(y.rows()) + ")");
    // A row-major 1 × N·V row is exactly a row-major N × V matrix.
    return {y.data() + t * y.cols(), opt_.num_heads, v_};
  }
  /// The view would dangle once the temporary dies at the end of the
  /// statement, so a temporary (or an expression converted to one) does not
  /// compile: keep the forward output in a named matrix.
  void draft_logits(Matrix<T>&&, Index) const = delete;
  void draft_logits(const Matrix<T>&&, Index) const = delete;

  /// `heads.<i>.weight` (V × d each), in head order, with their gradients,
  /// which this allocates (zeroed) if not yet: the views must stay valid for
  /// the layer's life (core/param.hpp).
  ParamList<T> params() {
    allocate_gradients();
    return param_list(w_grad_.data());
  }
  /// The same tensors, values only: never allocates gradients (core/param.hpp).
  ParamList<T> param_values() { return param_list(nullptr); }
  /// Zeroes the gradients (allocating them, zeroed, if not yet).
  void zero_grad() {
    if (!has_gradients()) return allocate_gradients();
    w_grad_.setZero();
  }
  /// Whether the gradients exist (core/param.hpp: allocated lazily).
  bool has_gradients() const { return has_grads_; }
  /// Allocates the gradients, zeroed, unless they exist. ConfigError if the
  /// weights and gradients together exceed physical memory (core/memory_budget.hpp).
  void allocate_gradients() {
    if (has_grads_) return;
    constexpr const char* where = "MultiTokenHeads::allocate_gradients";
    check_gradient_fit(where, description(), weight_bytes(where), weight_bytes(where));
    w_grad_ = Matrix<T>::Zero(w_.rows(), d_);
    has_grads_ = true;
  }

  /// V × d weight of head i (k = i + 1), PyTorch layout.
  auto weight(Index i) { return w_.middleRows(checked(i) * v_, v_); }
  auto weight(Index i) const { return w_.middleRows(checked(i) * v_, v_); }
  /// V × d gradient of head i (ValueError as weight); NoGradientError
  /// before the gradients are allocated.
  auto weight_grad(Index i) const {
    if (!has_grads_)
      throw NoGradientError("MultiTokenHeads::weight_grad: no gradients yet (allocated by the first backward, "
                       "zero_grad() or params())");
    return w_grad_.middleRows(checked(i) * v_, v_);
  }
  /// N·V × d: every head's weight, head 0 first.
  const Matrix<T>& weights() const { return w_; }

 private:
  /// The head views with gradient base `grad` (nullptr: values only).
  ParamList<T> param_list(T* grad) {
    ParamList<T> out;
    for (Index i = 0; i < opt_.num_heads; ++i)
      out.push_back({"heads." + std::to_string(i) + ".weight", w_.data() + i * v_ * d_,
                     detail::offset_or_null(grad, i * v_ * d_), v_, d_});
    return out;
  }
  /// Bytes of the head weights (as many again for the gradients).
  std::uint64_t weight_bytes(const char* where) const {
    return detail::scalar_bytes<T>(where, "head weight bytes", opt_.num_heads * v_ * d_);
  }
  std::string description() const {
    return "multi-token heads (" + std::to_string(opt_.num_heads) + " x vocab " + std::to_string(v_) +
           " x d_model " + std::to_string(d_) + ")";
  }

  Index checked(Index i) const {
    if (i < 0 || i >= opt_.num_heads)
      throw ValueError("MultiTokenHeads::weight: head " + std::to_string(i) + " outside [0, " +
                       std::to_string(opt_.num_heads) + ")");
    return i;
  }

  Index d_, v_;
  MultiTokenOptions opt_;
  Matrix<T> w_;       ///< N·V × d: [W_1ᵀ; …; W_Nᵀ] (PyTorch layout per head)
  Matrix<T> w_grad_;  ///< N·V × d once allocated, else 0 × 0
  bool has_grads_ = false;
};

}  // namespace apex
