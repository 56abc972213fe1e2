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
/// This is the portable unpacker, reading each code where
/// kernels/quant_layout.hpp puts it. The SIMD unpacker
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

/// Columns a chunk of the transposed product unpacks (one block of the
/// 32-weight formats, one sub-block of Q4_K).
inline constexpr Index kChunkColumns = 32;

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
/// reads, as f(first byte, byte count), for prefetching.
template <Dtype T, class F>
void chunk_bytes(const typename WeightType<T>::Element* codes, const std::byte* scales, Index chunk, F&& f) {
  using W = WeightType<T>;
  if constexpr (!W::kQuantized) {
    constexpr Index n = kPanelLanes * kChunkColumns;  // elements (bf16: 2 bytes a weight, in pairs)
    f(reinterpret_cast<const std::byte*>(codes + chunk * n), n * Index(sizeof(typename W::Element)));
  } else if constexpr (W::kBlockWeights == kChunkColumns) {
    f(W::slab(codes, chunk), kPanelLanes * W::kCodeBytes);
    f(W::area(scales, chunk), kPanelLanes * W::kScaleBytes);
  } else {  // a K-quant sub-block: its 4-bit codes (Q6_K: and 2-bit parts), the super-block's scales
    const Index b = chunk / 8, part = chunk % 8;
    f(W::slab(codes, b) + part * 16 * kPanelLanes, 16 * kPanelLanes);
    if constexpr (T == Dtype::q6_k) f(W::slab(codes, b) + W::kHighBits + part * 8 * kPanelLanes, 8 * kPanelLanes);
    f(W::area(scales, b), kPanelLanes * W::kScaleBytes);
  }
}

APEX_QUANT_FP_STRICT_BEGIN

/// The integer value of code k (< 32) of lane `lane` in a 32-weight block's
/// slab: Q8_0's q, Q4_0's q − 8, MXFP4's v2[q].
template <Dtype T>
int block32_value(const std::byte* slab, Index k, Index lane) {
  if constexpr (T == Dtype::q8_0) return std::int8_t(byte_at(slab, q8_byte(k, lane)));
  else if constexpr (T == Dtype::q4_0) return int(get_nibble(slab, k, lane)) - 8;
  else return quant::kMxfp4Values[get_nibble(slab, k, lane)];
}

/// The 32 lanes × 32 columns of block `chunk` of a Q8_0, Q4_0 or MXFP4 panel.
template <Dtype T>
void unpack_block32_scalar(const std::byte* codes, const std::byte* scales, Index chunk, float* dst) {
  APEX_QUANT_FP_STRICT_SCOPE
  using W = WeightType<T>;
  const std::byte* slab = W::slab(codes, chunk);
  const std::byte* area = W::area(scales, chunk);
  for (Index l = 0; l < kPanelLanes; ++l) {
    float s;
    if constexpr (T == Dtype::mxfp4) s = quant::e8m0_to_fp32_half(byte_at(area, l));
    else s = quant::fp16_to_fp32(get_u16(area, l));
    for (Index c = 0; c < kChunkColumns; ++c) dst[l * kChunkColumns + c] = float(block32_value<T>(slab, c, l)) * s;
  }
}

/// Sub-block chunk mod 8 of super-block chunk / 8 of a Q4_K panel.
inline void unpack_q4_k_scalar(const std::byte* codes, const std::byte* scales, Index chunk, float* dst) {
  APEX_QUANT_FP_STRICT_SCOPE
  using W = WeightType<Dtype::q4_k>;
  const Index b = chunk / 8, j = chunk % 8;
  const std::byte* slab = W::slab(codes, b);
  const std::byte* area = W::area(scales, b);
  for (Index l = 0; l < kPanelLanes; ++l) {
    std::uint8_t packed_scales[12], sc, m;
    for (Index i = 0; i < 12; ++i) packed_scales[i] = byte_at(area, W::kScalePlanes + i * kPanelLanes + l);
    quant::q4_k_scale_min(int(j), packed_scales, sc, m);
    const float d1 = quant::fp16_to_fp32(get_u16(area, l)) * float(sc);
    const float m1 = quant::fp16_to_fp32(get_u16(area + W::kDminPlane, l)) * float(m);
    for (Index c = 0; c < kChunkColumns; ++c)
      dst[l * kChunkColumns + c] = d1 * float(get_nibble(slab, 32 * j + c, l)) - m1;
  }
}

/// Groups 2h and 2h + 1 (h = chunk mod 8) of super-block chunk / 8 of a Q6_K panel.
inline void unpack_q6_k_scalar(const std::byte* codes, const std::byte* scales, Index chunk, float* dst) {
  APEX_QUANT_FP_STRICT_SCOPE
  using W = WeightType<Dtype::q6_k>;
  const Index b = chunk / 8, h = chunk % 8;
  const std::byte* area = W::area(scales, b);
  for (Index l = 0; l < kPanelLanes; ++l) {
    const float d = quant::fp16_to_fp32(get_u16(area, l));
    for (Index c = 0; c < kChunkColumns; ++c) {
      const Index k = 32 * h + c;  // within the super-block; group k / 16
      const float s = d * float(std::int8_t(byte_at(area, W::kScalePlanes + (k / 16) * kPanelLanes + l)));
      dst[l * kChunkColumns + c] = s * float(int(W::code(codes, b, k, l)) - 32);
    }
  }
}

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
  } else if constexpr (T == Dtype::q4_k) {
    unpack_q4_k_scalar(codes, scales, chunk, dst);
  } else if constexpr (T == Dtype::q6_k) {
    unpack_q6_k_scalar(codes, scales, chunk, dst);
  } else {
    unpack_block32_scalar<T>(codes, scales, chunk, dst);
  }
}

APEX_QUANT_FP_STRICT_END

}  // namespace detail
}  // namespace apex::packed
