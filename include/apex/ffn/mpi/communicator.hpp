#pragma once
/// \file mpi/communicator.hpp
/// The communicator every expert-parallel object talks through, and the rule
/// that keeps a fault on one rank from hanging the others.
///
/// `Communicator` duplicates the user's `MPI_Comm` (so the layer's messages
/// never match the user's), sets `MPI_ERRORS_RETURN` on the duplicate (an MPI
/// failure becomes an `MpiError`, not an abort), and frees it when the last
/// copy goes away (unless MPI is already finalised).
///
/// **Error agreement.** A collective blocks until every rank enters it. If one
/// rank throws between two collectives (a NaN router logit, a wrong shape on
/// that rank only) and the others go on into the next exchange, they wait
/// forever. So every local phase of a distributed operation runs inside
/// `step(where, fn)`: the phase's exception is caught, and all ranks agree
/// with one `MPI_Allreduce` (MIN of "my rank if I failed, else P") whether
/// anyone failed, before any rank enters a data collective. On failure the
/// lowest failing rank broadcasts its error's type and message; that rank
/// rethrows its own exception, every other rank throws the same apex type
/// with the message `where: rank r failed: <message>`. Cost when nothing
/// fails: one `MPI_Allreduce` per phase (a few µs on one node).
///
/// **Setting agreement.** A per-rank setting that shapes the messages (the
/// exchange chunk limit: one rank chunking and another not is a truncation
/// on one and a hang on the other) is passed to `step(where, same, fn)` as a
/// named int64; the same `MPI_Allreduce` (MIN over v and −v) gives every
/// rank the smallest and largest value, so a difference is the same
/// ConfigError on every rank before anyone enters the collective it shapes.

#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <memory>
#include <new>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../core/errors.hpp"

namespace apex::mpi {

/// An MPI call returned an error code (the message is MPI's error string).
class MpiError : public Error {
 public:
  using Error::Error;
};

namespace detail {

/// Throws MpiError naming `what` unless `rc` is MPI_SUCCESS.
inline void check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = 0;
  throw MpiError(std::string("MPI: ") + what + " failed: " + std::string(text, std::size_t(len)));
}

/// The error classes error agreement carries between ranks.
enum class ErrorKind : int { none = 0, shape, config, value, format, mpi, apex, bad_alloc, other };

inline ErrorKind classify(const std::exception_ptr& e, std::string& message) {
  try {
    std::rethrow_exception(e);
  } catch (const ShapeError& x) {
    message = x.what();
    return ErrorKind::shape;
  } catch (const ConfigError& x) {
    message = x.what();
    return ErrorKind::config;
  } catch (const ValueError& x) {
    message = x.what();
    return ErrorKind::value;
  } catch (const FormatError& x) {
    message = x.what();
    return ErrorKind::format;
  } catch (const MpiError& x) {
    message = x.what();
    return ErrorKind::mpi;
  } catch (const Error& x) {
    message = x.what();
    return ErrorKind::apex;
  } catch (const std::bad_alloc& x) {
    message = std::string("out of memory (") + x.what() + ")";
    return ErrorKind::bad_alloc;
  } catch (const std::exception& x) {
    message = x.what();
    return ErrorKind::other;
  } catch (...) {
    message = "unknown exception";
    return ErrorKind::other;
  }
}

/// The exception a rank that did not fail throws for another rank's error.
[[noreturn]] inline void throw_remote(ErrorKind kind, const std::string& message) {
  switch (kind) {
    case ErrorKind::shape: throw ShapeError(message);
    case ErrorKind::config: throw ConfigError(message);
    case ErrorKind::value: throw ValueError(message);
    case ErrorKind::format: throw FormatError(message);
    case ErrorKind::mpi: throw MpiError(message);
    default: throw Error(message);
  }
}

struct CommDeleter {
  void operator()(MPI_Comm* c) const {
    int finalized = 1;
    MPI_Finalized(&finalized);
    if (!finalized && *c != MPI_COMM_NULL) MPI_Comm_free(c);
    delete c;
  }
};

}  // namespace detail

/// The MPI datatype of a scalar the layer exchanges.
template <class T>
MPI_Datatype datatype() {
  if constexpr (std::is_same_v<T, double>) return MPI_DOUBLE;
  else if constexpr (std::is_same_v<T, float>) return MPI_FLOAT;
  else if constexpr (std::is_same_v<T, std::int64_t>) return MPI_INT64_T;
  else if constexpr (std::is_same_v<T, int>) return MPI_INT;
  else if constexpr (std::is_same_v<T, char>) return MPI_CHAR;
  else static_assert(sizeof(T) == 0, "apex::mpi::datatype: no MPI datatype for this scalar");
}

