#pragma once
/// \file kernels/matrix_runs.hpp
/// One packed matrix times a block of rows, on a kernel path: which tiles
/// run a panel of each weight type on each path (the weight-type table's,
/// kernels/weight_types.hpp), and the loop over a matrix's panels that
/// quantizes the rows once for a block format. The fused expert
/// (kernels/fused_expert.hpp), the expert kinds' two-pass forwards and the
/// packed products (kernels/packed_products.hpp, dequantized_product.hpp,
/// transposed_product.hpp) all run their matrices through these.

#include <algorithm>

#include "isa.hpp"
#include "arch/avx2.hpp"
#include "arch/avx2_quant.hpp"
#include "arch/avx2_quant_k.hpp"
#include "arch/avx512.hpp"
#include "arch/avx512_quant.hpp"
#include "arch/avx512_quant_k.hpp"
#include "arch/avx512_vnni_quant.hpp"
#include "arch/amx_int8_quant.hpp"
#include "arch/scalar.hpp"
#include "epilogue.hpp"
#include "panel_matrix.hpp"
#include "quant_activations.hpp"
#include "weight_types.hpp"

namespace apex::packed {

/// Row count at or below which a call is one block (decode regime: every
/// panel is read from memory once for all rows).
inline constexpr Index kSmallRows = 32;
/// Rows per block in the many-row regime: X (64 × d) and A (64 × f) of a
/// block stay in L2 while the panels stream.
inline constexpr Index kRowBlock = 64;

namespace detail {

/// One panel (codes w, scales) on path `isa`: the tiles the table has for
/// (T, isa), the portable kernel on the scalar path. avx512_vnni and
/// avx512_bf16 run the avx512 tiles (they differ only for block formats and
/// paired bf16 products).
template <Dtype T, class Epi>
void run_panel(Isa isa, const typename WeightType<T>::Element* w, const std::byte* scales, Index K, const float* x,
               Index ldx, Index rows, float* out, Index ldo, Index ncols) {
#if APEX_PACKED_X86
  if (is_avx512(isa)) return panel_avx512<T, Epi>(w, scales, K, x, ldx, rows, out, ldo, ncols);
  if (isa == Isa::avx2) return panel_avx2<T, Epi>(w, scales, K, x, ldx, rows, out, ldo, ncols);
#endif
  panel_scalar<T, Epi>(w, scales, K, x, ldx, rows, out, ldo, ncols);
}

/// Panel p of pm (of type T) on path `isa`.
template <Dtype T, class Epi>
void run_panel(Isa isa, const PanelMatrix& pm, Index p, const float* x, Index ldx, Index rows, float* out, Index ldo,
               Index ncols) {
  run_panel<T, Epi>(isa, pm.panel<T>(p), pm.scales(p), pm.k(), x, ldx, rows, out, ldo, ncols);
}

/// One block-format panel against quantized rows: the type's
/// Tiles<T, Isa::avx512_vnni> on avx512_vnni and avx512_bf16
/// (kernels/arch/avx512_vnni_quant.hpp), Tiles<T, Isa::avx512> on avx512
/// (arch/avx512_quant*.hpp), Tiles<T, Isa::avx2> on avx2
/// (arch/avx2_quant*.hpp), the entry's dot_block on scalar. A type without
/// one of them does not compile (weight_types.hpp: TilesOn).
template <Dtype T, class Epi>
void run_quant_panel(Isa isa, const PanelMatrix& pm, Index p, const QuantRows& x, Index rows, float* out, Index ldo,
                     Index ncols) {
#if APEX_PACKED_X86
  const std::byte* codes = pm.panel<T>(p);
  if (has_vnni(isa))
    return quant_panel_512<QuantTilesVnni, T, Epi>(codes, pm.scales(p), pm.k(), x, rows, out, ldo, ncols);
  if (isa == Isa::avx512)
    return quant_panel_512<QuantTilesAvx512, T, Epi>(codes, pm.scales(p), pm.k(), x, rows, out, ldo, ncols);
  if (isa == Isa::avx2) return quant_panel_avx2<T, Epi>(codes, pm.scales(p), pm.k(), x, rows, out, ldo, ncols);
#endif
  (void)isa;
  quant_panel_scalar<T, Epi>(pm.panel<T>(p), pm.scales(p), pm.k(), x, rows, out, ldo, ncols);
}

/// Whether a block of `rows` rows of block format T runs on the AMX-INT8
/// tiles (kernels/arch/amx_int8_quant.hpp): path amx_bf16 on a CPU with
/// AMX-INT8, Q8_0 from 8 rows, Q4_0 and MXFP4 from 16 (they unpack a panel
/// first). Below that the VNNI tiles, which compute only the rows there are,
/// win. The bits are the VNNI tiles', so the choice is speed alone
/// (bench_inference --isa=amx_bf16 at N = 16 and 128, 8 against 16 rows:
/// Q8_0 1.08–1.11× at N = 128, the 4-bit types 0.93–0.97×).
template <Dtype T>
bool amx_int8_rows(Isa isa, Index rows) {
#if APEX_PACKED_X86
  if constexpr (has_amx_int8_tiles_v<T>)
    return isa == Isa::amx_bf16 && rows >= (T == Dtype::q8_0 ? 8 : kAmxQuantRows) && amx_int8_present();
#endif
  (void)isa, (void)rows;
  return false;
}

/// out = epilogue(x (rows × K) · pm) over every panel of pm: panel p writes
/// columns [p·step, p·step + min(step, n − p·step)) of out. Block formats
/// quantize x once for all panels (kernels/quant_activations.hpp).
template <class Epi>
void run_matrix(Isa isa, const PanelMatrix& pm, const float* x, Index ldx, Index rows, float* out, Index ldo,
                Index step, Index n) {
  visit_dtype(pm.dtype(), [&](auto tag) {
    constexpr Dtype T = decltype(tag)::value;
    using W = WeightType<T>;
    if constexpr (W::kQuantized) {
      const bool tiles = amx_int8_rows<T>(isa, rows);
      const QuantRows xq = quantize_rows(isa, W::kActivation, x, ldx, rows, pm.k(), tiles ? kAmxQuantRows : 1);
#if APEX_PACKED_X86
      if constexpr (has_amx_int8_tiles_v<T>)
        if (tiles) {
          const AmxTiles state(amx_int8_block_tiles());
          for (Index p = 0; p < pm.panels(); ++p)
            quant_panel_amx<T, Epi>(pm.panel<T>(p), pm.scales(p), pm.k(), xq, rows, out + p * step, ldo,
                                    std::min(step, n - p * step), p + 1 < pm.panels() ? pm.panel<T>(p + 1) : nullptr,
                                    pm.panel_code_bytes());
          return;
        }
#endif
      for (Index p = 0; p < pm.panels(); ++p)
        run_quant_panel<T, Epi>(isa, pm, p, xq, rows, out + p * step, ldo, std::min(step, n - p * step));
    } else {
      for (Index p = 0; p < pm.panels(); ++p)
        run_panel<T, Epi>(isa, pm, p, x, ldx, rows, out + p * step, ldo, std::min(step, n - p * step));
    }
  });
}

}  // namespace detail

}  // namespace apex::packed
