#pragma once
/// \file kernels/spread_rows.hpp
/// Activation rows copied apart when their stride would make the tiles
/// thrash L1. Rows a multiple of 4 KiB apart fall in the same L1 sets, and
/// a tile reads 12 of them at once, more than the 8 ways. Such rows are
/// copied 64 bytes further apart first. Measured with the f32 tiles: the
/// down shape of a Qwen3-30B expert in the transposed product (2048-float
/// rows, 32 rows) 15-40 % faster; the gate/up forward (2048-float rows) 10 %.
/// The tiles' bits do not depend on the row stride, so the copy changes
/// only the speed.

#include <algorithm>

#include "../core/checked_size.hpp"
#include "../core/types.hpp"
#include "aligned_array.hpp"

namespace apex::packed::detail {

/// x (rows × n, row stride ld) itself, or its copy in `copy` (grown as
/// needed) with ld set to the copy's stride n + 16 when ld is a multiple of
/// 1024 floats and there are two rows or more. `where` names the caller in
/// a size error.
inline const float* spread_rows(const float* x, Index& ld, Index rows, Index n, AlignedArray<float>& copy,
                                const char* where) {
  if (rows < 2 || n == 0 || ld % 1024 != 0) return x;
  const Index spread = n + 16;
  float* c = grow(copy, apex::detail::checked_product(where, "activation copy", {rows, spread}));
  for (Index r = 0; r < rows; ++r) std::copy(x + r * ld, x + r * ld + n, c + r * spread);
  ld = spread;
  return c;
}

}  // namespace apex::packed::detail
