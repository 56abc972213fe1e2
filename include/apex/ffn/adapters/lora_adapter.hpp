#pragma once
/// \file adapters/lora_adapter.hpp
/// One low-rank adapter and its forward and backward: the frozen projection
/// y₀ = x·Wᵀ gains
///
///     h = x·Aᵀ           (n × r)      A: r × in
///     y = y₀ + s·h·Bᵀ    (n × out)    B: out × r
///
/// and, given dy = ∂L/∂y (n × out),
///
///     ∂L/∂B += s·dyᵀ·h        (out × r)
///     t      = s·dy·B         (n × r)      t = ∂L/∂h
///     ∂L/∂A += tᵀ·x           (r × in)
///     ∂L/∂x += t·A            (n × in)     (W's own term, dy·W, is the frozen layer's)
///
/// h is kept from the forward (the expert's workspace), so the backward
/// needs no product with x·Aᵀ again. `LoraExpertAdapters` holds the adapters
/// of one expert's projections (adapters/lora_options.hpp's targets).

#include <array>
#include <string>

#include "../core/init.hpp"
#include "../core/types.hpp"
#include "../core/workspace.hpp"

namespace apex {

/// A (r × in) and B (out × r): an adapter's values, or their gradients.
template <class T>
struct LoraPair {
  Matrix<T> a;  ///< r × in
  Matrix<T> b;  ///< out × r
  bool empty() const { return a.size() == 0; }
  Index rank() const { return a.rows(); }
};

/// The projections of an expert an adapter can sit on, in state_dict order.
enum class LoraSlot { gate, up, gate_up, down };
inline constexpr int kLoraSlots = 4;

/// The name of the projection a slot adapts, as the expert's state_dict
/// names its weight (`w_gate.weight` …; the fused gate/up is `w_gate_up`).
inline const char* lora_slot_name(LoraSlot s) {
  switch (s) {
    case LoraSlot::gate: return "w_gate";
    case LoraSlot::up: return "w_up";
    case LoraSlot::gate_up: return "w_gate_up";
    case LoraSlot::down: return "w_down";
  }
  return "?";
}

namespace detail {
struct LoraHiddenGradTag;  ///< backward workspace: t = s·dy·B (n × r)

/// h = x·Aᵀ, y += s·h·Bᵀ. x: n × in, h: n × r (written), y: n × out.
template <class T, class X, class H, class Y>
void lora_forward(const LoraPair<T>& w, T s, const X& x, const Eigen::MatrixBase<H>& h_,
                  const Eigen::MatrixBase<Y>& y_) {
  auto& h = const_cast<Eigen::MatrixBase<H>&>(h_);
  auto& y = const_cast<Eigen::MatrixBase<Y>&>(y_);
  h.noalias() = x * w.a.transpose();
  y.noalias() += (s * h) * w.b.transpose();
}

/// The backward above: adds ∂L/∂A, ∂L/∂B into g and ∂L/∂x (the adapter's
/// term) into dx. x: n × in, h: n × r as the forward left it, dy: n × out.
template <class T, class X, class H, class DY, class DX>
void lora_backward(const LoraPair<T>& w, T s, const X& x, const H& h, const DY& dy, LoraPair<T>& g,
                   const Eigen::MatrixBase<DX>& dx_) {
  auto& dx = const_cast<Eigen::MatrixBase<DX>&>(dx_);
  const Index n = dy.rows();
  if (n == 0) return;
  auto t = thread_workspace<T, LoraHiddenGradTag>(n, w.rank());  // n × r: ∂L/∂h
  g.b.noalias() += (s * dy.transpose()) * h;
  t.noalias() = s * (dy * w.b);
  g.a.noalias() += t.transpose() * x;
  dx.noalias() += t * w.a;
}

/// A fresh adapter of a projection in → out: A drawn as peft draws it
/// (kaiming-uniform with a = √5, which is U(−1/√in, 1/√in), the library's
/// init_linear), B zero.
template <class T>
LoraPair<T> new_lora_pair(Index in, Index out, Index rank, Rng& rng) {
  LoraPair<T> p;
  p.a.resize(rank, in);
  init_linear(p.a, rng);
  p.b = Matrix<T>::Zero(out, rank);
  return p;
}

/// A zeroed pair of the shape of `like` (a gradient buffer).
template <class T>
LoraPair<T> zero_like(const LoraPair<T>& like) {
  return {Matrix<T>::Zero(like.a.rows(), like.a.cols()), Matrix<T>::Zero(like.b.rows(), like.b.cols())};
}
}  // namespace detail

/// The adapters of one expert, by slot; an absent slot is empty.
template <class T>
struct LoraExpertAdapters {
  std::array<LoraPair<T>, kLoraSlots> slot;

  LoraPair<T>& operator[](LoraSlot s) { return slot[std::size_t(s)]; }
  const LoraPair<T>& operator[](LoraSlot s) const { return slot[std::size_t(s)]; }
  bool has(LoraSlot s) const { return !(*this)[s].empty(); }
  /// Σ r over the adapted slots: the columns of h the expert's workspace keeps.
  Index hidden_cols() const {
    Index c = 0;
    for (const auto& p : slot) c += p.empty() ? 0 : p.rank();
    return c;
  }
  /// Scalars of A and B over every slot.
  Index size() const {
    Index c = 0;
    for (const auto& p : slot) c += p.a.size() + p.b.size();
    return c;
  }
};

}  // namespace apex
