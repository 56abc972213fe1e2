#pragma once
/// \file image.hpp
/// The canvas the demo's charts are drawn on: an 8-bit RGB raster with the
/// few primitives a line chart needs (pixels, filled rectangles, thick
/// lines). Drawing clips to the image, so a chart may draw past its edges.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <vector>

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

}  // namespace apex::demo
