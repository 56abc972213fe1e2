#pragma once
/// \file text.hpp
/// Text on an Image in the 5 × 7 font (font.hpp), scaled by whole pixels so
/// labels stay crisp without anti-aliasing.

#include <cstddef>
#include <string>

#include "font.hpp"
#include "image.hpp"

namespace apex::demo {

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

}  // namespace apex::demo
