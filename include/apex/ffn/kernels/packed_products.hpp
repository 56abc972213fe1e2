#pragma once
/// \file kernels/packed_products.hpp
/// Plain float products on the packed engine's micro-kernels, for the float
/// training layers (SwiGLU<float>::gated_forward / gated_backward):
///
///     y (n × out) = x (n × K) · Wᵀ,   W: out × K  (linear_nt:  X·Wᵀ, PyTorch layout)
///     y (n × out) = x (n × K) · W,    W: K × out  (linear_nn:  the dx products, dY·W)
///
/// Packing is per call. A training layer's weights change after every
/// optimiser step through raw Param pointers the layer cannot observe, so a
/// persistent packed copy could serve stale weights. Instead each call packs
/// W into the panel order of kernels/packed_weights.hpp (32 output lanes per panel,
/// float, no gate/up interleave) in chunks of ≤ kChunkBytes in a per-thread
/// scratch buffer and runs every row block against a chunk while it sits in
/// L2 (kernels of kernels/fused_expert.hpp, plain epilogue). That is what Eigen's GEMM does
/// as well (it repacks the weights on every product); the gain is the
/// micro-kernel. Packing reads W once (out·K floats); the product does
/// n·out·K FMAs, so packing is a small share once n is a few dozen rows.
///
/// Determinism. Every output row is a fixed sequence of fused multiply-adds
/// (k ascending) on its own input row: its bits do not depend on n, on the
/// row blocking, on how rows are split into calls or threads, and they are
/// the same on every path (scalar, AVX2, AVX-512). A product is
/// single-threaded: the MoE layers run it inside their expert tasks.
///
/// Which path the training layers use is a process-wide setting
/// (training_engine / set_training_engine): by default the best SIMD path of
/// the running CPU for products of at least kTrainingMinRows rows, Eigen
/// below that and on CPUs without AVX2. Every path gives the same bits, so
/// the default changes speed only.

#include <algorithm>
#include <atomic>
#include <cstring>

#include "matrix_runs.hpp"

