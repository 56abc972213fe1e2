#pragma once
/// \file adapters/lora_block.hpp
/// One expert with adapters over its frozen weights, as the MoE pipeline's
/// local experts run it (the block interface of moe/expert_contract.hpp,
/// driven by moe/local_experts.hpp). With s the adapters' scale and Δ_P(z) =
/// s·(z·A_Pᵀ)·B_Pᵀ the low-rank term of projection P (adapters/lora_adapter.hpp):
///
///     [G | U] = x·W_guᵀ + Δ_gate_up(x)          (or Δ_gate(x) on G, Δ_up(x) on U)
///     A       = act(G, U)                         (the kind's Activation, inference/engine/expert_kind.hpp)
///     y       = A·W_downᵀ + Δ_down(A)  (+ b_down)
///
/// and the backward, the forward in reverse:
///
///     ∂L/∂A   = dy·W_down + (adapter term of Δ_down)      ∂L/∂A_down, ∂L/∂B_down
///     [∂L/∂G | ∂L/∂U] = act'(…)                           (and ∂L/∂ℓ for κ)
///     ∂L/∂x   = [∂L/∂G | ∂L/∂U]·W_gu + (adapter terms)    ∂L/∂A_gu, ∂L/∂B_gu
///
/// The frozen products are `Frozen`'s (adapters/frozen_dense.hpp in T,
/// adapters/frozen_packed.hpp on packed weights). A row's workspace is
/// [G̃ | Ũ | A | h_gate | h_up | h_gate_up | h_down] (3f + Σ r columns, the
/// h of the adapted slots only): everything the backward reads.
///
/// A block is a view: the adapters' values and the gradients it adds into
/// belong to the layer (adapters/lora_moe.hpp), which makes the blocks
/// anew for every call.

#include "../core/types.hpp"
#include "../core/workspace.hpp"
#include "../moe/expert_contract.hpp"
#include "lora_adapter.hpp"

namespace apex {

namespace detail {
struct LoraGateGradTag;  ///< backward workspace: [∂L/∂G | ∂L/∂U] (n × 2f)
}

template <class Frozen, class Act>
class LoraBlock {
 public:
  using Scalar = typename Frozen::Scalar;
  using T = Scalar;
  using SideInput = typename Act::SideInput;

  /// values: this expert's adapters; grads: where its backward adds their
  /// gradients (same slots and shapes); scale: s.
  LoraBlock(Frozen frozen, const Act* act, const LoraExpertAdapters<T>* values, LoraExpertAdapters<T>* grads, T scale)
      : frozen_(frozen), act_(act), w_(values), g_(grads), s_(scale) {}

  Index d_model() const { return frozen_.d_model(); }
  Index d_ffn() const { return frozen_.d_ffn(); }
  Index work_cols() const { return 3 * d_ffn() + w_->hidden_cols(); }

  /// \name Block interface (moe/expert_contract.hpp); x: n × d, work: n × work_cols(), y: n × d
  ///@{
  template <class Work, class Y>
  void forward_block(const ConstMatrixRef<T>& x, const Eigen::MatrixBase<Work>& work, const Eigen::MatrixBase<Y>& y) const {
    forward_rows(x, ConstVectorRef<T>(Vector<T>()), work, y);
  }
  template <class Work, class Y>
  void forward_block(const ConstMatrixRef<T>& x, const ConstVectorRef<T>& side, const Eigen::MatrixBase<Work>& work,
                     const Eigen::MatrixBase<Y>& y) const {
    forward_rows(x, side, work, y);
  }
  template <class DX>
  void backward_block(const ConstMatrixRef<T>& x, const ConstMatrixRef<T>& work, const ConstMatrixRef<T>& dy,
                      const Eigen::MatrixBase<DX>& dx) {
    Vector<T> none;
    backward_rows(x, ConstVectorRef<T>(none), work, dy, dx, VectorRef<T>(none));
  }
  template <class DX, class DS>
  void backward_block(const ConstMatrixRef<T>& x, const ConstVectorRef<T>& side, const ConstMatrixRef<T>& work,
                      const ConstMatrixRef<T>& dy, const Eigen::MatrixBase<DX>& dx, const Eigen::MatrixBase<DS>& ds) {
    backward_rows(x, side, work, dy, dx, VectorRef<T>(const_cast<Eigen::MatrixBase<DS>&>(ds).derived()));
  }
  ///@}

