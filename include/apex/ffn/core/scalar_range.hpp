#pragma once
/// \file core/scalar_range.hpp
/// Configuration options are doubles; a layer converts most of them to the
/// scalar type T it computes in. A value finite as a double can be +inf as a
/// float (1e39), and converting it is undefined behaviour besides, so every
/// option a layer of T converts is checked against T's range where the
/// layer is built (docs/error_model.md#exceptions). One helper for every
/// config: KappaOptions, RoutingConfig, MoEConfig, SkipGateConfig, RMSNorm's
/// ε, the load balancer's α, cross-entropy's and the multi-token loss's weights.
/// Readers of files (config.json, GGUF options) check a positive float key
/// with `positive_float_problem` where they read it, so the error names the key.

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

/// Empty if `v` is a positive float value: finite, > 0, at most float's
/// largest (3.40282e+38) and not rounding to 0 in float (an ε or a scale the
/// layer computes with in float). Else what is wrong, for the caller's
/// message: "must be finite, > 0 and a positive float (at most 3.40282e+38,
/// not rounding to 0), got -1".
inline std::string positive_float_problem(double v) {
  const double max = double(std::numeric_limits<float>::max());
  if (std::isfinite(v) && v > 0 && v <= max && float(v) > 0) return {};
  return "must be finite, > 0 and a positive float (at most " + number(max) + ", not rounding to 0), got " + number(v);
}

}  // namespace apex::detail
