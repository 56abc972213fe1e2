#pragma once
/// \file kernels/fused_expert.hpp
/// The fused expert forward on packed weights,
///
///     Y (m × d) = act(X·W_gateᵀ, X·W_upᵀ)·W_downᵀ,     X: m × d, row-major fp32,
///
/// act = SiLU(G) ⊙ U by default (SwiGLU), or any gated activation of
/// kernels/epilogue.hpp. Two passes over a block of rows: the gate/up panels
/// produce A = act(G, U) (m × f) in the tile's epilogue, in registers, then
/// the down panels produce Y from A. Accumulation is fp32 always. Each
/// matrix runs the tiles the weight-type table (kernels/weight_types.hpp)
/// gives its (type, path), block formats on path amx_bf16 the AMX-INT8
/// tiles from 8 or 16 rows (kernels/matrix_runs.hpp).
///
/// Regimes. One micro-kernel shape serves both (kernels/arch/avx512.hpp): a tile of
/// up to 12 rows against one 32-lane panel.
/// - Few rows (m ≤ kSmallRows = 32, decode): bandwidth-bound. Every panel is
///   read from memory once for all rows of the call (further 12-row tiles
///   re-read it from L2), with a software prefetch 4 KiB ahead; bf16 weights
///   are widened by a shift and multiplied with exact fp32 activations.
/// - Many rows: compute-bound. Rows are processed in blocks of kRowBlock so a
///   block's X and A stay in L2 while every panel streams through; the
///   12 × 32 tile runs at the FMA peak (≈ 149 GFLOP/s on one core here).
///
/// bf16 products. `widened` (the default everywhere) converts each weight with
/// one shift or mask and uses fp32 FMAs: activations stay exact and the speed
/// is the float kernel's. `paired` (avx512_bf16 and amx_bf16) rounds X and A to bf16
/// and uses `vdpbf16ps`, two multiply-adds per lane and instruction. Its
/// worth depends on the CPU: on a Sapphire Rapids-class Xeon `vdpbf16ps`
/// issues at about half the rate of an fp32 FMA, so paired products reach
/// ≈ 85 GFLOP/s against ≈ 149 widened, and the `amx_bf16` path runs them on
/// AMX-BF16 tiles instead (kernels/arch/amx_bf16.hpp: ≈ 10× packed float
/// at 512 rows, in blocks of kAmxRowBlock rows); on an AMD Zen 4 EPYC it
/// issues at the FMA's rate, so paired products reach 197–216 GFLOP/s against
/// 100–110 widened, 1.96–2.26× packed float from 16 to 1024 rows (bench_packed,
/// BM_expert's bf16p column). `automatic` stays widened on every CPU: paired
/// products round X and A, so a row's bits would depend on the CPU and the
/// path. Callers whose activations are bf16 already lose nothing by pairing
/// and choose it (the Python package does for bf16 models).
///
/// Accuracy. Float weights: the error of a dot product of length K in fp32,
/// |δ| ≤ ≈K·2⁻²⁴·Σ|x||w| (the tests bound it componentwise; measured
/// ≈ 1e-6 in norm against double). Widened bf16: the same on the bf16-rounded
/// weights; against the float weights the weight rounding (2⁻⁹ relative)
/// gives 2.6–2.9e-3 in norm on random data (d, f = 256…1376). Paired bf16:
/// X and A are rounded to bf16 as well: 3.7–4.0e-3.
///
/// Measured (bench_packed, one expert, one thread, cold weights, medians of 5;
/// ratios, since the machine is shared):
///
///     cmake --preset bench && cmake --build --preset bench --target bench_packed
///     build/bench/benchmarks/bench_packed --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
///
///   (d, f)      m      f32/Eigen  bf16/f32  f32 of read bw  bf16 of read bw
///   512, 1376   1      1.18       1.70      0.97            0.85
///               4      1.92       1.68      0.81            0.73
///               16     1.69       1.51
///               128    1.14       1.10
///               1024   1.28       1.00
///   1024, 512   1      1.11       1.69      0.93            0.80
///               4      1.55       1.83      0.84            0.73
///               16     1.81       1.55
///               128    1.20       1.06
///               1024   1.22       1.01
///
/// Large m runs at 0.9–1.0 of the FMA peak in float and in widened bf16 alike,
/// so bf16 gains nothing there without a faster bf16 product (AMX here). At
/// m = 16 (d, f = 512, 1376) float takes ≈ 1.7× the larger of its compute and
/// bandwidth bounds, bf16 ≈ 1.25×: the first 12-row tile streams a panel from
/// memory, the remaining rows re-read it from L2 while memory idles.
///
/// Determinism. Single-threaded per call; the caller parallelises over experts
/// and row tiles. Each output row is a fixed sequence of operations on its own
/// input row, so the bits of a row do not depend on m, on the other rows, or on
/// how rows are split into calls. Float weights and widened bf16 give
/// identical bits on every path (scalar, AVX2, AVX-512), and widened bf16
/// equals float weights holding the bf16-rounded values.

