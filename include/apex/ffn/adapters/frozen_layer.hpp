#pragma once
/// \file adapters/frozen_layer.hpp
/// How a layer of adapters reads the frozen MoE layer it adapts:
/// `FrozenLayer<Base>` gives the scalar, the expert type, one expert's frozen
/// weights (as the products of adapters/frozen_dense.hpp or
/// adapters/frozen_packed.hpp run them) and its activation with the frozen
/// float parts (adapters/gated_activation.hpp), and the routing parts the
/// adapted layer starts from (router, balancing bias, shared gate).
///
///  - `MoEFFN<T, Expert>`: a training layer's weights in T, never updated
///    (the reference of the packed form, and in double the layer of the
///    finite-difference checks);
///  - `PackedMoE<Storage, Expert>`: the packed engine's experts in any
///    weight type, read in place (a GGUF file's blocks, a pack-once mapping).

#include <type_traits>

#include "../core/types.hpp"
#include "../inference/packed_moe.hpp"
#include "../kernels/epilogue.hpp"
#include "../moe/moe_ffn.hpp"
#include "frozen_dense.hpp"
#include "frozen_packed.hpp"
#include "gated_activation.hpp"

namespace apex {

template <class Base>
struct FrozenLayer;

namespace detail {
/// The SwiGLU that holds an expert's three projections.
template <class T>
const SwiGLU<T>& gated_weights(const SwiGLU<T>& e) {
  return e;
}
template <class E>
const auto& gated_weights(const E& e) {
  return e.swiglu();
}
}  // namespace detail

/// A float or double training layer, frozen.
template <class T, class Expert>
struct FrozenLayer<MoEFFN<T, Expert>> {
  using Base = MoEFFN<T, Expert>;
  using Scalar = T;
  using ExpertType = Expert;
  using Routed = FrozenDenseExpert<T>;
  using Shared = FrozenDenseExpert<T>;

  static Routed routed(const Base& b, Index e, packed::Isa) { return {&detail::gated_weights(b.experts()[std::size_t(e)])}; }
  static Shared shared(const Base& b, Index s, packed::Isa) { return {&b.shared_experts()[std::size_t(s)]}; }
  static GatedActivation<Expert> activation(const Base& b, Index e) {
    return GatedActivation<Expert>::of(b.experts()[std::size_t(e)]);
  }
  /// Expert e's frozen float parts as a packed layer keeps them (float layers only).
  template <class K = PackedExpertKind<Expert>>
  static typename K::Extra packed_extra(const Base& b, Index e) {
    return K::extra(b.experts()[std::size_t(e)]);
  }
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
  using Routed = FrozenPackedExpert;
  using Shared = FrozenPackedExpert;

  static Routed routed(const Base& b, Index e, packed::Isa isa) { return {&b.experts()[std::size_t(e)], isa}; }
  static Shared shared(const Base& b, Index s, packed::Isa isa) { return {&b.shared_experts()[std::size_t(s)], isa}; }
  static GatedActivation<Expert> activation(const Base& b, Index e) {
    if constexpr (Base::kHasExtra) return GatedActivation<Expert>::of(b.extras()[std::size_t(e)]);
    else return GatedActivation<Expert>::of(NoExpertExtra{});
  }
  static const typename Base::Extra& packed_extra(const Base& b, Index e) { return b.extras()[std::size_t(e)]; }
  static const Router<float>& router(const Base& b) { return b.router(); }
  static const RowVector<float>& bias(const Base& b) { return b.bias(); }
  static const Matrix<float>& shared_gate(const Base& b) { return b.shared_gate_weight(); }
  static Index shared_ffn(const Base& b) { return b.config().shared_ffn(); }
};

}  // namespace apex
