#pragma once
/// \file layers/clamped_swiglu.hpp
/// Clamped SwiGLU with biases: gpt-oss's expert (docs/math.md#clamped-swiglu),
///
///     G̃ = x·W_gateᵀ + b_gate,   Ũ = x·W_upᵀ + b_up                 (n × f each)
///     Ĝ = min(G̃, L),            Û = clamp(Ũ, −L, L)
///     A = (Û + 1) ⊙ Ĝ·σ(α·Ĝ)                                        (n × f)
///     y = A·W_downᵀ + b_down                                         (n × d)
///
/// with α = 1.702 and L = 7 by default (Hugging Face `GptOssExperts`:
/// `swiglu_alpha`, `swiglu_limit`). The clamps' subgradients are PyTorch's
/// `clamp`: 1 where the input lies inside the closed interval, 0 outside.
///
/// The weights are a SwiGLU's (`w_gate`, `w_up` f × d, `w_down` d × f in
/// PyTorch layout) run through its gated skeleton (layers/swiglu.hpp), so the
/// products, workspaces and names are SwiGLU's; this layer adds the three
/// biases and the activation. Meets the expert contract (moe/expert_contract.hpp).

#include <cmath>
#include <cstdint>
#include <string>
#include <utility>

#include "../core/errors.hpp"
#include "../core/init.hpp"
#include "../core/param.hpp"
#include "../core/scalar_range.hpp"
#include "../core/types.hpp"
#include "../core/workspace.hpp"
#include "activations.hpp"
#include "swiglu.hpp"

namespace apex {

/// α and L of the clamped SwiGLU (gpt-oss's values by default).
struct ClampedSwiGLUOptions {
  double alpha = 1.702;  ///< slope inside the sigmoid: Ĝ·σ(α·Ĝ); finite and > 0
  double limit = 7.0;    ///< L: Ĝ = min(G̃, L), Û = clamp(Ũ, −L, L); finite and > 0

  /// Throws ConfigError naming the first field out of range.
  void validate(const char* where = "ClampedSwiGLUOptions") const {
    detail::require_config(std::isfinite(alpha) && alpha > 0, where,
                           "alpha must be finite and > 0, got " + std::to_string(alpha));
    detail::require_config(std::isfinite(limit) && limit > 0, where,
                           "limit must be finite and > 0, got " + std::to_string(limit));
  }
  /// As validate(), for a layer that computes in T.
  template <class T>
  void validate_for(const char* where) const {
    validate(where);
    detail::require_fits<T>(where, "alpha", alpha);
    detail::require_fits<T>(where, "limit", limit);
  }
};

namespace detail {
struct ClampedWorkTag;  ///< workspace of a cacheless forward: [G̃ | Ũ | A]

/// A = (clamp(u, −L, L) + 1) ⊙ min(g, L)·σ(α·min(g, L)) for arrays of one
/// shape (g, u: biased pre-activations). The float layer and the packed
/// kernels' epilogue (inference/engine/kinds/clamped_swiglu.hpp) both call this, so they
/// apply the same operations.
template <class G, class U, class A, class T>
void clamped_glu(const G& g, const U& u, A&& a, T alpha, T limit) {
  const auto gc = g.min(limit);
  a = (u.max(-limit).min(limit) + T(1)) * (gc * array::sigmoid(alpha * gc));
}

/// The backward of clamped_glu: work (n × ≥2f) starts with the biased [G̃ | Ũ],
/// dh (n × 2f) holds ∂L/∂A in its right half and becomes [∂L/∂G̃ | ∂L/∂Ũ].
/// With s = σ(α·Ĝ), per element:
///     ∂L/∂Ũ = ∂L/∂A · Ĝ·s · [−L ≤ Ũ ≤ L]
///     ∂L/∂G̃ = ∂L/∂A · (Û + 1) · s·(1 + α·Ĝ·σ(−α·Ĝ)) · [G̃ ≤ L]
/// d(Ĝ·σ(αĜ))/dĜ = σ(αĜ)·(1 + αĜ·σ(−αĜ)); σ(αĜ) and σ(−αĜ) from one exponential.
template <class Work, class DH, class T>
void clamped_glu_backward(const Work& work, DH& dh, T alpha, T limit) {
  const Index f = dh.cols() / 2;
  array::Row<T> gc(f), z(f), s(f), sm(f), e(f), uc(f);  // 1 × f: Ĝ, αĜ, σ(αĜ), σ(−αĜ), scratch, Û
  for (Index t = 0; t < dh.rows(); ++t) {
    const auto g = work.row(t).head(f).array(), u = work.row(t).segment(f, f).array();
    gc = g.min(limit);
    z = alpha * gc;
    array::sigmoid_pair(z, s, sm, e);
    uc = u.max(-limit).min(limit);
    auto da = dh.row(t).tail(f).array();
    dh.row(t).head(f).array() = (g <= limit).select(da * (uc + T(1)) * s * (T(1) + z * sm), T(0));
    da = ((u >= -limit) && (u <= limit)).select(da * gc * s, T(0));
  }
}
}  // namespace detail

/// gpt-oss's routed expert: a clamped SwiGLU with gate, up and down biases.
template <class T>
class ClampedSwiGLU {
 public:
  using Scalar = T;

