#pragma once
/// \file swiglu.hpp
/// SwiGLU feed-forward network (reference §12, SPEC "SwiGLU"):
///
///     FFN(X) = (SiLU(X·W_gateᵀ) ⊙ (X·W_upᵀ)) · W_downᵀ
///
/// with weights in PyTorch layout: `w_gate`, `w_up` are `f × d`, `w_down` is
/// `d × f` (the reference's `W_gate ∈ R^{d×f}` is `w_gate` transposed). No biases.
///
/// `w_gate` and `w_up` live in one `2f × d` buffer (gate rows first), so the
/// gate and value branches are one matrix product `X·W_guᵀ`.

#include <cstdint>
#include <string>

#include "activations.hpp"
#include "errors.hpp"
#include "init.hpp"
#include "linear.hpp"
#include "param.hpp"
#include "types.hpp"
#include "workspace.hpp"

namespace apex {

/// The default hidden width: ⌈8d/3⌉ rounded up to a multiple of 32.
inline Index default_ffn_width(Index d_model) {
  const Index f = (8 * d_model + 2) / 3;
  return ((f + 31) / 32) * 32;
}

namespace detail {
struct SwiGLUWorkTag;      ///< workspace of a cacheless forward: [G | U | A]
struct SwiGLUGateGradTag;  ///< workspace of backward_block: [dG | dU]
}  // namespace detail

/// Dense SwiGLU FFN. Also the default routed and shared expert of MoEFFN.
template <class T>
class SwiGLU {
 public:
  using Scalar = T;
  /// Routed experts of this type ignore the router logit (contrast KappaSwiGLU).
  static constexpr bool uses_router_logit = false;

  /// Activations kept for backward.
  struct Cache {
    Matrix<T> x;     ///< N × d: the input
    Matrix<T> work;  ///< N × 3f: [G | U | A], G = X·W_gateᵀ, U = X·W_upᵀ, A = SiLU(G) ⊙ U
  };

  SwiGLU(Index d_model, Index d_ffn, Rng& rng) : d_(d_model), f_(d_ffn) {
    detail::require_config(d_model > 0, "SwiGLU", "d_model must be positive, got " + std::to_string(d_model));
    detail::require_config(d_ffn > 0, "SwiGLU", "d_ffn must be positive, got " + std::to_string(d_ffn));
    w_gate_up_.resize(2 * f_, d_);
    w_down_.resize(d_, f_);
    init_linear(w_gate_up_, rng);
    init_linear(w_down_, rng);
    w_gate_up_grad_ = Matrix<T>::Zero(2 * f_, d_);
    w_down_grad_ = Matrix<T>::Zero(d_, f_);
  }
  SwiGLU(Index d_model, Index d_ffn, Rng&& rng) : SwiGLU(d_model, d_ffn, rng) {}
  /// Weights drawn from `Rng(seed)`; pass `default_ffn_width(d_model)` for the usual width.
  SwiGLU(Index d_model, Index d_ffn, std::uint64_t seed = 0) : SwiGLU(d_model, d_ffn, Rng(seed)) {}

  Index d_model() const { return d_; }
  Index d_ffn() const { return f_; }
  /// Width of the per-row workspace `forward_block` fills and `backward_block` reads.
  Index work_cols() const { return 3 * f_; }

  /// x: N × d → N × d.
  Matrix<T> forward(const ConstMatrixRef<T>& x, Cache* cache = nullptr) const {
    detail::check_shape("SwiGLU::forward", "x", x, detail::kAny, d_);
    Matrix<T> y(x.rows(), d_);
    if (cache) {
      cache->x = x;
      cache->work.resize(x.rows(), work_cols());
      forward_block(x, no_logit(), cache->work, y);
    } else {
      // Per-thread workspace reused across calls (workspace.hpp): a fresh
      // N × 3f buffer over glibc's mmap ceiling would be faulted in every time.
      forward_block(x, no_logit(), detail::thread_workspace<T, detail::SwiGLUWorkTag>(x.rows(), work_cols()), y);
    }
    return y;
  }

  /// dy: N × d → dx: N × d; adds into the weight gradients. ShapeError if
  /// dy does not match the cache, or the cache was not filled by a forward
  /// of a layer of this shape.
  Matrix<T> backward(const ConstMatrixRef<T>& dy, const Cache& cache) {
    check_cache("SwiGLU::backward", cache);
    detail::check_shape("SwiGLU::backward", "dy", dy, cache.x.rows(), d_);
    Matrix<T> dx(dy.rows(), d_);
    Vector<T> unused;
    backward_block(cache.x, no_logit(), cache.work, dy, dx, unused);
    return dx;
  }

  /// \name Block interface used by MoEFFN's grouped dispatch
  /// The caller owns every buffer; shapes are not re-checked here.
  /// `logit` (one router logit per row) is ignored by SwiGLU.
  ///@{

