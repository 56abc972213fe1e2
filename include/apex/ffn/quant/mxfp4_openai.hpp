#pragma once
/// \file quant/mxfp4_openai.hpp
/// OpenAI's MXFP4 layout, as gpt-oss checkpoints ship their experts
/// (Hugging Face `<name>_blocks` U8 [..., rows, K/32, 16] and `<name>_scales`
/// U8 [..., rows, K/32]), and ggml's `block_mxfp4`, converted into each other
/// without changing a weight.
///
///     OpenAI:  16 bytes per block, byte j = code(2j) | code(2j + 1) << 4; the E8M0 scale apart
///     ggml:    { e; qs[16] },      qs[j]  = code(j)  | code(j + 16) << 4
///
/// Both use the same E2M1 codes and the same biased exponent: OpenAI's value
/// is FP4[code]·2^(e − 127), ggml's kMxfp4Values[code]·2^(e − 128) with the
/// table doubled, the same number. Only the order of the nibbles differs. The
/// one difference in decoding: code 8 is −0 in OpenAI's table and 0 in
/// ggml's, equal as numbers and in every product's sum.

#include <cstdint>

#include "blocks.hpp"

namespace apex::quant {

/// ggml's block of the 32 weights an OpenAI block holds: `packed` its 16 code
/// bytes, `scale` its E8M0 exponent.
inline BlockMXFP4 mxfp4_from_openai(const std::uint8_t* packed, std::uint8_t scale) {
  std::uint8_t code[32];
  for (int j = 0; j < 16; ++j) {
    code[2 * j] = static_cast<std::uint8_t>(packed[j] & 0x0F);
    code[2 * j + 1] = static_cast<std::uint8_t>(packed[j] >> 4);
  }
  BlockMXFP4 b;
  b.e = scale;
  for (int j = 0; j < 16; ++j) b.qs[j] = static_cast<std::uint8_t>(code[j] | (code[j + 16] << 4));
  return b;
}

/// The inverse: OpenAI's 16 code bytes of a ggml block, and its scale.
inline void mxfp4_to_openai(const BlockMXFP4& b, std::uint8_t* packed, std::uint8_t& scale) {
  std::uint8_t code[32];
  for (int j = 0; j < 16; ++j) {
    code[j] = static_cast<std::uint8_t>(b.qs[j] & 0x0F);
    code[j + 16] = static_cast<std::uint8_t>(b.qs[j] >> 4);
  }
  for (int j = 0; j < 16; ++j) packed[j] = static_cast<std::uint8_t>(code[2 * j] | (code[2 * j + 1] << 4));
  scale = b.e;
}

}  // namespace apex::quant
