#pragma once
/// \file kernels/streamed_product.hpp
/// A product with few rows on float weights read in place:
///
///     y (m × n) = x (m × K) · Wᵀ,   W: n × K row-major (PyTorch `[out, in]`), m small
///
/// Each weight row is read from memory once and from L1 for the other rows
/// of x; nothing is packed (a GEMM would first pack all of W for a handful
/// of rows). This is a decode step's product on weights the caller owns and
/// may change at any time (the Python package's float experts).
///
/// The time is the weights' bytes, so what matters is keeping enough loads
/// in flight: four weight rows at a time, each with its own accumulator
/// chain. A single chain, as a compiler makes of a plain dot-product loop,
/// is bound by the add's latency: one SSE vector (16 bytes) per 4 cycles,
/// ≈ 10 GB/s at 2.6 GHz, under one core's memory rate on a Xeon of that
/// clock.
///
/// Bits. Each y(i, j) is 16 lane sums, lane l the fused multiply-adds of
/// the k ≡ l (mod 16), k ascending (past K: zeros), then added by a fixed
/// tree ((l, l+8), (l, l+4), (l, l+2), (l, l+1)). The AVX2 path (two 8-lane
/// halves) and the AVX-512 path (one 16-lane vector) run exactly those
/// operations: the same bits, independent of m, n and the other rows.

#include <cmath>

#include "../core/types.hpp"
#include "isa.hpp"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
namespace apex::packed {
namespace detail {

/// Weight rows per pass (independent accumulator chains per row of x).
inline constexpr Index kStreamedRowsPerPass = 4;

/// The fixed reduction of 16 lane sums (see the file comment).
inline float reduce16(const float* lane) {
  float s[8];
  for (int l = 0; l < 8; ++l) s[l] = lane[l] + lane[l + 8];
  for (int l = 0; l < 4; ++l) s[l] = s[l] + s[l + 4];
  for (int l = 0; l < 2; ++l) s[l] = s[l] + s[l + 2];
  return s[0] + s[1];
}

/// Portable form of the lane sums (CPUs without AVX2): the same operations
/// one lane at a time (std::fma), so the same bits, slowly.
inline void streamed_rows_scalar(const float* x, const float* w, Index ldw, Index rows, Index K, float* y) {
  const Index padded = (K + 15) / 16 * 16;  // the vector paths' zeros past K (fma(0, 0, −0) is +0)
  for (Index j = 0; j < rows; ++j) {
    float lane[16] = {};
    for (Index k = 0; k < padded; ++k)
      lane[k % 16] = k < K ? std::fma(x[k], w[j * ldw + k], lane[k % 16]) : std::fma(0.0f, 0.0f, lane[k % 16]);
    y[j] = reduce16(lane);
  }
}

#if APEX_PACKED_X86
/// y[j] = x · w_j for `rows` ≤ 4 weight rows of stride ldw, on AVX-512.
template <int R>
APEX_TARGET_AVX512 void streamed_rows_avx512(const float* x, const float* w, Index ldw, Index K, float* y) {
  __m512 acc[R];
  for (int j = 0; j < R; ++j) acc[j] = _mm512_setzero_ps();
  Index k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m512 xv = _mm512_loadu_ps(x + k);
    for (int j = 0; j < R; ++j) acc[j] = _mm512_fmadd_ps(xv, _mm512_loadu_ps(w + j * ldw + k), acc[j]);
  }
  if (k < K) {  // zeros past K: fma(0, 0, s) = s
    const __mmask16 m = __mmask16((1u << (K - k)) - 1u);
    const __m512 xv = _mm512_maskz_loadu_ps(m, x + k);
    for (int j = 0; j < R; ++j) acc[j] = _mm512_fmadd_ps(xv, _mm512_maskz_loadu_ps(m, w + j * ldw + k), acc[j]);
  }
  alignas(64) float lane[16];
  for (int j = 0; j < R; ++j) {
    _mm512_store_ps(lane, acc[j]);
    y[j] = reduce16(lane);
  }
}

/// As streamed_rows_avx512 on AVX2: lanes 0–7 and 8–15 as two vectors.
template <int R>
APEX_TARGET_AVX2 void streamed_rows_avx2(const float* x, const float* w, Index ldw, Index K, float* y) {
  __m256 lo[R], hi[R];
  for (int j = 0; j < R; ++j) lo[j] = hi[j] = _mm256_setzero_ps();
  Index k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
    for (int j = 0; j < R; ++j) {
      lo[j] = _mm256_fmadd_ps(x0, _mm256_loadu_ps(w + j * ldw + k), lo[j]);
      hi[j] = _mm256_fmadd_ps(x1, _mm256_loadu_ps(w + j * ldw + k + 8), hi[j]);
    }
  }
  if (k < K) {
    alignas(32) float xt[16] = {}, wt[16];
    for (Index t = k; t < K; ++t) xt[t - k] = x[t];
    const __m256 x0 = _mm256_load_ps(xt), x1 = _mm256_load_ps(xt + 8);
    for (int j = 0; j < R; ++j) {
      for (Index t = 0; t < 16; ++t) wt[t] = k + t < K ? w[j * ldw + k + t] : 0.0f;
      lo[j] = _mm256_fmadd_ps(x0, _mm256_load_ps(wt), lo[j]);
      hi[j] = _mm256_fmadd_ps(x1, _mm256_load_ps(wt + 8), hi[j]);
    }
  }
  alignas(32) float lane[16];
  for (int j = 0; j < R; ++j) {
    _mm256_store_ps(lane, lo[j]);
    _mm256_store_ps(lane + 8, hi[j]);
    y[j] = reduce16(lane);
  }
}

