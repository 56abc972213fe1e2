#pragma once
/// \file adapters/lora_swiglu.hpp
/// `LoraSwiGLU<Base>`: low-rank adapters on a frozen dense SwiGLU FFN,
///
///     FFN(X) = act(X·W_guᵀ + Δ_gu(X))·W_downᵀ + Δ_down(A)
///
/// one adapted expert over every row (adapters/lora_block.hpp). Base is
/// `PackedSwiGLU<Storage>` (the weights in any packed type, never expanded
/// to float) or `SwiGLU<T>` (the reference). The layer contract of
/// docs/layer_contract.md: const forward into a cache, backward returning
/// ∂L/∂x and adding into the adapters' gradients, which `params()` lists
/// (`w_gate_up.lora_A.weight` …). LoraOptions' per_expert, shared_experts
/// and train_router do not apply to a dense layer.
///
/// Threads: forward runs row tiles in parallel (each row's bits depend on
/// that row only); backward is one pass over the rows, since every row adds
/// into the same adapter gradients.

#include <utility>

#include "../core/parallel.hpp"
#include "../core/types.hpp"
#include "../inference/engine/kinds/swiglu.hpp"
#include "../inference/engine/packed_swiglu.hpp"
#include "../layers/swiglu.hpp"
#include "../moe/expert_tasks.hpp"
#include "frozen_dense.hpp"
#include "frozen_packed.hpp"
#include "lora_adapter_set.hpp"
#include "lora_block.hpp"
#include "lora_options.hpp"

namespace apex {

namespace detail {
template <class Base>
struct FrozenDense;
template <class T>
struct FrozenDense<SwiGLU<T>> {
  using Scalar = T;
  using Frozen = FrozenDenseExpert<T>;
  static Frozen frozen(const SwiGLU<T>& b, packed::Isa) { return {&b}; }
};
template <class Storage, class Act>
struct FrozenDense<PackedSwiGLU<Storage, Act>> {
  static_assert(std::is_same_v<Act, packed::SiluGate>, "LoraSwiGLU: a custom gated activation has no backward here");
  using Scalar = float;
  using Frozen = FrozenPackedExpert;
  static Frozen frozen(const PackedSwiGLU<Storage, Act>& b, packed::Isa isa) { return {&b.weights(), isa}; }
};
}  // namespace detail

template <class Base>
class LoraSwiGLU {
  using Frozen = detail::FrozenDense<Base>;

 public:
  using Scalar = typename Frozen::Scalar;
  using T = Scalar;
  using Activation = typename ExpertKind<SwiGLU<T>>::Activation;
  using Block = LoraBlock<typename Frozen::Frozen, Activation>;

  struct Cache {
    Matrix<T> x;     ///< N × d: the input
    Matrix<T> work;  ///< N × work_cols: [G | U | A | h of each adapter]
  };

  /// Adapters on `base` (moved in, frozen) as `options` target them; A
  /// from rng, B zero. ConfigError for options that do not fit.
  LoraSwiGLU(Base base, const LoraOptions& options, Rng& rng)
      : base_(std::move(base)),
        opt_((options.validate("LoraSwiGLU", base_.d_model(), base_.d_ffn()), options)),
        adapters_(1, base_.d_model(), base_.d_ffn(), opt_, true, "", rng) {}  // one set: `w_gate_up.lora_A.weight`
  LoraSwiGLU(Base base, const LoraOptions& options, Rng&& rng) : LoraSwiGLU(std::move(base), options, rng) {}

  Index d_model() const { return base_.d_model(); }
  Index d_ffn() const { return base_.d_ffn(); }
  const Base& base() const { return base_; }
  const LoraOptions& options() const { return opt_; }
  LoraAdapterSet<T>& adapters() { return adapters_; }
  const LoraAdapterSet<T>& adapters() const { return adapters_; }
  void set_threads(int threads) { threads_ = threads; }
  void set_isa(packed::Isa isa) { isa_ = isa; }
  packed::Isa isa() const { return isa_; }

  /// x: N × d → N × d. ShapeError on a wrong width.
  Matrix<T> forward(const ConstMatrixRef<T>& x, Cache* cache = nullptr) const {
    constexpr const char* where = "LoraSwiGLU::forward";
    detail::check_shape(where, "x", x, detail::kAny, d_model());
    packed::detail::require_isa(where, isa_);
    const Block b = block();
    Matrix<T> y(x.rows(), d_model());
    Matrix<T> local;
    Matrix<T>& work = cache ? cache->work : local;
    work.resize(x.rows(), b.work_cols());
    const auto tiles = detail::forward_tasks({0}, 1, x.rows(), MoEFFN<T>::kMaxTileRows);
    detail::parallel_for(Index(tiles.size()), resolve_threads(threads_), [&](Index i) {
      const Index r = tiles[std::size_t(i)].begin, m = tiles[std::size_t(i)].rows;
      b.forward_block(x.middleRows(r, m), work.middleRows(r, m), y.middleRows(r, m));
    });
    if (cache) cache->x = x;
    return y;
  }

  /// dy: N × d → dx: N × d; adds into the adapters' gradients. ShapeError
  /// if dy or the cache does not match a forward of this layer.
  Matrix<T> backward(const ConstMatrixRef<T>& dy, const Cache& cache) {
    constexpr const char* where = "LoraSwiGLU::backward";
    allocate_gradients();
    const Block b = block();
    detail::check_shape(where, "cache.x", cache.x, detail::kAny, d_model());
    detail::check_shape(where, "cache.work", cache.work, cache.x.rows(), b.work_cols());
    detail::check_shape(where, "dy", dy, cache.x.rows(), d_model());
    Matrix<T> dx(dy.rows(), d_model());
    Block bw = block();
    bw.backward_block(cache.x, cache.work, dy, dx);
    return dx;
  }

  ParamList<T> params() {
    allocate_gradients();
    return adapters_.params(true);
  }
  ParamList<T> param_values() { return adapters_.params(false); }
  void zero_grad() { adapters_.zero_grad(); }
  void allocate_gradients() { adapters_.allocate_gradients(); }
  bool has_gradients() const { return adapters_.has_gradients(); }

 private:
  Block block() const {
    auto& set = const_cast<LoraAdapterSet<T>&>(adapters_);
    return Block(Frozen::frozen(base_, isa_), &act_, &adapters_.values(0),
                 set.has_gradients() ? set.grads_of(0) : nullptr, T(opt_.scale()));
  }

  Base base_;
  LoraOptions opt_;
  LoraAdapterSet<T> adapters_;
  Activation act_;
  packed::Isa isa_ = packed::kDefaultIsa;
  int threads_ = 0;
};

}  // namespace apex