  /// x: n × d, work: n × 3f (filled), y: n × d (written).
  template <class Work, class Y>
  void forward_block(const ConstMatrixRef<T>& x, const ConstVectorRef<T>& /*logit*/,
                     const Eigen::MatrixBase<Work>& work_, const Eigen::MatrixBase<Y>& y) const {
    auto& work = const_cast<Eigen::MatrixBase<Work>&>(work_);
    auto gu = work.leftCols(2 * f_);  // n × 2f: [G | U]
    detail::linear_nt(x, w_gate_up_, gu, false);
    // A = SiLU(G) ⊙ U = G · σ(G) ⊙ U
    const auto g = work.leftCols(f_).array();
    work.rightCols(f_).array() = g * array::sigmoid(g) * work.middleCols(f_, f_).array();
    detail::linear_nt(work.rightCols(f_), w_down_, y, false);
  }

  /// Backward of forward_block. dy: n × d, dx: n × d (written); adds into
  /// the weight gradients. `dlogit` is left untouched.
  template <class DX, class DL>
  void backward_block(const ConstMatrixRef<T>& x, const ConstVectorRef<T>& /*logit*/, const ConstMatrixRef<T>& work,
                      const ConstMatrixRef<T>& dy, const Eigen::MatrixBase<DX>& dx,
                      const Eigen::MatrixBase<DL>& /*dlogit*/) {
    const Index n = x.rows();
    const auto g = work.leftCols(f_);        // n × f
    const auto u = work.middleCols(f_, f_);  // n × f
    const auto a = work.rightCols(f_);       // n × f
    // ∂L/∂W_down += dYᵀ·A      (d × f)
    w_down_grad_.noalias() += dy.transpose() * a;
    auto dh = detail::thread_workspace<T, detail::SwiGLUGateGradTag>(n, 2 * f_);  // n × 2f: [dG | dU]
    // ∂L/∂A = dY·W_down        (n × f), held in the dU half until dU replaces it
    dh.rightCols(f_).noalias() = dy * w_down_;
    // dG = dA ⊙ U ⊙ SiLU'(G),  SiLU'(G) = σ(G)(1 + G·σ(−G));  dU = dA ⊙ SiLU(G) = dA ⊙ G·σ(G).
    // A row at a time, σ(G) and σ(−G) from one exponential (array::sigmoid_pair).
    array::Row<T> s(f_), sm(f_), e(f_);  // 1 × f: σ(g), σ(−g), scratch
    for (Index t = 0; t < n; ++t) {
      const auto gt = g.row(t).array();
      array::sigmoid_pair(gt, s, sm, e);
      auto da = dh.row(t).tail(f_).array();
      dh.row(t).head(f_).array() = da * u.row(t).array() * s * (T(1) + gt * sm);
      da = da * gt * s;
    }
    // ∂L/∂W_gu += dHᵀ·X (2f × d);  ∂L/∂X = dH·W_gu (n × d)
    w_gate_up_grad_.noalias() += dh.transpose() * x;
    const_cast<Eigen::MatrixBase<DX>&>(dx).noalias() = dh * w_gate_up_;
  }
  ///@}

  ParamList<T> params() {
    ParamList<T> out;
    out.push_back({"w_gate.weight", w_gate_up_.data(), w_gate_up_grad_.data(), f_, d_});
    out.push_back({"w_up.weight", w_gate_up_.data() + f_ * d_, w_gate_up_grad_.data() + f_ * d_, f_, d_});
    out.push_back(detail::make_param<T>("w_down.weight", w_down_, w_down_grad_));
    return out;
  }
  void zero_grad() {
    w_gate_up_grad_.setZero();
    w_down_grad_.setZero();
  }

  /// f × d views of the gate and value weights, d × f down weight.
  auto w_gate() { return w_gate_up_.topRows(f_); }
  auto w_up() { return w_gate_up_.bottomRows(f_); }
  Matrix<T>& w_down() { return w_down_; }
  auto w_gate() const { return w_gate_up_.topRows(f_); }
  auto w_up() const { return w_gate_up_.bottomRows(f_); }
  const Matrix<T>& w_down() const { return w_down_; }
  /// 2f × d: gate rows then up rows.
  const Matrix<T>& w_gate_up() const { return w_gate_up_; }
  /// Gradient buffers (2f × d and d × f), in the layout of the weights;
  /// backward adds into them, zero_grad clears them.
  Matrix<T>& w_gate_up_grad() { return w_gate_up_grad_; }
  Matrix<T>& w_down_grad() { return w_down_grad_; }
  const Matrix<T>& w_gate_up_grad() const { return w_gate_up_grad_; }
  const Matrix<T>& w_down_grad() const { return w_down_grad_; }

 private:
  /// ShapeError unless `cache` holds a forward of this layer: x is N × d and
  /// work N × 3f (a default-constructed cache has neither).
  void check_cache(const char* where, const Cache& cache) const {
    detail::check_shape(where, "cache.x", cache.x, detail::kAny, d_);
    detail::check_shape(where, "cache.work", cache.work, cache.x.rows(), work_cols());
  }

  static ConstVectorRef<T> no_logit() {
    static const Vector<T> empty;
    return empty;
  }

  Index d_, f_;
  Matrix<T> w_gate_up_;       ///< 2f × d: [W_gate; W_up] (PyTorch layout)
  Matrix<T> w_down_;          ///< d × f
  Matrix<T> w_gate_up_grad_;  ///< 2f × d
  Matrix<T> w_down_grad_;     ///< d × f
};

}  // namespace apex
