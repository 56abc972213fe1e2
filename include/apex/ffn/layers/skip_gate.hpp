#pragma once
/// \file layers/skip_gate.hpp
/// Dynamic skip gate (docs/math.md#skip-gate):
///
///     g(x) = σ(W₂ · SiLU(W₁x + b₁) + b₂),   keep mask m = 1[g ≥ τ]
///
/// one scalar per token. The gate only scores tokens; FFNSublayer
/// (`layers/ffn_sublayer.hpp`) applies the mask and the straight-through estimator.
///
/// Weights are stored in PyTorch layout (`w1.weight` is `h × d`, `w2.weight`
/// is `1 × h`), the `W₁` and `W₂` of docs/math.md.
///
/// The optional compute penalty `λ_skip · mean_t(g_t)` is part of the gate:
/// `forward` reports its value in the Cache and `backward` adds its gradient
/// `λ_skip / N` to every `∂L/∂g_t`, so a trainer adds `cache.penalty` to its
/// loss and nothing else.

#include <cmath>
#include <cstdint>
#include <string>

#include "activations.hpp"
#include "../core/checked_size.hpp"
#include "../core/errors.hpp"
#include "../core/init.hpp"
#include "linear.hpp"
#include "../core/param.hpp"
#include "../core/scalar_range.hpp"
#include "../core/types.hpp"

namespace apex {

/// Hyper-parameters of a SkipGate.
struct SkipGateConfig {
  Index d_model = 0;  ///< d: width of the tokens the gate reads
  Index hidden = 0;   ///< h: the presets use 16 (tiny), 64 (small), 128 (medium), 256 (large)
  /// τ ∈ [0, 1]: a token is kept when g ≥ τ.
  double threshold = 0.15;
  /// g of every token at initialisation before the small W₂-term: b₂ = logit(initial_gate), in (0, 1).
  /// The default 0.9 starts all gates open (see SkipGate).
  double initial_gate = 0.9;
  /// λ_skip ≥ 0 of the compute penalty λ_skip · mean(g); 0 disables it.
  double penalty = 0.0;

  /// Throws ConfigError naming the first bad field.
  void validate() const {
    const char* where = "SkipGateConfig";
    detail::require_config(d_model > 0, where, "d_model must be positive, got " + std::to_string(d_model));
    detail::require_config(hidden > 0, where, "hidden must be positive, got " + std::to_string(hidden));
    (void)detail::checked_product(where, "hidden x d_model (w1.weight)", {hidden, d_model});
    detail::require_config(threshold >= 0.0 && threshold <= 1.0, where,
                           "threshold must be in [0, 1], got " + std::to_string(threshold));
    detail::require_config(initial_gate > 0.0 && initial_gate < 1.0, where,
                           "initial_gate must be in (0, 1), got " + std::to_string(initial_gate));
    detail::require_config(penalty >= 0.0 && std::isfinite(penalty), where,
                           "penalty must be finite and >= 0, got " + std::to_string(penalty));
  }
  /// As validate(), for a gate that computes in T: λ_skip is converted to T
  /// (τ and the initial gate lie in [0, 1], so they always fit).
  template <class T>
  void validate_for() const {
    validate();
    detail::require_fits<T>("SkipGateConfig", "penalty", penalty);
  }
};

/// The per-token gate g(x) ∈ (0, 1) of the dynamic skip gate.
///
/// Initialisation: `w1` (weight and bias) and `w2.weight` as PyTorch's
/// `nn.Linear` (U(−1/√in, 1/√in)); `w2.bias` = logit(initial_gate) = ln 9 for
/// the default 0.9. Why open: the sublayer then starts as the plain pre-norm
/// residual block, so the FFN receives gradient from every token while the
/// gate learns which tokens to drop (a skipped token gives the FFN none). The
/// logit margin to τ = 0.15 is ln 9 − logit(0.15) ≈ 3.9, far beyond the spread
/// of the initial W₂-term (standard deviation ≈ rms(SiLU(W₁x + b₁))/√3), so no
/// token starts skipped by chance; and σ′ = 0.09 at g = 0.9 is far from
/// saturation, so the gate can close quickly where the FFN does not help.
template <class T>
class SkipGate {
 public:
  using Scalar = T;

  /// Activations kept for backward.
  struct Cache {
    Matrix<T> x;    ///< N × d: the input
    Matrix<T> z;    ///< N × h: x·W₁ᵀ + b₁
    Vector<T> s;    ///< N: the logit W₂·SiLU(z) + b₂
    Vector<T> g;    ///< N: σ(s)
    T penalty = 0;  ///< λ_skip · mean(g) (0 for N = 0)
  };

