#pragma once
/// \file kernels/arch/avx2.hpp
/// AVX2 + FMA path: a slab of 32 lanes is four 8-float vectors; a tile of
/// R = 3 rows keeps 12 accumulators and the 4 weight vectors in the 16 ymm
/// registers. bf16 weights are widened by a shift (even k) or a mask (odd k)
/// and multiplied with fp32 activations, so activations stay exact.
/// The tiles are the `Tiles<T, Isa::avx2>` entries of the weight-type table
/// (kernels/weight_types.hpp); `panel_avx2` runs any type that has them.
/// Conventions as in kernels/arch/scalar.hpp.

#include <cstddef>
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

/// One row's 32 accumulators (four vectors) through the epilogue.
template <class Epi>
APEX_TARGET_AVX2 APEX_KERNEL_INLINE inline void store_row_avx2(const __m256* acc, float* out, Index ncols) {
  alignas(32) float tmp[32];
  if constexpr (Epi::kGated && vectorised_v<typename Epi::Activation>) {
    using Act = typename Epi::Activation;
    const __m256 a0 = Act::apply_avx2(acc[0], acc[2]), a1 = Act::apply_avx2(acc[1], acc[3]);
    if (ncols == 16) {
      _mm256_storeu_ps(out, a0);
      _mm256_storeu_ps(out + 8, a1);
      return;
    }
    _mm256_store_ps(tmp, a0);
    _mm256_store_ps(tmp + 8, a1);
  } else if constexpr (Epi::kGated) {  // an activation without SIMD forms: per element
    for (int v = 0; v < 4; ++v) _mm256_store_ps(tmp + 8 * v, acc[v]);
    return store_row_lanes<Epi>(tmp, out, ncols);
  } else {
    if (ncols == 32) {
      for (int v = 0; v < 4; ++v) _mm256_storeu_ps(out + 8 * v, acc[v]);
      return;
    }
    for (int v = 0; v < 4; ++v) _mm256_store_ps(tmp + 8 * v, acc[v]);
  }
  std::memcpy(out, tmp, std::size_t(ncols) * sizeof(float));
}

/// How a weight type with one fp32 value per lane and k is read: slab k (32
/// lanes) as four fp32 vectors, lanes 8v … 8v + 7.
struct F32Slab {
  using Weight = float;
  APEX_TARGET_AVX2 APEX_KERNEL_INLINE static void load(const float* w, Index k, __m256* wv) {
    for (int v = 0; v < 4; ++v) wv[v] = _mm256_load_ps(w + 32 * k + 8 * v);
  }
};
/// f16 weights widened by F16C (`vcvtph2ps`, exact).
struct F16Slab {
  using Weight = f16;
  APEX_TARGET_AVX2 APEX_KERNEL_INLINE static void load(const f16* w, Index k, __m256* wv) {
    for (int v = 0; v < 4; ++v)
      wv[v] = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(w + 32 * k + 8 * v)));
  }
};

