#pragma once
/// \file core/errors.hpp
/// The library's error model: every rejected input throws a subclass of
/// `apex::Error` whose message names the function, the argument, what was
/// expected and what was given. Nothing is validated with `assert` alone.

#include <cmath>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "types.hpp"

namespace apex {

/// Base of every exception the library throws.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// An argument has the wrong shape.
class ShapeError : public Error {
 public:
  using Error::Error;
};

/// A configuration is impossible (K > E, zero widths, τ outside [0, 1], …).
class ConfigError : public Error {
 public:
  using Error::Error;
};

/// A value is outside its domain (non-finite input, token id out of range, …).
class ValueError : public Error {
 public:
  using Error::Error;
};

/// A file is malformed, truncated or cannot be written.
class FormatError : public Error {
 public:
  using Error::Error;
};

/// A gradient was asked of a `Param` that has none: one from a layer's
/// values-only view `param_values()` (core/param.hpp).
class NoGradientError : public Error {
 public:
  using Error::Error;
};

namespace detail {

/// Wildcard for `check_shape`: any extent is accepted in that dimension.
inline constexpr Index kAny = -1;

inline std::string extent(Index n) { return n == kAny ? std::string("*") : std::to_string(n); }

/// Throws ShapeError unless `rows × cols` matches `want_rows × want_cols`
/// (either may be kAny).
inline void check_shape(const char* where, const char* arg, Index rows, Index cols, Index want_rows,
                        Index want_cols) {
  if ((want_rows == kAny || rows == want_rows) && (want_cols == kAny || cols == want_cols)) return;
  std::ostringstream msg;
  msg << where << ": argument '" << arg << "' has shape [" << rows << " x " << cols
      << "], expected [" << extent(want_rows) << " x " << extent(want_cols) << "]";
  throw ShapeError(msg.str());
}

template <class Derived>
void check_shape(const char* where, const char* arg, const Eigen::EigenBase<Derived>& m,
                 Index want_rows, Index want_cols) {
  check_shape(where, arg, m.rows(), m.cols(), want_rows, want_cols);
}

/// Throws ConfigError with `where: what` unless `ok`.
inline void require_config(bool ok, const char* where, const std::string& what) {
  if (!ok) throw ConfigError(std::string(where) + ": " + what);
}

/// The same for a fixed message: a check that passes builds no string (a
/// literal bound to `const std::string&` would be copied to the heap on
/// every call, passing or not).
inline void require_config(bool ok, const char* where, const char* what) {
  if (!ok) throw ConfigError(std::string(where) + ": " + what);
}

/// The same with the message made by `what()` only when the check fails: the
/// form for checks on a per-call path (a decode step, a training product),
/// where building "got " + std::to_string(n) on every call would allocate.
template <class What, std::enable_if_t<std::is_invocable_r_v<std::string, What&>, int> = 0>
void require_config(bool ok, const char* where, What&& what) {
  if (!ok) throw ConfigError(std::string(where) + ": " + what());
}

/// Throws ValueError unless every entry of `m` is finite.
template <class Derived>
void check_finite(const char* where, const char* arg, const Eigen::DenseBase<Derived>& m) {
  if (!m.allFinite()) throw ValueError(std::string(where) + ": argument '" + arg + "' contains NaN or Inf");
}

}  // namespace detail
}  // namespace apex