  SkipGate(const SkipGateConfig& cfg, Rng& rng) {
    cfg.template validate_for<T>();
    d_ = cfg.d_model;
    h_ = cfg.hidden;
    threshold_ = T(cfg.threshold);
    penalty_ = T(cfg.penalty);
    w1_.resize(h_, d_);
    b1_.resize(h_);
    w2_.resize(1, h_);
    b2_.resize(1, 1);
    init_linear(w1_, rng);
    fill_uniform(b1_, rng, 1.0 / std::sqrt(double(d_)));
    init_linear(w2_, rng);
    b2_(0, 0) = T(std::log(cfg.initial_gate / (1.0 - cfg.initial_gate)));
    // Gradients: allocate_gradients() (core/param.hpp).
  }
  SkipGate(const SkipGateConfig& cfg, Rng&& rng) : SkipGate(cfg, rng) {}
  /// Weights drawn from `Rng(seed)`.
  explicit SkipGate(const SkipGateConfig& cfg, std::uint64_t seed = 0) : SkipGate(cfg, Rng(seed)) {}

  Index d_model() const { return d_; }
  Index hidden() const { return h_; }
  /// τ: tokens with g ≥ τ are kept.
  T threshold() const { return threshold_; }
  /// Sets τ; throws ConfigError unless τ ∈ [0, 1].
  void set_threshold(T tau) {
    detail::require_config(tau >= T(0) && tau <= T(1), "SkipGate::set_threshold",
                           "threshold must be in [0, 1], got " + std::to_string(double(tau)));
    threshold_ = tau;
  }
  /// λ_skip of the compute penalty λ_skip · mean(g).
  T penalty_weight() const { return penalty_; }
  /// Sets λ_skip; throws ConfigError unless finite and ≥ 0.
  void set_penalty_weight(T lambda) {
    detail::require_config(lambda >= T(0) && std::isfinite(double(lambda)), "SkipGate::set_penalty_weight",
                           "penalty must be finite and >= 0, got " + std::to_string(double(lambda)));
    penalty_ = lambda;
  }
  /// The keep decision m = 1[g ≥ τ] for one gate value.
  bool keep(T g) const { return g >= threshold_; }

  /// x: N × d → g: N. Throws ValueError if x holds NaN or Inf (a NaN gate
  /// would silently skip its token).
  Vector<T> forward(const ConstMatrixRef<T>& x, Cache* cache = nullptr) const {
    detail::check_shape("SkipGate::forward", "x", x, detail::kAny, d_);
    detail::check_finite("SkipGate::forward", "x", x);
    const Index n = x.rows();
    Matrix<T> z(n, h_);  // N × h
    detail::linear_nt(x, w1_, z, false);
    z.rowwise() += b1_;
    // s = SiLU(z)·W₂ᵀ + b₂,  SiLU(z) = z·σ(z)
    const Matrix<T> a = (z.array() * array::sigmoid(z.array())).matrix();  // N × h
    Vector<T> s(n);
    detail::linear_nt(a, w2_, s, false);
    s.array() += b2_(0, 0);
    Vector<T> g = array::sigmoid(s.array()).matrix();  // N
    if (cache) {
      cache->x = x;
      cache->z = std::move(z);
      cache->s = std::move(s);
      cache->g = g;
      cache->penalty = penalty_value(g);
    }
    return g;
  }

  /// λ_skip · mean(g), 0 for an empty batch.
  T penalty_value(const ConstVectorRef<T>& g) const {
    return g.size() > 0 ? penalty_ * g.mean() : T(0);
  }

