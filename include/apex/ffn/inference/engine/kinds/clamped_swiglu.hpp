#pragma once
/// \file inference/engine/kinds/clamped_swiglu.hpp
/// gpt-oss's clamped SwiGLU with biases as an expert kind
/// (inference/engine/expert_kind.hpp): its row, and its forward on packed weights:
///
///     [G | U] = X·[W_gate; W_up]ᵀ                  packed gate/up panels, any storage type
///     A = (clamp(U + b_up, −L, L) + 1) ⊙ Ĝ·σ(α·Ĝ),  Ĝ = min(G + b_gate, L)
///     Y = A·W_downᵀ + b_down                        packed down panels
///
/// The gate/up panels run with the plain epilogue (G in lanes 0–15, U in
/// lanes 16–31 of each panel); the biases and the activation are applied to
/// a block's [G | U] while it is still in cache, by the float layer's own
/// expression (detail::clamped_glu), then the down panels run on A and b_down
/// is added. A tile epilogue sees a panel's 32 lanes but not which hidden
/// units they are, so a per-unit bias cannot be added inside it; the extra
/// pass reads and writes rows × 2f floats of L1/L2, against the 2f × d
/// weights every block streams. The biases, α and L stay float.
///
/// Per row, the result depends only on that row, so any split of rows into
/// calls and threads gives the same bits. In GGUF files the kind is
/// llama.cpp's gpt-oss block: the biases are `ffn_{gate,up,down}_exps.bias`,
/// α and L the architecture row's (io/gguf_architectures.hpp).

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "../../../core/checked_size.hpp"
#include "../../../core/errors.hpp"
#include "../../../core/types.hpp"
#include "../../../io/gguf_architectures.hpp"
#include "../../../kernels/fused_expert.hpp"
#include "../../../layers/clamped_swiglu.hpp"
#include "../../../moe/expert_contract.hpp"
#include "../expert_kind.hpp"
#include "../packed_two_pass.hpp"

namespace apex {

/// The float part of one clamped-SwiGLU expert: its three biases and options.
struct ClampedBiases {
  RowVector<float> gate;  ///< 1 × f
  RowVector<float> up;    ///< 1 × f
  RowVector<float> down;  ///< 1 × d
  ClampedSwiGLUOptions options;
};

namespace detail::inference {

inline void clamped_block(packed::Isa isa, const packed::PackedExpert& e, const ClampedBiases& b, const float* x,
                          Index ldx, Index rows, float* gu, Index ldgu, float* a, Index lda, float* y, Index ldy) {
  using packed::PlainEpilogue;
  using packed::detail::run_matrix;
  const Index d = e.d_model(), f = e.d_ffn();
  constexpr Index H = packed::PackedExpert::kHiddenPerPanel, O = packed::PackedExpert::kOutPerPanel;
  run_matrix<PlainEpilogue>(isa, e.gate_up(), x, ldx, rows, gu, ldgu, 2 * H, e.gate_up().panels() * 2 * H);
  const float alpha = float(b.options.alpha), limit = float(b.options.limit);
  float* units = unit_rows(2, f);
  Eigen::Map<array::Row<float>> g(units, f), u(units + f, f);  // 1 × f each: G + b_gate, U + b_up
  for (Index t = 0; t < rows; ++t) {
    const float* r = gu + t * ldgu;
    for (Index p = 0; p * H < f; ++p) {  // panel p holds units [pH, pH + H): G then U
      const Index n = std::min(H, f - p * H);
      g.segment(p * H, n) = Eigen::Map<const array::Row<float>>(r + p * 2 * H, n);
      u.segment(p * H, n) = Eigen::Map<const array::Row<float>>(r + p * 2 * H + H, n);
    }
    g += b.gate.array();
    u += b.up.array();
    apex::detail::clamped_glu(g, u, Eigen::Map<array::Row<float>>(a + t * lda, f), alpha, limit);
  }
  run_matrix<PlainEpilogue>(isa, e.down(), a, lda, rows, y, ldy, O, d);
  for (Index t = 0; t < rows; ++t) Eigen::Map<array::Row<float>>(y + t * ldy, d) += b.down.array();
}

}  // namespace detail::inference

/// y (m × d, row stride ldy) = clamped-SwiGLU expert(x (m × d, row stride
/// ldx)). Blocks as packed::forward: one block for m ≤ kSmallRows (decode),
/// blocks of kRowBlock rows otherwise. ConfigError for `paired` bf16
/// products (the biases need G and U apart) and as packed::forward.
inline void clamped_forward(const packed::PackedExpert& e, const ClampedBiases& b, const float* x, Index ldx, Index m,
                            float* y, Index ldy, const packed::ForwardOptions& opt = {}) {
  detail::inference::two_pass_forward(
      "clamped_forward", "clamped-SwiGLU", e, x, ldx, m, y, ldy, opt,
      [&](const float* xr, Index, Index rows, float* gu, Index ldgu, float* a, Index lda, float* yr) {
        detail::inference::clamped_block(opt.isa, e, b, xr, ldx, rows, gu, ldgu, a, lda, yr, ldy);
      });
}

/// The clamped SwiGLU's row: its three biases kept as float.
template <class T>
struct ExpertKind<ClampedSwiGLU<T>> {
  using Expert = ClampedSwiGLU<T>;
  static constexpr const char* kName = "clamped_swiglu";
  static constexpr const char* kLabel = "clamped-SwiGLU";
  using Options = ClampedSwiGLUOptions;
  using Packed = ClampedSwiGLU<float>;

