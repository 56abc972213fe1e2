#pragma once
/// \file core/scalar_range.hpp
/// Configuration options are doubles; a layer converts most of them to the
/// scalar type T it computes in. A value finite as a double can be +inf as a
/// float (1e39), and converting it is undefined behaviour besides, so every
/// option a layer of T converts is checked against T's range where the
/// layer is built (docs/error_model.md#exceptions). One helper for every
/// config: KappaOptions, RoutingConfig, MoEConfig, SkipGateConfig, RMSNorm's
/// ε, the load balancer's α, cross-entropy's and the multi-token loss's weights.

#include <cmath>
#include <limits>
#include <sstream>
#include <string>
#include <type_traits>

#include "errors.hpp"

namespace apex::detail {

/// "float", "double", or a generic name for another scalar type.
template <class T>
const char* scalar_name() {
  if constexpr (std::is_same_v<T, float>) return "float";
  else if constexpr (std::is_same_v<T, double>) return "double";
  else return "the layer's scalar type";
}

/// `v` as %g ("1e+39", "1e-06"): std::to_string would print 1e39 with 39
/// digits and a small value as 0.000000.
inline std::string number(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
}

/// Throws ConfigError "where: field must lie within the range of T (|value|
/// <= max), got v" unless |v| ≤ max(T). NaN fails too; the caller checks
/// the option's own domain (sign, finiteness) first, with its own message.
template <class T>
void require_fits(const char* where, const std::string& field, double v) {
  const double max = double(std::numeric_limits<T>::max());
  require_config(std::abs(v) <= max, where,
                 field + " must lie within the range of the layer's scalar type " + scalar_name<T>() +
                     " (|value| <= " + number(max) + "), got " + number(v));
}

}  // namespace apex::detail