namespace apex::packed {

/// Products with fewer rows than this run on Eigen by default (measured:
/// see docs/performance.md, "Training products on the packed engine").
inline constexpr Index kTrainingMinRows = 16;

/// The fastest path the running CPU has for float weights, or scalar.
inline Isa best_float_isa() {
  for (const Isa isa : {Isa::avx512, Isa::avx2})
    if (cpu_supports(isa)) return isa;
  return Isa::scalar;
}

/// Which path the float training products take. The default is chosen at run
/// time: the best SIMD path of the CPU (every path is compiled into every
/// build, so a build for the baseline target still gets AVX-512 kernels), and
/// Eigen on a CPU without AVX2, where the portable kernel is slower.
struct TrainingEngine {
  bool enabled = best_float_isa() != Isa::scalar;  ///< false: every product on Eigen
  Isa isa = best_float_isa();                      ///< kernel path when enabled
  Index min_rows = kTrainingMinRows;               ///< fewer rows: Eigen
  bool forward = true;                             ///< X·W_guᵀ and A·W_downᵀ on the engine
  bool dx = true;                                  ///< dY·W_down and dH·W_gu on the engine
};

namespace detail {
struct TrainingEngineSlot {
  std::atomic<bool> enabled{TrainingEngine{}.enabled};
  std::atomic<int> isa{int(TrainingEngine{}.isa)};
  std::atomic<Index> min_rows{kTrainingMinRows};
  std::atomic<bool> forward{TrainingEngine{}.forward};
  std::atomic<bool> dx{TrainingEngine{}.dx};
};
inline TrainingEngineSlot& training_engine_slot() {
  static TrainingEngineSlot s;
  return s;
}
}  // namespace detail

/// The current setting (relaxed reads: set it before training, not during).
inline TrainingEngine training_engine() {
  const auto& s = detail::training_engine_slot();
  return {s.enabled.load(std::memory_order_relaxed), Isa(s.isa.load(std::memory_order_relaxed)),
          s.min_rows.load(std::memory_order_relaxed), s.forward.load(std::memory_order_relaxed),
          s.dx.load(std::memory_order_relaxed)};
}

/// Changes the path of every later float training product. ConfigError for a
/// path the CPU lacks (when enabled) or a negative min_rows. For tests and
/// for reproducing the Eigen path; not to be called while layers run.
inline void set_training_engine(const TrainingEngine& e) {
  constexpr const char* where = "set_training_engine";
  apex::detail::require_config(e.min_rows >= 0, where, "min_rows = " + std::to_string(e.min_rows) + " is negative");
  if (e.enabled) detail::require_isa(where, e.isa);
  auto& s = detail::training_engine_slot();
  s.enabled.store(e.enabled, std::memory_order_relaxed);
  s.isa.store(int(e.isa), std::memory_order_relaxed);
  s.min_rows.store(e.min_rows, std::memory_order_relaxed);
  s.forward.store(e.forward, std::memory_order_relaxed);
  s.dx.store(e.dx, std::memory_order_relaxed);
}

namespace detail {

inline constexpr Index kLinLanes = PanelMatrix::kLanes;  // 32 output lanes per panel

/// Per-thread scratch for the packed weights of one product (grows, never shrinks).
inline AlignedArray<float>& linear_pack_scratch() {
  thread_local AlignedArray<float> s;
  return s;
}

#if APEX_PACKED_X86
/// dst[j·ldd + i] = src[i·lds + j] for an 8 × 8 block (AVX2 register transpose).
APEX_TARGET_AVX2 inline void transpose8_avx2(const float* src, Index lds, float* dst, Index ldd) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * lds);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  // r[0..3]: columns 0,1,2,3 of rows 0–3 (low half) and 4–7 of the same rows (high half); r[4..7] rows 4–7
  for (int j = 0; j < 4; ++j) {
    _mm256_storeu_ps(dst + j * ldd, _mm256_permute2f128_ps(r[j], r[j + 4], 0x20));
    _mm256_storeu_ps(dst + (j + 4) * ldd, _mm256_permute2f128_ps(r[j], r[j + 4], 0x31));
  }
}
#endif

/// Panels [p0, p1) of Wᵀ for y = x·Wᵀ: lane l of panel p is row 32p + l of w
/// (out × K, row stride ldw); rows past `out` are zero. dst holds the panels
/// back to back (K × 32 floats each). A transpose: 8 × 8 register blocks
/// when the CPU has AVX2 (pure data movement, so the bits never depend on it).
inline void pack_nt(const float* w, Index ldw, Index out, Index K, Index p0, Index p1, float* dst) {
  constexpr Index L = kLinLanes;
#if APEX_PACKED_X86
  static const bool avx2 = cpu_supports(Isa::avx2);
#else
  constexpr bool avx2 = false;
#endif
  for (Index p = p0; p < p1; ++p) {
    float* pan = dst + (p - p0) * K * L;
    const Index lanes = std::min(L, out - p * L);
    Index k8 = 0;  // columns [0, k8) done by 8 × 8 blocks
#if APEX_PACKED_X86
    if (avx2 && lanes == L) {
      k8 = K / 8 * 8;
      for (Index k0 = 0; k0 < k8; k0 += 8)
        for (Index g = 0; g < L; g += 8) transpose8_avx2(w + (p * L + g) * ldw + k0, ldw, pan + k0 * L + g, L);
    }
#endif
    for (Index l = 0; l < lanes; ++l) {
      const float* src = w + (p * L + l) * ldw;
      for (Index k = k8; k < K; ++k) pan[k * L + l] = src[k];
    }
    for (Index k = k8; k < K; ++k)
      for (Index l = lanes; l < L; ++l) pan[k * L + l] = 0.0f;
  }
}

