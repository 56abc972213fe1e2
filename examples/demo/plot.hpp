#pragma once
/// \file plot.hpp
/// Line charts as PNG files, with no plotting library: axes with
/// round-number ticks, a grid, clipped lines and a legend, drawn on an RGB
/// canvas (image.hpp) with a 5 × 7 bitmap font (font.hpp, text.hpp) and
/// written by a small PNG encoder (png.hpp). Including this header gives
/// all of them.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "font.hpp"
#include "image.hpp"
#include "png.hpp"
#include "text.hpp"

namespace apex::demo {

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

/// The ink of text, ticks and axes, and the grid's lighter grey.
inline constexpr Rgb kInk{40, 40, 40}, kGrid{228, 228, 228};

/// Where the data goes on the image: the plot area in pixels, the data range
/// it shows and the tick steps chosen for that range.
struct Frame {
  int left = 0, right = 0, top = 0, bottom = 0;  ///< plot area, pixels
  double x0 = 0, x1 = 1, y0 = 0, y1 = 1;         ///< data range shown
  double xs = 1, ys = 1;                         ///< tick steps
  int px(double x) const { return left + int(std::lround((x - x0) / (x1 - x0) * (right - left))); }
  int py(double y) const { return bottom - int(std::lround((y - y0) / (y1 - y0) * (bottom - top))); }
};

/// The frame of `series` on a chart shaped by `opt`: the range of the finite
/// points, widened as the options ask, with y rounded out to whole ticks so
/// the top and bottom grid lines bound the plot.
inline Frame fit_frame(const std::vector<Series>& series, const ChartOptions& opt) {
  Frame f;
  f.left = 90, f.right = opt.width - 36, f.top = 76, f.bottom = opt.height - 62;
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
  const double ys = nice_step(y1 - y0, 6);
  y0 = std::floor(y0 / ys + 1e-9) * ys;
  y1 = std::ceil(y1 / ys - 1e-9) * ys;
  f.x0 = x0, f.x1 = x1, f.y0 = y0, f.y1 = y1;
  f.xs = nice_step(x1 - x0, 8), f.ys = ys;
  return f;
}

/// Grid, tick marks and labels, the two axes, the title and axis labels.
inline void draw_axes(Image& img, const Frame& f, const ChartOptions& opt) {
  for (double v = f.y0; v <= f.y1 + f.ys * 1e-6; v += f.ys) {
    const int y = f.py(v);
    img.line(f.left, y, f.right, y, kGrid);
    const std::string l = tick_label(v, f.ys);
    draw_text(img, f.left - 8 - text_width(l, 2), y - 7, l, kInk);
  }
  for (double v = std::ceil(f.x0 / f.xs - 1e-9) * f.xs; v <= f.x1 + f.xs * 1e-6; v += f.xs) {
    const int x = f.px(v);
    img.line(x, f.top, x, f.bottom, kGrid);
    img.line(x, f.bottom, x, f.bottom + 5, kInk);
    const std::string l = tick_label(v, f.xs);
    draw_text(img, x - text_width(l, 2) / 2, f.bottom + 10, l, kInk);
  }
  img.line(f.left, f.top, f.left, f.bottom, kInk, 2);
  img.line(f.left, f.bottom, f.right, f.bottom, kInk, 2);
  draw_text(img, (opt.width - text_width(opt.title, 3)) / 2, 10, opt.title, kInk, 3);
  draw_text(img, (f.left + f.right - text_width(opt.x_label, 2)) / 2, opt.height - 26, opt.x_label, kInk);
  draw_text(img, 8, f.top - 28, opt.y_label, kInk);
}

/// Each series as connected segments, broken at non-finite values and
/// clamped vertically to the plot area.
inline void draw_lines(Image& img, const Frame& f, const std::vector<Series>& series) {
  for (const auto& s : series) {
    bool have = false;
    int lx = 0, ly = 0;
    for (std::size_t i = 0; i < s.x.size() && i < s.y.size(); ++i) {
      if (!std::isfinite(s.y[i])) {
        have = false;
        continue;
      }
      const int x = f.px(s.x[i]), y = std::clamp(f.py(s.y[i]), f.top, f.bottom);
      if (have) img.line(lx, ly, x, y, s.color, s.thickness);
      lx = x, ly = y, have = true;
    }
  }
}

/// A boxed legend in the top right corner: a colour swatch and the name of
/// each series, drawn last so it covers the lines beneath it.
inline void draw_legend(Image& img, const Frame& f, const std::vector<Series>& series) {
  int widest = 0;
  for (const auto& s : series) widest = std::max(widest, text_width(s.name, 2));
  const int lw = widest + 50, lh = int(series.size()) * 22 + 10;
  const int lx0 = f.right - lw - 10, ly0 = f.top + 10;
  img.fill_rect(lx0, ly0, lx0 + lw, ly0 + lh, {255, 255, 255});
  img.line(lx0, ly0, lx0 + lw, ly0, kInk);
  img.line(lx0, ly0 + lh, lx0 + lw, ly0 + lh, kInk);
  img.line(lx0, ly0, lx0, ly0 + lh, kInk);
  img.line(lx0 + lw, ly0, lx0 + lw, ly0 + lh, kInk);
  for (std::size_t i = 0; i < series.size(); ++i) {
    const int y = ly0 + 12 + int(i) * 22;
    img.line(lx0 + 8, y + 6, lx0 + 36, y + 6, series[i].color, 3);
    draw_text(img, lx0 + 44, y, series[i].name, kInk);
  }
}

}  // namespace plot_detail

/// Renders the series as a line chart with axes, ticks, grid and legend.
inline Image line_chart(const std::vector<Series>& series, const ChartOptions& opt) {
  Image img(opt.width, opt.height);
  const plot_detail::Frame f = plot_detail::fit_frame(series, opt);
  plot_detail::draw_axes(img, f, opt);
  plot_detail::draw_lines(img, f, series);
  plot_detail::draw_legend(img, f, series);
  return img;
}

}  // namespace apex::demo
