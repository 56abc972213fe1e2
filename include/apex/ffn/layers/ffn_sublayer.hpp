#pragma once
/// \file layers/ffn_sublayer.hpp
/// The pre-norm residual FFN sublayer of an APEX-1 block, optionally guarded
/// by the dynamic skip gate (docs/math.md#ffn-sublayer):
///
///     y = x + m ⊙ FFN(RMSNorm(x)),   m_t = 1[g(x_t) ≥ τ]   (m ≡ 1 without a gate)
///
/// `FFN` is any layer with the library's contract — `SwiGLU<T>`,
/// `MoEFFN<T, Expert>` (so also κ-SwiGLU MoE). Parameters are named
/// `norm.weight`, `ffn.…` and `skip_gate.…`.
///
/// Two modes, same `y`:
/// - **training** (with a cache) computes the FFN for every token: the
///   straight-through estimator needs `F = FFN(RMSNorm(x))` of the skipped
///   tokens too. Backward treats ∂m/∂g = 1, so
///   `∂L/∂g_t = Σ_j ∂L/∂y_tj · F_tj`; the FFN and the norm receive the true
///   gradient `m_t · ∂L/∂y_t` (nothing from skipped tokens).
/// - **inference** computes the FFN only for kept tokens: it gathers their
///   normalised rows, runs the FFN on that block (an MoE layer routes only
///   them) and scatters `x + F` back; skipped rows are copied from `x`.
///
/// Both modes run the FFN on the same gathered block of kept rows (training
/// runs the skipped rows as a second, cache-less block), so the two modes'
/// `y` are bitwise equal for any deterministic FFN, and a forward with every
/// token kept is bitwise the ungated sublayer. Without a cache there is no
/// backward, so both modes then compute as inference does.
///
/// The keep decision lives in layers/skip_decision.hpp, the modes, the
/// cache and the FFN traits in layers/sublayer_cache.hpp; this header
/// includes both.
///
/// Load balancing: the FFN cache of the sublayer holds the kept tokens only,
/// in both modes, so `observe(cache)` makes an MoE balancer count exactly the
/// tokens that were routed through it.

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "../core/errors.hpp"
#include "../core/param.hpp"
#include "rms_norm.hpp"
#include "skip_decision.hpp"
#include "skip_gate.hpp"
#include "sublayer_cache.hpp"
#include "../core/types.hpp"

namespace apex {

/// `y = x + m ⊙ FFN(RMSNorm(x))` with an optional skip gate; see the file comment.
template <class T, class FFN>
class FFNSublayer {
 public:
  using Scalar = T;
  using FFNType = FFN;

  /// Everything one forward leaves behind (layers/sublayer_cache.hpp).
  using Cache = SublayerCache<T, typename FFN::Cache>;

  /// The plain pre-norm residual sublayer `x + FFN(RMSNorm(x))`.
  FFNSublayer(Index d_model, FFN ffn) : norm_(d_model), ffn_(std::move(ffn)) { check_ffn_width(); }
  /// The gated sublayer; `gate.d_model()` must equal `d_model`.
  FFNSublayer(Index d_model, FFN ffn, SkipGate<T> gate)
      : norm_(d_model), ffn_(std::move(ffn)), gate_(std::move(gate)) {
    check_ffn_width();
    detail::require_config(gate_->d_model() == d_model, "FFNSublayer",
                           "skip gate d_model " + std::to_string(gate_->d_model()) + " differs from d_model " +
                               std::to_string(d_model));
  }

  Index d_model() const { return norm_.d_model(); }
  bool gated() const { return gate_.has_value(); }
  /// The mode `forward(x, cache)` uses; training by default.
  SublayerMode mode() const { return mode_; }
  /// ConfigError for a value that is neither mode.
  void set_mode(SublayerMode mode) {
    detail::check_mode("FFNSublayer::set_mode", mode);
    mode_ = mode;
  }

  /// x: N × d → y: N × d, in the layer's mode.
  Matrix<T> forward(const ConstMatrixRef<T>& x, Cache* cache = nullptr) const { return forward(x, mode_, cache); }

  /// x: N × d → y: N × d, in `mode`. Three steps: decide which tokens the
  /// FFN sees, run it, and fill the cache — each field written once.
  Matrix<T> forward(const ConstMatrixRef<T>& x, SublayerMode mode, Cache* cache) const {
    constexpr const char* where = "FFNSublayer::forward";
    const bool train = cache != nullptr && mode == SublayerMode::training;
    Decision decision;
    // Training with a gate calls the FFN twice (kept rows, then skipped rows).
    local_step(where, train && gate_ ? 2 : 1, [&] {
      detail::check_shape(where, "x", x, detail::kAny, d_model());
      detail::check_mode(where, mode);
      decision = decide(x, train);
    });
    Matrix<T> f;  // training, gated: N × d, F of every token
    Matrix<T> y = run(x, decision, train, cache, f);
    if (cache) fill_cache(*cache, x.rows(), train, std::move(decision), std::move(f));
    return y;
  }

