#pragma once
// Machinery of the error-handling sweeps that each test file runs over its
// own layer: wrong shapes (rows and columns off by one, zero columns, a
// backward cache from another batch), impossible configurations and
// non-finite values. Each call must raise its typed exception (ShapeError,
// ConfigError, ValueError, FormatError — all apex::Error) with a message
// naming the function and the argument, or, where the library propagates NaN
// instead of checking (dense activations: a check would cost a pass over
// memory, see docs/error_model.md), return the NaN in the affected rows only
// and leave every other row bitwise unchanged. These tests carry the tag
// [sweeps].
//
// Tests tagged [regression] document defects the headers had: each names the
// header, the input and the fix, and fails if the defect returns. A defect
// still open would be tagged [bug][!mayfail] instead, and become a
// [regression] test once fixed. Calls that crashed before their fix run in a
// forked child process (outcome_isolated), so a regression fails its own test
// instead of ending the whole run.

#include <apex/ffn/core/errors.hpp>
#include <apex/ffn/core/types.hpp>

#include <catch2/catch.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstring>
#include <functional>
#include <iostream>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "fixtures.hpp"

namespace apex::test {

inline const double kNaN = std::numeric_limits<double>::quiet_NaN();
inline const double kInf = std::numeric_limits<double>::infinity();

inline std::string shape(Index rows, Index cols) { return "[" + std::to_string(rows) + " x " + std::to_string(cols) + "]"; }

/// What a call did, as one string: "returned", or "<exception type>: <what()>".
/// Most-derived types first, so the string names the exact type thrown.
inline std::string outcome(const std::function<void()>& call) {
  try {
    call();
    return "returned";
  } catch (const ShapeError& e) {
    return std::string("ShapeError: ") + e.what();
  } catch (const ConfigError& e) {
    return std::string("ConfigError: ") + e.what();
  } catch (const ValueError& e) {
    return std::string("ValueError: ") + e.what();
  } catch (const FormatError& e) {
    return std::string("FormatError: ") + e.what();
  } catch (const Error& e) {
    return std::string("apex::Error: ") + e.what();
  } catch (const std::exception& e) {
    return std::string("std::exception (not apex::Error): ") + e.what();
  } catch (...) {
    return "an exception not derived from std::exception";
  }
}

/// outcome(call) computed in a forked child process, so an abort (a failed
/// eigen_assert), a segfault or a sanitizer report ends the child only and
/// comes back as "died: …" with the start of what the child wrote to stderr.
/// OpenMP is not fork-safe: a child must not open a team of more than one
/// thread (it would wait for workers that were not forked), so MoE layers
/// probed here run with set_threads(1).
inline std::string outcome_isolated(const std::function<void()>& call) {
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  int pipe_fd[2];
  if (::pipe(pipe_fd) != 0) return "could not create a pipe";
  std::FILE* err = std::tmpfile();
  const pid_t pid = ::fork();
  if (pid < 0) return "could not fork";
  if (pid == 0) {
    ::close(pipe_fd[0]);
    // The test framework's crash handlers (inherited) would report in the
    // child; the parent judges the child by how it ended instead.
    for (int sig : {SIGABRT, SIGSEGV, SIGFPE, SIGILL, SIGBUS, SIGTERM, SIGINT}) std::signal(sig, SIG_DFL);
    if (err) {
      ::dup2(::fileno(err), STDOUT_FILENO);
      ::dup2(::fileno(err), STDERR_FILENO);
    }
    ::alarm(30);  // a hang becomes SIGALRM
    const std::string r = outcome(call);
    const ssize_t written = ::write(pipe_fd[1], r.data(), r.size());
    ::_exit(written == ssize_t(r.size()) ? 0 : 3);
  }
  ::close(pipe_fd[1]);
  std::string result;
  char buf[512];
  for (ssize_t got; (got = ::read(pipe_fd[0], buf, sizeof buf)) > 0;) result.append(buf, std::size_t(got));
  ::close(pipe_fd[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  std::string diag;
  if (err) {
    std::rewind(err);
    char line[240];
    const std::size_t n = std::fread(line, 1, sizeof line, err);
    diag.assign(line, n);
    std::fclose(err);
  }
  if (WIFSIGNALED(status))
    return "died: signal " + std::to_string(WTERMSIG(status)) + " (" + strsignal(WTERMSIG(status)) + ")" +
           (diag.empty() ? "" : ": " + diag);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    return "died: exit status " + std::to_string(WEXITSTATUS(status)) + (diag.empty() ? "" : ": " + diag);
  return result;
}

/// Checks that `got` (an outcome string) is exception `type` and its message
/// contains every one of `names` (the function, the argument or field).
inline void expect(const std::string& got, const std::string& type, const std::vector<std::string>& names) {
  CHECK_THAT(got, Catch::Matchers::StartsWith(type + ": "));
  if (got.rfind(type + ": ", 0) != 0) return;  // one failure per call is enough
  for (const std::string& n : names) CHECK_THAT(got, Catch::Matchers::Contains(n));
}

/// One row of a sweep table.
struct Case {
  std::string what;                ///< the call, shown when the case fails
  std::function<void()> call;
  std::string type;                ///< "ShapeError", "ConfigError", "ValueError" or "FormatError"
  std::vector<std::string> names;  ///< substrings the message must contain
};

inline void run_sweep(const std::vector<Case>& cases) {
  for (const Case& c : cases) {
    INFO("case: " << c.what);
    expect(outcome(c.call), c.type, c.names);
  }
}

/// A forward over N × d (any N) fed d − 1, d + 1 and 0 columns.
template <class T, class Fwd>
void add_width_cases(std::vector<Case>& cases, const std::string& fn, const std::string& arg, Index n, Index d,
                     Fwd fwd) {
  for (Index w : {d - 1, d + 1, Index(0)})
    cases.push_back({fn + " with " + arg + " " + shape(n, w), [=] { fwd(Matrix<T>::Ones(n, w)); }, "ShapeError",
                     {fn, "'" + arg + "'", shape(n, w)}});
}

/// A backward whose cache holds n rows fed an upstream gradient with rows
/// off by one, no rows, columns off by one and no columns.
template <class T, class Bwd>
void add_grad_cases(std::vector<Case>& cases, const std::string& fn, const std::string& arg, Index n, Index cols,
                    Bwd bwd) {
  const std::pair<Index, Index> shapes[] = {{n - 1, cols}, {n + 1, cols}, {0, cols}, {n, cols - 1}, {n, cols + 1}, {n, 0}};
  for (const auto& rc : shapes) {
    const Index r = rc.first, c = rc.second;  // named copies: C++17 lambdas cannot capture structured bindings
    cases.push_back({fn + " with " + arg + " " + shape(r, c) + " for a cache of " + std::to_string(n) + " rows",
                     [=] { bwd(Matrix<T>::Ones(r, c)); }, "ShapeError", {fn, "'" + arg + "'", shape(r, c)}});
  }
}

/// Runs `f` on an n × d input with NaN in row 1 and +Inf in row 3: it must
/// not throw, rows 1 and 3 of the output must be non-finite (row 1 NaN) and
/// every other row bitwise equal to the output of the clean input.
template <class T, class F>
void check_nan_stays_in_its_row(Index n, Index d, F f) {
  INFO("batch of " << n << " rows");
  const Matrix<T> clean = rnd<T>(n, d, 70 + std::uint64_t(n));
  Matrix<T> dirty = clean;
  dirty(1, 0) = T(kNaN);
  dirty(3, d - 1) = T(kInf);
  const Matrix<T> y_clean = f(clean);
  Matrix<T> y;
  REQUIRE_NOTHROW(y = f(dirty));
  REQUIRE(y.rows() == n);
  CHECK(y.row(1).hasNaN());
  CHECK_FALSE(y.row(3).allFinite());
  CHECK(y_clean.allFinite());
  for (Index t = 0; t < n; ++t)
    if (t != 1 && t != 3) CHECK(y.row(t) == y_clean.row(t));
}

// Every backward checks dy against the cache's row count, so a
// default-constructed Cache with dy of N > 0 rows raises ShapeError — but
// with an empty batch (dy 0 × d) that check passes, and an empty cache used
// to be read as if filled. Each backward therefore checks its cache's own
// shapes first, raising ShapeError naming 'cache', as
// MultiTokenHeads::backward always did with `cache.h`.

/// A backward of one layer with an unfilled cache and an empty batch.
struct CacheProbe {
  const char* layer;
  std::function<void()> call;
};

inline void expect_cache_rejected(const std::vector<CacheProbe>& probes, const char* what) {
  for (const CacheProbe& p : probes) {
    INFO(p.layer << "::backward with " << what);
    const std::string got = outcome_isolated(p.call);
    CHECK_THAT(got, Catch::Matchers::StartsWith("ShapeError: ") || Catch::Matchers::StartsWith("ValueError: "));
    CHECK_THAT(got, Catch::Matchers::Contains(std::string(p.layer) + "::backward"));
    CHECK_THAT(got, Catch::Matchers::Contains("cache"));
  }
}

}  // namespace apex::test
