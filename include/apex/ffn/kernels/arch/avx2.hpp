#pragma once
/// \file kernels/arch/avx2.hpp
/// AVX2 + FMA path: a slab of 32 lanes is four 8-float vectors; a tile of
/// R = 3 rows keeps 12 accumulators and the 4 weight vectors in the 16 ymm
/// registers. bf16 weights are widened by a shift (even k) or a mask (odd k)
/// and multiplied with fp32 activations, so activations stay exact.
/// Conventions as in kernels/arch/scalar.hpp.

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

APEX_TARGET_AVX2 inline void store_row_avx2(const __m256* acc, float* out, Index ncols, bool silu) {
  alignas(32) float tmp[32];
  if (silu) {
    const __m256 a0 = silu_mul_avx2(acc[0], acc[2]), a1 = silu_mul_avx2(acc[1], acc[3]);
    if (ncols == 16) {
      _mm256_storeu_ps(out, a0);
      _mm256_storeu_ps(out + 8, a1);
      return;
    }
    _mm256_store_ps(tmp, a0);
    _mm256_store_ps(tmp + 8, a1);
  } else {
    if (ncols == 32) {
      for (int v = 0; v < 4; ++v) _mm256_storeu_ps(out + 8 * v, acc[v]);
      return;
    }
    for (int v = 0; v < 4; ++v) _mm256_store_ps(tmp + 8 * v, acc[v]);
  }
  std::memcpy(out, tmp, std::size_t(ncols) * sizeof(float));
}

template <int R>
APEX_TARGET_AVX2 void tile_f32_avx2(const float* w, Index K, const float* x, Index ldx, float* out, Index ldo,
                                    Index ncols, bool silu) {
  __m256 acc[R][4];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm256_setzero_ps();
  for (Index k = 0; k < K; ++k) {
    prefetch_slab(w + 32 * k);
    __m256 wv[4];
    for (int v = 0; v < 4; ++v) wv[v] = _mm256_load_ps(w + 32 * k + 8 * v);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_set1_ps(x[r * ldx + k]);
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm256_fmadd_ps(xv, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r) store_row_avx2(acc[r], out + r * ldo, ncols, silu);
}

template <int R>
APEX_TARGET_AVX2 void tile_w16_avx2(const bf16* w, Index K, const float* x, Index ldx, float* out, Index ldo,
                                    Index ncols, bool silu) {
  const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 acc[R][4];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm256_setzero_ps();
  const Index pairs = (K + 1) / 2;
  for (Index kk = 0; kk < pairs; ++kk) {
    prefetch_slab(w + 64 * kk);
    __m256i raw[4];  // lanes 8v…8v+7, each lane (k even | k odd << 16)
    for (int v = 0; v < 4; ++v) raw[v] = _mm256_load_si256(reinterpret_cast<const __m256i*>(w + 64 * kk + 16 * v));
    __m256 wv[4];
    for (int v = 0; v < 4; ++v) wv[v] = _mm256_castsi256_ps(_mm256_slli_epi32(raw[v], 16));
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_set1_ps(x[r * ldx + 2 * kk]);
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm256_fmadd_ps(xv, wv[v], acc[r][v]);
    }
    if (2 * kk + 1 == K) break;  // odd K: the last pair has no odd half
    for (int v = 0; v < 4; ++v) wv[v] = _mm256_castsi256_ps(_mm256_and_si256(raw[v], hi));
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_set1_ps(x[r * ldx + 2 * kk + 1]);
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm256_fmadd_ps(xv, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r) store_row_avx2(acc[r], out + r * ldo, ncols, silu);
}

/// out (rows × ncols) = epilogue(x (rows × K) · panel), tiles of 3 rows.
template <class W>
APEX_TARGET_AVX2 void panel_avx2(const W* w, Index K, const float* x, Index ldx, Index rows, float* out, Index ldo,
                                 Index ncols, bool silu) {
  constexpr bool f32 = std::is_same_v<W, float>;
  Index r = 0;
  for (; r + 3 <= rows; r += 3) {
    if constexpr (f32) tile_f32_avx2<3>(w, K, x + r * ldx, ldx, out + r * ldo, ldo, ncols, silu);
    else tile_w16_avx2<3>(w, K, x + r * ldx, ldx, out + r * ldo, ldo, ncols, silu);
  }
  const Index rem = rows - r;
  if (rem == 2) {
    if constexpr (f32) tile_f32_avx2<2>(w, K, x + r * ldx, ldx, out + r * ldo, ldo, ncols, silu);
    else tile_w16_avx2<2>(w, K, x + r * ldx, ldx, out + r * ldo, ldo, ncols, silu);
  } else if (rem == 1) {
    if constexpr (f32) tile_f32_avx2<1>(w, K, x + r * ldx, ldx, out + r * ldo, ldo, ncols, silu);
    else tile_w16_avx2<1>(w, K, x + r * ldx, ldx, out + r * ldo, ldo, ncols, silu);
  }
}

}  // namespace apex::packed::detail
#endif
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
