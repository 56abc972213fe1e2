#pragma once
/// \file inference/files/gguf/plan.hpp
/// What the GGUF MoE loaders (inference/files/gguf/load.hpp) check before they build
/// anything: the architecture (io/gguf_architectures.hpp), the layer
/// configuration from its metadata keys, every tensor's presence, type and
/// ggml shape, the storage types the experts go into, and memory. Also the
/// row decoder that widens any supported tensor type to float.
///
/// Storage of the file's types: F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q6_K and
/// MXFP4 experts are moved into packed panels of that type byte for byte
/// (kernels/weight_types.hpp has an entry for each). Gate and up share one packed panel
/// (kernels/packed_weights.hpp), so they must have one type; down may differ,
/// and the shared expert has its own pair.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "../../../core/errors.hpp"
#include "../../../core/types.hpp"
#include "../../../io/gguf.hpp"
#include "../../../io/gguf_architectures.hpp"
#include "../../../quant/formats.hpp"
#include "../../engine/packed_types.hpp"

namespace apex::detail::gguf_moe {

using gguf::TensorInfo;
using gguf::TensorType;

/// The packed type a GGUF tensor type goes into, or false for a type the
/// library has no storage for.
inline bool packed_type_of(TensorType t, packed::Dtype& out) {
  switch (t) {
    case TensorType::F32: out = packed::Dtype::f32; return true;
    case TensorType::F16: out = packed::Dtype::f16; return true;
    case TensorType::BF16: out = packed::Dtype::bf16; return true;
    case TensorType::Q8_0: out = packed::Dtype::q8_0; return true;
    case TensorType::Q4_0: out = packed::Dtype::q4_0; return true;
    case TensorType::Q4_K: out = packed::Dtype::q4_k; return true;
    case TensorType::Q6_K: out = packed::Dtype::q6_k; return true;
    case TensorType::MXFP4: out = packed::Dtype::mxfp4; return true;
    default: return false;
  }
}

/// The GGUF tensor type that stores packed type `t` (the writer's choice).
inline TensorType file_type_of(packed::Dtype t) {
  switch (t) {
    case packed::Dtype::f32: return TensorType::F32;
    case packed::Dtype::bf16: return TensorType::BF16;
    case packed::Dtype::f16: return TensorType::F16;
    case packed::Dtype::q8_0: return TensorType::Q8_0;
    case packed::Dtype::q4_0: return TensorType::Q4_0;
    case packed::Dtype::q4_k: return TensorType::Q4_K;
    case packed::Dtype::q6_k: return TensorType::Q6_K;
    case packed::Dtype::mxfp4: return TensorType::MXFP4;
  }
  throw ConfigError("gguf: packed type " + std::to_string(int(t)) + " has no GGUF tensor type");
}

/// "Q5_K (type 13)": a tensor type for messages.
inline std::string type_label(TensorType t) {
  return std::string(gguf::type_name(t)) + " (type " + std::to_string(unsigned(t)) + ")";
}

/// Widens `rows` rows of `cols` weights of type `t` at `src` (ggml row
/// layout, whole blocks) into rows × cols floats at `dst`, exactly as ggml's
/// dequantizers do. The caller checked the type is supported.
inline void decode_rows(TensorType t, const std::byte* src, Index rows, Index cols, float* dst) {
  const auto each_row = [&](std::size_t row_bytes, auto&& f) {
    for (Index r = 0; r < rows; ++r) f(src + std::size_t(r) * row_bytes, dst + r * cols);
  };
  const auto blocks = [&](auto block, auto dequant, Index per) {
    using B = decltype(block);
    const std::size_t row_bytes = std::size_t(cols / per) * sizeof(B);
    std::vector<B> tmp(std::size_t(cols / per));  // an aligned copy: mapped bytes may be unaligned for B
    each_row(row_bytes, [&](const std::byte* s, float* d) {
      std::memcpy(tmp.data(), s, row_bytes);
      dequant(tmp.data(), d, cols);
    });
  };
  switch (t) {
    case TensorType::F32:
      std::memcpy(dst, src, std::size_t(rows * cols) * 4);
      return;
    case TensorType::F16:
    case TensorType::BF16:
      each_row(std::size_t(cols) * 2, [&](const std::byte* s, float* d) {
        for (Index c = 0; c < cols; ++c) {
          std::uint16_t h;
          std::memcpy(&h, s + 2 * c, 2);
          d[c] = t == TensorType::F16 ? quant::fp16_to_fp32(h) : packed::bf16_bits_to_float(h);
        }
      });
      return;
    case TensorType::Q8_0: return blocks(quant::BlockQ8_0{}, quant::dequantize_row_q8_0, 32);
    case TensorType::Q4_0: return blocks(quant::BlockQ4_0{}, quant::dequantize_row_q4_0, 32);
    case TensorType::MXFP4: return blocks(quant::BlockMXFP4{}, quant::dequantize_row_mxfp4, 32);
    case TensorType::Q4_K: return blocks(quant::BlockQ4_K{}, quant::dequantize_row_q4_k, 256);
    case TensorType::Q6_K: return blocks(quant::BlockQ6_K{}, quant::dequantize_row_q6_k, 256);
    default: throw FormatError("gguf: tensor type " + type_label(t) + " cannot be decoded");
  }
}

/// One tensor of the layer: its info and the packed type it goes into.
struct Tensor {
  const TensorInfo* info = nullptr;
  packed::Dtype dtype = packed::Dtype::f32;
};

/// Everything a load needs, checked: the architecture, the configuration,
/// the tensors (shared and optional ones have info == nullptr when absent).
struct Plan {
  const gguf::Architecture* arch = nullptr;
  Index layer = 0;
  MoEConfig config;
  double rms_eps = 0;  ///< 0: the file has no `attention.layer_norm_rms_epsilon`
  Tensor router, gate, up, down, shared_gate_w, shared_up, shared_down, shared_gate, bias, norm;
  Tensor router_bias;          ///< `ffn_gate_inp.bias` (architecture.router_bias), else absent
  std::vector<Tensor> extras;  ///< the experts' float parts (the kind's Gguf::extra_tensors order)
  std::vector<std::string> extra_names;  ///< their parameter names under `experts.{e}.` (the same order)
  PackedTypes types = packed::Dtype::f32;
};

}  // namespace apex::detail::gguf_moe
