#pragma once
/// \file moe/expert_contract.hpp
/// What a routed-expert type must provide to be the `Expert` of
/// `MoEFFN<T, Expert>`, checked at compile time; the prose version is
/// docs/expert_contract.md.
///
/// An expert maps a block of n rows (n ≥ 0, the rows the dispatch plan gave
/// it, contiguous in the sorted buffers) to n output rows, row by row: row i
/// of the output depends on row i of the input (and of the side input) only.
/// `E` below is the expert type, `T` its scalar:
///
///     using Scalar = T;
///     E(Index d_model, Index d_ffn, Rng& rng);      // draws its weights from rng
///     Index d_model() const;                        // d: width of x and y
///     Index work_cols() const;                      // w ≥ 0: per-row workspace width
///     ParamList<T> params();                        // names, values, gradients
///     void zero_grad();
///     // optional; NoSideInput when absent:
///     using SideInput = NoSideInput | RouterLogitInput;
///     // optional, for lazily allocated gradients (core/param.hpp); the library's
///     // experts have all three:
///     ParamList<T> param_values();                  // values only, never allocates
///     void allocate_gradients();                    // allocates them, zeroed, once
///     static std::uint64_t weight_bytes(const char* where, Index d_model, Index d_ffn);
///
///     // without a side input:
///     void forward_block(x, work, y) const;
///     void backward_block(x, work, dy, dx);
///     // with a side input (one scalar per row, s: n):
///     void forward_block(x, s, work, y) const;
///     void backward_block(x, s, work, dy, dx, ds);
///
/// Shapes: x: n × d (ConstMatrixRef<T>), s: n (ConstVectorRef<T>), work:
/// n × w, y: n × d, dy: n × d, dx: n × d, ds: n. `work`, `y`, `dx` and `ds`
/// are blocks of the caller's buffers (Eigen expressions: take them as
/// `const Eigen::MatrixBase<…>&` templates and write through them).
///
/// - forward_block fills `work` with whatever backward_block needs and
///   assigns `y`. It is const and may run concurrently on *different* row
///   blocks of the same expert (MoEFFN tiles a busy expert across threads).
/// - backward_block reads what forward_block wrote into `work`, assigns `dx`
///   (∂L/∂x for the block, given dy = ∂L/∂y) and `ds` (∂L/∂s), and *adds*
///   ∂L/∂θ into its own parameter gradients (those `params()` exposes), so
///   gradients accumulate across micro-batches until zero_grad. An expert
///   with lazily allocated gradients allocates them on its first
///   backward_block; MoEFFN calls every expert's allocate_gradients (or,
///   lacking it, params()) before its parallel section, so no task allocates.
///   Without param_values(), checkpoints and packing of the layer call
///   params(), which allocates. MoEFFN runs
///   one backward_block per expert per step, never two at once on the same
///   expert; different experts run concurrently, so an expert must not write
///   state it shares with another expert.
/// - Neither checks shapes (the caller sized every buffer) nor allocates per
///   call beyond per-thread workspaces (core/workspace.hpp).
/// - Results must not depend on the thread that runs the call.

#include <type_traits>
#include <utility>

#include "../core/init.hpp"
#include "../core/param.hpp"
#include "../core/types.hpp"
#include "../layers/expert_side_input.hpp"  // NoSideInput, RouterLogitInput

