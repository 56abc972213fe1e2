#pragma once
/// \file kernels/arch/avx512.hpp
/// AVX-512 paths. A slab of 32 lanes is two zmm vectors (for gate/up panels:
/// gate and up of 16 hidden units; for down panels: 32 output features). A
/// tile of R ≤ 12 rows keeps 2R accumulators and both weight vectors in the
/// 32 zmm registers; per k it issues 2 weight loads, R broadcasts and 2R FMAs,
/// so it is FMA-bound once R is large and streams the weights once for up to
/// 12 rows.
///
/// - f32 weights: acc ← fma(x_k, w_k, acc), k ascending.
/// - bf16 weights, widened (AVX-512F): the pair lane (w_2j | w_2j+1 << 16)
///   gives w_2j by `<< 16` and w_2j+1 by masking the low half; then the same
///   FMAs as for float, so activations stay exact and the result equals the
///   f32 kernel on the bf16-rounded weights bit for bit.
/// - bf16 weights, paired (AVX-512 BF16): activations rounded to bf16 and
///   `vdpbf16ps` accumulates x_2j·w_2j + x_2j+1·w_2j+1 per lane: two
///   multiply-adds per instruction, at the cost of the activation rounding
///   (relative 2⁻⁹ per element). On the CPU measured it issues at half the
///   FMA rate, so it is not faster there (see kernels/fused_expert.hpp).
/// The widened tiles are the `Tiles<T, Isa::avx512>` entries of the
/// weight-type table (kernels/weight_types.hpp); the avx512_bf16 path runs
/// them too, except for the paired bf16 products.
/// Conventions as in kernels/arch/scalar.hpp.

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "../bf16_vectors.hpp"
#include "../epilogue.hpp"
#include "../weight_types.hpp"

// GCC 12 reports its own `_mm512_undefined_*` placeholders (`__Y = __Y`) as
// maybe-uninitialized once they are inlined (GCC PR 105593, fixed in 13).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#if APEX_PACKED_X86
namespace apex::packed::detail {

inline constexpr int kAvx512Rows = 12;

inline __mmask16 low_mask16(Index n) {
  return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1u);
}

/// One row's 32 accumulators (two vectors) through the epilogue. Masked
/// stores touch only the first ncols floats (no access past a row).
template <class Epi>
APEX_TARGET_AVX512 APEX_KERNEL_INLINE inline void store_row_avx512(__m512 a0, __m512 a1, float* out, Index ncols) {
  if constexpr (Epi::kGated && vectorised_v<typename Epi::Activation>) {
    _mm512_mask_storeu_ps(out, low_mask16(ncols), Epi::Activation::apply_avx512(a0, a1));
  } else if constexpr (Epi::kGated) {  // an activation without SIMD forms: per element
    alignas(64) float tmp[32];
    _mm512_store_ps(tmp, a0);
    _mm512_store_ps(tmp + 16, a1);
    store_row_lanes<Epi>(tmp, out, ncols);
  } else {
    _mm512_mask_storeu_ps(out, low_mask16(ncols), a0);
    if (ncols > 16) _mm512_mask_storeu_ps(out + 16, low_mask16(ncols - 16), a1);
  }
}

/// How a weight type with one fp32 value per lane and k is read: slab k (32
/// lanes) as two fp32 vectors.
struct F32Slab512 {
  using Weight = float;
  APEX_TARGET_AVX512 APEX_KERNEL_INLINE static void load(const float* w, Index k, __m512& w0, __m512& w1) {
    w0 = _mm512_load_ps(w + 32 * k);
    w1 = _mm512_load_ps(w + 32 * k + 16);
  }
};
/// f16 weights widened by `vcvtph2ps` (exact, AVX-512F).
struct F16Slab512 {
  using Weight = f16;
  APEX_TARGET_AVX512 APEX_KERNEL_INLINE static void load(const f16* w, Index k, __m512& w0, __m512& w1) {
    w0 = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(w + 32 * k)));
    w1 = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(w + 32 * k + 16)));
  }
};

