#pragma once
/// \file plot.hpp
/// Line charts as PNG files, with no plotting library: an RGB canvas, a
/// 5 × 7 bitmap font, axes with round-number ticks, a legend, and a PNG
/// encoder (RFC 2083). The image data is deflated with zlib when the demo is
/// built with it (`APEX_DEMO_HAVE_ZLIB`), else stored uncompressed in
/// deflate "stored" blocks (RFC 1951 §3.2.4) — a valid PNG either way, only
/// larger.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#ifdef APEX_DEMO_HAVE_ZLIB
#include <zlib.h>
#endif

namespace apex::demo {

struct Rgb {
  std::uint8_t r = 0, g = 0, b = 0;
};

/// An 8-bit RGB image, row-major, top row first.
class Image {
 public:
  Image(int width, int height, Rgb fill = {255, 255, 255})
      : w_(width), h_(height), px_(std::size_t(width) * std::size_t(height) * 3) {
    for (int y = 0; y < h_; ++y)
      for (int x = 0; x < w_; ++x) set(x, y, fill);
  }
  int width() const { return w_; }
  int height() const { return h_; }
  /// Writes one pixel; coordinates outside the image are ignored (clipping).
  void set(int x, int y, Rgb c) {
    if (x < 0 || y < 0 || x >= w_ || y >= h_) return;
    std::uint8_t* p = &px_[(std::size_t(y) * std::size_t(w_) + std::size_t(x)) * 3];
    p[0] = c.r;
    p[1] = c.g;
    p[2] = c.b;
  }
  Rgb get(int x, int y) const {
    const std::uint8_t* p = &px_[(std::size_t(y) * std::size_t(w_) + std::size_t(x)) * 3];
    return {p[0], p[1], p[2]};
  }
  const std::vector<std::uint8_t>& pixels() const { return px_; }

  void fill_rect(int x0, int y0, int x1, int y1, Rgb c) {
    for (int y = std::max(0, y0); y <= std::min(h_ - 1, y1); ++y)
      for (int x = std::max(0, x0); x <= std::min(w_ - 1, x1); ++x) set(x, y, c);
  }
  /// A line `thickness` pixels wide (Bresenham with a square brush).
  void line(int x0, int y0, int x1, int y1, Rgb c, int thickness = 1) {
    const int dx = std::abs(x1 - x0), dy = -std::abs(y1 - y0);
    const int sx = x0 < x1 ? 1 : -1, sy = y0 < y1 ? 1 : -1;
    int err = dx + dy;
    const int lo = -(thickness - 1) / 2, hi = thickness / 2;
    for (;;) {
      for (int oy = lo; oy <= hi; ++oy)
        for (int ox = lo; ox <= hi; ++ox) set(x0 + ox, y0 + oy, c);
      if (x0 == x1 && y0 == y1) break;
      const int e2 = 2 * err;
      if (e2 >= dy) {
        err += dy;
        x0 += sx;
      }
      if (e2 <= dx) {
        err += dx;
        y0 += sy;
      }
    }
  }