#include <algorithm>

#include "../core/errors.hpp"
#include "isa.hpp"
#include "arch/avx512.hpp"
#include "arch/amx_bf16.hpp"
#include "epilogue.hpp"
#include "matrix_runs.hpp"
#include "packed_weights.hpp"

namespace apex::packed {

/// How bf16 weights are multiplied (float weights ignore this except that
/// `paired` is rejected for them).
enum class Bf16Products {
  automatic,  ///< widened: exact activations, the same bits on every path and CPU
  widened,    ///< weights widened to fp32, activations exact (every path)
  paired,     ///< bf16 pairs, activations rounded to bf16 (avx512_bf16: `vdpbf16ps`; amx_bf16: tiles)
};

struct ForwardOptions {
  Isa isa = kDefaultIsa;  ///< kernel path; ConfigError if the CPU lacks it
  Bf16Products bf16_products = Bf16Products::automatic;
};

namespace detail {
/// ConfigError unless the CPU runs `opt.isa` and `opt.bf16_products` is one
/// of its enumerators (another value would be read as `widened`).
inline void check_forward_options(const char* where, const ForwardOptions& opt) {
  require_isa(where, opt.isa);
  const Bf16Products p = opt.bf16_products;
  apex::detail::require_config(p == Bf16Products::automatic || p == Bf16Products::widened || p == Bf16Products::paired,
                               where, [&] {
                                 return "bf16_products must be automatic, widened or paired, got " +
                                        std::to_string(int(p));
                               });
}
}  // namespace detail

/// Rows per block of paired products on AMX tiles. The tiles multiply
/// ≈ 10× faster than the vector paths, so at 64 rows a block is bound by
/// streaming its weights from memory once per block; 256 rows (X and A in
/// bf16, 1.4 MiB at d = 2048, f = 768, still in L2) streams them a quarter
/// as often (one expert, 512 rows, on a Sapphire Rapids-class Xeon: 64 /
/// 128 / 256 / 512 rows gave 436–472 / 598–625 / 693–711 / 579–596
/// GFLOP/s at d = f = 2880).
inline constexpr Index kAmxRowBlock = 256;

namespace detail {

/// Per-thread scratch kept between calls (like core/workspace.hpp, 64-byte aligned).
struct Scratch {
  AlignedArray<float> a;   // rows × lda: A = SiLU(G) ⊙ U
  AlignedArray<bf16> xb;   // rows × ⌈d⌉₂ (amx_bf16: ⌈rows⌉₁₆ × ⌈d⌉₃₂ as tiles): X in bf16 (paired products)
  AlignedArray<bf16> ab;   // rows × ⌈f⌉₂ (amx_bf16: ⌈rows⌉₁₆ × ⌈f⌉₃₂ as tiles): A in bf16 (paired products)
};
inline Scratch& thread_scratch() {
  thread_local Scratch s;
  return s;
}

/// y (rows × d) for one block of rows; a: rows × lda scratch.
template <class Act>
void forward_block(Isa isa, const PackedExpert& e, const float* x, Index ldx, Index rows, float* a, Index lda,
                   float* y, Index ldy) {
  constexpr Index H = PackedExpert::kHiddenPerPanel, O = PackedExpert::kOutPerPanel;
  run_matrix<GatedEpilogue<Act>>(isa, e.gate_up(), x, ldx, rows, a, lda, H, e.d_ffn());
  run_matrix<PlainEpilogue>(isa, e.down(), a, lda, rows, y, ldy, O, e.d_model());
}

#if APEX_PACKED_X86
/// Rows of src (rows × n, stride lds) to bf16 rows of even length ld ≥ n,
/// the pad element zero so a pair never reads an unset value.
inline void rows_to_bf16(const float* src, Index lds, Index rows, Index n, bf16* dst, Index ld) {
  for (Index r = 0; r < rows; ++r) {
    to_bf16_n(src + r * lds, dst + r * ld, n, Isa::avx512);
    if (ld > n) dst[r * ld + n] = bf16{0};
  }
}

/// As forward_block with paired bf16 products: `vdpbf16ps` on avx512_bf16,
/// AMX tiles on amx_bf16 (kernels/arch/amx_bf16.hpp), whose scratch holds
/// X and A as activation tiles (rows_to_bf16_tiles).
template <class Act>
void forward_block_paired(Isa isa, const PackedExpert& e, const float* x, Index ldx, Index rows, float* a,
                          Index lda, Scratch& s, float* y, Index ldy) {
  const Index d = e.d_model(), f = e.d_ffn();
  constexpr Index H = PackedExpert::kHiddenPerPanel, O = PackedExpert::kOutPerPanel;
  if (isa == Isa::amx_bf16) {
    const Index rows_pad = (rows + kAmxRows - 1) / kAmxRows * kAmxRows;
    const Index cd = (d + kAmxDepth - 1) / kAmxDepth, cf = (f + kAmxDepth - 1) / kAmxDepth;
    bf16* xt = grow(s.xb, rows_pad * cd * kAmxDepth);  // X as tiles: ⌈rows⌉₁₆ × ⌈d⌉₃₂
    bf16* at = grow(s.ab, rows_pad * cf * kAmxDepth);  // A as tiles: ⌈rows⌉₁₆ × ⌈f⌉₃₂
    rows_to_bf16_tiles(x, ldx, rows, d, xt, cd);
    const AmxTiles tiles(amx_full_tiles());
    const PanelMatrix &gu = e.gate_up(), &dn = e.down();
    for (Index p = 0; p < gu.panels(); ++p) {  // then the next panel, or the first down panel
      const bool more = p + 1 < gu.panels();
      panel_amx<GatedEpilogue<Act>>(gu.bf16_panel(p), d, xt, cd, rows, a + p * H, lda, std::min(H, f - p * H),
                                    more ? gu.bf16_panel(p + 1) : dn.bf16_panel(0),
                                    more ? gu.panel_code_bytes() : dn.panel_code_bytes());
    }
    rows_to_bf16_tiles(a, lda, rows, f, at, cf);
    for (Index q = 0; q < dn.panels(); ++q)
      panel_amx<PlainEpilogue>(dn.bf16_panel(q), f, at, cf, rows, y + q * O, ldy, std::min(O, d - q * O),
                               q + 1 < dn.panels() ? dn.bf16_panel(q + 1) : nullptr, dn.panel_code_bytes());
    return;
  }
  const Index ldxb = d + (d & 1), ldab = f + (f & 1);
  bf16* xb = grow(s.xb, rows * ldxb);  // rows × ldxb
  bf16* ab = grow(s.ab, rows * ldab);  // rows × ldab
  rows_to_bf16(x, ldx, rows, d, xb, ldxb);
  for (Index p = 0; p < e.gate_up().panels(); ++p)
    panel_dot_avx512<GatedEpilogue<Act>>(e.gate_up().bf16_panel(p), d, xb, ldxb, rows, a + p * H, lda,
                                         std::min(H, f - p * H));
  rows_to_bf16(a, lda, rows, f, ab, ldab);
  for (Index q = 0; q < e.down().panels(); ++q)
    panel_dot_avx512<PlainEpilogue>(e.down().bf16_panel(q), f, ab, ldab, rows, y + q * O, ldy, std::min(O, d - q * O));
}
#endif

}  // namespace detail

/// y (m × d, row stride ldy) = expert(x (m × d, row stride ldx)), with the
/// gated activation Act (kernels/epilogue.hpp; SwiGLU's by default). x and y
/// must not overlap. ConfigError for m < 0, an unsupported path or `paired`
/// where it cannot run; ShapeError for a row stride below d.
template <class Act = SiluGate>
void forward(const PackedExpert& e, const float* x, Index ldx, Index m, float* y, Index ldy,
             const ForwardOptions& opt = {}) {
  constexpr const char* where = "packed::forward";
  const Index d = e.d_model(), f = e.d_ffn();
  apex::detail::require_config(m >= 0, where, [&] { return "row count m = " + std::to_string(m) + " is negative"; });
  if (ldx < d) apex::detail::check_shape(where, "x (row stride)", m, ldx, m, d);
  if (ldy < d) apex::detail::check_shape(where, "y (row stride)", m, ldy, m, d);
  detail::check_forward_options(where, opt);
  const bool is_bf16 = e.dtypes() == ExpertDtypes(Dtype::bf16);
  if (opt.bf16_products == Bf16Products::paired) {
    apex::detail::require_config(is_bf16, where, "bf16_products = paired needs bf16 weights");
    apex::detail::require_config(has_bf16_pairs(opt.isa), where, [&] {
      return std::string("bf16_products = paired needs path 'avx512_bf16' or 'amx_bf16', not '") +
             isa_name(opt.isa) + "'";
    });
  }
  if (m == 0) return;
  const bool paired = opt.bf16_products == Bf16Products::paired;  // validated above
  const Index block = m <= kSmallRows ? m : paired && opt.isa == Isa::amx_bf16 ? kAmxRowBlock : kRowBlock;
  const Index lda = (f + 15) / 16 * 16;  // A rows start on 64-byte boundaries
  detail::Scratch& s = detail::thread_scratch();
  float* a = detail::grow(s.a, apex::detail::checked_product(where, "scratch rows x d_ffn", {block, lda}));
  for (Index r0 = 0; r0 < m; r0 += block) {
    const Index rows = std::min(block, m - r0);
    const float* xr = x + r0 * ldx;
    float* yr = y + r0 * ldy;
#if APEX_PACKED_X86
    if (paired) {
      detail::forward_block_paired<Act>(opt.isa, e, xr, ldx, rows, a, lda, s, yr, ldy);
      continue;
    }
#endif
    (void)paired;
    detail::forward_block<Act>(opt.isa, e, xr, ldx, rows, a, lda, yr, ldy);
  }
}

/// Y = expert(X) for X: N × d (ShapeError otherwise) → N × d.
template <class Act = SiluGate>
Matrix<float> forward(const PackedExpert& e, const ConstMatrixRef<float>& x, const ForwardOptions& opt = {}) {
  apex::detail::check_shape("packed::forward", "x", x, apex::detail::kAny, e.d_model());
  Matrix<float> y(x.rows(), e.d_model());  // N × d
  forward<Act>(e, x.data(), x.outerStride(), x.rows(), y.data(), e.d_model(), opt);
  return y;
}

}  // namespace apex::packed