namespace apex {
namespace detail::expert {

template <class E, class = void>
struct side_input {
  using type = NoSideInput;
};
template <class E>
struct side_input<E, std::void_t<typename E::SideInput>> {
  using type = typename E::SideInput;
};

template <class E, class = void>
struct has_scalar : std::false_type {};
template <class E>
struct has_scalar<E, std::void_t<typename E::Scalar>> : std::true_type {};

template <class E, class T, class = void>
struct has_shape : std::false_type {};
template <class E, class T>
struct has_shape<E, T,
                 std::enable_if_t<std::is_convertible_v<decltype(std::declval<const E&>().d_model()), Index> &&
                                  std::is_convertible_v<decltype(std::declval<const E&>().work_cols()), Index>>>
    : std::true_type {};

template <class E, class T, class = void>
struct has_params : std::false_type {};
template <class E, class T>
struct has_params<E, T,
                  std::enable_if_t<std::is_same_v<decltype(std::declval<E&>().params()), ParamList<T>> &&
                                   std::is_void_v<decltype(std::declval<E&>().zero_grad())>>> : std::true_type {};

template <class E, class T, class Side, class = void>
struct has_forward_block : std::false_type {};
template <class E, class T, class Side, class = void>
struct has_backward_block : std::false_type {};

template <class E, class T>
struct has_forward_block<E, T, NoSideInput,
                         std::void_t<decltype(std::declval<const E&>().forward_block(
                             std::declval<const ConstMatrixRef<T>&>(), std::declval<MatrixRef<T>>(),
                             std::declval<MatrixRef<T>>()))>> : std::true_type {};
template <class E, class T>
struct has_backward_block<E, T, NoSideInput,
                          std::void_t<decltype(std::declval<E&>().backward_block(
                              std::declval<const ConstMatrixRef<T>&>(), std::declval<const ConstMatrixRef<T>&>(),
                              std::declval<const ConstMatrixRef<T>&>(), std::declval<MatrixRef<T>>()))>>
    : std::true_type {};
template <class E, class T>
struct has_forward_block<E, T, RouterLogitInput,
                         std::void_t<decltype(std::declval<const E&>().forward_block(
                             std::declval<const ConstMatrixRef<T>&>(), std::declval<const ConstVectorRef<T>&>(),
                             std::declval<MatrixRef<T>>(), std::declval<MatrixRef<T>>()))>> : std::true_type {};
template <class E, class T>
struct has_backward_block<E, T, RouterLogitInput,
                          std::void_t<decltype(std::declval<E&>().backward_block(
                              std::declval<const ConstMatrixRef<T>&>(), std::declval<const ConstVectorRef<T>&>(),
                              std::declval<const ConstMatrixRef<T>&>(), std::declval<const ConstMatrixRef<T>&>(),
                              std::declval<MatrixRef<T>>(), std::declval<VectorRef<T>>()))>> : std::true_type {};

}  // namespace detail::expert

/// The side input `E` declares (NoSideInput when it declares none).
template <class E>
using expert_side_input_t = typename detail::expert::side_input<E>::type;

/// Columns of side input per (token, slot) pair: 0 or 1.
template <class E>
inline constexpr Index expert_side_cols = std::is_same_v<expert_side_input_t<E>, NoSideInput> ? 0 : 1;

/// Compile-time check of the contract above, one readable message per
/// missing member. `static_assert(check_expert_contract<E, T>())` in a
/// template that needs an expert.
template <class E, class T>
constexpr bool check_expert_contract() {
  using Side = expert_side_input_t<E>;
  static_assert(detail::expert::has_scalar<E>::value,
                "apex expert contract: the expert type must define `using Scalar = T;`");
  static_assert(std::is_same_v<Side, NoSideInput> || std::is_same_v<Side, RouterLogitInput>,
                "apex expert contract: `SideInput` must be NoSideInput or RouterLogitInput");
  static_assert(std::is_constructible_v<E, Index, Index, Rng&>,
                "apex expert contract: the expert type needs a constructor E(Index d_model, Index d_ffn, Rng& rng)");
  static_assert(detail::expert::has_shape<E, T>::value,
                "apex expert contract: the expert type needs `Index d_model() const` and `Index work_cols() const`");
  static_assert(detail::expert::has_params<E, T>::value,
                "apex expert contract: the expert type needs `ParamList<T> params()` and `void zero_grad()`");
  static_assert(detail::expert::has_forward_block<E, T, Side>::value,
                "apex expert contract: the expert type needs `forward_block(x, work, y) const` (with a side input: "
                "`forward_block(x, s, work, y) const`), see moe/expert_contract.hpp");
  static_assert(detail::expert::has_backward_block<E, T, Side>::value,
                "apex expert contract: the expert type needs `backward_block(x, work, dy, dx)` (with a side input: "
                "`backward_block(x, s, work, dy, dx, ds)`), see moe/expert_contract.hpp");
  return true;
}

namespace detail {

/// forward_block of rows [b, b + m) of an expert, passing the side input's
/// rows when the expert declares one: the one place the two signatures meet.
/// side: every sorted row's side input (empty for NoSideInput).
template <class E, class Work, class Y, class T = typename E::Scalar>
void expert_forward(const E& expert, const ConstMatrixRef<typename E::Scalar>& x, const Vector<T>& side, Index b,
                    Index m, const Work& work, const Y& y) {
  if constexpr (expert_side_cols<E> == 0) expert.forward_block(x, work, y);
  else expert.forward_block(x, side.segment(b, m), work, y);
}

/// backward_block of rows [b, b + m), writing ∂L/∂s into d_side's rows.
template <class E, class DX, class T = typename E::Scalar>
void expert_backward(E& expert, const ConstMatrixRef<typename E::Scalar>& x, const Vector<T>& side, Index b, Index m,
                     const ConstMatrixRef<typename E::Scalar>& work, const ConstMatrixRef<typename E::Scalar>& dy,
                     const DX& dx, Vector<T>& d_side) {
  if constexpr (expert_side_cols<E> == 0) expert.backward_block(x, work, dy, dx);
  else expert.backward_block(x, side.segment(b, m), work, dy, dx, d_side.segment(b, m));
}

}  // namespace detail
}  // namespace apex
