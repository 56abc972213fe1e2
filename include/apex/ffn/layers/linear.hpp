#pragma once
/// \file layers/linear.hpp
/// The one matrix product every layer is built from: `Y (=|+=) X·Wᵀ` with `X`
/// row-major `n × in` (tokens) and `W` a PyTorch-layout `[out, in]` weight.
///
/// For a handful of rows (decode) a general matrix product packs all of `W`
/// into a scratch buffer before it multiplies: it reads the weights twice and
/// writes them once, which triples the memory traffic of a bandwidth-bound
/// product. Below `kSmallRows` rows each weight row is streamed once and dotted
/// with every token while it sits in L1 — the matrix–vector path.

#include "../core/types.hpp"

namespace apex {
namespace detail {

/// Row count at or below which the streaming matrix–vector path is used.
inline constexpr Index kSmallRows = 8;

/// y = x·Wᵀ (accumulate = false) or y += x·Wᵀ.
/// x: n × in, w: out × in, y: n × out.
template <class XT, class WT, class YT>
void linear_nt(const Eigen::MatrixBase<XT>& x, const Eigen::MatrixBase<WT>& w, const Eigen::MatrixBase<YT>& y_,
               bool accumulate) {
  using T = typename XT::Scalar;
  // Eigen's idiom for writing through an expression argument (a block of a buffer).
  auto& y = const_cast<Eigen::MatrixBase<YT>&>(y_);
  const Index n = x.rows();
  if (n == 0) return;
  if (n <= kSmallRows && w.rows() > 0) {
    // Streaming path: W row j is read once for all n tokens.
    for (Index j = 0; j < w.rows(); ++j) {
      const auto wj = w.row(j);
      for (Index t = 0; t < n; ++t) {
        const T v = x.row(t).dot(wj);
        if (accumulate)
          y(t, j) += v;
        else
          y(t, j) = v;
      }
    }
    return;
  }
  if (accumulate)
    y.noalias() += x * w.transpose();
  else
    y.noalias() = x * w.transpose();
}

/// Backward of `y = x·Wᵀ` (see linear_nt), the one place it is written:
///
///     ∂L/∂W += dyᵀ·x      dw: out × in   (adds: shared weights, micro-batches)
///     ∂L/∂x  = dy·W       dx: n × in     (assigned)
///
/// dy: n × out, x: n × in, w: out × in. Either output may be an Eigen block.
template <class DY, class X, class W, class DW, class DX>
void linear_nt_backward(const Eigen::MatrixBase<DY>& dy, const Eigen::MatrixBase<X>& x,
                        const Eigen::MatrixBase<W>& w, const Eigen::MatrixBase<DW>& dw_,
                        const Eigen::MatrixBase<DX>& dx_) {
  auto& dw = const_cast<Eigen::MatrixBase<DW>&>(dw_);
  auto& dx = const_cast<Eigen::MatrixBase<DX>&>(dx_);
  dw.noalias() += dy.transpose() * x;
  dx.noalias() = dy * w;
}

}  // namespace detail
}  // namespace apex
