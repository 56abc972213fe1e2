#pragma once
/// \file core/parallel.hpp
/// The library's one threading primitive: a dynamic-schedule loop over
/// independent tasks. OpenMP when the translation unit is compiled with it,
/// a plain loop otherwise; the library target itself never links OpenMP.
///
/// Determinism: tasks must write disjoint outputs and not depend on which
/// thread runs them, so results are bitwise identical for any thread count.
/// Inside the loop Eigen's own products run single-threaded (Eigen detects the
/// enclosing parallel region), so threads never nest.

#include <algorithm>
#include <exception>

#include "types.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace apex {

/// Threads the library may use: `requested` if positive, else OpenMP's
/// default (1 without OpenMP).
inline int resolve_threads(int requested) {
#ifdef _OPENMP
  return requested > 0 ? requested : omp_get_max_threads();
#else
  (void)requested;
  return 1;
#endif
}

namespace detail {

/// Runs fn(i) for i in [0, n) on up to `threads` threads (dynamic schedule).
///
/// Every call opens an OpenMP region — also with one thread — and sets the
/// region's thread budget to 1, so Eigen products inside `fn` always run
/// single-threaded: a product Eigen parallelises itself blocks its reduction
/// differently from a sequential one, which would make results depend on the
/// thread count. (A user who calls `Eigen::setNbThreads(n)` overrides this
/// budget; results then stay correct but may differ in the last bits between
/// thread counts.) An exception thrown by `fn` is rethrown on the calling
/// thread once the loop ends; exceptions must not cross an OpenMP region.
template <class Fn>
void parallel_for(Index n, int threads, Fn&& fn) {
  if (n <= 0) return;
#ifdef _OPENMP
  std::exception_ptr error;
#pragma omp parallel num_threads(int(std::min<Index>(threads > 1 ? threads : 1, n)))
  {
    omp_set_num_threads(1);  // this region's tasks only: Eigen stays sequential
#pragma omp for schedule(dynamic, 1)
    for (Index i = 0; i < n; ++i) {
      try {
        fn(i);
      } catch (...) {
#pragma omp critical(apex_parallel_for_error)
        if (!error) error = std::current_exception();
      }
    }
  }
  if (error) std::rethrow_exception(error);
#else
  (void)threads;
  for (Index i = 0; i < n; ++i) fn(i);
#endif
}

/// Runs fn() once with Eigen's own threading off (see parallel_for).
template <class Fn>
void serial(Fn&& fn) {
  parallel_for(1, 1, [&](Index) { fn(); });
}

}  // namespace detail
}  // namespace apex