  /// dg: N (∂L/∂g of the upstream loss) → dx: N × d. Adds into the parameter
  /// gradients the gradient of the upstream loss plus the compute penalty.
  /// Throws ShapeError if the cache was not filled by a forward of a gate of
  /// this shape (checked first: an unfilled cache and an empty dg would
  /// otherwise pass) or dg does not have the cache's N entries.
  Matrix<T> backward(const ConstVectorRef<T>& dg, const Cache& cache) {
    constexpr const char* where = "SkipGate::backward";
    const Index n = cache.x.rows();
    detail::check_shape(where, "cache.x", cache.x, detail::kAny, d_);
    detail::check_shape(where, "cache.z", cache.z, n, h_);
    detail::check_shape(where, "cache.s", cache.s, n, 1);
    detail::check_shape(where, "cache.g", cache.g, n, 1);
    detail::check_shape(where, "dg", dg.rows(), dg.cols(), n, 1);
    allocate_gradients();
    // ∂(λ·mean g)/∂g_t = λ/N;  ds = ∂L/∂g · σ′(s),  σ′(s) = σ(s)·σ(−s)
    Vector<T> ds = dg;  // N
    if (n > 0) ds.array() += penalty_ / T(n);
    ds.array() *= cache.g.array() * array::sigmoid(-cache.s.array());
    const auto z = cache.z.array();                                    // N × h
    const Matrix<T> a = (z * array::sigmoid(z)).matrix();              // N × h: SiLU(z)
    // ∂L/∂W₂ += dsᵀ·a (1 × h);  ∂L/∂a = ds·W₂ (N × h);  ∂L/∂b₂ += Σ_t ds_t
    Matrix<T> dz(n, h_);  // N × h
    detail::linear_nt_backward(ds, a, w2_, w2_grad_, dz);
    b2_grad_(0, 0) += ds.sum();
    // dz = ∂L/∂a ⊙ SiLU′(z),  SiLU′(z) = σ(z)(1 + z·σ(−z))
    dz.array() *= array::sigmoid(z) * (T(1) + z * array::sigmoid(-z));
    // ∂L/∂W₁ += dzᵀ·x (h × d);  ∂L/∂x = dz·W₁ (N × d);  ∂L/∂b₁ += Σ_t dz_t
    Matrix<T> dx(n, d_);
    detail::linear_nt_backward(dz, cache.x, w1_, w1_grad_, dx);
    b1_grad_.noalias() += dz.colwise().sum();
    return dx;
  }

  /// `w1.weight`, `w1.bias`, `w2.weight`, `w2.bias` with their gradients,
  /// which this allocates (zeroed) if not yet: the views must stay valid for
  /// the layer's life (core/param.hpp).
  ParamList<T> params() {
    allocate_gradients();
    return param_list(true);
  }
  /// The same tensors, values only: never allocates gradients (core/param.hpp).
  ParamList<T> param_values() { return param_list(false); }
  /// Whether the gradients exist (core/param.hpp: allocated lazily).
  bool has_gradients() const { return has_grads_; }
  /// Allocates the gradients, zeroed, unless they exist.
  void allocate_gradients() {
    if (has_grads_) return;
    w1_grad_ = Matrix<T>::Zero(h_, d_);
    b1_grad_ = RowVector<T>::Zero(h_);
    w2_grad_ = Matrix<T>::Zero(1, h_);
    b2_grad_ = Matrix<T>::Zero(1, 1);
    has_grads_ = true;
  }
  /// Zeroes the gradients (allocating them, zeroed, if not yet).
  void zero_grad() {
    if (!has_gradients()) return allocate_gradients();
    w1_grad_.setZero();
    b1_grad_.setZero();
    w2_grad_.setZero();
    b2_grad_.setZero();
  }

  /// h × d, h, 1 × h and the scalar b₂.
  Matrix<T>& w1() { return w1_; }
  RowVector<T>& b1() { return b1_; }
  Matrix<T>& w2() { return w2_; }
  T& b2() { return b2_(0, 0); }
  const Matrix<T>& w1() const { return w1_; }
  const RowVector<T>& b1() const { return b1_; }
  const Matrix<T>& w2() const { return w2_; }
  T b2() const { return b2_(0, 0); }

 private:
  /// params() (grads) or param_values() (!grads).
  ParamList<T> param_list(bool grads) {
    ParamList<T> out;
    out.push_back(detail::make_param<T>("w1.weight", w1_, grads ? &w1_grad_ : nullptr));
    out.push_back(detail::make_param<T>("w1.bias", b1_, grads ? &b1_grad_ : nullptr));
    out.push_back(detail::make_param<T>("w2.weight", w2_, grads ? &w2_grad_ : nullptr));
    out.push_back(detail::make_param<T>("w2.bias", b2_, grads ? &b2_grad_ : nullptr));
    return out;
  }

  Index d_ = 0, h_ = 0;
  T threshold_ = T(0.15);
  T penalty_ = T(0);
  Matrix<T> w1_;          ///< h × d: W₁ᵀ (PyTorch layout)
  RowVector<T> b1_;       ///< 1 × h
  Matrix<T> w2_;          ///< 1 × h
  Matrix<T> b2_;          ///< 1 × 1
  Matrix<T> w1_grad_;     ///< h × d
  RowVector<T> b1_grad_;  ///< 1 × h
  Matrix<T> w2_grad_;     ///< 1 × h
  Matrix<T> b2_grad_;     ///< 1 × 1
  bool has_grads_ = false;  ///< whether the four gradients above are allocated (else all empty)
};

}  // namespace apex
