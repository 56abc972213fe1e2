#pragma once
// The memory-read probe the benchmarks' bandwidth bounds are timed with.
//
// A bound must be the fastest way this core can read the bytes, or the
// fractions of it flatter the kernels. A scalar sum measures the add's
// latency; one vector stream with one accumulator measures it too, 16 lanes
// wide. This probe reads the span as kReadStreams contiguous parts side by
// side (each part its own hardware-prefetch stream, so a core keeps misses in
// flight on several pages at once), two full-width vector loads per part per
// step into independent accumulators (no add chain longer than the loads),
// and no software prefetch. On a 2-vCPU AVX-512 EPYC, 40 MB cold, medians of
// 15 alternated reads: 24.5 GB/s on one thread against 20.5 for one AVX
// stream with a prefetch 4 KiB ahead (the probe before), 18–22 for one or
// two AVX-512 streams with it, 20 for four streams with it; at two threads
// 29–31 GB/s, where all of them read 26–31. The width is the compiler
// target's: AVX-512 under -march=native on an AVX-512 CPU, else AVX, SSE2 or
// scalar; `kReadProbeName` names the one built, and the benchmark labels
// carry it.

#include <apex/ffn/core/types.hpp>

#include <cstdint>
#include <cstring>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace apex::bench {

inline constexpr int kReadStreams = 4;

#if defined(__AVX512F__)
inline constexpr const char* kReadProbeName = "avx512x4streams";
#elif defined(__AVX__)
inline constexpr const char* kReadProbeName = "avx256x4streams";
#elif defined(__SSE2__)
inline constexpr const char* kReadProbeName = "sse128x4streams";
#else
inline constexpr const char* kReadProbeName = "scalar4streams";
#endif

namespace detail {
#if defined(__AVX512F__)
using ReadVector = __m512;
inline ReadVector read_zero() { return _mm512_setzero_ps(); }
inline ReadVector read_load(const float* q) { return _mm512_loadu_ps(q); }
inline ReadVector read_add(ReadVector a, ReadVector b) { return _mm512_add_ps(a, b); }
#elif defined(__AVX__)
using ReadVector = __m256;
inline ReadVector read_zero() { return _mm256_setzero_ps(); }
inline ReadVector read_load(const float* q) { return _mm256_loadu_ps(q); }
inline ReadVector read_add(ReadVector a, ReadVector b) { return _mm256_add_ps(a, b); }
#elif defined(__SSE2__)
using ReadVector = __m128;
inline ReadVector read_zero() { return _mm_setzero_ps(); }
inline ReadVector read_load(const float* q) { return _mm_loadu_ps(q); }
inline ReadVector read_add(ReadVector a, ReadVector b) { return _mm_add_ps(a, b); }
#else
using ReadVector = float;
inline ReadVector read_zero() { return 0.0f; }
inline ReadVector read_load(const float* q) { return *q; }
inline ReadVector read_add(ReadVector a, ReadVector b) { return a + b; }
#endif
}  // namespace detail

/// Σ p[0, n), read as described above (the value only defeats the optimiser).
inline float multi_stream_sum(const float* p, Index n) {
  using detail::ReadVector;
  constexpr Index kLanes = Index(sizeof(ReadVector) / sizeof(float));
  constexpr Index kStep = 2 * kLanes;  // floats per part per step
  const Index part = n / kReadStreams / kStep * kStep;
  ReadVector acc[2 * kReadStreams];
  for (ReadVector& a : acc) a = detail::read_zero();
  for (Index i = 0; i < part; i += kStep)
    for (int s = 0; s < kReadStreams; ++s) {
      const float* q = p + s * part + i;
      acc[2 * s] = detail::read_add(acc[2 * s], detail::read_load(q));
      acc[2 * s + 1] = detail::read_add(acc[2 * s + 1], detail::read_load(q + kLanes));
    }
  for (int a = 1; a < 2 * kReadStreams; ++a) acc[0] = detail::read_add(acc[0], acc[a]);
  float lanes[kLanes];
  std::memcpy(lanes, &acc[0], sizeof(lanes));
  float sum = 0;
  for (float v : lanes) sum += v;
  for (Index i = part * kReadStreams; i < n; ++i) sum += p[i];
  return sum;
}

}  // namespace apex::bench