  /// dy: N × d → dx: N × d; adds into every parameter gradient, including the
  /// straight-through gradient of the gate and the penalty's. Needs a cache
  /// filled by a training-mode forward (ValueError otherwise) of a sublayer
  /// of this width: its own fields are checked (ShapeError naming the cache
  /// field) before dy, since an unfilled cache and an empty dy would pass the
  /// dy check; the norm, FFN and gate backwards check their parts.
  Matrix<T> backward(const ConstMatrixRef<T>& dy, const Cache& cache) {
    constexpr const char* where = "FFNSublayer::backward";
    const Index n = cache.tokens;
    const Index n_kept = Index(cache.kept.size());
    local_step(where, 1, [&] {
      if (cache.mode != SublayerMode::training)
        throw ValueError(
            "FFNSublayer::backward: argument 'cache' was filled by an inference-mode forward, expected a "
            "training-mode one (inference does not compute the FFN of skipped tokens)");
      detail::sublayer::check_provenance(where, cache, gated());
      if (gate_) detail::check_shape(where, "cache.f", cache.f, n, d_model());
      detail::check_shape(where, "dy", dy, n, d_model());
    });

    // y = x + m ⊙ F(RMSNorm(x)):  ∂L/∂F_t = m_t · ∂L/∂y_t, the residual passes dy.
    Matrix<T> dx = dy;  // N × d
    if (n_kept == 0 && collective)  // the other processes' backward needs this one's part of the exchange
      (void)ffn_.backward(Matrix<T>(0, d_model()), cache.ffn);
    if (n_kept > 0) {
      Matrix<T> dxn;  // N × d: ∂L/∂RMSNorm(x)
      if (n_kept == n) {
        dxn = ffn_.backward(dy, cache.ffn);
      } else {
        const Matrix<T> dxk = ffn_.backward(detail::sublayer::gather<T>(dy, cache.kept), cache.ffn);  // n_kept × d
        dxn = Matrix<T>::Zero(n, d_model());
        for (Index i = 0; i < n_kept; ++i) dxn.row(cache.kept[std::size_t(i)]) = dxk.row(i);
      }
      dx += norm_.backward(dxn, cache.norm);
    }
    if (gate_) {
      // STE, ∂m/∂g = 1:  ∂L/∂g_t = Σ_j ∂L/∂y_tj · F_tj  (the gate adds λ_skip/N itself)
      const Vector<T> dg = (dy.array() * cache.f.array()).rowwise().sum().matrix();  // N
      dx += gate_->backward(dg, cache.gate);
    }
    return dx;
  }

  /// Adds the tokens the FFN routed in the forward that filled `cache` — the
  /// kept tokens only, in either mode — to the FFN's load-balancer counts.
  /// Exists when `FFN` has `observe(const FFN::Cache&)` (MoEFFN).
  template <class F = FFN, std::enable_if_t<detail::sublayer::has_observe<F>::value, int> = 0>
  void observe(const Cache& cache) {
    detail::sublayer::check_provenance("FFNSublayer::observe", cache, gated());
    if (cache.ffn_ran || collective) ffn_.observe(cache.ffn);
  }

  /// `norm.weight`, `ffn.…`, then (gated) `skip_gate.w1.weight`, …, with
  /// their gradients, which this allocates (zeroed) where not yet: the views
  /// must stay valid for the layer's life (core/param.hpp).
  ParamList<T> params() {
    ParamList<T> out;
    detail::append_prefixed(out, "norm.", norm_.params());
    detail::append_prefixed(out, "ffn.", ffn_.params());
    if (gate_) detail::append_prefixed(out, "skip_gate.", gate_->params());
    return out;
  }
  /// The same tensors, values only: never allocates gradients (core/param.hpp).
  ParamList<T> param_values() {
    ParamList<T> out;
    detail::append_prefixed(out, "norm.", norm_.param_values());
    detail::append_prefixed(out, "ffn.", detail::param_values_of(ffn_));
    if (gate_) detail::append_prefixed(out, "skip_gate.", gate_->param_values());
    return out;
  }
  /// Zeroes every gradient (allocating them, zeroed, where not yet).
  void zero_grad() {
    norm_.zero_grad();
    ffn_.zero_grad();
    if (gate_) gate_->zero_grad();
  }
  /// Whether the norm's, the FFN's and the gate's gradients all exist.
  bool has_gradients() const {
    return norm_.has_gradients() && ffn_.has_gradients() && (!gate_ || gate_->has_gradients());
  }
  /// Allocates every gradient, zeroed, where not yet (each part's backward
  /// would allocate its own; this is the explicit form).
  void allocate_gradients() {
    norm_.allocate_gradients();
    detail::allocate_gradients_of(ffn_);
    if (gate_) gate_->allocate_gradients();
  }

