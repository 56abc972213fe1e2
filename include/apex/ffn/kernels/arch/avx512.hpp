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
/// Conventions as in kernels/arch/scalar.hpp.

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../bf16_vectors.hpp"
#include "../vec_math.hpp"

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

APEX_TARGET_AVX512 inline void store_row_avx512(__m512 a0, __m512 a1, float* out, Index ncols, bool silu) {
  // Masked stores touch only the first ncols floats (no access past a row).
  if (silu) {
    _mm512_mask_storeu_ps(out, low_mask16(ncols), silu_mul_avx512(a0, a1));
  } else {
    _mm512_mask_storeu_ps(out, low_mask16(ncols), a0);
    if (ncols > 16) _mm512_mask_storeu_ps(out + 16, low_mask16(ncols - 16), a1);
  }
}

template <int R>
APEX_TARGET_AVX512 void tile_f32_avx512(const float* w, Index K, const float* x, Index ldx, float* out, Index ldo,
                                        Index ncols, bool silu) {
  __m512 a0[R], a1[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  for (Index k = 0; k < K; ++k) {
    prefetch_slab(w + 32 * k);
    const __m512 w0 = _mm512_load_ps(w + 32 * k), w1 = _mm512_load_ps(w + 32 * k + 16);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
      a0[r] = _mm512_fmadd_ps(xv, w0, a0[r]);
      a1[r] = _mm512_fmadd_ps(xv, w1, a1[r]);
    }
  }
  for (int r = 0; r < R; ++r) store_row_avx512(a0[r], a1[r], out + r * ldo, ncols, silu);
}

template <int R>
APEX_TARGET_AVX512 void tile_w16_avx512(const bf16* w, Index K, const float* x, Index ldx, float* out, Index ldo,
                                        Index ncols, bool silu) {
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
  for (int r = 0; r < R; ++r) store_row_avx512(a0[r], a1[r], out + r * ldo, ncols, silu);
}

/// xb: rows of bf16 activations, ⌈K/2⌉ pairs each (an odd K padded with a
/// zero), row stride ldxb elements (even).
template <int R>
APEX_TARGET_AVX512BF16 void tile_dot_avx512(const bf16* w, Index K, const bf16* xb, Index ldxb, float* out,
                                            Index ldo, Index ncols, bool silu) {
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
  for (int r = 0; r < R; ++r) store_row_avx512(a0[r], a1[r], out + r * ldo, ncols, silu);
}

// Tiles of 12 rows, then one tile of the remainder. Row r's result does not
// depend on which tile it falls in (per-row arithmetic is the same).
#define APEX_PACKED_ROWS_SWITCH(TILE, W, X)                                                        \
  Index r = 0;                                                                                     \
  for (; r + kAvx512Rows <= rows; r += kAvx512Rows)                                               \
    TILE<kAvx512Rows>(W, K, X + r * ldx, ldx, out + r * ldo, ldo, ncols, silu);                   \
  switch (rows - r) {                                                                              \
    case 1: TILE<1>(W, K, X + r * ldx, ldx, out + r * ldo, ldo, ncols, silu); break;              \
    case 2: TILE<2>(W, K, X + r * ldx, ldx, out + r * ldo, ldo, ncols, silu); break;              \
    case 3: TILE<3>(W, K, X + r * ldx, ldx, out + r * ldo, ldo, ncols, silu); break;              \
    case 4: TILE<4>(W, K, X + r * ldx, ldx, out + r * ldo, ldo, ncols, silu); break;              \
    case 5: TILE<5>(W, K, X + r * ldx, ldx, out + r * ldo, ldo, ncols, silu); break;              \
    case 6: TILE<6>(W, K, X + r * ldx, ldx, out + r * ldo, ldo, ncols, silu); break;              \
    case 7: TILE<7>(W, K, X + r * ldx, ldx, out + r * ldo, ldo, ncols, silu); break;              \
    case 8: TILE<8>(W, K, X + r * ldx, ldx, out + r * ldo, ldo, ncols, silu); break;              \
    case 9: TILE<9>(W, K, X + r * ldx, ldx, out + r * ldo, ldo, ncols, silu); break;              \
    case 10: TILE<10>(W, K, X + r * ldx, ldx, out + r * ldo, ldo, ncols, silu); break;            \
    case 11: TILE<11>(W, K, X + r * ldx, ldx, out + r * ldo, ldo, ncols, silu); break;            \
    default: break;                                                                                \
  }

/// out (rows × ncols) = epilogue(x (rows × K) · panel); float or widened bf16.
template <class W>
APEX_TARGET_AVX512 void panel_avx512(const W* w, Index K, const float* x, Index ldx, Index rows, float* out,
                                     Index ldo, Index ncols, bool silu) {
  if constexpr (std::is_same_v<W, float>) {
    APEX_PACKED_ROWS_SWITCH(tile_f32_avx512, w, x)
  } else {
    APEX_PACKED_ROWS_SWITCH(tile_w16_avx512, w, x)
  }
}

/// As panel_avx512 with bf16 activations xb (row stride ldx) and `vdpbf16ps`.
APEX_TARGET_AVX512BF16 inline void panel_dot_avx512(const bf16* w, Index K, const bf16* xb, Index ldx, Index rows,
                                                    float* out, Index ldo, Index ncols, bool silu) {
  APEX_PACKED_ROWS_SWITCH(tile_dot_avx512, w, xb)
}

#undef APEX_PACKED_ROWS_SWITCH

}  // namespace apex::packed::detail
#endif
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
