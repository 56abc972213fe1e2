#pragma once
/// \file context_embedding.hpp
/// The demo model's input layer: a fixed window of the previous `c` tokens,
/// each looked up in an embedding table, concatenated and projected to the
/// model width.
///
///     e_t = [E[id_{t,0}] | E[id_{t,1}] | … | E[id_{t,c−1}]]     (1 × c·k)
///     y_t = e_t·Wᵀ + b                                            (1 × d)
///
/// `E` is `V × k` (`token.weight`, PyTorch's `nn.Embedding`), `W` is
/// `d × c·k` and `b` is `1 × d` (`proj.weight`, `proj.bias`, an `nn.Linear`).
/// Position is encoded by where an embedding lands in the concatenation, so
/// no attention and no positional table is needed: the model sees exactly the
/// last `c` characters. Same contract as the library's layers: a const
/// forward into a caller-owned cache, a backward that adds (`+=`) into the
/// gradients. There is no input gradient: the inputs are token ids.

#include <apex/ffn/core/errors.hpp>
#include <apex/ffn/core/init.hpp>
#include <apex/ffn/layers/linear.hpp>
#include <apex/ffn/core/param.hpp>
#include <apex/ffn/moe/router.hpp>
#include <apex/ffn/core/types.hpp>

#include <cmath>
#include <cstdint>
#include <string>

namespace apex::demo {

/// Token ids of the context windows, one window per row: `N × c`, oldest first.
using ContextIds = IndexMatrix;

template <class T>
class ContextEmbedding {
 public:
  using Scalar = T;

  struct Cache {
    ContextIds ids;    ///< N × c: the windows
    Matrix<T> concat;  ///< N × c·k: the concatenated embeddings e
  };

  /// `vocab` tokens, windows of `context` tokens, `embed` values per token,
  /// output width `d_model`. E ~ N(0, 1) as `nn.Embedding`; W, b as `nn.Linear`.
  ContextEmbedding(Index vocab, Index context, Index embed, Index d_model, Rng& rng)
      : c_(context), k_(embed) {
    detail::require_config(vocab > 0, "ContextEmbedding", "vocab must be positive, got " + std::to_string(vocab));
    detail::require_config(context > 0, "ContextEmbedding", "context must be positive, got " + std::to_string(context));
    detail::require_config(embed > 0, "ContextEmbedding", "embed must be positive, got " + std::to_string(embed));
    detail::require_config(d_model > 0, "ContextEmbedding", "d_model must be positive, got " + std::to_string(d_model));
    table_.resize(vocab, embed);
    for (Index i = 0; i < table_.size(); ++i) table_.data()[i] = T(rng.normal());
    proj_.resize(d_model, context * embed);
    init_linear(proj_, rng);
    bias_.resize(d_model);
    fill_uniform(bias_, rng, 1.0 / std::sqrt(double(context * embed)));
    table_grad_ = Matrix<T>::Zero(vocab, embed);
    proj_grad_ = Matrix<T>::Zero(d_model, context * embed);
    bias_grad_ = RowVector<T>::Zero(d_model);
  }
  ContextEmbedding(Index vocab, Index context, Index embed, Index d_model, Rng&& rng)
      : ContextEmbedding(vocab, context, embed, d_model, rng) {}
  /// Weights drawn from `Rng(seed)`.
  ContextEmbedding(Index vocab, Index context, Index embed, Index d_model, std::uint64_t seed = 0)
      : ContextEmbedding(vocab, context, embed, d_model, Rng(seed)) {}

  Index vocab() const { return table_.rows(); }
  Index context() const { return c_; }
  Index embed() const { return k_; }
  Index d_model() const { return proj_.rows(); }

  /// ids: N × c token ids in [0, vocab) → N × d. ShapeError on a wrong
  /// window width, ValueError on an id outside the vocabulary.
  Matrix<T> forward(const ContextIds& ids, Cache* cache = nullptr) const {
    detail::check_shape("ContextEmbedding::forward", "ids", ids, detail::kAny, c_);
    const Index n = ids.rows();
    Matrix<T> concat(n, c_ * k_);  // N × c·k
    for (Index t = 0; t < n; ++t)
      for (Index j = 0; j < c_; ++j) {
        const Index id = ids(t, j);
        if (id < 0 || id >= vocab())
          throw ValueError("ContextEmbedding::forward: argument 'ids' has token id " + std::to_string(id) +
                           " at row " + std::to_string(t) + ", column " + std::to_string(j) +
                           ", expected a value in [0, " + std::to_string(vocab()) + ")");
        concat.row(t).segment(j * k_, k_) = table_.row(id);
      }
    Matrix<T> y(n, d_model());  // N × d
    detail::linear_nt(concat, proj_, y, false);
    y.rowwise() += bias_;
    if (cache) {
      cache->ids = ids;
      cache->concat = std::move(concat);
    }
    return y;
  }

  /// dy: N × d; adds into ∂L/∂E, ∂L/∂W, ∂L/∂b.
  void backward(const ConstMatrixRef<T>& dy, const Cache& cache) {
    detail::check_shape("ContextEmbedding::backward", "dy", dy, cache.ids.rows(), d_model());
    // ∂L/∂W += dYᵀ·e (d × c·k);  ∂L/∂b += Σ_t dy_t
    proj_grad_.noalias() += dy.transpose() * cache.concat;
    bias_grad_.noalias() += dy.colwise().sum();
    // ∂L/∂e = dY·W (N × c·k), scattered back to the table rows it was read from
    Matrix<T> de(dy.rows(), c_ * k_);
    de.noalias() = dy * proj_;
    for (Index t = 0; t < de.rows(); ++t)
      for (Index j = 0; j < c_; ++j) table_grad_.row(cache.ids(t, j)) += de.row(t).segment(j * k_, k_);
  }

  /// `token.weight` (V × k), `proj.weight` (d × c·k), `proj.bias` (1 × d).
  ParamList<T> params() {
    ParamList<T> out;
    out.push_back(detail::make_param<T>("token.weight", table_, table_grad_));
    out.push_back(detail::make_param<T>("proj.weight", proj_, proj_grad_));
    out.push_back(detail::make_param<T>("proj.bias", bias_, bias_grad_));
    return out;
  }
  void zero_grad() {
    table_grad_.setZero();
    proj_grad_.setZero();
    bias_grad_.setZero();
  }

 private:
  Index c_, k_;
  Matrix<T> table_;         ///< V × k: E
  Matrix<T> proj_;          ///< d × c·k: W
  RowVector<T> bias_;       ///< 1 × d: b
  Matrix<T> table_grad_;    ///< V × k
  Matrix<T> proj_grad_;     ///< d × c·k
  RowVector<T> bias_grad_;  ///< 1 × d
};

}  // namespace apex::demo