/// acc ← fma(x_k, w_k, acc), k ascending, on the weights as `Slab` widens
/// them (f32, f16): the same bits for every type widened exactly to fp32.
template <class Slab, int R, class Epi>
APEX_TARGET_AVX512 inline void fma_tile_avx512(const typename Slab::Weight* w, Index K, const float* x, Index ldx,
                                               float* out, Index ldo, Index ncols) {
  __m512 a0[R], a1[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  for (Index k = 0; k < K; ++k) {
    prefetch_slab(w + 32 * k);
    __m512 w0, w1;
    Slab::load(w, k, w0, w1);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
      a0[r] = _mm512_fmadd_ps(xv, w0, a0[r]);
      a1[r] = _mm512_fmadd_ps(xv, w1, a1[r]);
    }
  }
  for (int r = 0; r < R; ++r) store_row_avx512<Epi>(a0[r], a1[r], out + r * ldo, ncols);
}

/// float weights: acc ← fma(x_k, w_k, acc), k ascending.
template <>
struct Tiles<Dtype::f32, Isa::avx512> {
  template <int R, class Epi>
  APEX_TARGET_AVX512 static void tile(const float* w, const std::byte*, Index K, const float* x, Index ldx,
                                      float* out, Index ldo, Index ncols) {
    fma_tile_avx512<F32Slab512, R, Epi>(w, K, x, ldx, out, ldo, ncols);
  }
};

/// f16 weights widened by `vcvtph2ps` (exact, AVX-512F): then the f32
/// tile's fma(x_k, w_k, acc), k ascending.
template <>
struct Tiles<Dtype::f16, Isa::avx512> {
  template <int R, class Epi>
  APEX_TARGET_AVX512 static void tile(const f16* w, const std::byte*, Index K, const float* x, Index ldx,
                                      float* out, Index ldo, Index ncols) {
    fma_tile_avx512<F16Slab512, R, Epi>(w, K, x, ldx, out, ldo, ncols);
  }
};

/// bf16 weights widened: even k by `<< 16`, odd k by masking the low half.
template <>
struct Tiles<Dtype::bf16, Isa::avx512> {
  template <int R, class Epi>
  APEX_TARGET_AVX512 static void tile(const bf16* w, const std::byte*, Index K, const float* x, Index ldx,
                                      float* out, Index ldo, Index ncols) {
    const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    __m512 a0[R], a1[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
    const Index pairs = (K + 1) / 2;
    for (Index kk = 0; kk < pairs; ++kk) {
      prefetch_slab(w + 64 * kk);
      const __m512i v0 = _mm512_load_si512(w + 64 * kk), v1 = _mm512_load_si512(w + 64 * kk + 32);
      __m512 w0 = _mm512_castsi512_ps(_mm512_slli_epi32(v0, 16)), w1 = _mm512_castsi512_ps(_mm512_slli_epi32(v1, 16));
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_set1_ps(x[r * ldx + 2 * kk]);
        a0[r] = _mm512_fmadd_ps(xv, w0, a0[r]);
        a1[r] = _mm512_fmadd_ps(xv, w1, a1[r]);
      }
      if (2 * kk + 1 == K) break;  // odd K: the last pair has no odd half
      w0 = _mm512_castsi512_ps(_mm512_and_si512(v0, hi));
      w1 = _mm512_castsi512_ps(_mm512_and_si512(v1, hi));
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_set1_ps(x[r * ldx + 2 * kk + 1]);
        a0[r] = _mm512_fmadd_ps(xv, w0, a0[r]);
        a1[r] = _mm512_fmadd_ps(xv, w1, a1[r]);
      }
    }
    for (int r = 0; r < R; ++r) store_row_avx512<Epi>(a0[r], a1[r], out + r * ldo, ncols);
  }
};

/// xb: rows of bf16 activations, ⌈K/2⌉ pairs each (an odd K padded with a
/// zero), row stride ldxb elements (even).
template <int R, class Epi>
APEX_TARGET_AVX512BF16 void tile_dot_avx512(const bf16* w, const std::byte*, Index K, const bf16* xb, Index ldxb,
                                            float* out, Index ldo, Index ncols) {
  __m512 a0[R], a1[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  const Index pairs = (K + 1) / 2;
  for (Index kk = 0; kk < pairs; ++kk) {
    prefetch_slab(w + 64 * kk);
    const __m512bh v0 = (__m512bh)_mm512_load_si512(w + 64 * kk);
    const __m512bh v1 = (__m512bh)_mm512_load_si512(w + 64 * kk + 32);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      std::uint32_t pair;  // (x_2kk | x_2kk+1 << 16), read without type punning
      std::memcpy(&pair, xb + r * ldxb + 2 * kk, sizeof pair);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      a0[r] = _mm512_dpbf16_ps(a0[r], xv, v0);
      a1[r] = _mm512_dpbf16_ps(a1[r], xv, v1);
    }
  }
  for (int r = 0; r < R; ++r) store_row_avx512<Epi>(a0[r], a1[r], out + r * ldo, ncols);
}

