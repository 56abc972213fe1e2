#pragma once
/// \file inference/engine/kinds/kappa_swiglu.hpp
/// κ-SwiGLU as an expert kind (inference/engine/expert_kind.hpp): its row,
/// and its forward on packed weights (docs/math.md#kappa-swiglu):
///
///     Y = (G·σ(κ ⊙ G) ⊙ U)·W_downᵀ,   [G | U] = X·[W_gate; W_up]ᵀ,
///     κ_tj = exp(ln U_max · tanh(b_j + α_j·s_t)) ∈ [1/U_max, U_max],   s_t = c·ℓ_t
///
/// The packed kernels fuse SiLU into the gate/up pass (kernels/fused_expert.hpp);
/// κ needs each row's router logit, so here the gate/up panels are run with
/// the plain epilogue (G in lanes 0–15, U in lanes 16–31 of each panel), A is
/// formed from them with κ from the function the float layer calls
/// (layers/kappa_row.hpp) and the float layer's SiLU_κ expression, and the
/// down panels run on A as in the SwiGLU forward. α, b and the options stay
/// float: κ is the float layer's κ bit for bit. With U_max = 1
/// (κ ≡ 1) the fused SwiGLU kernel runs instead.
///
/// Per row, the result depends only on that row (as for the SwiGLU kernels),
/// so any split of rows into calls and threads gives the same bits.

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "../../../core/checked_size.hpp"
#include "../../../core/errors.hpp"
#include "../../../core/state_names.hpp"
#include "../../../core/types.hpp"
#include "../../../kernels/fused_expert.hpp"
#include "../../../layers/activations.hpp"
#include "../../../layers/kappa_activation.hpp"
#include "../../../layers/kappa_options.hpp"
#include "../../../layers/kappa_row.hpp"
#include "../../../layers/kappa_swiglu.hpp"
#include "../../../moe/expert_contract.hpp"
#include "../expert_kind.hpp"
#include "../packed_two_pass.hpp"

namespace apex {

/// The float part of one κ-SwiGLU expert: α, b (1 × f each) and its options.
struct KappaGate {
  RowVector<float> alpha;  ///< 1 × f
  RowVector<float> bias;   ///< 1 × f
  KappaOptions options;
};

namespace detail::inference {

inline void kappa_block(packed::Isa isa, const packed::PackedExpert& e, const KappaGate& k, const float* x, Index ldx,
                 const float* logit, Index rows, float* gu, Index ldgu, float* a, Index lda, float* y, Index ldy) {
  using packed::PlainEpilogue;
  using packed::detail::run_matrix;
  const Index d = e.d_model(), f = e.d_ffn();
  constexpr Index H = packed::PackedExpert::kHiddenPerPanel, O = packed::PackedExpert::kOutPerPanel;
  // [G | U] of 16 hidden units per panel, plain epilogue (all 32 lanes)
  run_matrix<PlainEpilogue>(isa, e.gate_up(), x, ldx, rows, gu, ldgu, 2 * H, e.gate_up().panels() * 2 * H);
  // A = G·σ(κG) ⊙ U, a row at a time, κ by the float layer's own function
  float* units = unit_rows(4, f);
  Eigen::Map<array::Row<float>> g(units, f), u(units + f, f), tau(units + 2 * f, f), kap(units + 3 * f, f);  // 1 × f each
  for (Index t = 0; t < rows; ++t) {
    const float* r = gu + t * ldgu;
    for (Index j = 0; j < f; ++j) {
      g(j) = r[(j / H) * 2 * H + j % H];
      u(j) = r[(j / H) * 2 * H + H + j % H];
    }
    kappa_row(k.options, k.alpha, k.bias, logit[t], tau, kap);
    Eigen::Map<array::Row<float>>(a + t * lda, f) = g * array::sigmoid(kap * g) * u;
  }
  run_matrix<PlainEpilogue>(isa, e.down(), a, lda, rows, y, ldy, O, d);
}

}  // namespace detail::inference

/// y (m × d, row stride ldy) = κ-SwiGLU expert(x (m × d, row stride ldx),
/// logit (m)). Blocks as packed::forward: one block for m ≤ kSmallRows
/// (decode), blocks of kRowBlock rows otherwise. ConfigError for `paired`
/// bf16 products (κ needs G and U apart, which the paired path does not
/// produce) and as packed::forward.
inline void kappa_forward(const packed::PackedExpert& e, const KappaGate& k, const float* x, Index ldx,
                          const float* logit, Index m, float* y, Index ldy, const packed::ForwardOptions& opt = {}) {
  constexpr const char* where = "kappa_forward";
  detail::inference::require_unpaired(where, opt, "kappa-SwiGLU");
  if (k.options.U == 1.0) return packed::forward(e, x, ldx, m, y, ldy, opt);  // κ ≡ 1: SwiGLU
  detail::inference::two_pass_forward(
      where, "kappa-SwiGLU", e, x, ldx, m, y, ldy, opt,
      [&](const float* xr, Index r0, Index rows, float* gu, Index ldgu, float* a, Index lda, float* yr) {
        detail::inference::kappa_block(opt.isa, e, k, xr, ldx, logit + r0, rows, gu, ldgu, a, lda, yr, ldy);
      });
}

/// κ-SwiGLU's row: α and b kept as float, κ from each row's router logit
/// (the side input); no GGUF form.
template <class T>
struct ExpertKind<KappaSwiGLU<T>> {
  using Expert = KappaSwiGLU<T>;
  static constexpr const char* kName = "kappa_swiglu";
  static constexpr const char* kLabel = "kappa-SwiGLU";
  using Options = KappaOptions;
  using Packed = KappaSwiGLU<float>;

