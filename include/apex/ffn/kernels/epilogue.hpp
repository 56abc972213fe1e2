#pragma once
/// \file kernels/epilogue.hpp
/// What a tile kernel does with its 32 accumulators of a row: the epilogue,
/// a template parameter of every tile (kernels/arch/*.hpp), so the activation
/// is a policy of the kernel and not a flag threaded through each path.
///
/// - `PlainEpilogue`:        out[c] = acc[c],                   c < ncols ≤ 32
/// - `GatedEpilogue<Act>`:   out[c] = Act::apply(acc[c], acc[16 + c]),  c < ncols ≤ 16
///   (a gate/up panel holds G in lanes 0–15 and U in lanes 16–31).
///
/// A gated activation is a type with
///
///     static float apply(float g, float u);   // a = act(g, u), one element
///
/// and, optionally, `static constexpr bool kVectorised = true` with
/// `apply_avx2(__m256, __m256)` and `apply_avx512(__m512, __m512)` carrying
/// APEX_TARGET_AVX2 / APEX_TARGET_AVX512. Without them the SIMD paths spill
/// the accumulators and call `apply` per element, so a user-defined
/// activation runs on every path, with the same bits on every path, without
/// editing a library header (tests/test_custom_activation.cpp defines one).
/// `SiluGate` is SwiGLU's activation, vectorised (kernels/vec_math.hpp).

#include <type_traits>

#include "../core/types.hpp"
#include "vec_math.hpp"

namespace apex::packed {

/// out = acc on all 32 lanes (down panels, plain products, κ's [G | U]).
struct PlainEpilogue {
  static constexpr bool kGated = false;
  using Activation = void;  // none
};

/// out = Act(G, U) on 16 lanes.
template <class Act>
struct GatedEpilogue {
  static constexpr bool kGated = true;
  using Activation = Act;
};

/// SwiGLU's a = SiLU(g)·u: the same IEEE operations on every path
/// (kernels/vec_math.hpp), so every path gives the same bits.
struct SiluGate {
  static constexpr bool kVectorised = true;
  static float apply(float g, float u) { return detail::silu_mul_scalar(g, u); }
#if APEX_PACKED_X86
  APEX_TARGET_AVX2 static __m256 apply_avx2(__m256 g, __m256 u) { return detail::silu_mul_avx2(g, u); }
  APEX_TARGET_AVX512 static __m512 apply_avx512(__m512 g, __m512 u) { return detail::silu_mul_avx512(g, u); }
#endif
};

/// The default epilogue of the expert forward's gate/up pass.
using SiluEpilogue = GatedEpilogue<SiluGate>;

namespace detail {
/// Whether Act declares SIMD forms (`kVectorised = true`).
template <class Act, class = void>
struct vectorised : std::false_type {};
template <class Act>
struct vectorised<Act, std::void_t<decltype(Act::kVectorised)>> : std::bool_constant<Act::kVectorised> {};
template <class Act>
inline constexpr bool vectorised_v = vectorised<Act>::value;

/// The epilogue of one row, one lane at a time (the scalar path, and the SIMD
/// paths for activations without SIMD forms): acc holds 32 floats.
template <class Epi>
inline void store_row_lanes(const float* acc, float* out, Index ncols) {
  if constexpr (Epi::kGated) {
    for (Index c = 0; c < ncols; ++c) out[c] = Epi::Activation::apply(acc[c], acc[16 + c]);
  } else {
    for (Index c = 0; c < ncols; ++c) out[c] = acc[c];
  }
}
}  // namespace detail

}  // namespace apex::packed
