#pragma once
/// \file png.hpp
/// A PNG encoder (RFC 2083) for an Image, so the demo writes plots with no
/// image library. The image data is deflated with zlib when the demo is
/// built with it (`APEX_DEMO_HAVE_ZLIB`), else stored uncompressed in
/// deflate "stored" blocks (RFC 1951 §3.2.4) — a valid PNG either way, only
/// larger.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#ifdef APEX_DEMO_HAVE_ZLIB
#include <zlib.h>
#endif

#include "image.hpp"

namespace apex::demo {

namespace png {

inline std::uint32_t crc32(const std::uint8_t* data, std::size_t n, std::uint32_t crc = 0) {
  static const auto table = [] {
    std::array<std::uint32_t, 256> t{};
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;  // reflected CRC-32 polynomial
      t[i] = c;
    }
    return t;
  }();
  crc = ~crc;
  for (std::size_t i = 0; i < n; ++i) crc = table[(crc ^ data[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

inline std::uint32_t adler32(const std::uint8_t* data, std::size_t n) {
  std::uint32_t a = 1, b = 0;
  for (std::size_t i = 0; i < n; ++i) {
    a = (a + data[i]) % 65521;
    b = (b + a) % 65521;
  }
  return (b << 16) | a;
}

/// A zlib stream (RFC 1950) of `raw` in stored deflate blocks.
inline std::vector<std::uint8_t> zlib_stored(const std::vector<std::uint8_t>& raw) {
  std::vector<std::uint8_t> out = {0x78, 0x01};  // deflate, 32 KiB window, no dictionary; (0x78·256 + 1) % 31 = 0
  std::size_t pos = 0;
  do {
    const std::size_t len = std::min<std::size_t>(65535, raw.size() - pos);
    const bool last = pos + len == raw.size();
    out.push_back(last ? 1 : 0);  // BFINAL, BTYPE = 00 (stored)
    out.push_back(std::uint8_t(len & 0xFF));
    out.push_back(std::uint8_t(len >> 8));
    out.push_back(std::uint8_t(~len & 0xFF));
    out.push_back(std::uint8_t((~len >> 8) & 0xFF));
    out.insert(out.end(), raw.begin() + std::ptrdiff_t(pos), raw.begin() + std::ptrdiff_t(pos + len));
    pos += len;
  } while (pos < raw.size());
  const std::uint32_t a = adler32(raw.data(), raw.size());
  for (int s = 24; s >= 0; s -= 8) out.push_back(std::uint8_t(a >> s));
  return out;
}

inline std::vector<std::uint8_t> zlib_compress(const std::vector<std::uint8_t>& raw) {
#ifdef APEX_DEMO_HAVE_ZLIB
  uLongf len = compressBound(uLong(raw.size()));
  std::vector<std::uint8_t> out(len);
  if (compress2(out.data(), &len, raw.data(), uLong(raw.size()), 9) == Z_OK) {
    out.resize(len);
    return out;
  }
#endif
  return zlib_stored(raw);
}

inline void put32(std::vector<std::uint8_t>& v, std::uint32_t x) {
  for (int s = 24; s >= 0; s -= 8) v.push_back(std::uint8_t(x >> s));
}

inline void chunk(std::vector<std::uint8_t>& file, const char type[4], const std::vector<std::uint8_t>& data) {
  put32(file, std::uint32_t(data.size()));
  const std::size_t start = file.size();
  file.insert(file.end(), type, type + 4);
  file.insert(file.end(), data.begin(), data.end());
  put32(file, crc32(&file[start], file.size() - start));  // over type and data
}

/// The bytes of a PNG file holding `img` (8-bit RGB, filter "Sub" on every row).
inline std::vector<std::uint8_t> encode(const Image& img) {
  const int w = img.width(), h = img.height();
  std::vector<std::uint8_t> raw;
  raw.reserve(std::size_t(h) * (std::size_t(w) * 3 + 1));
  const auto& px = img.pixels();
  for (int y = 0; y < h; ++y) {
    raw.push_back(1);  // filter Sub: each byte minus the byte 3 to its left; flat areas become zeros
    const std::uint8_t* row = &px[std::size_t(y) * std::size_t(w) * 3];
    for (int i = 0; i < w * 3; ++i) raw.push_back(std::uint8_t(row[i] - (i >= 3 ? row[i - 3] : 0)));
  }
  std::vector<std::uint8_t> file = {0x89, 'P', 'N', 'G', 0x0D, 0x0A, 0x1A, 0x0A};
  std::vector<std::uint8_t> ihdr;
  put32(ihdr, std::uint32_t(w));
  put32(ihdr, std::uint32_t(h));
  ihdr.insert(ihdr.end(), {8, 2, 0, 0, 0});  // 8 bits, RGB, deflate, adaptive filtering, no interlace
  chunk(file, "IHDR", ihdr);
  chunk(file, "IDAT", zlib_compress(raw));
  chunk(file, "IEND", {});
  return file;
}

}  // namespace png

/// Writes `img` to `path` as PNG; std::runtime_error if the file cannot be written.
inline void write_png(const std::string& path, const Image& img) {
  const std::vector<std::uint8_t> bytes = png::encode(img);
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
  if (!out) throw std::runtime_error("write_png: cannot write '" + path + "'");
}

}  // namespace apex::demo
