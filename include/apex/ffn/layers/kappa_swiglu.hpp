#pragma once
/// \file layers/kappa_swiglu.hpp
/// κ-SwiGLU: a SwiGLU expert whose gate sharpness follows the router's
/// confidence (docs/math.md#kappa-swiglu). For a token t routed to this
/// expert, with raw (unbiased) router logit ℓ_t, and gate unit j:
///
///     s_t    = c · ℓ_t                              (saturated to ±max of T)
///     u_tj   = b_j + α_j · s_t
///     κ_tj   = exp(ln U · tanh(u_tj))               ∈ [1/U, U]
///     FFN(x) = (SiLU_κ(x·W_gateᵀ) ⊙ (x·W_upᵀ)) · W_downᵀ,   SiLU_κ(z) = z·σ(κz)
///
/// α and b (`kappa_alpha`, `kappa_bias`, 1 × f) start at 0, so κ ≡ 1 and the
/// layer starts as plain SwiGLU. Defaults: U = 4, c = 0.3; the gradient that
/// reaches ℓ through κ is scaled by ρ = 0.1 (ρ = 0 detaches it; the forward
/// value is unchanged). The loss term `w·(mean(b²) + mean(α²))`, w = 1e-2,
/// keeps κ near 1 (`regularizer`, `add_regularizer_grad`).
///
/// The weights are a SwiGLU (same init order, names and layout: one 2f × d
/// gate-and-up buffer), so `KappaSwiGLU(d, f, seed)` has the weights of
/// `SwiGLU(d, f, seed)`, and a trained SwiGLU can be converted. The workspace
/// is SwiGLU's too (`[G | U | A]`, 3f per row): κ adds none.
/// Forward forms κ a row at a time in a row buffer; backward recomputes it
/// from ℓ, α, b (a tanh and an exp per entry) rather than reading two more
/// stored n × f arrays, whose writes would cost the inference forward more
/// than the recomputation costs backward.
///
/// Options, the U ramp (layers/kappa_options.hpp), the gated activation
/// SiLU_κ(G) ⊙ U with its derivatives (layers/kappa_activation.hpp) and the
/// MoE-wide helpers (layers/kappa_experts.hpp) live apart from the layer;
/// this header includes all three.

#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>

#include "activations.hpp"
#include "../core/errors.hpp"
#include "expert_side_input.hpp"
#include "../core/init.hpp"
#include "kappa_activation.hpp"
#include "kappa_options.hpp"
#include "kappa_row.hpp"
#include "../core/param.hpp"
#include "../core/state_names.hpp"
#include "swiglu.hpp"
#include "../core/types.hpp"
#include "../core/workspace.hpp"

namespace apex {

namespace detail {
struct KappaWorkTag;  ///< workspace of a cacheless forward: [G | U | A]
}  // namespace detail

/// SwiGLU with router-confidence adaptive gate sharpness; the routed expert of
/// `MoEFFN<T, KappaSwiGLU<T>>`. Shared experts and dense layers stay SwiGLU.
template <class T>
class KappaSwiGLU {
 public:
  using Scalar = T;
  /// MoEFFN's dispatch passes each row's raw router logit ℓ and takes ∂L/∂ℓ
  /// back (moe/expert_contract.hpp).
  using SideInput = RouterLogitInput;

  /// Activations kept for backward.
  struct Cache {
    Matrix<T> x;      ///< N × d: the input
    Vector<T> logit;  ///< N: the router logit ℓ of each row
    Matrix<T> work;   ///< N × 3f: [G | U | A] (see work_cols)
  };

  /// What backward returns: the input gradients.
  struct InputGrad {
    Matrix<T> dx;      ///< N × d: ∂L/∂x
    Vector<T> dlogit;  ///< N: ρ·∂L/∂ℓ (the path through κ only)
  };