 private:
  int w_, h_;
  std::vector<std::uint8_t> px_;
};

namespace font {

/// 5 × 7 glyphs of ASCII 32 … 126: seven rows, bit 4 = leftmost column.
inline const std::array<std::array<std::uint8_t, 7>, 95>& glyphs() {
  static const std::array<std::array<std::uint8_t, 7>, 95> g = {{
      {0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00},  // space
      {0x04, 0x04, 0x04, 0x04, 0x00, 0x00, 0x04},  // !
      {0x0A, 0x0A, 0x0A, 0x00, 0x00, 0x00, 0x00},  // "
      {0x0A, 0x0A, 0x1F, 0x0A, 0x1F, 0x0A, 0x0A},  // #
      {0x04, 0x0F, 0x14, 0x0E, 0x05, 0x1E, 0x04},  // $
      {0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03},  // %
      {0x0C, 0x12, 0x14, 0x08, 0x15, 0x12, 0x0D},  // &
      {0x0C, 0x04, 0x08, 0x00, 0x00, 0x00, 0x00},  // '
      {0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02},  // (
      {0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08},  // )
      {0x00, 0x04, 0x15, 0x0E, 0x15, 0x04, 0x00},  // *
      {0x00, 0x04, 0x04, 0x1F, 0x04, 0x04, 0x00},  // +
      {0x00, 0x00, 0x00, 0x00, 0x0C, 0x04, 0x08},  // ,
      {0x00, 0x00, 0x00, 0x1F, 0x00, 0x00, 0x00},  // -
      {0x00, 0x00, 0x00, 0x00, 0x00, 0x0C, 0x0C},  // .
      {0x00, 0x01, 0x02, 0x04, 0x08, 0x10, 0x00},  // /
      {0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E},  // 0
      {0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E},  // 1
      {0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F},  // 2
      {0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E},  // 3
      {0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02},  // 4
      {0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E},  // 5
      {0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E},  // 6
      {0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08},  // 7
      {0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E},  // 8
      {0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C},  // 9
      {0x00, 0x0C, 0x0C, 0x00, 0x0C, 0x0C, 0x00},  // :
      {0x00, 0x0C, 0x0C, 0x00, 0x0C, 0x04, 0x08},  // ;
      {0x02, 0x04, 0x08, 0x10, 0x08, 0x04, 0x02},  // <
      {0x00, 0x00, 0x1F, 0x00, 0x1F, 0x00, 0x00},  // =
      {0x08, 0x04, 0x02, 0x01, 0x02, 0x04, 0x08},  // >
      {0x0E, 0x11, 0x01, 0x02, 0x04, 0x00, 0x04},  // ?
      {0x0E, 0x11, 0x01, 0x0D, 0x15, 0x15, 0x0E},  // @
      {0x0E, 0x11, 0x11, 0x11, 0x1F, 0x11, 0x11},  // A
      {0x1E, 0x11, 0x11, 0x1E, 0x11, 0x11, 0x1E},  // B
      {0x0E, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0E},  // C
      {0x1C, 0x12, 0x11, 0x11, 0x11, 0x12, 0x1C},  // D
      {0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x1F},  // E
      {0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x10},  // F
      {0x0E, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0F},  // G
      {0x11, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11},  // H
      {0x0E, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E},  // I
      {0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C},  // J
      {0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11},  // K
      {0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1F},  // L
      {0x11, 0x1B, 0x15, 0x15, 0x11, 0x11, 0x11},  // M
      {0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11},  // N
      {0x0E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E},  // O
      {0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10, 0x10},  // P
      {0x0E, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0D},  // Q
      {0x1E, 0x11, 0x11, 0x1E, 0x14, 0x12, 0x11},  // R
      {0x0F, 0x10, 0x10, 0x0E, 0x01, 0x01, 0x1E},  // S
      {0x1F, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04},  // T
      {0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E},  // U
      {0x11, 0x11, 0x11, 0x11, 0x11, 0x0A, 0x04},  // V
      {0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0A},  // W
      {0x11, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x11},  // X
      {0x11, 0x11, 0x11, 0x0A, 0x04, 0x04, 0x04},  // Y
      {0x1F, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1F},  // Z
      {0x0E, 0x08, 0x08, 0x08, 0x08, 0x08, 0x0E},  // [
      {0x00, 0x10, 0x08, 0x04, 0x02, 0x01, 0x00},  // backslash
      {0x0E, 0x02, 0x02, 0x02, 0x02, 0x02, 0x0E},  // ]
      {0x04, 0x0A, 0x11, 0x00, 0x00, 0x00, 0x00},  // ^
      {0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x1F},  // _
      {0x08, 0x04, 0x02, 0x00, 0x00, 0x00, 0x00},  // `
      {0x00, 0x00, 0x0E, 0x01, 0x0F, 0x11, 0x0F},  // a
      {0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x1E},  // b
      {0x00, 0x00, 0x0E, 0x10, 0x10, 0x11, 0x0E},  // c
      {0x01, 0x01, 0x0D, 0x13, 0x11, 0x11, 0x0F},  // d
      {0x00, 0x00, 0x0E, 0x11, 0x1F, 0x10, 0x0E},  // e
      {0x06, 0x09, 0x08, 0x1C, 0x08, 0x08, 0x08},  // f
      {0x00, 0x0F, 0x11, 0x11, 0x0F, 0x01, 0x0E},  // g
      {0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x11},  // h
      {0x04, 0x00, 0x0C, 0x04, 0x04, 0x04, 0x0E},  // i
      {0x02, 0x00, 0x06, 0x02, 0x02, 0x12, 0x0C},  // j
      {0x10, 0x10, 0x12, 0x14, 0x18, 0x14, 0x12},  // k
      {0x0C, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E},  // l
      {0x00, 0x00, 0x1A, 0x15, 0x15, 0x11, 0x11},  // m
      {0x00, 0x00, 0x16, 0x19, 0x11, 0x11, 0x11},  // n
      {0x00, 0x00, 0x0E, 0x11, 0x11, 0x11, 0x0E},  // o
      {0x00, 0x00, 0x1E, 0x11, 0x1E, 0x10, 0x10},  // p
      {0x00, 0x00, 0x0D, 0x13, 0x0F, 0x01, 0x01},  // q
      {0x00, 0x00, 0x16, 0x19, 0x10, 0x10, 0x10},  // r
      {0x00, 0x00, 0x0E, 0x10, 0x0E, 0x01, 0x1E},  // s
      {0x08, 0x08, 0x1C, 0x08, 0x08, 0x09, 0x06},  // t
      {0x00, 0x00, 0x11, 0x11, 0x11, 0x13, 0x0D},  // u
      {0x00, 0x00, 0x11, 0x11, 0x11, 0x0A, 0x04},  // v
      {0x00, 0x00, 0x11, 0x11, 0x15, 0x15, 0x0A},  // w
      {0x00, 0x00, 0x11, 0x0A, 0x04, 0x0A, 0x11},  // x
      {0x00, 0x00, 0x11, 0x11, 0x0F, 0x01, 0x0E},  // y
      {0x00, 0x00, 0x1F, 0x02, 0x04, 0x08, 0x1F},  // z
      {0x02, 0x04, 0x04, 0x08, 0x04, 0x04, 0x02},  // {
      {0x04, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04},  // |
      {0x08, 0x04, 0x04, 0x02, 0x04, 0x04, 0x08},  // }
      {0x00, 0x00, 0x08, 0x15, 0x02, 0x00, 0x00},  // ~
  }};
  return g;
}

constexpr int kWidth = 5, kHeight = 7, kAdvance = 6;  ///< pixels at scale 1

/// Lower-case letters with a descender: drawn 2 rows lower, so their bowl sits
/// on the baseline and the tail hangs below it (the cell is then 9 rows tall).
inline const std::array<std::uint8_t, 7>* descender(char ch) {
  static const std::array<std::uint8_t, 7> g = {0x0F, 0x11, 0x11, 0x11, 0x0F, 0x01, 0x0E};
  static const std::array<std::uint8_t, 7> p = {0x1E, 0x11, 0x11, 0x11, 0x1E, 0x10, 0x10};
  static const std::array<std::uint8_t, 7> q = {0x0F, 0x11, 0x11, 0x11, 0x0F, 0x01, 0x01};
  static const std::array<std::uint8_t, 7> y = {0x11, 0x11, 0x11, 0x11, 0x0F, 0x01, 0x0E};
  switch (ch) {
    case 'g': return &g;
    case 'p': return &p;
    case 'q': return &q;
    case 'y': return &y;
    default: return nullptr;
  }
}

}  // namespace font

/// Width in pixels of `s` drawn at `scale`.
inline int text_width(const std::string& s, int scale) { return int(s.size()) * font::kAdvance * scale - scale; }

/// Draws `s` with its top-left corner at (x, y); characters outside ASCII
/// 32 … 126 draw as '?'.
inline void draw_text(Image& img, int x, int y, const std::string& s, Rgb c, int scale = 2) {
  for (char ch : s) {
    const int code = (ch >= 32 && ch <= 126) ? ch - 32 : '?' - 32;
    const auto* low = font::descender(ch);
    const auto& g = low ? *low : font::glyphs()[std::size_t(code)];
    const int y0 = y + (low ? 2 * scale : 0);
    for (int row = 0; row < font::kHeight; ++row)
      for (int col = 0; col < font::kWidth; ++col)
        if (g[std::size_t(row)] & (0x10 >> col))
          img.fill_rect(x + col * scale, y0 + row * scale, x + col * scale + scale - 1, y0 + row * scale + scale - 1, c);
    x += font::kAdvance * scale;
  }
}

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

/// One line of a chart.
struct Series {
  std::string name;
  std::vector<double> x, y;
  Rgb color;
  int thickness = 2;
};

struct ChartOptions {
  std::string title, x_label, y_label;
  int width = 960, height = 540;
  bool y_include_zero = false;
  double y_min = NAN, y_max = NAN;  ///< fixed y range where set
};

/// A palette that stays distinguishable on white.
inline Rgb palette(std::size_t i) {
  static const Rgb p[] = {{31, 119, 180}, {214, 39, 40}, {44, 160, 44}, {255, 127, 14},
                          {148, 103, 189}, {140, 86, 75}, {227, 119, 194}, {23, 190, 207}};
  return p[i % (sizeof(p) / sizeof(p[0]))];
}

namespace plot_detail {

/// Round tick step for a range: 1, 2 or 5 × 10^k giving about `target` ticks.
inline double nice_step(double span, int target) {
  const double raw = span / std::max(1, target);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double f = raw / mag;
  return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * mag;
}

inline std::string tick_label(double v, double step) {
  char buf[32];
  if (std::abs(v) < step * 1e-6) v = 0;
  const int decimals = step >= 1 ? 0 : int(std::ceil(-std::log10(step) - 1e-9));
  if (std::abs(v) >= 1e5 && step >= 1)
    std::snprintf(buf, sizeof buf, "%.0fk", v / 1000);
  else
    std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  return buf;
}

}  // namespace plot_detail

/// Renders the series as a line chart with axes, ticks, grid and legend.
inline Image line_chart(const std::vector<Series>& series, const ChartOptions& opt) {
  Image img(opt.width, opt.height);
  const Rgb ink{40, 40, 40}, grid{228, 228, 228};
  const int left = 90, right = opt.width - 36, top = 76, bottom = opt.height - 62;

  double x0 = INFINITY, x1 = -INFINITY, y0 = INFINITY, y1 = -INFINITY;
  for (const auto& s : series)
    for (std::size_t i = 0; i < s.x.size() && i < s.y.size(); ++i) {
      if (!std::isfinite(s.y[i])) continue;
      x0 = std::min(x0, s.x[i]);
      x1 = std::max(x1, s.x[i]);
      y0 = std::min(y0, s.y[i]);
      y1 = std::max(y1, s.y[i]);
    }
  if (!(x0 <= x1)) x0 = 0, x1 = 1;
  if (!(y0 <= y1)) y0 = 0, y1 = 1;
  if (opt.y_include_zero) y0 = std::min(y0, 0.0), y1 = std::max(y1, 0.0);
  if (std::isfinite(opt.y_min)) y0 = opt.y_min;
  if (std::isfinite(opt.y_max)) y1 = opt.y_max;
  if (x1 == x0) x1 = x0 + 1;
  if (y1 == y0) y1 = y0 + 1;
  const double ys = plot_detail::nice_step(y1 - y0, 6);
  y0 = std::floor(y0 / ys + 1e-9) * ys;
  y1 = std::ceil(y1 / ys - 1e-9) * ys;
  const double xs = plot_detail::nice_step(x1 - x0, 8);

  auto px = [&](double x) { return left + int(std::lround((x - x0) / (x1 - x0) * (right - left))); };
  auto py = [&](double y) { return bottom - int(std::lround((y - y0) / (y1 - y0) * (bottom - top))); };

  // Grid and tick labels.
  for (double v = y0; v <= y1 + ys * 1e-6; v += ys) {
    const int y = py(v);
    img.line(left, y, right, y, grid);
    const std::string l = plot_detail::tick_label(v, ys);
    draw_text(img, left - 8 - text_width(l, 2), y - 7, l, ink);
  }
  for (double v = std::ceil(x0 / xs - 1e-9) * xs; v <= x1 + xs * 1e-6; v += xs) {
    const int x = px(v);
    img.line(x, top, x, bottom, grid);
    img.line(x, bottom, x, bottom + 5, ink);
    const std::string l = plot_detail::tick_label(v, xs);
    draw_text(img, x - text_width(l, 2) / 2, bottom + 10, l, ink);
  }
  img.line(left, top, left, bottom, ink, 2);
  img.line(left, bottom, right, bottom, ink, 2);

  // Title, axis labels.
  draw_text(img, (opt.width - text_width(opt.title, 3)) / 2, 10, opt.title, ink, 3);
  draw_text(img, (left + right - text_width(opt.x_label, 2)) / 2, opt.height - 26, opt.x_label, ink);
  draw_text(img, 8, top - 28, opt.y_label, ink);

  // Lines, clipped to the plot area.
  for (const auto& s : series) {
    bool have = false;
    int lx = 0, ly = 0;
    for (std::size_t i = 0; i < s.x.size() && i < s.y.size(); ++i) {
      if (!std::isfinite(s.y[i])) {
        have = false;
        continue;
      }
      const int x = px(s.x[i]), y = std::clamp(py(s.y[i]), top, bottom);
      if (have) img.line(lx, ly, x, y, s.color, s.thickness);
      lx = x, ly = y, have = true;
    }
  }

  // Legend, top right.
  int widest = 0;
  for (const auto& s : series) widest = std::max(widest, text_width(s.name, 2));
  const int lw = widest + 50, lh = int(series.size()) * 22 + 10;
  const int lx0 = right - lw - 10, ly0 = top + 10;
  img.fill_rect(lx0, ly0, lx0 + lw, ly0 + lh, {255, 255, 255});
  img.line(lx0, ly0, lx0 + lw, ly0, ink);
  img.line(lx0, ly0 + lh, lx0 + lw, ly0 + lh, ink);
  img.line(lx0, ly0, lx0, ly0 + lh, ink);
  img.line(lx0 + lw, ly0, lx0 + lw, ly0 + lh, ink);
  for (std::size_t i = 0; i < series.size(); ++i) {
    const int y = ly0 + 12 + int(i) * 22;
    img.line(lx0 + 8, y + 6, lx0 + 36, y + 6, series[i].color, 3);
    draw_text(img, lx0 + 44, y, series[i].name, ink);
  }
  return img;
}

}  // namespace apex::demo
