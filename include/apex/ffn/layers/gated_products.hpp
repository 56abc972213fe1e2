#pragma once
/// \file layers/gated_products.hpp
/// The products of the training layers' gated forward and backward
/// (SwiGLU<T>::gated_forward / gated_backward), routed to the packed engine
/// (kernels/packed_products.hpp) or to Eigen (layers/linear.hpp):
///
/// - float with the engine enabled (packed::training_engine), at least
///   min_rows rows, and single-threaded context (inside the MoE layers'
///   expert tasks, or an OpenMP budget of one thread): the forward products
///   X·Wᵀ and the dx products dY·W on the engine's kernels, packing W per
///   call. A dense layer called with more threads keeps Eigen's own
///   multi-threaded GEMM (the engine's products are single-threaded);
/// - otherwise (double, the finite-difference reference; few rows; the
///   engine disabled): exactly linear_nt / linear_nt_backward.
///
/// Weight gradients ∂L/∂W += dYᵀ·X stay Eigen products in every case.

#include <type_traits>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "linear.hpp"
#include "../kernels/packed_products.hpp"

namespace apex::detail {

/// The engine path for a float product of n rows, or false for Eigen.
template <class T>
bool use_training_engine(Index n, bool dx_product, packed::Isa& isa) {
  if constexpr (!std::is_same_v<T, float>) {
    (void)n, (void)dx_product, (void)isa;
    return false;
  } else {
    const packed::TrainingEngine e = packed::training_engine();
    isa = e.isa;
#ifdef _OPENMP
    // Outside a parallel region with a thread budget > 1 (a dense layer called
    // directly) Eigen threads the product itself: keep it there.
    if (!omp_in_parallel() && omp_get_max_threads() > 1) return false;
#endif
    return e.enabled && (dx_product ? e.dx : e.forward) && n > 0 && n >= e.min_rows;
  }
}

/// y = x·Wᵀ (assigned). x: n × in, w: out × in, y: n × out; row-major blocks.
template <class XT, class WT, class YT>
void train_linear_nt(const Eigen::MatrixBase<XT>& x, const Eigen::MatrixBase<WT>& w,
                     const Eigen::MatrixBase<YT>& y_) {
  using T = typename XT::Scalar;
  packed::Isa isa{};
  if (use_training_engine<T>(x.rows(), false, isa)) {
    if constexpr (std::is_same_v<T, float>) {
      const Eigen::Ref<const Matrix<float>> xr(x), wr(w);
      Eigen::Ref<Matrix<float>> yr(const_cast<YT&>(y_.derived()));
      packed::linear_nt(isa, xr.data(), xr.outerStride(), xr.rows(), wr.data(), wr.outerStride(), wr.rows(),
                        wr.cols(), yr.data(), yr.outerStride());
      return;
    }
  }
  linear_nt(x, w, y_, false);
}

/// Backward of y = x·Wᵀ: ∂L/∂W += dyᵀ·x (Eigen), ∂L/∂x = dy·W (engine or
/// Eigen). dy: n × out, x: n × in, w: out × in, dw: out × in, dx: n × in.
template <class DY, class X, class W, class DW, class DX>
void train_linear_nt_backward(const Eigen::MatrixBase<DY>& dy, const Eigen::MatrixBase<X>& x,
                              const Eigen::MatrixBase<W>& w, const Eigen::MatrixBase<DW>& dw_,
                              const Eigen::MatrixBase<DX>& dx_) {
  using T = typename DY::Scalar;
  packed::Isa isa{};
  if (use_training_engine<T>(dy.rows(), true, isa)) {
    if constexpr (std::is_same_v<T, float>) {
      const_cast<Eigen::MatrixBase<DW>&>(dw_).noalias() += dy.transpose() * x;
      const Eigen::Ref<const Matrix<float>> dyr(dy), wr(w);
      Eigen::Ref<Matrix<float>> dxr(const_cast<DX&>(dx_.derived()));
      // dx (n × in) = dy (n × out) · W (out × in): reduction over out
      packed::linear_nn(isa, dyr.data(), dyr.outerStride(), dyr.rows(), wr.data(), wr.outerStride(), wr.cols(),
                        wr.rows(), dxr.data(), dxr.outerStride());
      return;
    }
  }
  linear_nt_backward(dy, x, w, dw_, dx_);
}

}  // namespace apex::detail
