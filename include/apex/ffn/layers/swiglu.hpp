#pragma once
/// \file layers/swiglu.hpp
/// SwiGLU feed-forward network (docs/math.md#swiglu):
///
///     FFN(X) = (SiLU(X·W_gateᵀ) ⊙ (X·W_upᵀ)) · W_downᵀ
///
/// with weights in PyTorch layout: `w_gate`, `w_up` are `f × d`, `w_down` is
/// `d × f` (the math's `W_gate ∈ R^{d×f}` is `w_gate` transposed). No biases.
///
/// `w_gate` and `w_up` live in one `2f × d` buffer (gate rows first), so the
/// gate and value branches are one matrix product `X·W_guᵀ`.
///
/// Products (layers/gated_products.hpp). For `T = float` the forward products
/// `[G | U] = X·W_guᵀ` and `Y = A·W_downᵀ` and the ∂L/∂x products of the
/// backward, `∂L/∂A = dY·W_down` and `∂L/∂X = dH·W_gu`, run on the packed
/// engine's micro-kernels (kernels/packed_products.hpp) once a block has
/// `packed::kTrainingMinRows` rows and runs single-threaded (MoE expert
/// tasks; a dense layer with an OpenMP budget of one); the weight gradients `dYᵀ·A`, `dHᵀ·X`
/// stay Eigen products, and `double` (the finite-difference reference) stays
/// on Eigen throughout. The forward writes pre-activation G and U (a plain
/// product, not the engine's fused SiLU kernel) because the backward reads
/// them. The weights are packed per call into per-thread scratch, never kept:
/// they change after every optimiser step through raw `Param` pointers this
/// layer cannot observe, so a persistent packed copy could be stale. Every
/// row's bits depend on that row only, so outputs, ∂L/∂x and weight gradients
/// are bitwise identical for any thread count. Measured ratios and the
/// command: docs/performance.md, "Training products on the packed engine".

#include <cstdint>
#include <string>

#include "activations.hpp"
#include "../core/checked_size.hpp"
#include "../core/errors.hpp"
#include "../core/init.hpp"
#include "linear.hpp"
#include "../core/memory_budget.hpp"
#include "../core/param.hpp"
#include "../core/state_names.hpp"
#include "gated_products.hpp"
#include "../core/types.hpp"
#include "../core/workspace.hpp"

namespace apex {

/// The default hidden width: ⌈8d/3⌉ rounded up to a multiple of 32.
/// ConfigError for a negative d_model or one whose 8·d does not fit an Index.
inline Index default_ffn_width(Index d_model) {
  constexpr const char* where = "default_ffn_width";
  const Index eight_d = detail::checked_product(where, "8*d_model", {8, d_model});
  const Index f = detail::checked_sum(where, "8*d_model + 2", eight_d, 2) / 3;
  return (detail::checked_sum(where, "d_ffn + 31", f, 31) / 32) * 32;
}

namespace detail {
/// SwiGLU's gate derivative: work (n × ≥2f) starts with [G | U], dh (n × 2f)
/// holds ∂L/∂A in its right half and becomes [∂L/∂G | ∂L/∂U]:
///     dG = dA ⊙ U ⊙ SiLU'(G),  SiLU'(G) = σ(G)(1 + G·σ(−G));   dU = dA ⊙ SiLU(G) = dA ⊙ G·σ(G).
/// A row at a time, σ(G) and σ(−G) from one exponential (array::sigmoid_pair).
/// SwiGLU's backward and the adapters over frozen experts (adapters/) both call it.
template <class Work, class DH>
void silu_glu_backward(const Work& work, DH& dh) {
  using T = typename DH::Scalar;
  const Index f = dh.cols() / 2;
  array::Row<T> s(f), sm(f), e(f);  // 1 × f: σ(g), σ(−g), scratch
  for (Index t = 0; t < dh.rows(); ++t) {
    const auto gt = work.row(t).head(f).array();
    array::sigmoid_pair(gt, s, sm, e);
    auto da = dh.row(t).tail(f).array();
    dh.row(t).head(f).array() = da * work.row(t).segment(f, f).array() * s * (T(1) + gt * sm);
    da = da * gt * s;
  }
}

struct SwiGLUWorkTag;      ///< workspace of a cacheless forward: [G | U | A]
struct SwiGLUGateGradTag;  ///< workspace of the gated backward (also κ-SwiGLU's): [dG | dU]
}  // namespace detail

/// Dense SwiGLU FFN. Also the default routed and shared expert of MoEFFN.
template <class T>
class SwiGLU {
 public:
  using Scalar = T;