  /// Activations kept for backward.
  struct Cache {
    Matrix<T> x;     ///< N × d: the input
    Matrix<T> work;  ///< N × 3f: [G̃ | Ũ | A], biased pre-activations and A
  };

  /// Weights as `SwiGLU(d_model, d_ffn, rng)` draws them; the biases 0.
  ClampedSwiGLU(Index d_model, Index d_ffn, Rng& rng, const ClampedSwiGLUOptions& options = {})
      : ClampedSwiGLU(SwiGLU<T>(d_model, d_ffn, rng), options) {}
  ClampedSwiGLU(Index d_model, Index d_ffn, Rng&& rng, const ClampedSwiGLUOptions& options = {})
      : ClampedSwiGLU(d_model, d_ffn, rng, options) {}
  ClampedSwiGLU(Index d_model, Index d_ffn, std::uint64_t seed = 0, const ClampedSwiGLUOptions& options = {})
      : ClampedSwiGLU(d_model, d_ffn, Rng(seed), options) {}
  /// Takes over the weights of a SwiGLU; the biases 0.
  explicit ClampedSwiGLU(SwiGLU<T> mlp, const ClampedSwiGLUOptions& options = {})
      : mlp_(std::move(mlp)), opt_(options) {
    opt_.template validate_for<T>("ClampedSwiGLU");
    b_gate_ = RowVector<T>::Zero(d_ffn());
    b_up_ = RowVector<T>::Zero(d_ffn());
    b_down_ = RowVector<T>::Zero(d_model());
  }

  Index d_model() const { return mlp_.d_model(); }
  Index d_ffn() const { return mlp_.d_ffn(); }
  /// Per-row workspace: 3f, [G̃ | Ũ | A] (SwiGLU's layout, biases included).
  Index work_cols() const { return 3 * d_ffn(); }

  const ClampedSwiGLUOptions& options() const { return opt_; }
  /// Throws ConfigError (and changes nothing) if `options` is invalid.
  void set_options(const ClampedSwiGLUOptions& options) {
    options.template validate_for<T>("ClampedSwiGLU::set_options");
    opt_ = options;
  }

  /// x: N × d → N × d. ShapeError on a wrong width.
  Matrix<T> forward(const ConstMatrixRef<T>& x, Cache* cache = nullptr) const {
    detail::check_shape("ClampedSwiGLU::forward", "x", x, detail::kAny, d_model());
    Matrix<T> y(x.rows(), d_model());
    if (cache) {
      cache->x = x;
      cache->work.resize(x.rows(), work_cols());
      forward_block(x, cache->work, y);
    } else {
      forward_block(x, detail::thread_workspace<T, detail::ClampedWorkTag>(x.rows(), work_cols()), y);
    }
    return y;
  }

  /// dy: N × d → dx: N × d; adds into every parameter gradient. ShapeError
  /// if dy or the cache does not match this layer.
  Matrix<T> backward(const ConstMatrixRef<T>& dy, const Cache& cache) {
    constexpr const char* where = "ClampedSwiGLU::backward";
    detail::check_shape(where, "cache.x", cache.x, detail::kAny, d_model());
    detail::check_shape(where, "cache.work", cache.work, cache.x.rows(), work_cols());
    detail::check_shape(where, "dy", dy, cache.x.rows(), d_model());
    Matrix<T> dx(dy.rows(), d_model());
    backward_block(cache.x, cache.work, dy, dx);
    return dx;
  }

  /// \name Block interface: the expert contract of MoEFFN (moe/expert_contract.hpp)
  ///@{

  /// x: n × d, work: n × 3f (filled), y: n × d (written).
  template <class Work, class Y>
  void forward_block(const ConstMatrixRef<T>& x, const Eigen::MatrixBase<Work>& work,
                     const Eigen::MatrixBase<Y>& y_) const {
    auto& y = const_cast<Eigen::MatrixBase<Y>&>(y_);
    const T alpha = T(opt_.alpha), limit = T(opt_.limit);
    mlp_.gated_forward(x, work, y, [&](auto&& g, auto&& u, auto&& a) {  // n × f each
      g.rowwise() += b_gate_.array();                                   // G̃ = G + b_gate
      u.rowwise() += b_up_.array();                                     // Ũ = U + b_up
      detail::clamped_glu(g, u, a, alpha, limit);
    });
    y.rowwise() += b_down_;  // y = A·W_downᵀ + b_down
  }