// Tiles of 12 rows, then one tile of the remainder. Row r's result does not
// depend on which tile it falls in (per-row arithmetic is the same).
// TILE(R) names the tile of R rows; every tile takes (w, scales, K, x, …).
#define APEX_PACKED_ROWS_SWITCH(TILE, X)                                                           \
  Index r = 0;                                                                                     \
  for (; r + kAvx512Rows <= rows; r += kAvx512Rows)                                               \
    TILE(kAvx512Rows)(w, scales, K, X + r * ldx, ldx, out + r * ldo, ldo, ncols);                 \
  switch (rows - r) {                                                                              \
    case 1: TILE(1)(w, scales, K, X + r * ldx, ldx, out + r * ldo, ldo, ncols); break;            \
    case 2: TILE(2)(w, scales, K, X + r * ldx, ldx, out + r * ldo, ldo, ncols); break;            \
    case 3: TILE(3)(w, scales, K, X + r * ldx, ldx, out + r * ldo, ldo, ncols); break;            \
    case 4: TILE(4)(w, scales, K, X + r * ldx, ldx, out + r * ldo, ldo, ncols); break;            \
    case 5: TILE(5)(w, scales, K, X + r * ldx, ldx, out + r * ldo, ldo, ncols); break;            \
    case 6: TILE(6)(w, scales, K, X + r * ldx, ldx, out + r * ldo, ldo, ncols); break;            \
    case 7: TILE(7)(w, scales, K, X + r * ldx, ldx, out + r * ldo, ldo, ncols); break;            \
    case 8: TILE(8)(w, scales, K, X + r * ldx, ldx, out + r * ldo, ldo, ncols); break;            \
    case 9: TILE(9)(w, scales, K, X + r * ldx, ldx, out + r * ldo, ldo, ncols); break;            \
    case 10: TILE(10)(w, scales, K, X + r * ldx, ldx, out + r * ldo, ldo, ncols); break;          \
    case 11: TILE(11)(w, scales, K, X + r * ldx, ldx, out + r * ldo, ldo, ncols); break;          \
    default: break;                                                                                \
  }

/// out (rows × ncols) = epilogue(x (rows × K) · panel), widened weights of
/// any type with avx512 tiles (a compile error naming T for one without).
template <Dtype T, class Epi>
APEX_TARGET_AVX512 void panel_avx512(const typename WeightType<T>::Element* w, const std::byte* scales, Index K,
                                     const float* x, Index ldx, Index rows, float* out, Index ldo, Index ncols) {
  static_assert(TilesOn<T, Isa::avx512>::check());
#define APEX_PACKED_TABLE_TILE(R) Tiles<T, Isa::avx512>::template tile<R, Epi>
  APEX_PACKED_ROWS_SWITCH(APEX_PACKED_TABLE_TILE, x)
#undef APEX_PACKED_TABLE_TILE
}

/// As panel_avx512 with bf16 activations xb (row stride ldx) and `vdpbf16ps`.
template <class Epi>
APEX_TARGET_AVX512BF16 inline void panel_dot_avx512(const bf16* w, Index K, const bf16* xb, Index ldx, Index rows,
                                                    float* out, Index ldo, Index ncols) {
  const std::byte* scales = nullptr;  // bf16 has none
#define APEX_PACKED_DOT_TILE(R) tile_dot_avx512<R, Epi>
  APEX_PACKED_ROWS_SWITCH(APEX_PACKED_DOT_TILE, xb)
#undef APEX_PACKED_DOT_TILE
}

#undef APEX_PACKED_ROWS_SWITCH

}  // namespace apex::packed::detail
#endif
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