  RMSNorm<T>& norm() { return norm_; }
  const RMSNorm<T>& norm() const { return norm_; }
  FFN& ffn() { return ffn_; }
  const FFN& ffn() const { return ffn_; }
  /// The gate, or nullptr for the ungated sublayer.
  SkipGate<T>* skip_gate() { return gate_ ? &*gate_ : nullptr; }
  const SkipGate<T>* skip_gate() const { return gate_ ? &*gate_ : nullptr; }

 private:
  /// Which tokens the FFN sees (layers/skip_decision.hpp).
  using Decision = detail::sublayer::Decision<T>;
  Decision decide(const ConstMatrixRef<T>& x, bool train) const { return detail::sublayer::decide<T>(gate_, x, train); }

  /// y = x + m ⊙ FFN(RMSNorm(x)). The kept rows go through the FFN in one call
  /// in both modes (a product's result for a row can depend on how many rows
  /// share the call, so this keeps the modes bitwise equal); training adds a
  /// cacheless call on the skipped rows, whose F only the gate's STE needs.
  /// Fills `f` (training, gated) and, with a cache, its norm and FFN parts.
  Matrix<T> run(const ConstMatrixRef<T>& x, const Decision& d, bool train, Cache* cache, Matrix<T>& f) const {
    const Index n = x.rows();
    const Index n_kept = Index(d.kept.size());
    typename FFN::Cache* ffn_cache = cache ? &cache->ffn : nullptr;
    if (n_kept == 0 && !train) {  // every token skipped: no norm, no FFN (a collective FFN sees 0 rows)
      if constexpr (collective) (void)ffn_.forward(Matrix<T>(0, d_model()), ffn_cache);
      return x;
    }
    const Matrix<T> xn = norm_.forward(x, train ? &cache->norm : nullptr);  // N × d
    if (d.skipped.empty()) {
      // The ungated computation exactly: one FFN call on all rows.
      Matrix<T> fk = ffn_.forward(xn, ffn_cache);  // N × d
      // A collective FFN: processes that skipped tokens make a second call for them.
      if constexpr (collective)
        if (train && gate_) (void)ffn_.forward(Matrix<T>(0, d_model()));
      Matrix<T> y = x + fk;
      if (train && gate_) f = std::move(fk);
      return y;
    }
    Matrix<T> fk;  // n_kept × d
    if (n_kept > 0 || collective) fk = ffn_.forward(detail::sublayer::gather<T>(xn, d.kept), ffn_cache);
    Matrix<T> y = x;
    for (Index i = 0; i < n_kept; ++i) {
      const Index t = d.kept[std::size_t(i)];
      y.row(t) = x.row(t) + fk.row(i);
    }
    if (train) {
      const Matrix<T> fs = ffn_.forward(detail::sublayer::gather<T>(xn, d.skipped));  // n_skip × d
      f.resize(n, d_model());
      for (Index i = 0; i < n_kept; ++i) f.row(d.kept[std::size_t(i)]) = fk.row(i);
      for (Index i = 0; i < Index(d.skipped.size()); ++i) f.row(d.skipped[std::size_t(i)]) = fs.row(i);
    }
    return y;
  }

  /// The decisions and statistics of one forward. `run` already wrote the
  /// norm (training) and FFN parts; an inference forward leaves no norm
  /// activations, so a stale training norm cache cannot be mistaken for one.
  void fill_cache(Cache& c, Index n, bool train, Decision&& d, Matrix<T>&& f) const {
    c.mode = train ? SublayerMode::training : SublayerMode::inference;
    c.gated = gated();
    c.tokens = n;
    c.ffn_ran = !d.kept.empty();
    c.kept = std::move(d.kept);
    c.f = std::move(f);
    c.penalty = gate_ ? gate_->penalty_value(d.gate.g) : T(0);
    c.gate = std::move(d.gate);
    if (!train) c.norm = {};
  }

  void check_ffn_width() const {
    if constexpr (detail::sublayer::has_d_model<FFN>::value) {
      detail::require_config(ffn_.d_model() == d_model(), "FFNSublayer",
                             "FFN d_model " + std::to_string(ffn_.d_model()) + " differs from d_model " +
                                 std::to_string(d_model()));
    }
  }

  static constexpr bool collective = detail::sublayer::is_collective<FFN>::value;

  /// Runs the sublayer's own checks and decisions, `fn`. With a collective
  /// FFN every process must then make the same FFN calls: the FFN's
  /// `agree_step` runs `fn` and agrees on its outcome and on `ffn_calls`, so a
  /// check failing on one process, or processes in different modes (one
  /// passing a cache, one not), give the same exception on every process
  /// instead of leaving the others blocked in the FFN's collective.
  template <class Fn>
  void local_step(const char* where, std::int64_t ffn_calls, Fn&& fn) const {
    if constexpr (collective)
      ffn_.agree_step(where, "the number of FFN calls (the sublayer's mode, a cache passed or not, a gate or not)",
                      ffn_calls, std::forward<Fn>(fn));
    else
      fn();
  }

  RMSNorm<T> norm_;
  FFN ffn_;
  std::optional<SkipGate<T>> gate_;
  SublayerMode mode_ = SublayerMode::training;
};

}  // namespace apex