/// A value that must be the same on every rank (see setting agreement), and
/// its name for the message, e.g. "the exchange limit (set_exchange_limit)".
struct Agreed {
  const char* name;
  std::int64_t value;
};

/// The bits of a double, to agree on its exact value.
inline std::int64_t bits_of(double v) {
  std::int64_t bits = 0;
  std::memcpy(&bits, &v, sizeof bits);
  return bits;
}

/// A duplicate of an `MPI_Comm`, shared by copies, with error agreement.
class Communicator {
 public:
  /// Duplicates `comm` (collective over `comm`). MpiError if MPI is not
  /// initialised or the duplication fails.
  explicit Communicator(MPI_Comm comm = MPI_COMM_WORLD) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) throw MpiError("apex::mpi::Communicator: MPI is not initialised (call MPI_Init first)");
    std::unique_ptr<MPI_Comm, detail::CommDeleter> dup(new MPI_Comm(MPI_COMM_NULL));
    detail::check(MPI_Comm_dup(comm, dup.get()), "MPI_Comm_dup");
    detail::check(MPI_Comm_set_errhandler(*dup, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    detail::check(MPI_Comm_rank(*dup, &rank_), "MPI_Comm_rank");
    detail::check(MPI_Comm_size(*dup, &size_), "MPI_Comm_size");
    comm_ = std::shared_ptr<MPI_Comm>(dup.release(), detail::CommDeleter{});
  }

  int rank() const { return rank_; }
  int size() const { return size_; }
  MPI_Comm get() const { return *comm_; }

  /// Agrees on whether any rank failed its local phase (`error` null: this
  /// rank did not) and on every value of `same`. Collective. If any rank
  /// failed, throws on every rank (see the file comment); else if a value of
  /// `same` differs between ranks, throws the same ConfigError on every rank;
  /// otherwise returns.
  void agree(const char* where, const std::exception_ptr& error, std::initializer_list<Agreed> same = {}) const {
    // [first failing rank, v₀, −v₀, v₁, −v₁, …], reduced by MIN: one call.
    std::vector<std::int64_t> mine{error ? rank_ : size_}, all(1 + 2 * same.size());
    for (const Agreed& a : same) {
      const std::int64_t v = std::max<std::int64_t>(a.value, INT64_MIN + 1);  // −v must exist
      mine.push_back(v);
      mine.push_back(-v);
    }
    detail::check(MPI_Allreduce(mine.data(), all.data(), int(mine.size()), MPI_INT64_T, MPI_MIN, get()),
                  "MPI_Allreduce (error agreement)");
    if (all[0] != size_) raise(where, error, int(all[0]));
    std::size_t i = 1;
    for (const Agreed& a : same) {
      const std::int64_t low = all[i], high = -all[i + 1];
      i += 2;
      if (low != high)
        throw ConfigError(std::string(where) + ": " + a.name + " differs between ranks, got values from " +
                          std::to_string(low) + " to " + std::to_string(high) +
                          "; every rank must use the same value");
    }
  }

  /// Runs the local phase `fn` and agrees on its outcome (collective): returns
  /// on every rank or throws on every rank.
  template <class Fn>
  void step(const char* where, Fn&& fn) const {
    step(where, {}, std::forward<Fn>(fn));
  }
  /// As step(where, fn), also agreeing on every value of `same` (setting agreement).
  template <class Fn>
  void step(const char* where, std::initializer_list<Agreed> same, Fn&& fn) const {
    std::exception_ptr error;
    try {
      fn();
    } catch (...) {
      error = std::current_exception();
    }
    agree(where, error, same);
  }

  void barrier() const { detail::check(MPI_Barrier(get()), "MPI_Barrier"); }

 private:
  /// The error path of agree: rank `first` failed and tells the others what went wrong.
  [[noreturn]] void raise(const char* where, const std::exception_ptr& error, int first) const {
    std::string message;
    int head[2] = {0, 0};  // kind, message length
    if (rank_ == first) {
      head[0] = int(detail::classify(error, message));
      if (message.size() > 4096) message.resize(4096);
      head[1] = int(message.size());
    }
    detail::check(MPI_Bcast(head, 2, MPI_INT, first, get()), "MPI_Bcast (error agreement)");
    message.resize(std::size_t(head[1]));
    if (head[1] > 0) detail::check(MPI_Bcast(message.data(), head[1], MPI_CHAR, first, get()), "MPI_Bcast (error agreement)");
    if (error) std::rethrow_exception(error);
    detail::throw_remote(detail::ErrorKind(head[0]),
                         std::string(where) + ": rank " + std::to_string(first) + " failed: " + message);
  }

  std::shared_ptr<MPI_Comm> comm_;
  int rank_ = 0, size_ = 1;
};

}  // namespace apex::mpi
