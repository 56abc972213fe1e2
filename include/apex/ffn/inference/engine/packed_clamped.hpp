#pragma once
/// \file inference/engine/packed_clamped.hpp
/// gpt-oss's clamped SwiGLU with biases on packed weights, and its row of the
/// expert-kind table (inference/engine/packed_expert_kind.hpp):
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
/// calls and threads gives the same bits.

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "../../core/checked_size.hpp"
#include "../../core/errors.hpp"
#include "../../core/types.hpp"
#include "../../kernels/fused_expert.hpp"
#include "../../layers/clamped_swiglu.hpp"
#include "packed_expert_kind.hpp"
#include "packed_two_pass.hpp"

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

/// The clamped SwiGLU's row of the expert-kind table.
template <>
struct PackedExpertKind<ClampedSwiGLU<float>> {
  static constexpr const char* kName = "clamped_swiglu";
  static constexpr bool kCustomActivation = false;  // the clamped activation is the kind's
  using Options = ClampedSwiGLUOptions;
  using Extra = ClampedBiases;
  using Layer = ClampedSwiGLU<float>;

  static const SwiGLU<float>& weights(const Layer& e) { return e.swiglu(); }
  static Extra extra(const Layer& e) { return {e.b_gate(), e.b_up(), e.b_down(), e.options()}; }
  static std::vector<ExpertExtraTensor> extra_tensors(Index d, Index f) {
    return {{Layer::kGateBias, f}, {Layer::kUpBias, f}, {Layer::kDownBias, d}};
  }
  static std::vector<const RowVector<float>*> extra_rows(const Extra& b) { return {&b.gate, &b.up, &b.down}; }
  static Extra make_extra(std::vector<RowVector<float>> rows, const Options& o) {
    return {std::move(rows.at(0)), std::move(rows.at(1)), std::move(rows.at(2)), o};
  }
  template <class LoadOptions>
  static const Options& options_of(const LoadOptions& o) {
    return o.clamped;
  }
  static void check_extra(const char* where, const Extra& b, Index d, Index f) {
    detail::inference::check_extra_shapes<PackedExpertKind>(where, b, d, f);
    b.options.template validate_for<float>(where);
  }
  static void check_kernel_options(const char* where, const packed::ForwardOptions& opt) {
    detail::require_config(opt.bf16_products != packed::Bf16Products::paired, where,
                           "bf16_products = paired is not supported for clamped-SwiGLU experts");
  }
  template <class Act>
  static void forward(const packed::PackedExpert& e, const Extra& b, const float* x, Index ldx, const float*, Index m,
                      float* y, Index ldy, const packed::ForwardOptions& opt) {
    clamped_forward(e, b, x, ldx, m, y, ldy, opt);
  }
};

}  // namespace apex
