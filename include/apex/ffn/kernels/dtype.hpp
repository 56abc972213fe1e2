#pragma once
/// \file kernels/dtype.hpp
/// The list of storage types of packed weights, the `Dtype` enum generated
/// from it, the storage tags the layers take as their `Storage` parameter,
/// and the undefined primary templates every type specialises
/// (kernels/float_types.hpp, kernels/quant_types.hpp). What the table means
/// and how a type is added: kernels/weight_types.hpp.

#include <type_traits>

#include "../core/types.hpp"
#include "isa.hpp"

namespace apex::packed {

/// Every storage type, in the order of the enum below.
#define APEX_PACKED_WEIGHT_TYPES(X) X(f32) X(bf16) X(q8_0) X(q4_0) X(q4_k) X(q6_k) X(mxfp4) X(f16)

/// Storage type of packed weights. Accumulation is fp32 for every type.
enum class Dtype {
#define APEX_PACKED_ENUMERATOR(name) name,
  APEX_PACKED_WEIGHT_TYPES(APEX_PACKED_ENUMERATOR)
#undef APEX_PACKED_ENUMERATOR
};

/// Storage tags of ggml's block formats, for the layers' `Storage`
/// parameter (`PackedMoE<packed::q4_k>`); f32 and bf16 are `float` and
/// `packed::bf16`.
struct q8_0 {};
struct q4_0 {};
struct q4_k {};
struct q6_k {};
struct mxfp4 {};

/// Output lanes of every panel (two AVX-512 vectors, four AVX2 vectors).
inline constexpr Index kPanelLanes = 32;
/// Columns (k) a chunk of the column unpacker holds (kernels/unpack_columns.hpp):
/// one block of the 32-weight formats, one sub-block of Q4_K.
inline constexpr Index kChunkColumns = 32;

/// The table entry of storage type T; undefined for a type without one.
template <Dtype T>
struct WeightType;

namespace detail {
/// The tile kernels of type T on SIMD path I (kernels/arch/<isa>.hpp);
/// undefined for a pair without kernels. The scalar path needs none: it
/// reads single weights through `WeightType<T>::weight` (float types) or
/// the integer block product of the entry (quantized types).
template <Dtype T, Isa I>
struct Tiles;
}  // namespace detail

/// A type as a value, for generic lambdas: `visit_dtype(t, [](auto tag) {
/// using W = WeightType<decltype(tag)::value>; … })`.
template <Dtype T>
using DtypeTag = std::integral_constant<Dtype, T>;

}  // namespace apex::packed
