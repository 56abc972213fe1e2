#pragma once
// Lane rows of the block formats in their file form (the blocks of a GGUF
// row), for the kernel tests that move them into a PanelMatrix: random codes
// with every code value present, scales drawn from the ordinary or (with
// `extreme`) from the edges of fp16 and E8M0 that still give finite values.
#include <apex/ffn/kernels/weight_types.hpp>
#include <apex/ffn/quant/formats.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <random>
#include <vector>

namespace apex::test {

using packed::Dtype;
using packed::WeightType;

/// fp16 scales: `extreme` draws from zero, ±0, subnormals, the largest
/// half, infinities and NaNs as well as ordinary values; otherwise an
/// ordinary value of magnitude 2^-10 … 2^-2.
inline std::uint16_t half_scale(std::mt19937& rng, bool extreme) {
  static const std::uint16_t special[] = {0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x3C00,
                                          0xBC00, 0x7BFF, 0xFBFF, 0x7C00, 0xFC00, 0x7E00, 0x7D01};
  if (extreme && rng() % 2) return special[rng() % std::size(special)];
  const unsigned exponent = extreme ? rng() % 31 : 5 + rng() % 9;
  return std::uint16_t((rng() % 2) << 15 | exponent << 10 | (rng() & 0x3FF));
}

/// The library holds finite weights only (PanelMatrix::put_row refuses a
/// block whose values would not be: WeightType::scale_problem): a drawn
/// fp16 scale of ±Inf or NaN becomes the largest finite half of its sign,
/// an MXFP4 exponent too large for the block's codes the largest that fits.
template <Dtype T, class Block>
void keep_finite(Block& blk) {
  using W = WeightType<T>;
  const auto finite = [](std::uint16_t& h) {
    if ((h & 0x7C00) == 0x7C00) h = std::uint16_t((h & 0x8000) | 0x7BFF);
  };
  if constexpr (T == Dtype::mxfp4) {
    while (!W::scale_problem(blk).empty()) --blk.e;
  } else {
    finite(blk.d);
    if constexpr (T == Dtype::q4_k) finite(blk.dmin);
  }
}

/// Lane row (file form: the blocks of a GGUF row) `seed` of a block format:
/// random codes with every code value present (Q8_0's −128 and 127 in
/// each block, all 16 nibbles in each 4-bit block), scales by half_scale,
/// MXFP4 exponents cycling through all 256 across rows and blocks (or 118 … 129;
/// the largest lowered by keep_finite), Q4_K sub-block scales and mins and Q6_K group scales
/// cycling through all their values.
template <Dtype T>
std::vector<std::byte> block_row(Index K, unsigned seed, bool extreme) {
  using W = WeightType<T>;
  using Block = typename W::Block;
  std::mt19937 rng(seed);
  const auto byte = [&] { return std::uint8_t(rng()); };
  std::vector<Block> blocks(std::size_t(K / W::kBlockWeights));
  for (std::size_t b = 0; b < blocks.size(); ++b) {
    Block& blk = blocks[b];
    const unsigned cycle = seed * 8 + unsigned(b);
    if constexpr (T == Dtype::q8_0) {
      for (auto& q : blk.qs) q = std::int8_t(byte());
      blk.qs[rng() % 32] = -128;
      blk.qs[rng() % 16] = 127;
      blk.d = half_scale(rng, extreme);
    } else if constexpr (T == Dtype::q4_0 || T == Dtype::mxfp4) {
      const unsigned shift = rng() % 16;
      for (unsigned j = 0; j < 16; ++j) blk.qs[j] = std::uint8_t(((j + shift) % 16) | (byte() & 0xF0));
      if constexpr (T == Dtype::q4_0) blk.d = half_scale(rng, extreme);
      else blk.e = std::uint8_t(extreme ? cycle * 37 % 256 : 118 + rng() % 12);
    } else if constexpr (T == Dtype::q4_k) {
      for (auto& q : blk.qs) q = byte();
      for (int j = 0; j < 8; ++j)
        quant::detail::q4_k_pack_scale_min(j, std::uint8_t((cycle * 8 + unsigned(j)) % 64),
                                           std::uint8_t((cycle * 8 + unsigned(j) * 5 + 3) % 64), blk.scales);
      blk.d = half_scale(rng, extreme);
      blk.dmin = half_scale(rng, extreme);
    } else {
      for (auto& q : blk.ql) q = byte();
      for (auto& q : blk.qh) q = byte();
      for (int g = 0; g < 16; ++g) blk.scales[g] = std::int8_t(std::uint8_t(cycle * 16 + unsigned(g) * 3));
      blk.d = half_scale(rng, extreme);
    }
  }
  for (auto& blk : blocks) keep_finite<T>(blk);
  std::vector<std::byte> out(blocks.size() * sizeof(Block));
  std::memcpy(out.data(), blocks.data(), out.size());
  return out;
}

}  // namespace apex::test