  /// Weights as `SwiGLU(d_model, d_ffn, rng)` draws them; α = b = 0.
  KappaSwiGLU(Index d_model, Index d_ffn, Rng& rng, const KappaOptions& options = {})
      : KappaSwiGLU(SwiGLU<T>(d_model, d_ffn, rng), options) {}
  KappaSwiGLU(Index d_model, Index d_ffn, Rng&& rng, const KappaOptions& options = {})
      : KappaSwiGLU(d_model, d_ffn, rng, options) {}
  /// Weights from `Rng(seed)`: the same as `SwiGLU(d_model, d_ffn, seed)`.
  KappaSwiGLU(Index d_model, Index d_ffn, std::uint64_t seed = 0, const KappaOptions& options = {})
      : KappaSwiGLU(d_model, d_ffn, Rng(seed), options) {}
  /// Takes over the weights of a (trained) SwiGLU; α = b = 0, so the output is unchanged.
  explicit KappaSwiGLU(SwiGLU<T> mlp, const KappaOptions& options = {}) : mlp_(std::move(mlp)), opt_(options) {
    opt_.template validate_for<T>("KappaSwiGLU");
    const Index f = mlp_.d_ffn();
    alpha_ = RowVector<T>::Zero(f);
    bias_ = RowVector<T>::Zero(f);
    // Gradients (this layer's and mlp_'s): allocate_gradients() (core/param.hpp).
  }

  Index d_model() const { return mlp_.d_model(); }
  Index d_ffn() const { return mlp_.d_ffn(); }

  /// \name Options
  ///@{
  const KappaOptions& options() const { return opt_; }
  /// Throws ConfigError (and changes nothing) if `options` is invalid.
  void set_options(const KappaOptions& options) {
    options.template validate_for<T>("KappaSwiGLU::set_options");
    opt_ = options;
  }
  double U() const { return opt_.U; }
  /// The sharpness ceiling, changeable between steps (see kappa_ramp). Like
  /// the weights, U, c, α and b must not change between a forward and its
  /// backward: backward recomputes κ from them. ConfigError unless U ≥ 1 and finite.
  void set_U(double U) {
    KappaOptions o = opt_;
    o.U = U;
    set_options(o);
  }
  ///@}

  /// Width of the per-row workspace: 3f, `[G | U | A]` with G = x·W_gateᵀ,
  /// U = x·W_upᵀ, A = SiLU_κ(G) ⊙ U — SwiGLU's layout.
  Index work_cols() const { return 3 * d_ffn(); }

  /// x: N × d, logit: N (this expert's raw router logit per row) → N × d.
  /// ShapeError on wrong shapes, ValueError on a non-finite logit.
  Matrix<T> forward(const ConstMatrixRef<T>& x, const ConstVectorRef<T>& logit, Cache* cache = nullptr) const {
    detail::check_shape("KappaSwiGLU::forward", "x", x, detail::kAny, d_model());
    detail::check_shape("KappaSwiGLU::forward", "logit", logit, x.rows(), 1);
    detail::check_finite("KappaSwiGLU::forward", "logit", logit);
    Matrix<T> y(x.rows(), d_model());
    if (cache) {
      cache->x = x;
      cache->logit = logit;
      cache->work.resize(x.rows(), work_cols());
      forward_block(x, logit, cache->work, y);
    } else {
      // Reused per-thread workspace, as in SwiGLU::forward.
      forward_block(x, logit, detail::thread_workspace<T, detail::KappaWorkTag>(x.rows(), work_cols()), y);
    }
    return y;
  }

  /// dy: N × d → {∂L/∂x, ρ·∂L/∂ℓ}; adds into every parameter gradient.
  /// ShapeError if dy does not match the cache, or the cache was not filled
  /// by a forward of a layer of this shape.
  InputGrad backward(const ConstMatrixRef<T>& dy, const Cache& cache) {
    const char* where = "KappaSwiGLU::backward";
    detail::check_shape(where, "cache.x", cache.x, detail::kAny, d_model());
    detail::check_shape(where, "cache.logit", cache.logit, cache.x.rows(), 1);
    detail::check_shape(where, "cache.work", cache.work, cache.x.rows(), work_cols());
    detail::check_shape(where, "dy", dy, cache.x.rows(), d_model());
    InputGrad out{Matrix<T>(dy.rows(), d_model()), Vector<T>(dy.rows())};
    backward_block(cache.x, cache.logit, cache.work, dy, out.dx, out.dlogit);
    return out;
  }

