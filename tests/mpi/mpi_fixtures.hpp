#pragma once
// Helpers of the MPI tests: every rank builds the same global batch and the
// same single-process reference layer, and compares its own slice.

#include <apex/ffn/mpi/communicator.hpp>
#include <apex/ffn/core/param.hpp>
#include <apex/ffn/core/types.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "fixtures.hpp"

namespace apex::test {

/// Rows [begin, begin + rows) of a global batch of sum(sizes) tokens belong
/// to this rank; `all` is the concatenation every rank can rebuild.
struct Slice {
  Index begin = 0, rows = 0, total = 0;
};

inline Slice slice_of(const mpi::Communicator& comm, const std::vector<Index>& sizes) {
  Slice s;
  for (int r = 0; r < comm.size(); ++r) {
    const Index n = sizes[std::size_t(r) % sizes.size()];
    if (r < comm.rank()) s.begin += n;
    if (r == comm.rank()) s.rows = n;
    s.total += n;
  }
  return s;
}

/// max |a − b| / max |b| (0 when both are 0): the relative error of a tensor.
template <class A, class B>
double rel_error(const A& a, const B& b) {
  if (a.rows() != b.rows() || a.cols() != b.cols()) return 1e300;
  if (a.size() == 0) return 0;
  const double scale = double(b.cwiseAbs().maxCoeff());
  const double diff = double((a - b).cwiseAbs().maxCoeff());
  return scale > 0 ? diff / scale : diff;
}

template <class T>
std::map<std::string, Param<T>> by_name(const ParamList<T>& params) {
  std::map<std::string, Param<T>> m;
  for (const auto& p : params) m.emplace(p.name, p);
  return m;
}

/// Copies values of every parameter of `to` from the same-named one of `from`.
template <class T>
void copy_values(const ParamList<T>& from, const ParamList<T>& to) {
  auto src = by_name(from);
  for (const auto& p : to) {
    REQUIRE(src.count(p.name) == 1);
    p.value() = src.at(p.name).value();
  }
}

/// Every parameter of `mine` (a rank's subset) against the reference's:
/// values equal, gradients within `tol` relative.
template <class T>
void check_params_match(const ParamList<T>& mine, const ParamList<T>& ref, double tol) {
  auto r = by_name(ref);
  for (const auto& p : mine) {
    INFO("parameter " << p.name);
    REQUIRE(r.count(p.name) == 1);
    CHECK(p.value() == r.at(p.name).value());
    CHECK(rel_error(p.grad(), r.at(p.name).grad()) <= tol);
  }
}

/// Snapshot of the gradients (for bitwise run-to-run comparisons).
template <class T>
std::vector<Matrix<T>> grads_of(const ParamList<T>& params) {
  std::vector<Matrix<T>> g;
  for (const auto& p : params) g.push_back(p.grad());
  return g;
}

/// Runs fn and checks it throws E (exactly that class or a subclass) with
/// every string of `texts` in its message; one evaluation, so a collective
/// call is made exactly once on every rank.
template <class E, class Fn>
void throws(Fn&& fn, const std::vector<std::string>& texts = {}) {
  try {
    fn();
    FAIL_CHECK("no exception thrown");
  } catch (const E& e) {
    for (const auto& t : texts) CHECK_THAT(std::string(e.what()), Catch::Matchers::Contains(t));
  } catch (const std::exception& e) {
    FAIL_CHECK("another exception type: " << e.what());
  }
}

/// Ends the process (exit code 3, naming `what`) unless the scope is left
/// within `seconds`. A rank left alone in a collective blocks until the
/// CTest timeout, and its peers' later calls may pair with the wrong
/// messages; this turns such a hang into a prompt, named failure (mpiexec
/// then stops the job, since a rank exited without MPI_Finalize).
class HangGuard {
 public:
  explicit HangGuard(std::string what, double seconds = 60) : what_(std::move(what)) {
    watcher_ = std::thread([this, seconds] {
      std::unique_lock<std::mutex> lock(mutex_);
      if (!done_cv_.wait_for(lock, std::chrono::duration<double>(seconds), [this] { return done_; })) {
        std::fprintf(stderr, "HANG: '%s' did not return within %g s on this rank\n", what_.c_str(), seconds);
        std::fflush(stderr);
        std::_Exit(3);
      }
    });
  }
  HangGuard(const HangGuard&) = delete;
  HangGuard& operator=(const HangGuard&) = delete;
  ~HangGuard() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      done_ = true;
    }
    done_cv_.notify_one();
    watcher_.join();
  }

 private:
  std::string what_;
  std::mutex mutex_;
  std::condition_variable done_cv_;
  bool done_ = false;
  std::thread watcher_;
};

}  // namespace apex::test
