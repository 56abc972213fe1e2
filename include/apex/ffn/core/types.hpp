#pragma once
/// \file core/types.hpp
/// Matrix aliases shared by every layer.
///
/// Activations are row-major `N × width` (one token per row), so a token is a
/// contiguous row and gathering tokens for an expert is a row copy. Weights are
/// stored as PyTorch stores `nn.Linear.weight` (`[out, in]`, the `W` of docs/math.md), so checkpoints map one to one.
///
/// A column-major matrix passed to an argument of type
/// `Eigen::Ref<const Matrix<T>>` is silently copied into a row-major
/// temporary: correct, but a copy. Pass row-major data on hot paths.

#include <Eigen/Core>
#include <cstdint>

namespace apex {

using Index = Eigen::Index;

/// Row-major dynamic matrix: activations `N × d`, weights `[out, in]`.
template <class T>
using Matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// Column vector (one value per token).
template <class T>
using Vector = Eigen::Matrix<T, Eigen::Dynamic, 1>;

/// Row vector (one value per feature: norm gains, biases).
template <class T>
using RowVector = Eigen::Matrix<T, 1, Eigen::Dynamic>;

template <class T>
using MatrixRef = Eigen::Ref<Matrix<T>>;
template <class T>
using ConstMatrixRef = Eigen::Ref<const Matrix<T>>;
template <class T>
using VectorRef = Eigen::Ref<Vector<T>>;
template <class T>
using ConstVectorRef = Eigen::Ref<const Vector<T>>;

}  // namespace apex