  /// κ for every row and gate unit (N × f) given the rows' router logits:
  /// κ depends on ℓ only, not on x. For monitoring and tests.
  Matrix<T> kappa(const ConstVectorRef<T>& logit) const {
    Matrix<T> k(logit.size(), d_ffn());
    Eigen::Array<T, 1, Eigen::Dynamic> dk(d_ffn());
    for (Index t = 0; t < logit.size(); ++t)
      detail::kappa_with_derivative(opt_, alpha_, bias_, logit(t), k.row(t).array(), dk);
    return k;
  }

  /// \name Block interface: the expert contract of MoEFFN (moe/expert_contract.hpp)
  /// The caller owns every buffer; shapes are not re-checked here.
  ///@{

  /// x: n × d, logit: n, work: n × 3f (filled), y: n × d (written). SwiGLU's
  /// gated forward with SiLU_κ for SiLU.
  template <class Work, class Y>
  void forward_block(const ConstMatrixRef<T>& x, const ConstVectorRef<T>& logit, const Eigen::MatrixBase<Work>& work,
                     const Eigen::MatrixBase<Y>& y) const {
    eigen_assert(logit.size() == x.rows() && work.cols() == work_cols());
    mlp_.gated_forward(x, work, y, [&](auto&& gate, auto&& up, auto&& a) {  // n × f each
      detail::kappa_activation_forward(opt_, alpha_, bias_, logit, gate, up, a);  // layers/kappa_activation.hpp
    });
  }

  /// Backward of forward_block. dy: n × d; dx: n × d and dlogit: n (written,
  /// dlogit = ρ·∂L/∂ℓ); adds into every parameter gradient. SwiGLU's gated
  /// backward with the gate derivative of SiLU_κ, plus ∂L/∂α, ∂L/∂b, ∂L/∂ℓ.
  template <class DX, class DL>
  void backward_block(const ConstMatrixRef<T>& x, const ConstVectorRef<T>& logit, const ConstMatrixRef<T>& work,
                      const ConstMatrixRef<T>& dy, const Eigen::MatrixBase<DX>& dx,
                      const Eigen::MatrixBase<DL>& dlogit_) {
    auto& dlogit = const_cast<Eigen::MatrixBase<DL>&>(dlogit_);
    allocate_gradients();
    mlp_.gated_backward(x, work, dy, dx, [&](auto& dh) {  // dh: n × 2f, [dG | dU], dA in the dU half
      // layers/kappa_activation.hpp: dG, dU, and ∂L/∂α, ∂L/∂b, ρ·∂L/∂ℓ
      detail::kappa_activation_backward(opt_, alpha_, bias_, logit, work, dh, alpha_grad_, bias_grad_, dlogit);
    });
  }
  ///@}

  /// \name Regulariser R = w·(mean(b²) + mean(α²)) over this expert's f entries each
  ///@{
  T regularizer() const {
    const T f = T(d_ffn());
    return T(opt_.reg_weight) * (bias_.squaredNorm() / f + alpha_.squaredNorm() / f);
  }
  /// Adds scale·∂R/∂α = scale·2w·α/f (and likewise for b) into the gradients
  /// and returns scale·R. For a whole MoE layer's R over all E×f entries, call
  /// it on every expert with scale = 1/E and sum (see add_kappa_regularizer_grad).
  T add_regularizer_grad(T scale = T(1)) {
    const T g = scale * T(2 * opt_.reg_weight) / T(d_ffn());
    allocate_gradients();
    alpha_grad_ += g * alpha_;
    bias_grad_ += g * bias_;
    return scale * regularizer();
  }
  ///@}