  // ---- frozen float parts: b_gate, b_up (1 × f), b_down (1 × d) and the options
  using Extra = ClampedBiases;
  static const SwiGLU<T>& weights(const Expert& e) { return e.swiglu(); }
  static SwiGLU<T>& weights(Expert& e) { return e.swiglu(); }
  static Extra extra(const Expert& e) {
    return {e.b_gate().template cast<float>(), e.b_up().template cast<float>(), e.b_down().template cast<float>(),
            e.options()};
  }
  static std::vector<ExpertExtraTensor> extra_tensors(Index d, Index f) {
    return {{Expert::kGateBias, f}, {Expert::kUpBias, f}, {Expert::kDownBias, d}};
  }
  static std::vector<const RowVector<float>*> extra_rows(const Extra& b) { return {&b.gate, &b.up, &b.down}; }
  static Extra make_extra(std::vector<RowVector<float>> rows, const Options& o) {
    return {std::move(rows.at(0)), std::move(rows.at(1)), std::move(rows.at(2)), o};
  }
  static void check_extra(const char* where, const Extra& b, Index d, Index f) {
    detail::inference::check_extra_shapes<ExpertKind>(where, b, d, f);
    b.options.template validate_for<float>(where);
  }

  // ---- packed forward: two passes, the biases and the clamped activation between them
  static constexpr bool kCustomActivation = false;
  static void check_kernel_options(const char* where, const packed::ForwardOptions& opt) {
    detail::inference::require_unpaired(where, opt, kLabel);
  }
  template <class Act>
  static void forward(const packed::PackedExpert& e, const Extra& b, const float* x, Index ldx, const float*, Index m,
                      float* y, Index ldy, const packed::ForwardOptions& opt) {
    clamped_forward(e, b, x, ldx, m, y, ldy, opt);
  }

  // ---- GGUF: llama.cpp's gpt-oss block, the biases ne [cols, E], α and L the row's
  struct Gguf {
    /// In extra_tensors() order: b_gate, b_up, b_down.
    static std::vector<ExpertExtraTensor> extra_tensors(Index d, Index f) {
      namespace tn = gguf::tensor_names;
      return {{tn::kGateExpsBias, f}, {tn::kUpExpsBias, f}, {tn::kDownExpsBias, d}};
    }
    static Options options(const gguf::Architecture& a) {
      Options o;
      o.alpha = a.clamp_alpha, o.limit = a.clamp_limit;
      return o;
    }
    /// The float layer's experts get the row's α and L.
    template <class Layer>
    static void configure(Layer& layer, const gguf::Architecture& a) {
      for (auto& e : layer.experts()) e.set_options(options(a));
    }
    /// ConfigError unless every expert's α and L are the ones llama.cpp computes.
    static void check_extras(const char* where, const std::vector<Extra>& experts, const gguf::Architecture& a) {
      for (std::size_t e = 0; e < experts.size(); ++e) {
        const Options& o = experts[e].options;
        detail::require_config(o.alpha == a.clamp_alpha && o.limit == a.clamp_limit, where,
                               std::string("llama.cpp's ") + a.name + " cannot hold this layer: its clamped SwiGLU has " +
                                   "alpha " + std::to_string(a.clamp_alpha) + " and limit " +
                                   std::to_string(a.clamp_limit) + ", expert " + std::to_string(e) + "'s are " +
                                   std::to_string(o.alpha) + " and " + std::to_string(o.limit));
      }
    }
  };

  // ---- under adapters: the three biases and α, L frozen
  struct Activation {
    using SideInput = NoSideInput;
    ClampedSwiGLUOptions options;
    RowVector<T> b_gate, b_up;  ///< 1 × f each
    RowVector<T> b_down;        ///< 1 × d

    static Activation of(const Expert& e) { return {e.options(), e.b_gate(), e.b_up(), e.b_down()}; }
    static Activation of(const Extra& b) {
      return {b.options, b.gate.template cast<T>(), b.up.template cast<T>(), b.down.template cast<T>()};
    }

    /// g, u: n × f arrays (biased in place: G̃, Ũ); a: n × f (written).
    template <class G, class U, class A>
    void forward(const ConstVectorRef<T>&, G&& g, U&& u, A&& a) const {
      g.rowwise() += b_gate.array();  // G̃ = G + b_gate
      u.rowwise() += b_up.array();    // Ũ = U + b_up
      detail::clamped_glu(g, u, a, T(options.alpha), T(options.limit));
    }
    /// work: n × ≥2f starting [G̃ | Ũ]; dh: n × 2f, ∂L/∂A in its right half, becomes [∂L/∂G̃ | ∂L/∂Ũ].
    template <class Work, class DH>
    void backward(const ConstVectorRef<T>&, const Work& work, DH& dh, VectorRef<T>) const {
      detail::clamped_glu_backward(work, dh, T(options.alpha), T(options.limit));
    }
    /// y = A·W_downᵀ + b_down.
    template <class Y>
    void finish(Y&& y) const {
      y.rowwise() += b_down;
    }
    void apply_to(Expert& e) const {
      e.set_options(options);
      e.b_gate() = b_gate;
      e.b_up() = b_up;
      e.b_down() = b_down;
    }
  };
};

}  // namespace apex
