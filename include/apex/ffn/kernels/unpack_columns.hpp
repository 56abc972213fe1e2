#pragma once
/// \file kernels/unpack_columns.hpp
/// 32 columns of one panel as floats, lane by lane: what the transposed
/// product (kernels/transposed_product.hpp) multiplies. A panel stores each
/// lane's weights along K (kernels/packed_weights.hpp); the transposed
/// product reduces over the lanes, so it reads the panel 32 columns (k) at a
/// time, turned around:
///
///     dst[l·32 + c] = W(lane l, k = 32·chunk + c),   l, c < 32;  0 where k ≥ K
///
/// Chunk `chunk` is columns 32·chunk … 32·chunk + 31: for Q8_0, Q4_0 and
/// MXFP4 exactly block `chunk`; for Q4_K sub-block chunk mod 8 of
/// super-block chunk / 8 (its own scale and min); for Q6_K the groups of 16
/// 2·(chunk mod 8) and 2·(chunk mod 8) + 1 of that super-block; for f32,
/// bf16 and f16 any 32 columns, the last chunk partial when 32 ∤ K.
///
/// The values are PanelMatrix::unpack_row's, bit for bit: the stored float
/// widened, and for a block format ggml's dequantizer, whose steps are
/// separately rounded fp32 operations (quant/quantize_*.hpp, compiled with
/// fp-contract off, as this file is):
///
///   Q8_0   float(q)·d                  Q4_0   float(q − 8)·d
///   MXFP4  float(v2[q])·2^(e−128)      (v2: the doubled E2M1 values)
///   Q4_K   (d·float(sc_j))·float(q) − dmin·float(m_j)   (no fma: two roundings, then the difference)
///   Q6_K   (d·float(sc_g))·float(q − 32)
///
/// This is the portable unpacker: each block format's entry of the
/// weight-type table reads a chunk's codes where kernels/quant_layout.hpp
/// puts them and computes its factors (`chunk_codes`, `chunk_factors`,
/// kernels/quant_types.hpp); the products and Q4_K's difference are here,
/// under fp-contract off. The SIMD unpacker
/// (kernels/arch/avx2_unpack_columns.hpp) moves the same codes and applies
/// the same IEEE operations to the same operands, so every path writes the
/// same bytes (the tests compare them).

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "../quant/formats.hpp"
#include "quant_layout.hpp"
#include "weight_types.hpp"

namespace apex::packed {

/// Chunks of a reduction length K (the last one partial for a float type).
constexpr Index column_chunks(Index K) { return (K + kChunkColumns - 1) / kChunkColumns; }

namespace detail {

/// Each lane's factors of one chunk of a block format, as the SIMD
/// unpacker computes them for 8 lanes at once: w = float(q)·lo for
/// c < 16, float(q)·hi for c ≥ 16, minus `min` (Q4_K; zero otherwise).
struct ChunkFactors {
  alignas(64) float lo[kPanelLanes];
  alignas(64) float hi[kPanelLanes];
  alignas(64) float min[kPanelLanes];
};

/// The byte ranges of one panel's codes and scales that chunk `chunk`
/// reads, as f(first byte, byte count), for prefetching (a block format's
/// entry names its own: WeightType::chunk_bytes).
template <Dtype T, class F>
void chunk_bytes(const typename WeightType<T>::Element* codes, const std::byte* scales, Index chunk, F&& f) {
  using W = WeightType<T>;
  if constexpr (!W::kQuantized) {
    constexpr Index n = kPanelLanes * kChunkColumns;  // elements (bf16: 2 bytes a weight, in pairs)
    f(reinterpret_cast<const std::byte*>(codes + chunk * n), n * Index(sizeof(typename W::Element)));
  } else {
    W::chunk_bytes(codes, scales, chunk, f);
  }
}

APEX_QUANT_FP_STRICT_BEGIN

/// Chunk `chunk` of one panel of type T (codes, scales, reduction length K)
/// into dst (32 lanes × 32 floats, see the file comment; 64-byte aligned, as
/// the SIMD unpacker stores whole aligned vectors).
template <Dtype T>
void unpack_columns_scalar(const typename WeightType<T>::Element* codes, const std::byte* scales, Index K, Index chunk,
                           float* dst) {
  using W = WeightType<T>;
  if constexpr (!W::kQuantized) {
    const Index k0 = chunk * kChunkColumns, n = std::min(kChunkColumns, K - k0);
    for (Index l = 0; l < kPanelLanes; ++l)
      for (Index c = 0; c < kChunkColumns; ++c)
        dst[l * kChunkColumns + c] = c < n ? W::weight(codes, scales, k0 + c, l) : 0.0f;
  } else {  // the entry's codes and factors (WeightType::chunk_codes, chunk_factors)
    APEX_QUANT_FP_STRICT_SCOPE
    for (Index l = 0; l < kPanelLanes; ++l) {
      std::int8_t q[kChunkColumns];
      float lo, hi, min = 0.0f;
      W::chunk_codes(codes, chunk, l, q);
      W::chunk_factors(scales, chunk, l, lo, hi, min);
      for (Index c = 0; c < kChunkColumns; ++c) {
        float w = float(q[c]) * (c < kChunkColumns / 2 ? lo : hi);
        if constexpr (W::kChunkMin) w -= min;  // two roundings: fp-contract is off here
        dst[l * kChunkColumns + c] = w;
      }
    }
  }
}

APEX_QUANT_FP_STRICT_END

}  // namespace detail
}  // namespace apex::packed