/// acc ← fma(x_k, w_k, acc), k ascending, on the weights as `Slab` widens
/// them: the f32 tile, and every type widened exactly to fp32 (f16), so
/// those give the f32 kernel's bits on the widened weights.
template <class Slab, int R, class Epi>
APEX_TARGET_AVX2 inline void fma_tile_avx2(const typename Slab::Weight* w, Index K, const float* x, Index ldx,
                                           float* out, Index ldo, Index ncols) {
  __m256 acc[R][4];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm256_setzero_ps();
  for (Index k = 0; k < K; ++k) {
    prefetch_slab(w + 32 * k);
    __m256 wv[4];
    Slab::load(w, k, wv);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_set1_ps(x[r * ldx + k]);
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm256_fmadd_ps(xv, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r) store_row_avx2<Epi>(acc[r], out + r * ldo, ncols);
}

/// float weights: acc ← fma(x_k, w_k, acc), k ascending.
template <>
struct Tiles<Dtype::f32, Isa::avx2> {
  template <int R, class Epi>
  APEX_TARGET_AVX2 static void tile(const float* w, const std::byte*, Index K, const float* x, Index ldx, float* out,
                                    Index ldo, Index ncols) {
    fma_tile_avx2<F32Slab, R, Epi>(w, K, x, ldx, out, ldo, ncols);
  }
  /// Lanes 8v … 8v + 7 of column k (the column unpacker, kernels/arch/avx2_unpack_columns.hpp).
  APEX_TARGET_AVX2 APEX_KERNEL_INLINE static __m256 lanes(const float* w, Index k, int v) {
    return _mm256_load_ps(w + k * kPanelLanes + 8 * v);
  }
};

/// bf16 weights widened: even k by `<< 16`, odd k by masking the low half.
template <>
struct Tiles<Dtype::bf16, Isa::avx2> {
  template <int R, class Epi>
  APEX_TARGET_AVX2 static void tile(const bf16* w, const std::byte*, Index K, const float* x, Index ldx, float* out,
                                    Index ldo, Index ncols) {
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
    for (int r = 0; r < R; ++r) store_row_avx2<Epi>(acc[r], out + r * ldo, ncols);
  }
  /// Lanes 8v … 8v + 7 of column k: lane word (k even | k odd << 16) of pair k / 2.
  APEX_TARGET_AVX2 APEX_KERNEL_INLINE static __m256 lanes(const bf16* w, Index k, int v) {
    const __m256i pair = _mm256_load_si256(reinterpret_cast<const __m256i*>(w + (k / 2) * 2 * kPanelLanes + 16 * v));
    return _mm256_castsi256_ps(k % 2 ? _mm256_and_si256(pair, _mm256_set1_epi32(int(0xFFFF0000u)))
                                     : _mm256_slli_epi32(pair, 16));
  }
};

/// f16 weights widened by F16C (`vcvtph2ps`, exact): then the f32 tile's
/// fma(x_k, w_k, acc), k ascending, so the bits are the f32 kernel's on the
/// widened weights.
template <>
struct Tiles<Dtype::f16, Isa::avx2> {
  template <int R, class Epi>
  APEX_TARGET_AVX2 static void tile(const f16* w, const std::byte*, Index K, const float* x, Index ldx, float* out,
                                    Index ldo, Index ncols) {
    fma_tile_avx2<F16Slab, R, Epi>(w, K, x, ldx, out, ldo, ncols);
  }
  /// Lanes 8v … 8v + 7 of column k, widened by F16C.
  APEX_TARGET_AVX2 APEX_KERNEL_INLINE static __m256 lanes(const f16* w, Index k, int v) {
    return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(w + k * kPanelLanes + 8 * v)));
  }
};

/// out (rows × ncols) = epilogue(x (rows × K) · panel), tiles of 3 rows; a
/// compile error naming T for a type without AVX2 tiles.
template <Dtype T, class Epi>
APEX_TARGET_AVX2 void panel_avx2(const typename WeightType<T>::Element* w, const std::byte* scales, Index K,
                                 const float* x, Index ldx, Index rows, float* out, Index ldo, Index ncols) {
  static_assert(TilesOn<T, Isa::avx2>::check());
  using Tile = Tiles<T, Isa::avx2>;
  Index r = 0;
  for (; r + 3 <= rows; r += 3) Tile::template tile<3, Epi>(w, scales, K, x + r * ldx, ldx, out + r * ldo, ldo, ncols);
  const Index rem = rows - r;
  if (rem == 2) Tile::template tile<2, Epi>(w, scales, K, x + r * ldx, ldx, out + r * ldo, ldo, ncols);
  else if (rem == 1) Tile::template tile<1, Epi>(w, scales, K, x + r * ldx, ldx, out + r * ldo, ldo, ncols);
}

}  // namespace apex::packed::detail
#endif
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
