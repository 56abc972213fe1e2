#pragma once
/// \file kernels/transposed_product.hpp
/// PLACEHOLDER (replaced by the kernel branch): dx = dy · M on a PanelMatrix,
/// the naive fma chain over unpack_row values.
#include <algorithm>
#include <cmath>
#include <vector>
#include "panel_matrix.hpp"
#include "isa.hpp"
namespace apex::packed {
inline void transposed_product(Isa, const PanelMatrix& pm, const float* dy, Index lddy, Index rows, float* dx,
                               Index lddx) {
  const Index K = pm.k(), O = pm.panels() * kPanelLanes;
  std::vector<float> w(std::size_t(O * K));
  for (Index p = 0; p < pm.panels(); ++p)
    for (Index l = 0; l < kPanelLanes; ++l) pm.unpack_row(p, l, w.data() + (p * kPanelLanes + l) * K);
  for (Index r = 0; r < rows; ++r)
    for (Index k = 0; k < K; ++k) {
      float acc = 0;
      for (Index o = 0; o < O; ++o) acc = std::fma(dy[r * lddy + o], w[std::size_t(o * K + k)], acc);
      dx[r * lddx + k] = acc;
    }
}
}  // namespace apex::packed