  /// Activations kept for backward.
  struct Cache {
    Matrix<T> x;     ///< N × d: the input
    Matrix<T> work;  ///< N × 3f: [G | U | A], G = X·W_gateᵀ, U = X·W_upᵀ, A = SiLU(G) ⊙ U
  };

  SwiGLU(Index d_model, Index d_ffn, Rng& rng) : d_(d_model), f_(d_ffn) {
    detail::require_config(d_model > 0, "SwiGLU", "d_model must be positive, got " + std::to_string(d_model));
    detail::require_config(d_ffn > 0, "SwiGLU", "d_ffn must be positive, got " + std::to_string(d_ffn));
    // Sizes checked before anything is allocated (d_model·d_ffn of w_down follows from 2·d_ffn·d_model).
    detail::checked_product("SwiGLU", "w_gate_up size 2*d_ffn*d_model", {2, d_ffn, d_model});
    detail::checked_product("SwiGLU", "work_cols 3*d_ffn", {3, d_ffn});
    check_memory_fit("SwiGLU", description(), weight_bytes("SwiGLU", d_model, d_ffn));
    w_gate_up_.resize(2 * f_, d_);
    w_down_.resize(d_, f_);
    init_linear(w_gate_up_, rng);
    init_linear(w_down_, rng);
    // No gradients yet: allocate_gradients() (core/param.hpp).
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
      forward_block(x, cache->work, y);
    } else {
      // Per-thread workspace reused across calls (core/workspace.hpp): a fresh
      // N × 3f buffer over glibc's mmap ceiling would be faulted in every time.
      forward_block(x, detail::thread_workspace<T, detail::SwiGLUWorkTag>(x.rows(), work_cols()), y);
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
    backward_block(cache.x, cache.work, dy, dx);
    return dx;
  }

  /// \name Block interface: the expert contract of MoEFFN (moe/expert_contract.hpp)
  /// The caller owns every buffer; shapes are not re-checked here.
  ///@{

  /// x: n × d, work: n × 3f (filled), y: n × d (written).
  template <class Work, class Y>
  void forward_block(const ConstMatrixRef<T>& x, const Eigen::MatrixBase<Work>& work,
                     const Eigen::MatrixBase<Y>& y) const {
    // A = SiLU(G) ⊙ U = G · σ(G) ⊙ U
    gated_forward(x, work, y, [](auto&& g, auto&& u, auto&& a) { a = g * array::sigmoid(g) * u; });
  }

  /// Backward of forward_block. dy: n × d, dx: n × d (written); adds into
  /// the weight gradients.
  template <class DX>
  void backward_block(const ConstMatrixRef<T>& x, const ConstMatrixRef<T>& work, const ConstMatrixRef<T>& dy,
                      const Eigen::MatrixBase<DX>& dx) {
    allocate_gradients();
    gated_backward(x, work, dy, dx, [&](auto& dh) { detail::silu_glu_backward(work, dh); });
  }
  ///@}