  /// Backward of forward_block. dy: n × d, dx: n × d (written); adds into
  /// the weight and bias gradients: ∂L/∂G̃ and ∂L/∂Ũ as clamped_glu_backward gives them, and
  ///     ∂L/∂b_gate = Σ_rows ∂L/∂G̃,  ∂L/∂b_up = Σ_rows ∂L/∂Ũ,  ∂L/∂b_down = Σ_rows dy
  template <class DX>
  void backward_block(const ConstMatrixRef<T>& x, const ConstMatrixRef<T>& work, const ConstMatrixRef<T>& dy,
                      const Eigen::MatrixBase<DX>& dx) {
    allocate_gradients();
    const Index f = d_ffn();
    const T alpha = T(opt_.alpha), limit = T(opt_.limit);
    b_down_grad_ += dy.colwise().sum();
    mlp_.gated_backward(x, work, dy, dx, [&](auto& dh) {  // dh: n × 2f, [dG | dU], ∂L/∂A in the dU half
      detail::clamped_glu_backward(work, dh, alpha, limit);
      b_gate_grad_ += dh.leftCols(f).colwise().sum();
      b_up_grad_ += dh.rightCols(f).colwise().sum();
    });
  }
  ///@}

  /// SwiGLU's `w_gate.weight`, `w_up.weight`, `w_down.weight`, then
  /// `w_gate.bias`, `w_up.bias` (1 × f) and `w_down.bias` (1 × d), with
  /// their gradients, which this allocates (zeroed) if not yet.
  ParamList<T> params() {
    allocate_gradients();
    ParamList<T> out = mlp_.params();
    out.push_back(detail::make_param<T>(kGateBias, b_gate_, b_gate_grad_));
    out.push_back(detail::make_param<T>(kUpBias, b_up_, b_up_grad_));
    out.push_back(detail::make_param<T>(kDownBias, b_down_, b_down_grad_));
    return out;
  }
  /// The same tensors, values only: never allocates gradients.
  ParamList<T> param_values() {
    ParamList<T> out = mlp_.param_values();
    out.push_back(detail::make_value_param<T>(kGateBias, b_gate_));
    out.push_back(detail::make_value_param<T>(kUpBias, b_up_));
    out.push_back(detail::make_value_param<T>(kDownBias, b_down_));
    return out;
  }
  /// Zeroes every gradient (allocating them, zeroed, if not yet).
  void zero_grad() {
    if (!has_gradients()) return allocate_gradients();
    mlp_.zero_grad();
    b_gate_grad_.setZero();
    b_up_grad_.setZero();
    b_down_grad_.setZero();
  }
  bool has_gradients() const { return has_grads_; }
  /// Allocates every gradient (the SwiGLU's too), zeroed, unless they exist.
  void allocate_gradients() {
    if (has_grads_) return;
    mlp_.allocate_gradients();
    b_gate_grad_ = RowVector<T>::Zero(d_ffn());
    b_up_grad_ = RowVector<T>::Zero(d_ffn());
    b_down_grad_ = RowVector<T>::Zero(d_model());
    has_grads_ = true;
  }
  /// Bytes of the weights of a d_model × d_ffn layer: the SwiGLU's plus 2f + d biases.
  static std::uint64_t weight_bytes(const char* where, Index d_model, Index d_ffn) {
    const Index biases = detail::checked_sum(where, "bias count", detail::checked_product(where, "2*d_ffn", {2, d_ffn}),
                                             d_model);
    return std::uint64_t(detail::checked_sum(where, "weight bytes", Index(SwiGLU<T>::weight_bytes(where, d_model, d_ffn)),
                                             Index(detail::scalar_bytes<T>(where, "bias bytes", biases))));
  }

  /// The state_dict names of the three biases, beside SwiGLU's weights.
  static constexpr const char* kGateBias = "w_gate.bias";
  static constexpr const char* kUpBias = "w_up.bias";
  static constexpr const char* kDownBias = "w_down.bias";

  /// The gate/up/down weights (a SwiGLU).
  SwiGLU<T>& swiglu() { return mlp_; }
  const SwiGLU<T>& swiglu() const { return mlp_; }
  /// 1 × f, 1 × f, 1 × d, and their gradients (empty until allocated).
  RowVector<T>& b_gate() { return b_gate_; }
  RowVector<T>& b_up() { return b_up_; }
  RowVector<T>& b_down() { return b_down_; }
  const RowVector<T>& b_gate() const { return b_gate_; }
  const RowVector<T>& b_up() const { return b_up_; }
  const RowVector<T>& b_down() const { return b_down_; }
  const RowVector<T>& b_gate_grad() const { return b_gate_grad_; }
  const RowVector<T>& b_up_grad() const { return b_up_grad_; }
  const RowVector<T>& b_down_grad() const { return b_down_grad_; }

 private:
  SwiGLU<T> mlp_;
  ClampedSwiGLUOptions opt_;
  RowVector<T> b_gate_, b_up_;            ///< 1 × f each
  RowVector<T> b_down_;                   ///< 1 × d
  RowVector<T> b_gate_grad_, b_up_grad_;  ///< 1 × f once allocated, else empty
  RowVector<T> b_down_grad_;              ///< 1 × d once allocated, else empty
  bool has_grads_ = false;
};

}  // namespace apex