/// y[0..rows) = x · w_j for rows ≤ 4 weight rows on path `isa` (AVX2 or an AVX-512 path).
inline void streamed_rows(Isa isa, const float* x, const float* w, Index ldw, Index rows, Index K, float* y) {
  if (is_avx512(isa)) {
    switch (rows) {
      case 4: return streamed_rows_avx512<4>(x, w, ldw, K, y);
      case 3: return streamed_rows_avx512<3>(x, w, ldw, K, y);
      case 2: return streamed_rows_avx512<2>(x, w, ldw, K, y);
      default: return streamed_rows_avx512<1>(x, w, ldw, K, y);
    }
  }
  switch (rows) {
    case 4: return streamed_rows_avx2<4>(x, w, ldw, K, y);
    case 3: return streamed_rows_avx2<3>(x, w, ldw, K, y);
    case 2: return streamed_rows_avx2<2>(x, w, ldw, K, y);
    default: return streamed_rows_avx2<1>(x, w, ldw, K, y);
  }
}
#endif

}  // namespace detail

/// y (m × n, row stride ldy) = x (m × K, stride ldx) · Wᵀ, W: n × K (stride
/// ldw ≥ K), for few rows m (see the file comment); every path the same
/// bits. The caller checks shapes and the path (this is an inner product of
/// the Python package's experts, called per expert task).
inline void streamed_product_nt(Isa isa, const float* x, Index ldx, Index m, const float* w, Index ldw, Index n,
                                Index K, float* y, Index ldy) {
  constexpr Index P = detail::kStreamedRowsPerPass;
  for (Index j0 = 0; j0 < n; j0 += P) {
    const Index rows = n - j0 < P ? n - j0 : P;
    const float* wj = w + j0 * ldw;
    for (Index i = 0; i < m; ++i) {
#if APEX_PACKED_X86
      if (isa != Isa::scalar) {
        detail::streamed_rows(isa, x + i * ldx, wj, ldw, rows, K, y + i * ldy + j0);
        continue;
      }
#endif
      (void)isa;
      detail::streamed_rows_scalar(x + i * ldx, wj, ldw, rows, K, y + i * ldy + j0);
    }
  }
}

}  // namespace apex::packed
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