  /// `w_gate.weight`, `w_up.weight` (f × d), `w_down.weight` (d × f) with
  /// their gradients, which this allocates (zeroed) if not yet: the views
  /// must stay valid for the layer's life (core/param.hpp).
  ParamList<T> params() {
    allocate_gradients();
    return param_list(true);
  }
  /// The same tensors, values only: never allocates gradients (core/param.hpp).
  ParamList<T> param_values() { return param_list(false); }
  /// Zeroes the gradients (allocating them, zeroed, if not yet).
  void zero_grad() {
    if (!has_gradients()) return allocate_gradients();
    w_gate_up_grad_.setZero();
    w_down_grad_.setZero();
  }
  /// Whether the gradient buffers exist (core/param.hpp: allocated lazily).
  bool has_gradients() const { return has_grads_; }
  /// Allocates the gradients, zeroed, unless they exist. ConfigError if the
  /// weights and gradients together exceed physical memory (core/memory_budget.hpp).
  void allocate_gradients() {
    if (has_grads_) return;
    const std::uint64_t bytes = weight_bytes("SwiGLU::allocate_gradients", d_, f_);
    check_gradient_fit("SwiGLU::allocate_gradients", description(), bytes, bytes);
    w_gate_up_grad_ = Matrix<T>::Zero(2 * f_, d_);
    w_down_grad_ = Matrix<T>::Zero(d_, f_);
    has_grads_ = true;
  }
  /// Bytes of the weights of a d_model × d_ffn layer (as many again for the
  /// gradients). ConfigError beyond the index range.
  static std::uint64_t weight_bytes(const char* where, Index d_model, Index d_ffn) {
    const Index count = detail::checked_product(where, "3*d_ffn*d_model", {3, d_ffn, d_model});
    return detail::scalar_bytes<T>(where, "SwiGLU weight bytes", count);
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

  /// \name The gated skeleton: extension point for other gated activations
  /// A gated FFN with another activation (κ-SwiGLU, GEGLU, a clamped SwiGLU…)
  /// owns a SwiGLU for its weights and runs these two with its own
  /// activation and gate derivative, so it adds into this layer's gradients
  /// and shares its products, workspaces and state_dict names without editing
  /// this header (docs/expert_contract.md, "A new gated activation").
  ///@{

  /// The gated-FFN forward every SwiGLU variant shares (docs/math.md#swiglu):
  ///     [G | U] = x·W_guᵀ (n × 2f),  activation(G, U, A) fills A (n × f),  y = A·W_downᵀ (n × d)
  /// G, U and A are the three column blocks of work (n × 3f), passed as arrays.
  template <class Work, class Y, class Act>
  void gated_forward(const ConstMatrixRef<T>& x, const Eigen::MatrixBase<Work>& work_, const Eigen::MatrixBase<Y>& y,
                     Act&& activation) const {
    auto& work = const_cast<Eigen::MatrixBase<Work>&>(work_);
    detail::train_linear_nt(x, w_gate_up_, work.leftCols(2 * f_));
    activation(work.leftCols(f_).array(), work.middleCols(f_, f_).array(), work.rightCols(f_).array());
    detail::train_linear_nt(work.rightCols(f_), w_down_, y);
  }

  /// The gated-FFN backward every SwiGLU variant shares: the two linear
  /// backwards around `gate_grad(dh)`, which must turn dh (n × 2f workspace
  /// whose right half holds ∂L/∂A) into [∂L/∂G | ∂L/∂U] row by row. x: n × d
  /// and work: n × 3f as the forward left them, dy: n × d, dx: n × d
  /// (written); adds into the weight gradients (allocated first if not yet).
  template <class DX, class GateGrad>
  void gated_backward(const ConstMatrixRef<T>& x, const ConstMatrixRef<T>& work, const ConstMatrixRef<T>& dy,
                      const Eigen::MatrixBase<DX>& dx, GateGrad&& gate_grad) {
    allocate_gradients();  // a no-op once they exist (every caller in this library allocates first)
    auto dh = detail::thread_workspace<T, detail::SwiGLUGateGradTag>(x.rows(), 2 * f_);  // n × 2f: [dG | dU]
    // ∂L/∂W_down += dYᵀ·A (d × f);  ∂L/∂A = dY·W_down (n × f), held in the dU half until dU replaces it
    detail::train_linear_nt_backward(dy, work.rightCols(f_), w_down_, w_down_grad_, dh.rightCols(f_));
    gate_grad(dh);
    // ∂L/∂W_gu += dHᵀ·X (2f × d);  ∂L/∂X = dH·W_gu (n × d)
    detail::train_linear_nt_backward(dh, x, w_gate_up_, w_gate_up_grad_, dx);
  }
  ///@}

 private:
  /// ShapeError unless `cache` holds a forward of this layer: x is N × d and
  /// work N × 3f (a default-constructed cache has neither).
  void check_cache(const char* where, const Cache& cache) const {
    detail::check_shape(where, "cache.x", cache.x, detail::kAny, d_);
    detail::check_shape(where, "cache.work", cache.work, cache.x.rows(), work_cols());
  }

  /// params() (grads) or param_values() (!grads).
  ParamList<T> param_list(bool grads) {
    T* gu = grads ? w_gate_up_grad_.data() : nullptr;
    ParamList<T> out;
    out.push_back({state_names::kGate, w_gate_up_.data(), gu, f_, d_});
    out.push_back({state_names::kUp, w_gate_up_.data() + f_ * d_, detail::offset_or_null(gu, f_ * d_), f_, d_});
    out.push_back(detail::make_param<T>(state_names::kDown, w_down_, grads ? &w_down_grad_ : nullptr));
    return out;
  }
  /// "a SwiGLU (d_model d, d_ffn f)", for the memory-fit messages.
  std::string description() const {
    return "a SwiGLU (d_model " + std::to_string(d_) + ", d_ffn " + std::to_string(f_) + ")";
  }

  Index d_, f_;
  Matrix<T> w_gate_up_;       ///< 2f × d: [W_gate; W_up] (PyTorch layout)
  Matrix<T> w_down_;          ///< d × f
  Matrix<T> w_gate_up_grad_;  ///< 2f × d once allocated (allocate_gradients), else 0 × 0
  Matrix<T> w_down_grad_;     ///< d × f once allocated, else 0 × 0
  bool has_grads_ = false;
};

}  // namespace apex
