#pragma once
/// \file core/checked_size.hpp
/// Overflow-safe size arithmetic for constructors and allocators.
///
/// Sizes are `Index` (`std::ptrdiff_t`). A product such as `2·f·d` for a
/// configuration no machine could hold overflows a signed integer, which is
/// undefined behaviour and in practice wraps to a small or negative size that
/// then allocates a layer with the wrong number of weights. Every size product
/// a layer computes from user input goes through `checked_product`, which
/// throws `ConfigError` naming the product before anything is allocated.

#include <initializer_list>
#include <limits>
#include <sstream>
#include <string>

#include "errors.hpp"
#include "types.hpp"

namespace apex::detail {

/// `a·b·…` for non-negative factors, or ConfigError
/// `where: <what> = a x b x … does not fit in a 64-bit index` when the exact
/// product exceeds `Index`'s range. Negative factors are a ConfigError too:
/// callers validate signs first, this is the last line of defence.
inline Index checked_product(const char* where, const char* what, std::initializer_list<Index> factors) {
  constexpr Index kMax = std::numeric_limits<Index>::max();
  Index product = 1;
  bool overflow = false;
  for (const Index f : factors) {
    if (f < 0) {
      std::ostringstream msg;
      msg << where << ": " << what << " has a negative factor " << f;
      throw ConfigError(msg.str());
    }
    if (f != 0 && product > kMax / f) overflow = true;
    else product *= f;
  }
  // A zero factor makes the product 0 whatever came before it.
  for (const Index f : factors)
    if (f == 0) return 0;
  if (overflow) {
    std::ostringstream msg;
    msg << where << ": " << what << " = ";
    const char* sep = "";
    for (const Index f : factors) {
      msg << sep << f;
      sep = " x ";
    }
    msg << " does not fit in a 64-bit index";
    throw ConfigError(msg.str());
  }
  return product;
}

/// `a + b` for non-negative terms, or ConfigError naming the sum.
inline Index checked_sum(const char* where, const char* what, Index a, Index b) {
  if (a < 0 || b < 0 || a > std::numeric_limits<Index>::max() - b) {
    std::ostringstream msg;
    msg << where << ": " << what << " = " << a << " + " << b << " does not fit in a 64-bit index";
    throw ConfigError(msg.str());
  }
  return a + b;
}

}  // namespace apex::detail