  // ---- frozen float parts: α, b (1 × f each) and the options
  using Extra = KappaGate;
  static const SwiGLU<T>& weights(const Expert& e) { return e.swiglu(); }
  static SwiGLU<T>& weights(Expert& e) { return e.swiglu(); }
  static Extra extra(const Expert& e) {
    return {e.kappa_alpha().template cast<float>(), e.kappa_bias().template cast<float>(), e.options()};
  }
  static std::vector<ExpertExtraTensor> extra_tensors(Index, Index f) {
    return {{state_names::kKappaAlpha, f}, {state_names::kKappaBias, f}};
  }
  static std::vector<const RowVector<float>*> extra_rows(const Extra& g) { return {&g.alpha, &g.bias}; }
  static Extra make_extra(std::vector<RowVector<float>> rows, const Options& o) {
    return {std::move(rows.at(0)), std::move(rows.at(1)), o};
  }
  static void check_extra(const char* where, const Extra& g, Index d, Index f) {
    detail::inference::check_extra_shapes<ExpertKind>(where, g, d, f);
    g.options.template validate_for<float>(where);
  }

  // ---- packed forward: two passes, SiLU_κ between them (its own activation)
  static constexpr bool kCustomActivation = false;
  static void check_kernel_options(const char* where, const packed::ForwardOptions& opt) {
    detail::inference::require_unpaired(where, opt, kLabel);
  }
  template <class Act>
  static void forward(const packed::PackedExpert& e, const Extra& g, const float* x, Index ldx, const float* logit,
                      Index m, float* y, Index ldy, const packed::ForwardOptions& opt) {
    kappa_forward(e, g, x, ldx, logit, m, y, ldy, opt);
  }

  using Gguf = NoGgufForm;  // llama.cpp has no κ experts

  // ---- under adapters: A = G·σ(κG) ⊙ U, α, b and the options frozen
  struct Activation {
    using SideInput = RouterLogitInput;
    KappaOptions options;
    RowVector<T> alpha, bias;  ///< 1 × f each

    static Activation of(const Expert& e) { return {e.options(), e.kappa_alpha(), e.kappa_bias()}; }
    static Activation of(const Extra& g) { return {g.options, g.alpha.template cast<T>(), g.bias.template cast<T>()}; }

    /// logit: n; g, u: n × f arrays; a: n × f (written).
    template <class G, class U, class A>
    void forward(const ConstVectorRef<T>& logit, G&& g, U&& u, A&& a) const {
      detail::kappa_activation_forward(options, alpha, bias, logit, g, u, a);
    }
    /// ds = ρ·∂L/∂ℓ (KappaSwiGLU's convention); the α, b gradients are discarded.
    template <class Work, class DH>
    void backward(const ConstVectorRef<T>& logit, const Work& work, DH& dh, VectorRef<T> ds) const {
      thread_local RowVector<T> discard_a, discard_b;  // 1 × f: where the frozen α, b gradients go
      discard_a.resize(alpha.size());
      discard_b.resize(alpha.size());
      const ConstMatrixRef<T> w(work);
      detail::kappa_activation_backward(options, alpha, bias, logit, w, dh, discard_a, discard_b, ds);
    }
    template <class Y>
    void finish(Y&&) const {}
    void apply_to(Expert& e) const {
      e.set_options(options);
      e.kappa_alpha() = alpha;
      e.kappa_bias() = bias;
    }
  };
};

}  // namespace apex
