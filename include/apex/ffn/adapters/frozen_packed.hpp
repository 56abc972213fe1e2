#pragma once
/// \file adapters/frozen_packed.hpp
/// One expert's frozen weights as the packed engine holds them (any type of
/// the weight-type table, never expanded to float in memory): the four
/// products of adapters/frozen_dense.hpp on the packed kernels,
///
///     [G | U] = x·W_guᵀ     the gate/up panels with exact float activations
///                           (kernels/dequantized_product.hpp: a block format's panel dequantized,
///                           then the f32 tiles), lanes 0–15 of panel p gate units 16p…, lanes
///                           16–31 their up units
///     y       = a·W_downᵀ   the down panels, the same way
///     dx      = [dG | dU]·W_gu,  da = dy·W_down
///                           the transposed product (kernels/transposed_product.hpp): blocks
///                           dequantized a column chunk at a time into an f32 panel
///
/// Training differentiates what the forward computes: the inference
/// products of the block formats quantize activations to Q8_0 / Q8_K,
/// which the exact dequantized weights of the backward would not match, so
/// the forward here keeps the activations float.
///
/// Every product gives each row bits that depend on that row only, the same
/// on every kernel path (the forward tiles' property, and the transposed
/// product's), so a layer on these is bitwise identical across paths and
/// thread counts. [G | U] moves between the panels' interleaved order and
/// the adapters' natural order (gate units, then up units) through the
/// thread's scratch.

#include <algorithm>
#include <cstring>

#include "../core/checked_size.hpp"
#include "../core/types.hpp"
#include "../kernels/dequantized_product.hpp"
#include "../kernels/fused_expert.hpp"
#include "../kernels/packed_weights.hpp"
#include "../kernels/transposed_product.hpp"

namespace apex {

namespace detail {
/// Per-thread scratch of the packed frozen products (grows, never shrinks).
struct FrozenPackedScratch {
  packed::detail::AlignedArray<float> lanes;  ///< rows × 32·panels: a matrix's outputs in panel order
};
inline FrozenPackedScratch& frozen_packed_scratch() {
  thread_local FrozenPackedScratch s;
  return s;
}
}  // namespace detail

struct FrozenPackedExpert {
  using Scalar = float;
  static constexpr Index H = packed::PackedExpert::kHiddenPerPanel;  // 16 hidden units per gate/up panel
  const packed::PackedExpert* weights = nullptr;
  packed::Isa isa = packed::kDefaultIsa;

  Index d_model() const { return weights->d_model(); }
  Index d_ffn() const { return weights->d_ffn(); }

  /// gu (n × 2f, [G | U]) = x (n × d) · W_guᵀ.
  template <class GU>
  void gate_up(const ConstMatrixRef<float>& x, GU&& gu_) const {
    MatrixRef<float> gu(gu_);
    const Index n = x.rows(), f = d_ffn(), ld = lane_cols(weights->gate_up());
    if (n == 0) return;
    float* buf = scratch(n, ld);  // n × 32·panels, panel order
    packed::dequantized_product(isa, weights->gate_up(), x.data(), x.outerStride(), n, buf, ld, ld);
    for (Index t = 0; t < n; ++t)
      for (Index p = 0; p * H < f; ++p) {  // panel p: units [pH, pH + c) gate, then up
        const Index c = std::min(H, f - p * H);
        std::memcpy(&gu(t, p * H), buf + t * ld + p * 2 * H, std::size_t(c) * sizeof(float));
        std::memcpy(&gu(t, f + p * H), buf + t * ld + p * 2 * H + H, std::size_t(c) * sizeof(float));
      }
  }
  /// y (n × d) = a (n × f) · W_downᵀ.
  template <class A, class Y>
  void down(const A& a_, Y&& y_) const {
    const ConstMatrixRef<float> a(a_);
    MatrixRef<float> y(y_);
    if (a.rows() == 0) return;
    packed::dequantized_product(isa, weights->down(), a.data(), a.outerStride(), a.rows(), y.data(), y.outerStride(),
                                d_model());
  }
  /// dx (n × d) = dgu (n × 2f, [dG | dU]) · W_gu.
  template <class DGU, class DX>
  void gate_up_t(const DGU& dgu_, DX&& dx_) const {
    const ConstMatrixRef<float> dgu(dgu_);
    MatrixRef<float> dx(dx_);
    const Index n = dgu.rows(), f = d_ffn(), ld = lane_cols(weights->gate_up());
    if (n == 0) return;
    float* buf = scratch(n, ld);  // n × 32·panels: [dG | dU] in panel order, padding lanes 0
    for (Index t = 0; t < n; ++t) {
      float* row = buf + t * ld;
      std::fill(row, row + ld, 0.0f);
      for (Index p = 0; p * H < f; ++p) {
        const Index c = std::min(H, f - p * H);
        std::memcpy(row + p * 2 * H, dgu.row(t).data() + p * H, std::size_t(c) * sizeof(float));
        std::memcpy(row + p * 2 * H + H, dgu.row(t).data() + f + p * H, std::size_t(c) * sizeof(float));
      }
    }
    packed::transposed_product(isa, weights->gate_up(), buf, ld, n, dx.data(), dx.outerStride());
  }
  /// da (n × f) = dy (n × d) · W_down.
  template <class DY, class DA>
  void down_t(const DY& dy_, DA&& da_) const {
    const ConstMatrixRef<float> dy(dy_);
    MatrixRef<float> da(da_);
    const Index n = dy.rows(), d = d_model(), ld = lane_cols(weights->down());
    if (n == 0) return;
    if (ld == d) {  // whole panels: dy is read in place
      packed::transposed_product(isa, weights->down(), dy.data(), dy.outerStride(), n, da.data(), da.outerStride());
      return;
    }
    float* buf = scratch(n, ld);  // n × 32·panels: dy, padding lanes 0
    for (Index t = 0; t < n; ++t) {
      std::memcpy(buf + t * ld, dy.row(t).data(), std::size_t(d) * sizeof(float));
      std::fill(buf + t * ld + d, buf + (t + 1) * ld, 0.0f);
    }
    packed::transposed_product(isa, weights->down(), buf, ld, n, da.data(), da.outerStride());
  }

 private:
  static Index lane_cols(const packed::PanelMatrix& m) { return m.panels() * packed::kPanelLanes; }
  static float* scratch(Index rows, Index cols) {
    return packed::detail::grow(detail::frozen_packed_scratch().lanes,
                                detail::checked_product("FrozenPackedExpert", "scratch rows x lanes", {rows, cols}));
  }
};

}  // namespace apex
