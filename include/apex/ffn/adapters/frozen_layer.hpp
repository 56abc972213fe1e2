#pragma once
/// \file adapters/frozen_layer.hpp
/// How a layer of adapters reads the frozen MoE layer it adapts:
/// `FrozenLayer<Base>` gives the scalar, the expert type, one expert's frozen
/// weights (as the products of adapters/frozen_dense.hpp or
/// adapters/frozen_packed.hpp run them) and its activation with the frozen
/// float parts (the expert kind's `Activation`, inference/engine/expert_kind.hpp),
/// and the routing parts the adapted layer starts from (router, balancing
/// bias, shared gate).
///
///  - `MoEFFN<T, Expert>`: a training layer's weights in T, never updated
///    (the reference of the packed form, and in double the layer of the
///    finite-difference checks);
///  - `PackedMoE<Storage, Expert>`: the packed engine's experts in any
///    weight type, read in place (a GGUF file's blocks, a pack-once mapping).

#include <type_traits>

#include "../core/types.hpp"
#include "../inference/engine/expert_kind.hpp"
#include "../inference/engine/expert_kinds.hpp"
#include "../inference/engine/packed_moe.hpp"
#include "../kernels/epilogue.hpp"
#include "../moe/moe_ffn.hpp"
#include "frozen_dense.hpp"
#include "frozen_packed.hpp"

namespace apex {

template <class Base>
struct FrozenLayer;

/// A float or double training layer, frozen.
template <class T, class Expert>
struct FrozenLayer<MoEFFN<T, Expert>> {
  using Base = MoEFFN<T, Expert>;
  using Scalar = T;
  using ExpertType = Expert;
  using Kind = ExpertKind<Expert>;
  using Routed = FrozenDenseExpert<T>;
  using Shared = FrozenDenseExpert<T>;

  static Routed routed(const Base& b, Index e, packed::Isa) { return {&Kind::weights(b.experts()[std::size_t(e)])}; }
  static Shared shared(const Base& b, Index s, packed::Isa) { return {&b.shared_experts()[std::size_t(s)]}; }
  static typename Kind::Activation activation(const Base& b, Index e) {
    return Kind::Activation::of(b.experts()[std::size_t(e)]);
  }
  /// Expert e's frozen float parts as a packed layer keeps them.
  static typename Kind::Extra packed_extra(const Base& b, Index e) { return Kind::extra(b.experts()[std::size_t(e)]); }
  static const Router<T>& router(const Base& b) { return b.router(); }
  static const RowVector<T>& bias(const Base& b) { return b.balancer().bias(); }
  static const Matrix<T>& shared_gate(const Base& b) { return b.shared_gate_weight(); }
  static Index shared_ffn(const Base& b) { return b.config().shared_ffn(); }
};

/// A packed layer: experts in any weight type, never expanded to float.
template <class Storage, class Expert, class Act>
struct FrozenLayer<PackedMoE<Storage, Expert, Act>> {
  static_assert(std::is_same_v<Act, packed::SiluGate>,
                "adapters over PackedMoE: a custom gated activation has no backward here; use the expert kind's own");
  using Base = PackedMoE<Storage, Expert, Act>;
  using Scalar = float;
  using ExpertType = Expert;
  using Kind = ExpertKind<Expert>;
  using Routed = FrozenPackedExpert;
  using Shared = FrozenPackedExpert;

  static Routed routed(const Base& b, Index e, packed::Isa isa) { return {&b.experts()[std::size_t(e)], isa}; }
  static Shared shared(const Base& b, Index s, packed::Isa isa) { return {&b.shared_experts()[std::size_t(s)], isa}; }
  static typename Kind::Activation activation(const Base& b, Index e) {
    if constexpr (Base::kHasExtra) return Kind::Activation::of(b.extras()[std::size_t(e)]);
    else return Kind::Activation::of(NoExpertExtra{});
  }
  static const typename Base::Extra& packed_extra(const Base& b, Index e) { return b.extras()[std::size_t(e)]; }
  static const Router<float>& router(const Base& b) { return b.router(); }
  static const RowVector<float>& bias(const Base& b) { return b.bias(); }
  static const Matrix<float>& shared_gate(const Base& b) { return b.shared_gate_weight(); }
  static Index shared_ffn(const Base& b) { return b.config().shared_ffn(); }
};

}  // namespace apex