  /// `w_gate.weight`, `w_up.weight` (f × d), `w_down.weight` (d × f) as in
  /// SwiGLU, then `kappa_alpha`, `kappa_bias` (1 × f).
  /// With their gradients, which this allocates (zeroed) if not yet: the
  /// views must stay valid for the layer's life (core/param.hpp).
  ParamList<T> params() {
    allocate_gradients();
    ParamList<T> out = mlp_.params();
    out.push_back(detail::make_param<T>(state_names::kKappaAlpha, alpha_, alpha_grad_));
    out.push_back(detail::make_param<T>(state_names::kKappaBias, bias_, bias_grad_));
    return out;
  }
  /// The same tensors, values only: never allocates gradients (core/param.hpp).
  ParamList<T> param_values() {
    ParamList<T> out = mlp_.param_values();
    out.push_back(detail::make_value_param<T>(state_names::kKappaAlpha, alpha_));
    out.push_back(detail::make_value_param<T>(state_names::kKappaBias, bias_));
    return out;
  }
  /// Zeroes every gradient (allocating them, zeroed, if not yet).
  void zero_grad() {
    if (!has_gradients()) return allocate_gradients();
    mlp_.zero_grad();
    alpha_grad_.setZero();
    bias_grad_.setZero();
  }
  /// Whether the gradients exist (core/param.hpp: allocated lazily).
  bool has_gradients() const { return has_grads_; }
  /// Bytes of the weights of a d_model × d_ffn layer: the SwiGLU's plus α, b.
  static std::uint64_t weight_bytes(const char* where, Index d_model, Index d_ffn) {
    const std::uint64_t kappa =
        detail::scalar_bytes<T>(where, "kappa weight bytes", detail::checked_product(where, "2*d_ffn", {2, d_ffn}));
    return std::uint64_t(detail::checked_sum(where, "weight bytes", Index(SwiGLU<T>::weight_bytes(where, d_model, d_ffn)),
                                             Index(kappa)));
  }
  /// Allocates every gradient (the SwiGLU's too), zeroed, unless they exist.
  /// ConfigError as SwiGLU::allocate_gradients.
  void allocate_gradients() {
    if (has_grads_) return;
    mlp_.allocate_gradients();
    alpha_grad_ = RowVector<T>::Zero(d_ffn());
    bias_grad_ = RowVector<T>::Zero(d_ffn());
    has_grads_ = true;
  }

  /// The gate/up/down weights (a SwiGLU).
  SwiGLU<T>& swiglu() { return mlp_; }
  const SwiGLU<T>& swiglu() const { return mlp_; }
  auto w_gate() { return mlp_.w_gate(); }
  auto w_up() { return mlp_.w_up(); }
  Matrix<T>& w_down() { return mlp_.w_down(); }
  auto w_gate() const { return mlp_.w_gate(); }
  auto w_up() const { return mlp_.w_up(); }
  const Matrix<T>& w_down() const { return mlp_.w_down(); }
  /// 1 × f: α and b of every gate unit, and their gradients (empty until
  /// allocated, has_gradients()).
  RowVector<T>& kappa_alpha() { return alpha_; }
  RowVector<T>& kappa_bias() { return bias_; }
  const RowVector<T>& kappa_alpha() const { return alpha_; }
  const RowVector<T>& kappa_bias() const { return bias_; }
  const RowVector<T>& kappa_alpha_grad() const { return alpha_grad_; }
  const RowVector<T>& kappa_bias_grad() const { return bias_grad_; }

 private:
  SwiGLU<T> mlp_;
  KappaOptions opt_;
  RowVector<T> alpha_;       ///< 1 × f: α, init 0
  RowVector<T> bias_;        ///< 1 × f: b, init 0
  RowVector<T> alpha_grad_;  ///< 1 × f
  RowVector<T> bias_grad_;   ///< 1 × f
  bool has_grads_ = false;   ///< whether the two gradients above (and mlp_'s) are allocated
};

}  // namespace apex

// Helpers over a whole MoE layer of κ experts, for code that includes this header only.
#include "kappa_experts.hpp"