 private:
  /// First workspace column of slot s's h (slots in enum order, adapted ones only).
  Index hidden_col(LoraSlot s) const {
    Index c = 3 * d_ffn();
    for (int i = 0; i < int(s); ++i) c += w_->slot[std::size_t(i)].empty() ? 0 : w_->slot[std::size_t(i)].rank();
    return c;
  }

  template <class Work, class Y>
  void forward_rows(const ConstMatrixRef<T>& x, const ConstVectorRef<T>& side, const Eigen::MatrixBase<Work>& work_,
                    const Eigen::MatrixBase<Y>& y_) const {
    auto& work = const_cast<Eigen::MatrixBase<Work>&>(work_).derived();
    auto& y = const_cast<Eigen::MatrixBase<Y>&>(y_).derived();
    const Index f = d_ffn();
    auto gu = work.leftCols(2 * f);  // n × 2f: [G | U]
    auto a = work.middleCols(2 * f, f);  // n × f: A
    frozen_.gate_up(x, gu);
    const auto adapt = [&](LoraSlot s, auto&& in, auto&& out) {
      if (w_->has(s)) detail::lora_forward((*w_)[s], s_, in, work.middleCols(hidden_col(s), (*w_)[s].rank()), out);
    };
    adapt(LoraSlot::gate, x, gu.leftCols(f));
    adapt(LoraSlot::up, x, gu.rightCols(f));
    adapt(LoraSlot::gate_up, x, gu);
    act_->forward(side, gu.leftCols(f).array(), gu.rightCols(f).array(), a.array());
    frozen_.down(a, y);
    adapt(LoraSlot::down, a, y);
    act_->finish(y);
  }

  template <class DX>
  void backward_rows(const ConstMatrixRef<T>& x, const ConstVectorRef<T>& side, const ConstMatrixRef<T>& work,
                     const ConstMatrixRef<T>& dy, const Eigen::MatrixBase<DX>& dx_, VectorRef<T> ds) {
    auto& dx = const_cast<Eigen::MatrixBase<DX>&>(dx_).derived();
    const Index n = x.rows(), f = d_ffn();
    auto dh = detail::thread_workspace<T, detail::LoraGateGradTag>(n, 2 * f);  // n × 2f: [dG | dU]
    const auto a = work.middleCols(2 * f, f);
    const auto adapt = [&](LoraSlot s, const auto& in, const auto& dout, auto&& din) {
      if (w_->has(s))
        detail::lora_backward((*w_)[s], s_, in, work.middleCols(hidden_col(s), (*w_)[s].rank()), dout, (*g_)[s], din);
    };
    // ∂L/∂A = dy·W_down + the down adapter's term, in the dU half until act' replaces it
    frozen_.down_t(dy, dh.rightCols(f));
    adapt(LoraSlot::down, a, dy, dh.rightCols(f));
    act_->backward(side, work.leftCols(3 * f), dh, ds);  // dh = [∂L/∂G̃ | ∂L/∂Ũ]
    // ∂L/∂x = [dG | dU]·W_gu + the gate/up adapters' terms
    frozen_.gate_up_t(dh, dx);
    adapt(LoraSlot::gate, x, dh.leftCols(f), dx);
    adapt(LoraSlot::up, x, dh.rightCols(f), dx);
    adapt(LoraSlot::gate_up, x, dh, dx);
  }

  Frozen frozen_;
  const Act* act_;
  const LoraExpertAdapters<T>* w_;
  LoraExpertAdapters<T>* g_;
  T s_;
};

}  // namespace apex