/// Panels [p0, p1) of W for y = x·W: lane l of panel p is column 32p + l of
/// w (K × out, row stride ldw); columns past `out` are zero. Row k of w is
/// read once, front to back.
inline void pack_nn(const float* w, Index ldw, Index out, Index K, Index p0, Index p1, float* dst) {
  constexpr Index L = kLinLanes;
  for (Index k = 0; k < K; ++k) {
    const float* src = w + k * ldw;
    for (Index p = p0; p < p1; ++p) {
      float* slab = dst + (p - p0) * K * L + k * L;
      const Index lanes = std::min(L, out - p * L);
      std::memcpy(slab, src + p * L, std::size_t(lanes) * sizeof(float));
      if (lanes < L) std::memset(slab + lanes, 0, std::size_t(L - lanes) * sizeof(float));
    }
  }
}

/// Bytes of packed panels a chunk holds: they stay in L2 while every row
/// block of x runs against them.
inline constexpr Index kChunkBytes = Index(512) << 10;

/// y (n × out, stride ldy) = x (n × K, stride ldx) · Bᵀ, where `pack(p0, p1,
/// dst)` writes panels [p0, p1) of B (out lanes × K). Panels go in chunks
/// of about kChunkBytes, each packed into the thread's scratch and then run
/// against every row block. Single-threaded: callers parallelise over
/// experts and row tiles.
template <class Pack>
void packed_product(Isa isa, Index K, Index out, const float* x, Index ldx, Index n, float* y, Index ldy,
                    const Pack& pack) {
  constexpr Index L = kLinLanes;
  const Index panels = (out + L - 1) / L;
  const Index per_chunk = std::max<Index>(1, kChunkBytes / (std::max<Index>(K, 1) * L * Index(sizeof(float))));
  const Index chunks = (panels + per_chunk - 1) / per_chunk;
  const Index block = n <= kSmallRows ? n : kRowBlock;
  const auto run_chunk = [&](Index c) {
    const Index p0 = c * per_chunk, p1 = std::min(panels, p0 + per_chunk);
    float* buf = grow(linear_pack_scratch(), apex::detail::checked_product("packed::linear", "packed panels",
                                                                           {p1 - p0, K, L}));
    pack(p0, p1, buf);
    for (Index r0 = 0; r0 < n; r0 += block) {
      const Index rows = std::min(block, n - r0);
      for (Index p = p0; p < p1; ++p)
        run_panel<Dtype::f32, PlainEpilogue>(isa, buf + (p - p0) * K * L, nullptr, K, x + r0 * ldx, ldx, rows,
                                             y + r0 * ldy + p * L, ldy, std::min(L, out - p * L));
    }
  };
  for (Index c = 0; c < chunks; ++c) run_chunk(c);
}

}  // namespace detail

/// y (n × out, row stride ldy) = x (n × K, row stride ldx) · Wᵀ with w: out × K
/// (row stride ldw), on path isa (the caller checked it). y must not overlap x or w.
inline void linear_nt(Isa isa, const float* x, Index ldx, Index n, const float* w, Index ldw, Index out, Index K,
                      float* y, Index ldy) {
  if (n == 0 || out == 0) return;
  detail::packed_product(isa, K, out, x, ldx, n, y, ldy,
                         [&](Index p0, Index p1, float* dst) { detail::pack_nt(w, ldw, out, K, p0, p1, dst); });
}

/// y (n × out, row stride ldy) = x (n × K, row stride ldx) · W with w: K × out
/// (row stride ldw), on path isa (the caller checked it). y must not overlap x or w.
inline void linear_nn(Isa isa, const float* x, Index ldx, Index n, const float* w, Index ldw, Index out, Index K,
                      float* y, Index ldy) {
  if (n == 0 || out == 0) return;
  detail::packed_product(isa, K, out, x, ldx, n, y, ldy,
                         [&](Index p0, Index p1, float* dst) { detail::pack_nn(w, ldw, out, K, p0, p1, dst); });
}

}  // namespace apex::packed
