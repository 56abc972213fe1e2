// ggml's quantized block formats (quant/formats.hpp) against fixed vectors
// from ggml's own reference code: ggml/src/ggml-quants.c
// (quantize_row_*_ref, dequantize_row_*) and ggml-impl.h, compiled as C
// without FMA and run on the rows `row_value` defines. For each format and
// row the vectors hold the 64-bit FNV-1a hash of the quantized bytes, of the
// dequantized floats' bits, and whether quantizing the dequantized row
// gives the same bytes again; a few blocks are kept whole, so a failure
// shows which bytes differ. See docs/quantized_formats.md.
#include <apex/ffn/quant/formats.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

using namespace apex;
using namespace apex::quant;

namespace {

constexpr int kRowLen = 512;  // 16 blocks of 32, 2 super-blocks of 256
constexpr int kFixedRows = 10;

std::uint32_t mix32(std::uint32_t i, std::uint32_t row) {
  std::uint32_t z = i * 0x9E3779B9u + row * 0x85EBCA6Bu + 0x165667B1u;
  z ^= z >> 16;
  z *= 0x7FEB352Du;
  z ^= z >> 15;
  z *= 0x846CA68Bu;
  z ^= z >> 16;
  return z;
}

// Uniform in [-1, 1] in steps of 1e-4, from integers and one exactly rounded
// division, so the C reference and this file see the same floats.
float unit(int i, int row) {
  return static_cast<float>(static_cast<int>(mix32(static_cast<std::uint32_t>(i), static_cast<std::uint32_t>(row)) %
                                             20001u) -
                            10000) /
         10000.0f;
}

// The test rows. 0: scale doubling per block of 32 (0.125..2); 1: row 0 with
// a zero first block and a zero second super-block; 2: small noise with one
// large positive and one larger negative outlier; 3: the largest magnitude
// negative in every group of 16; 4: ±127 anchors and k + 0.5 values (ties
// for Q8_0 and Q8_K, whose steps are then exactly 1); 5: a −8 anchor and
// k + 0.5, 5, −7 (ties for Q4_0 and MXFP4 at step 1); 6: sub-blocks of very
// different scale, all-positive, constant and all-negative sub-blocks (the
// K-quants' searches); 7: a smooth cubic; 8: tiny values (half scales
// underflow); 9: huge values (Q8_0/Q4_0 scales overflow to Inf).
float row_value(int row, int i) {
  const float u = unit(i, row);
  const int b = i / 32;
  switch (row) {
    case 0: return u * (static_cast<float>(1 << (b % 5)) / 8.0f);
    case 1: return (i < 32 || i >= 256) ? 0.0f : u * (static_cast<float>(1 << (b % 5)) / 8.0f);
    case 2: return i == 77 ? 100.0f : i == 300 ? -250.0f : u * 0.01f;
    case 3: return i % 16 == 5 ? -(1.0f + static_cast<float>(i / 16) / 32.0f) : u * 0.5f;
    case 4:
      return i % 32 == 0 ? ((b % 2) ? -127.0f : 127.0f)
                         : static_cast<float>(static_cast<int>(mix32(static_cast<std::uint32_t>(i), 4u) % 254u) - 127) +
                               0.5f;
    case 5: {
      const int j = i % 32;
      if (j == 0) return -8.0f;
      if (j == 1) return 5.0f;
      if (j == 2) return -7.0f;
      return static_cast<float>(static_cast<int>(mix32(static_cast<std::uint32_t>(i), 5u) % 16u) - 8) + 0.5f;
    }
    case 6: {
      static const float s[8] = {1e-3f, 0.5f, 3.0f, 0.02f, 40.0f, 1.0f, 7.0f, 0.25f};
      const int k = b % 8;
      if (k == 2) return (std::fabs(u) + 0.5f) * s[k];
      if (k == 5) return 0.75f;
      if (k == 7) return -(std::fabs(u) + 0.1f) * s[k];
      if (k == 1 && i % 32 >= 16) return u * s[k] * 0.1f;
      return u * s[k];
    }
    case 7: {
      const float t = static_cast<float>(i % 64) / 32.0f - 1.0f;
      return t - t * t * t / 3.0f;
    }
    case 8: return u * 1e-6f;
    default: return i % 97 == 0 ? 1e7f : u * 3e6f;
  }
}

std::vector<float> test_row(int row) {
  std::vector<float> x(kRowLen);
  for (int i = 0; i < kRowLen; ++i) x[static_cast<std::size_t>(i)] = row_value(row, i);
  return x;
}

std::uint64_t fnv1a(const void* p, std::size_t n) {
  const auto* c = static_cast<const unsigned char*>(p);
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (std::size_t i = 0; i < n; ++i) {
    h ^= c[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

std::string to_hex(const void* p, std::size_t n) {
  static const char digits[] = "0123456789abcdef";
  const auto* c = static_cast<const unsigned char*>(p);
  std::string s;
  for (std::size_t i = 0; i < n; ++i) {
    s += digits[c[i] >> 4];
    s += digits[c[i] & 15];
  }
  return s;
}

std::uint32_t bits_of(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

float float_of(std::uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

struct RowHashes {
  int row;
  std::uint64_t quantized, dequantized;
  bool requantize_same;  // quantize(dequantize(q)) == q in the reference
};

struct FullBlock {
  int row, block;
  const char* hex;
};

// Reference hashes per row (ggml quantize_row_*_ref / dequantize_row_*).
const RowHashes kQ80Rows[] = {
    {0, 0x176e6e8c79c38042ull, 0xea69f70761d0de8cull, true},
    {1, 0xbcd7d9e1f59fe13dull, 0x274280c5c5916af2ull, true},
    {2, 0xcfed475ab9b22caeull, 0x56893f7a418ea256ull, true},
    {3, 0x3fe5f84ea1d0404aull, 0xfa4a4c31ac0a9ffcull, true},
    {4, 0x21496b74d8c46feeull, 0xdc9c3bd18a1ad49dull, true},
    {5, 0x1e05477e66310864ull, 0xbebe962523b3d7deull, true},
    {6, 0xd78a86ac02e3a4d3ull, 0x027f75b048b2235cull, true},
    {7, 0x621e0cb14300f265ull, 0x560e4a9255b3cf85ull, true},
    {8, 0x0ebe0d03e66e61c1ull, 0xe52ffed3687b0125ull, false},
    {9, 0xdaaa89b259c2c421ull, 0xbabef0d33d75612eull, false},
};
const RowHashes kQ40Rows[] = {
    {0, 0x9fabfe8069586149ull, 0x34b0f245f69abc84ull, true},
    {1, 0xe5f9e11e605f7dbdull, 0x2a47b34beee000d4ull, true},
    {2, 0xa9586c3469f5dfa9ull, 0xdb0717f1c8c34759ull, true},
    {3, 0x2511ba7de082146dull, 0xba4648218382f61dull, true},
    {4, 0x85c38e90001818d7ull, 0x1a178de68734ed69ull, true},
    {5, 0xbe4eeccd09e086d7ull, 0x7cf18a4bbbe55638ull, true},
    {6, 0xb8fcf6fcd8ccfda8ull, 0x41bfd73155868a8eull, true},
    {7, 0xfe352028c448e525ull, 0x777bc06696574235ull, true},
    {8, 0x7446c28408e6c248ull, 0x156faa91324231c9ull, true},
    {9, 0x5db38b90c6dd27d0ull, 0x5c7141c9ff6314e5ull, false},
};
const RowHashes kMXFP4Rows[] = {
    {0, 0xd18711d8ed9c2b94ull, 0x1a03080eecf28e38ull, true},
    {1, 0xd77f409289ab7e36ull, 0xfe0a28918d83cb2cull, true},
    {2, 0x68c6946c031d3b31ull, 0xab325eb7c0682177ull, true},
    {3, 0x2721147f623aab14ull, 0xd28281bea5213a68ull, true},
    {4, 0x5b6c1d0a405bac44ull, 0xaa94c03368295f62ull, true},
    {5, 0xc501d40770b7be14ull, 0xcce5d2d7c45a0e8bull, true},
    {6, 0xb1d9643a30c2e470ull, 0x42180a1ed5e3b726ull, true},
    {7, 0x7351027e42062cb5ull, 0x619d2364a9afc525ull, true},
    {8, 0x775d9e1d2198982cull, 0xf614cfdfc765b875ull, true},
    {9, 0x6199d97e0d25cd28ull, 0x87a81ee5899dee02ull, true},
};
const RowHashes kQ4KRows[] = {
    {0, 0x1620278ff5d2fcb1ull, 0x22bf3a03d0c49352ull, false},
    {1, 0x7f247825e8d57b64ull, 0xa0c96f9ede3a8faaull, true},
    {2, 0x40f1b99876c0dcf5ull, 0x6489e6340d42e2d8ull, false},
    {3, 0x616b308ef2e65816ull, 0xd8000c17308a04c0ull, true},
    {4, 0x1b0a3f9d5d4770c4ull, 0x2622d5daf1142a82ull, true},
    {5, 0xa42d103eed5e6e2eull, 0x637049c36c9a9929ull, true},
    {6, 0x2dcbfb44469ccadcull, 0xa3fc3b4e5d74bfa3ull, false},
    {7, 0x68613470681d8d85ull, 0x4f623e4968dd01d5ull, true},
    {8, 0xf935656b4d7d26d1ull, 0x28c31cf8df2ec325ull, false},
    {9, 0xa5d72db57fb5a339ull, 0xc57b6aa71c08e0aeull, true},
};
const RowHashes kQ6KRows[] = {
    {0, 0x33e42dd2333cc24full, 0x81b63e61c560f9a8ull, false},
    {1, 0xae15c53460a348cbull, 0x712dcdd9ae7b3cdaull, false},
    {2, 0xbb0659c7a161ebc7ull, 0x6b44012a8ebfe953ull, false},
    {3, 0x61c92eec0d178855ull, 0xa783c48921ca36c7ull, true},
    {4, 0x864504e0112c4287ull, 0x8728df1cf41e04a3ull, false},
    {5, 0xad57a1c9ff7f14e5ull, 0x9ded7a14625eccf8ull, true},
    {6, 0xba6fcf65a2ec29a6ull, 0xdf9c16082bff1fe0ull, false},
    {7, 0x6fa4bd91f8af6a05ull, 0xd152e94426afff95ull, true},
    {8, 0xdb70de9424b9ede4ull, 0xfc5e0637b4dc2ca5ull, false},
    {9, 0x710d73b9f045428aull, 0x0a5692835829e6beull, true},
};
const RowHashes kQ8KRows[] = {
    {0, 0x61c75ee36e57ec61ull, 0x25807e6d8ad4fcd8ull, true},
    {1, 0xbd7a952092158729ull, 0xf464c658d074cf89ull, true},
    {2, 0xa6a0eff98ccffc50ull, 0x7e4ddf1bf1f80925ull, true},
    {3, 0x61b129ed946b0e3aull, 0x5aa216202d19abfcull, true},
    {4, 0x46058cd972cee9e2ull, 0x55cbb1d06e3f08b8ull, true},
    {5, 0x221b125835e0d41eull, 0x4339a4dfa16fc646ull, true},
    {6, 0x3dfc1f45a60b949aull, 0x3070376680610210ull, true},
    {7, 0x2dc0a99dbafa495dull, 0x4597d17a33c82665ull, true},
    {8, 0x8e1eeab1b5c4b5b1ull, 0x9a3ea69bcd496ce8ull, true},
    {9, 0xceec930c21d568c1ull, 0xeeea5bdaf39a9e87ull, true},
};

const FullBlock kQ80Blocks[] = {
    {4, 0,
     "003c7f2cb501235c546920d8492a285b358b21616585ca853db2a407d1ddce57cc43"},
    {2, 2,
     "4d3a000000000000000000000000007f000000000000000000000000000000000000"},
};
const FullBlock kQ40Blocks[] = {
    {5, 0,
     "003c203d916f92993a88657d73ee787f2a79"},
    {3, 0,
     "2030865b7955690075ca98c7a574a775b9b4"},
};
const FullBlock kMXFP4Blocks[] = {
    {5, 0,
     "80ded40da50d00d100ab949d559096d190"},
    {8, 0,
     "69ced43e43ca5aad5c4c6a334914ada3eb"},
};
const FullBlock kQ4KBlocks[] = {
    {6, 0,
     "2c2d6438c0010400c0010000ff01cb004c737ea0d41b3c72b38e67464081c5107a7f76756f72667f73777b6e70667266"
     "8b87d6f7299af8b888d8151d97799786cebbbdadc52a35053645cc3dede6cc8c969093969c929c9e999c959d9e939291"
     "939b9698929c909a939a9d97909c95932ecc1cc133204f3ab4bdb300631fecfd71bec56dc7a10b6251ac5ec22ad04fd3"},
    {0, 1,
     "111c08285d7cc4071b7fc407f1ef2f44ecd94301c8caed42af6ca25879aecd7a5df0beb6989967bae0e97f71b77306f3"
     "3317c113de46d0bfc95c855de9f48fea9f9a35410bb244c5acd9675b4798f8de22992c2d4c0eae16c0cc7659a1f6d9a2"
     "8ac6ad02994ae460f762741bd36cdda1977e6cad683c74d2916b46a9b5b0502839d5f502a8d48e7295fc8beda897e8e3"},
};
const FullBlock kQ6KBlocks[] = {
    {6, 0,
     "640d1d03b28ee4ebecce5e1af0a7f5200460131753845543304151162c2553330ce0a111759a0230de9cb4cb9c2ca9ea"
     "29d4d09c0ea1d018e61f0fcf7b8b1f0b72dfdfb33ac50952d68a47f61011d589ef439c973bc9229edfdf4b9240f70930"
     "557545858565a58555656525c545b5d5e56585c5854525c5b545b585559595a58b581b14c14e0f484007d9c94884415c"
     "c5848e8ad00f121c1756cd00cbd2cf820243027230330010614072303003434330436102607310323042037210730171"
     "0000fe00f1f10000807dfdfde8ea0101ad20"},
    {2, 1,
     "f545f5502b04accaee270e902e1c978c2aaceeff02f3064cbfa594178000cae74090803010f000d0a0d0101051901000"
     "6c1d458b7d80a041baaa32296cdaddcac0445cb04507107facb172c5aec48209f76b33ecd172201f40825a8e07577451"
     "ef86435ae5216db7e2c7530f20007259bf931b3ea2ca33578de06087a4c9e9b199293a39094928691b5a5958b2b95b5a"
     "0c13a8d760361e6203499aa4a44d23976a6b9a5b9d5224f54e893b75392784453e35237c7f9076ce789e67ed7893cd00"
     "0000800000000000000000000000000008ac"},
};
const FullBlock kQ8KBlocks[] = {
    {4, 0,
     "000080bf81d44a00dea4ac98e028b8d6d8a6cc74e0a09c7a367ac44e5cfa2e2232aa34be7f825e8c8ad02eaade441cfc"
     "82520c26166e1ee0ea7a5c0a7c607e1268dc089a81685a668cc0880afcc604a85c2ce68cee42b63ce6ba6e364e72be4e"
     "d20e12cc7fd620eac2f026864c342c8e26c4dc9602f0849e040e4250b2e01886c08c089881ec02362a76069850ce9652"
     "7ae2c44452b0be3ee0c2a4c07e7a120eaae04e887fd8f21c960482b4ce5a2af02cc696e046cadc788a083cde488ceeb6"
     "fcd26ce8810c6858aa72a474069eae9082aac41a3282de2cd6aa44b6c03aa49ea01ee8687fa496ce48061ee8daf85a48"
     "9ed6be3ab434f4205c3254905a38a6a80cacb6b4b9fdcc005dff9e02effef00053ffd4fd4d007cffdffeaaff6dfe82fe"
     "bbff70ff"},
    {2, 1,
     "eff7fb3f0000000000000000000000000000000000000000000000000000000000000000000000000000000000000000"
     "810000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000"
     "000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000"
     "000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000"
     "000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000"
     "00000000000000000000000000000000000000000000000081ff00000000000000000000000000000000000000000000"
     "00000000"},
};

// Runs one format over every test row against the reference's hashes and
// whole blocks. The output buffers start zeroed, as the reference's did.
template <class Block, class Quantize, class Dequantize, std::size_t R, std::size_t B>
void check_format(Index block_len, Quantize quantize, Dequantize dequantize, const RowHashes (&rows)[R],
                  const FullBlock (&blocks)[B]) {
  REQUIRE(R == kFixedRows);
  const auto nb = static_cast<std::size_t>(kRowLen / block_len);
  for (const RowHashes& want : rows) {
    INFO("row " << want.row);
    const std::vector<float> x = test_row(want.row);
    std::vector<Block> q(nb), q2(nb);
    std::memset(q.data(), 0, nb * sizeof(Block));
    std::memset(q2.data(), 0, nb * sizeof(Block));
    quantize(x.data(), q.data(), Index{kRowLen});
    CHECK(fnv1a(q.data(), nb * sizeof(Block)) == want.quantized);
    std::vector<float> y(kRowLen);
    dequantize(q.data(), y.data(), Index{kRowLen});
    CHECK(fnv1a(y.data(), y.size() * sizeof(float)) == want.dequantized);
    quantize(y.data(), q2.data(), Index{kRowLen});
    CHECK((std::memcmp(q.data(), q2.data(), nb * sizeof(Block)) == 0) == want.requantize_same);
    for (const FullBlock& full : blocks) {
      if (full.row != want.row) continue;
      INFO("block " << full.block);
      CHECK(to_hex(&q[static_cast<std::size_t>(full.block)], sizeof(Block)) == full.hex);
    }
  }
}

}  // namespace

TEST_CASE("Q8_0 matches ggml's reference bytes and dequantized floats", "[quant][q8_0]") {
  check_format<BlockQ8_0>(kQK, quantize_row_q8_0, dequantize_row_q8_0, kQ80Rows, kQ80Blocks);
}

TEST_CASE("Q4_0 matches ggml's reference bytes and dequantized floats", "[quant][q4_0]") {
  check_format<BlockQ4_0>(kQK, quantize_row_q4_0, dequantize_row_q4_0, kQ40Rows, kQ40Blocks);
}

TEST_CASE("MXFP4 matches ggml's reference bytes and dequantized floats", "[quant][mxfp4]") {
  check_format<BlockMXFP4>(kQK, quantize_row_mxfp4, dequantize_row_mxfp4, kMXFP4Rows, kMXFP4Blocks);
}

TEST_CASE("Q4_K matches ggml's reference bytes and dequantized floats", "[quant][q4_k]") {
  check_format<BlockQ4_K>(kQKK, quantize_row_q4_k, dequantize_row_q4_k, kQ4KRows, kQ4KBlocks);
}

TEST_CASE("Q6_K matches ggml's reference bytes and dequantized floats", "[quant][q6_k]") {
  check_format<BlockQ6_K>(kQKK, quantize_row_q6_k, dequantize_row_q6_k, kQ6KRows, kQ6KBlocks);
}

TEST_CASE("Q8_K matches ggml's reference bytes and dequantized floats", "[quant][q8_k]") {
  check_format<BlockQ8_K>(kQKK, quantize_row_q8_k, dequantize_row_q8_k, kQ8KRows, kQ8KBlocks);
}

TEST_CASE("requantizing a dequantized row is stable where the format guarantees it", "[quant]") {
  // Q8_0, Q4_0 (the extreme element is exactly ±127·d or −8·d again), MXFP4
  // (the largest element stays in the same binade) and Q8_K return the same
  // bytes unless the stored half scale is 0 or Inf (Q8_0 rows 8 and 9, Q4_0
  // row 9). The K-quants' searches give no such guarantee (checked above
  // against the reference row by row).
  for (int r = 0; r < kFixedRows; ++r) {
    CHECK(kQ80Rows[r].requantize_same == (r < 8));
    CHECK(kQ40Rows[r].requantize_same == (r < 9));
    CHECK(kMXFP4Rows[r].requantize_same);
    CHECK(kQ8KRows[r].requantize_same);
  }
}

TEST_CASE("ties: roundf for Q8_0 and Q4_0's truncation round up, nearest_int rounds to even", "[quant]") {
  std::vector<float> x(256, 0.0f);
  x[0] = 127.0f;  // Q8_0: d = 1; Q8_K: max = 127, so iscale = −1
  x[1] = 2.5f;
  x[2] = -2.5f;
  x[3] = 3.5f;
  BlockQ8_0 q8[8];
  quantize_row_q8_0(x.data(), q8, 256);
  CHECK(q8[0].d == 0x3C00);
  CHECK((int(q8[0].qs[1]) == 3 && int(q8[0].qs[2]) == -3 && int(q8[0].qs[3]) == 4));
  BlockQ8_K q8k[1];
  quantize_row_q8_k(x.data(), q8k, 256);
  CHECK(q8k[0].d == -1.0f);
  CHECK((int(q8k[0].qs[1]) == -2 && int(q8k[0].qs[2]) == 2 && int(q8k[0].qs[3]) == -4));
  CHECK(q8k[0].bsums[0] == -127 - 2 + 2 - 4);
  CHECK((nearest_int(0.5f) == 0 && nearest_int(1.5f) == 2 && nearest_int(-2.5f) == -2 && nearest_int(-3.5f) == -4));
  std::vector<float> x4(32, 0.5f);
  x4[0] = -8.0f;  // d = 1: 0.5 + 8.5 = 9 exactly, −7.5 + 8.5 = 1
  x4[17] = -7.5f;
  BlockQ4_0 q4[1];
  quantize_row_q4_0(x4.data(), q4, 32);
  CHECK(q4[0].d == 0x3C00);
  CHECK((q4[0].qs[0] & 0xF) == 0);
  CHECK((q4[0].qs[1] >> 4) == 1);
  CHECK((q4[0].qs[1] & 0xF) == 9);
}

TEST_CASE("zero blocks quantize to zero scales and zero codes", "[quant]") {
  const std::vector<float> zeros(256, 0.0f);
  BlockQ8_0 a[8];
  BlockQ4_0 b[8];
  BlockMXFP4 c[8];
  BlockQ4_K d[1];
  BlockQ6_K e[1];
  BlockQ8_K f[1];
  std::memset(a, 0x5A, sizeof a);
  std::memset(b, 0x5A, sizeof b);
  std::memset(c, 0x5A, sizeof c);
  std::memset(d, 0x5A, sizeof d);
  std::memset(e, 0x5A, sizeof e);
  std::memset(f, 0x5A, sizeof f);
  quantize_row_q8_0(zeros.data(), a, 256);
  quantize_row_mxfp4(zeros.data(), c, 256);
  quantize_row_q4_k(zeros.data(), d, 256);
  quantize_row_q6_k(zeros.data(), e, 256);
  quantize_row_q8_k(zeros.data(), f, 256);
  const auto all = [](const void* p, std::size_t n, unsigned char v) {
    const auto* c8 = static_cast<const unsigned char*>(p);
    for (std::size_t i = 0; i < n; ++i)
      if (c8[i] != v) return false;
    return true;
  };
  CHECK(all(a, sizeof a, 0));
  CHECK(all(c, sizeof c, 0));
  CHECK(all(d, sizeof d, 0));
  CHECK(all(e, sizeof e, 0));
  CHECK(all(f, sizeof f, 0));  // bsums included (ggml leaves them as they were)
  quantize_row_q4_0(zeros.data(), b, 256);
  for (const BlockQ4_0& blk : b) {  // d = 0/−8 = −0 (half 0x8000) and every code 8 (0 + 8.5 truncated)
    CHECK(blk.d == 0x8000);
    CHECK(all(blk.qs, sizeof blk.qs, 0x88));
  }
}

TEST_CASE("fp16 conversions: every half, sampled floats and known values", "[quant][half]") {
  std::vector<float> h2f(65536);
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const float f = fp16_to_fp32(static_cast<std::uint16_t>(h));
    h2f[h] = f;
    const bool is_nan = (h & 0x7C00u) == 0x7C00u && (h & 0x3FFu) != 0;
    if (is_nan) {
      CHECK(std::isnan(f));
      CHECK(fp32_to_fp16(f) == ((h & 0x8000u) | 0x7E00u));
    } else if (fp32_to_fp16(f) != h) {
      FAIL("fp16 -> fp32 -> fp16 changed 0x" << std::hex << h);
    }
  }
  CHECK(fnv1a(h2f.data(), h2f.size() * sizeof(float)) == 0x5d79f1b086f30345ull);  // ggml_compute_fp16_to_fp32
  std::uint64_t hash = 0xcbf29ce484222325ull;  // every 4093rd float bit pattern
  for (std::uint64_t b = 0; b < (std::uint64_t{1} << 32); b += 4093) {
    const std::uint16_t h = fp32_to_fp16(float_of(static_cast<std::uint32_t>(b)));
    hash = (hash ^ (h & 0xFFu)) * 0x100000001b3ull;
    hash = (hash ^ (h >> 8)) * 0x100000001b3ull;
  }
  CHECK(hash == 0xb94b3c8fc7c0b819ull);  // ggml_compute_fp32_to_fp16
  const float inf = std::numeric_limits<float>::infinity();
  CHECK(fp32_to_fp16(1.0f) == 0x3C00);
  CHECK(fp32_to_fp16(-2.0f) == 0xC000);
  CHECK(fp32_to_fp16(0.1f) == 0x2E66);
  CHECK(fp32_to_fp16(1.0f / 3.0f) == 0x3555);
  CHECK(fp32_to_fp16(1.0f + 0x1p-11f) == 0x3C00);      // tie, to even
  CHECK(fp32_to_fp16(1.0f + 3 * 0x1p-11f) == 0x3C02);  // tie, to even
  CHECK(fp32_to_fp16(65504.0f) == 0x7BFF);
  CHECK(fp32_to_fp16(65519.996f) == 0x7BFF);
  CHECK(fp32_to_fp16(65520.0f) == 0x7C00);  // halfway past the largest half
  CHECK(fp32_to_fp16(-1e30f) == 0xFC00);
  CHECK(fp32_to_fp16(inf) == 0x7C00);
  CHECK(fp32_to_fp16(0x1p-14f) == 0x0400);
  CHECK(fp32_to_fp16(0x1p-24f) == 0x0001);
  CHECK(fp32_to_fp16(0x1p-25f) == 0x0000);  // tie between 0 and the smallest subnormal
  CHECK(fp32_to_fp16(0x1.8p-25f) == 0x0001);
  CHECK(fp32_to_fp16(-0.0f) == 0x8000);
  CHECK(fp32_to_fp16(std::numeric_limits<float>::quiet_NaN()) == 0x7E00);
  CHECK(fp32_to_fp16(-std::numeric_limits<float>::quiet_NaN()) == 0xFE00);
  CHECK(fp16_to_fp32(0x0001) == 0x1p-24f);
  CHECK(fp16_to_fp32(0x03FF) == 0x3FFp-24f);
  CHECK(fp16_to_fp32(0x7BFF) == 65504.0f);
  CHECK(fp16_to_fp32(0xFC00) == -inf);
  CHECK(bits_of(fp16_to_fp32(0x8000)) == 0x80000000u);
  CHECK(bits_of(fp16_to_fp32(0x7C01)) == 0x7FC02000u);  // payload kept, quiet bit set
}

TEST_CASE("e8m0 scales for all 256 codes", "[quant][half]") {
  float full[256], half[256];
  for (int e = 0; e < 256; ++e) {
    full[e] = e8m0_to_fp32(static_cast<std::uint8_t>(e));
    half[e] = e8m0_to_fp32_half(static_cast<std::uint8_t>(e));
    if (e >= 1 && e < 255) {
      CHECK(full[e] == std::ldexp(1.0f, e - 127));
      CHECK(half[e] == std::ldexp(1.0f, e - 128));
    }
  }
  CHECK(fnv1a(full, sizeof full) == 0x6c528b41c33741e5ull);  // ggml_e8m0_to_fp32
  CHECK(fnv1a(half, sizeof half) == 0x7b22ab04866e17b8ull);  // ggml_e8m0_to_fp32_half
  CHECK(bits_of(full[0]) == 0x00400000u);                   // 2^-127, a float subnormal
  CHECK(bits_of(half[0]) == 0x00200000u);                   // 2^-128
  CHECK(bits_of(half[1]) == 0x00400000u);
  CHECK(std::isinf(full[255]));
  CHECK(half[255] == 0x1p127f);
}

TEST_CASE("block layouts and the packed Q4_K scales", "[quant]") {
  CHECK(sizeof(BlockQ8_0) == 34);
  CHECK(sizeof(BlockQ4_0) == 18);
  CHECK(sizeof(BlockMXFP4) == 17);
  CHECK(sizeof(BlockQ4_K) == 144);
  CHECK(sizeof(BlockQ6_K) == 210);
  CHECK(sizeof(BlockQ8_K) == 292);
  CHECK(offsetof(BlockQ4_K, scales) == 4);
  CHECK(offsetof(BlockQ6_K, d) == 208);
  CHECK(offsetof(BlockQ8_K, bsums) == 260);
  // 6-bit scale s_j = 10 + j and min m_j = 50 + j, packed by hand.
  std::uint8_t packed[12];
  for (int j = 0; j < 4; ++j) {
    packed[j] = static_cast<std::uint8_t>((10 + j) | (((10 + j + 4) >> 4) << 6));
    packed[j + 4] = static_cast<std::uint8_t>((50 + j) | (((50 + j + 4) >> 4) << 6));
    packed[j + 8] = static_cast<std::uint8_t>(((10 + j + 4) & 0xF) | (((50 + j + 4) & 0xF) << 4));
  }
  for (int j = 0; j < 8; ++j) {
    std::uint8_t sc = 0, m = 0;
    q4_k_scale_min(j, packed, sc, m);
    CHECK(int(sc) == 10 + j);
    CHECK(int(m) == 50 + j);
  }
  CHECK(kMxfp4Values[7] == 12);
  CHECK(kMxfp4Values[15] == -12);
}

TEST_CASE("row lengths that are not whole blocks are ConfigErrors", "[quant][errors]") {
  std::vector<float> x(512, 1.0f);
  BlockQ8_0 a[16];
  BlockQ4_K d[2];
  BlockQ6_K e[2];
  BlockQ8_K f[2];
  CHECK_THROWS_WITH(quantize_row_q4_k(x.data(), d, 300),
                    "apex::quant::quantize_row_q4_k: row length 300 is not a multiple of 256 (q4_k super-block)");
  CHECK_THROWS_WITH(dequantize_row_q6_k(e, x.data(), 100),
                    "apex::quant::dequantize_row_q6_k: row length 100 is not a multiple of 256 (q6_k super-block)");
  CHECK_THROWS_WITH(quantize_row_q8_0(x.data(), a, 33),
                    "apex::quant::quantize_row_q8_0: row length 33 is not a multiple of 32 (q8_0 block)");
  CHECK_THROWS_WITH(quantize_row_q8_k(x.data(), f, -256), "apex::quant::quantize_row_q8_k: row length -256 is negative");
  CHECK_THROWS_AS(quantize_row_q4_0(x.data(), nullptr, 31), ConfigError);
  CHECK_THROWS_AS(dequantize_row_mxfp4(nullptr, x.data(), 48), ConfigError);
  CHECK_THROWS_AS(dequantize_row_q8_k(f, x.data(), 128), ConfigError);
  CHECK_THROWS_AS(dequantize_row_q4_k(d, x.data(), 1), ConfigError);
  CHECK_THROWS_AS(quantize_row_q6_k(x.data(), e, 257), ConfigError);
  CHECK_THROWS_AS(quantize_row_mxfp4(x.data(), nullptr, 16), ConfigError);
  CHECK_THROWS_AS(dequantize_row_q4_0(nullptr, x.data(), 8), ConfigError);
  CHECK_THROWS_AS(dequantize_row_q8_0(a, x.data(), 17), ConfigError);
  CHECK_NOTHROW(quantize_row_q4_k(x.data(), nullptr, 0));  // an empty row writes nothing
}

TEST_CASE("MXFP4 in OpenAI's layout converts to ggml's block and back without changing a weight",
          "[quant][mxfp4][gpt_oss]") {
  // Fixed vector from the two definitions: code(i) = i mod 16. OpenAI's byte j
  // holds codes 2j, 2j+1; ggml's qs[j] holds codes j, j+16, so qs[j] = j·0x11.
  std::uint8_t openai[16];
  for (int j = 0; j < 16; ++j) openai[j] = static_cast<std::uint8_t>(((2 * j) % 16) | (((2 * j + 1) % 16) << 4));
  const BlockMXFP4 b = mxfp4_from_openai(openai, 121);
  CHECK(b.e == 121);
  for (int j = 0; j < 16; ++j) CHECK(b.qs[j] == std::uint8_t(0x11 * j));
  std::uint8_t back[16], scale = 0;
  mxfp4_to_openai(b, back, scale);
  CHECK(std::memcmp(back, openai, 16) == 0);
  CHECK(scale == 121);
  // Values: OpenAI's FP4 table (OCP E2M1) times 2^(e − 127) equals ggml's
  // dequantization, for every code at every exponent of a normal float.
  const float fp4[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  for (int e = 2; e <= 254; ++e) {
    const BlockMXFP4 be = mxfp4_from_openai(openai, std::uint8_t(e));
    float y[32];
    dequantize_row_mxfp4(&be, y, 32);
    for (int i = 0; i < 32; ++i) {
      INFO("e " << e << ", weight " << i);
      CHECK(y[i] == std::ldexp(fp4[openai[i / 2] >> (4 * (i % 2)) & 0x0F], e - 127));
    }
  }
}
