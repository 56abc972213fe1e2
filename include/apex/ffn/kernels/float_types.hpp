#pragma once
/// \file kernels/float_types.hpp
/// The f32, bf16 and f16 entries of the weight-type table
/// (kernels/weight_types.hpp): one weight per block, no scale, activations
/// multiplied in fp32.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "bf16_vectors.hpp"
#include "dtype.hpp"
#include "../core/errors.hpp"
#include "../core/scalar_range.hpp"
#include "../quant/half.hpp"

namespace apex::packed {

/// float weights: panel[k·32 + lane].
template <>
struct WeightType<Dtype::f32> {
  using Storage = float;  ///< the inference layers' `Storage` parameter
  using Element = float;  ///< what a panel's code array holds
  static constexpr const char* kName = "f32";
  static constexpr const char* kFileDtype = "F32";  ///< safetensors spelling of a tensor of this type
  static constexpr std::uint32_t kGgmlType = 0;     ///< GGUF spelling: ggml's type id …
  static constexpr const char* kGgmlName = "f32";  ///< … and name (as io/gguf/types.hpp has them)
  static constexpr Index kGroup = 1;
  static constexpr Index kBlockWeights = 1;
  static constexpr Index kBlockBytes = 4;
  static constexpr Index kScaleBytes = 0;
  static constexpr bool kQuantized = false;
  using Block = float;  ///< one weight of a file row

  static Index offset(Index k, Index lane) { return k * kPanelLanes + lane; }
  static float weight(const Element* panel, const std::byte*, Index k, Index lane) { return panel[offset(k, lane)]; }
  /// One lane's K weights from float (the padding stays zero).
  static void pack_row(const float* w, Index K, Index lane, Element* panel, std::byte*) {
    for (Index k = 0; k < K; ++k) panel[offset(k, lane)] = w[k];
  }
  /// Block b (= weight b) of a lane from and to a file row's bytes.
  static void put_block(const Block& v, Index b, Index lane, Element* panel, std::byte*) { panel[offset(b, lane)] = v; }
  static Block get_block(const Element* panel, const std::byte*, Index b, Index lane) { return panel[offset(b, lane)]; }
  /// A file element as float (a GGUF row decoded, kernels/weight_types.hpp)
  /// and a float as a file element (a float checkpoint's value stored).
  static float widen(Block v) { return v; }
  static Block narrow(float x) { return x; }
};

/// bf16 weights (round to nearest even, NaN kept): panel[(k/2)·64 +
/// lane·2 + k mod 2], the two k of a pair in one 32-bit lane. A finite
/// weight that rounds to ±Inf (|w| ≥ 3.3961775e+38, halfway past the largest
/// bf16) is a ValueError, as for f16: packing never turns a weight into
/// infinity.
template <>
struct WeightType<Dtype::bf16> {
  using Storage = bf16;
  using Element = bf16;
  static constexpr const char* kName = "bf16";
  static constexpr const char* kFileDtype = "BF16";
  static constexpr std::uint32_t kGgmlType = 30;      ///< GGUF spelling: ggml's type id …
  static constexpr const char* kGgmlName = "bf16";  ///< … and name (io/gguf/types.hpp)
  static constexpr Index kGroup = 2;
  static constexpr Index kBlockWeights = 1;
  static constexpr Index kBlockBytes = 2;
  static constexpr Index kScaleBytes = 0;
  static constexpr bool kQuantized = false;
  using Block = bf16;

  static Index offset(Index k, Index lane) { return (k >> 1) * 2 * kPanelLanes + lane * 2 + (k & 1); }
  static float weight(const Element* panel, const std::byte*, Index k, Index lane) {
    return to_float(panel[offset(k, lane)]);
  }
  static void pack_row(const float* w, Index K, Index lane, Element* panel, std::byte*) {
    for (Index k = 0; k < K; ++k) {
      const bf16 v = to_bf16(w[k]);
      if (std::isfinite(w[k]) && (v.bits & 0x7FFFu) == 0x7F80u)
        throw ValueError("packed bf16: weight " + apex::detail::number(w[k]) + " at k = " + std::to_string(k) +
                         " is beyond the bfloat16 range (|w| < 3.3961775e+38, halfway past the largest bf16); "
                         "store this matrix as f32");
      panel[offset(k, lane)] = v;
    }
  }
  static void put_block(const Block& v, Index b, Index lane, Element* panel, std::byte*) { panel[offset(b, lane)] = v; }
  static Block get_block(const Element* panel, const std::byte*, Index b, Index lane) { return panel[offset(b, lane)]; }
  static float widen(Block v) { return to_float(v); }
  static Block narrow(float x) { return to_bf16(x); }  ///< round to nearest even, no range check
};

/// One IEEE binary16 value, stored as its bit pattern: the element of f16
/// panels and the storage tag of `PackedMoE<packed::f16>`.
struct f16 {
  std::uint16_t bits;
};
static_assert(sizeof(f16) == 2, "f16 must be two bytes so arrays of it are raw F16 tensors");

/// IEEE binary16 weights: panel[k·32 + lane], widened exactly to fp32 for
/// the products (F16C `vcvtph2ps` on the SIMD paths). The form of F16 model
/// files (llama.cpp's `--outtype f16`): their rows move in unchanged. From
/// float, round to nearest even (quant/half.hpp, ggml's conversion); a
/// finite weight beyond the binary16 range (|w| ≥ 65520, which would become
/// ±Inf) is a ValueError, so packing never turns a weight into infinity.
template <>
struct WeightType<Dtype::f16> {
  using Storage = f16;
  using Element = f16;
  static constexpr const char* kName = "f16";
  static constexpr const char* kFileDtype = nullptr;  ///< held as U8 rows in the library's files
  static constexpr std::uint32_t kGgmlType = 1;      ///< GGUF spelling: ggml's type id …
  static constexpr const char* kGgmlName = "f16";  ///< … and name (io/gguf/types.hpp)
  static constexpr Index kGroup = 1;
  static constexpr Index kBlockWeights = 1;
  static constexpr Index kBlockBytes = 2;
  static constexpr Index kScaleBytes = 0;
  static constexpr bool kQuantized = false;
  using Block = f16;

  static Index offset(Index k, Index lane) { return k * kPanelLanes + lane; }
  static float weight(const Element* panel, const std::byte*, Index k, Index lane) {
    return quant::fp16_to_fp32(panel[offset(k, lane)].bits);
  }
  static void pack_row(const float* w, Index K, Index lane, Element* panel, std::byte*) {
    for (Index k = 0; k < K; ++k) {
      const std::uint16_t h = quant::fp32_to_fp16(w[k]);
      if (std::isfinite(w[k]) && (h & 0x7FFFu) == 0x7C00u)
        throw ValueError("packed f16: weight " + std::to_string(w[k]) + " at k = " + std::to_string(k) +
                         " is beyond the binary16 range (|w| < 65520); store this matrix as f32 or bf16");
      panel[offset(k, lane)] = f16{h};
    }
  }
  static void put_block(const Block& v, Index b, Index lane, Element* panel, std::byte*) { panel[offset(b, lane)] = v; }
  static Block get_block(const Element* panel, const std::byte*, Index b, Index lane) { return panel[offset(b, lane)]; }
  static float widen(Block v) { return quant::fp16_to_fp32(v.bits); }
  static Block narrow(float x) { return f16{quant::fp32_to_fp16(x)}; }  ///< no range check
};

}  // namespace apex::packed
