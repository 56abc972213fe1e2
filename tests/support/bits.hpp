#pragma once
// Bitwise comparison of float results: the packed layers promise the same
// bits (forward and forward_into, a layer before and after a rejected load),
// which == on matrices would also grant to +0 against -0 and deny to NaN.

#include <apex/ffn/core/types.hpp>

#include <cstring>

namespace apex::test {

/// Same shape and the same bytes.
inline bool same_bits(const Matrix<float>& a, const Matrix<float>& b) {
  return a.rows() == b.rows() && a.cols() == b.cols() &&
         (a.size() == 0 || std::memcmp(a.data(), b.data(), std::size_t(a.size()) * sizeof(float)) == 0);
}

}  // namespace apex::test
