#pragma once
// Shared helpers for the benchmark binaries.
//
// Every speed figure is a ratio against a baseline timed in the same run.
// `Interleaved` times the code under test and its baseline alternately inside
// one benchmark loop (manual time = the code under test), so drift and other
// load on a shared machine hit both alike; the ratio is reported as a counter.

#include <apex/ffn/core/init.hpp>
#include <apex/ffn/core/types.hpp>
#include <benchmark/benchmark.h>

#include <chrono>
#include <fstream>
#include <string>

namespace apex::bench {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

/// Random row-major matrix U(−scale, scale), seeded.
template <class T>
Matrix<T> random_matrix(Index rows, Index cols, std::uint64_t seed, double scale = 1.0) {
  Rng rng(seed);
  Matrix<T> m(rows, cols);
  fill_uniform(m, rng, scale);
  return m;
}

/// Runs `subject` and `baseline` alternately for the benchmark's iterations;
/// the benchmark's (manual) time is the subject's; adds counter `name` =
/// subject time / baseline time.
template <class Subject, class Baseline>
void interleaved(benchmark::State& state, const char* name, Subject&& subject, Baseline&& baseline) {
  double subject_total = 0, baseline_total = 0;
  for (auto _ : state) {
    auto t0 = Clock::now();
    subject();
    const double s = seconds_since(t0);
    t0 = Clock::now();
    baseline();
    baseline_total += seconds_since(t0);
    subject_total += s;
    state.SetIterationTime(s);
  }
  state.counters[name] = baseline_total > 0 ? subject_total / baseline_total : 0.0;
}

/// Dense product Y = X·Wᵀ with X: m × k, W: n × k — the roofline baseline of
/// "the same FLOPs (2·m·k·n) as one matrix product with the same GEMM engine".
template <class T>
struct DenseProduct {
  Matrix<T> x, w, y;
  DenseProduct(Index m, Index k, Index n) : x(random_matrix<T>(m, k, 1)), w(random_matrix<T>(n, k, 2)), y(m, n) {}
  void run() {
    y.noalias() = x * w.transpose();
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  double flops() const { return 2.0 * double(x.rows()) * double(x.cols()) * double(w.rows()); }
};

/// VmRSS of this process in bytes (/proc/self/status), 0 where unknown: the
/// resident benchmarks' reading (a fresh process per figure, since pages an
/// earlier benchmark freed are reused without growth).
inline double vm_rss() {
  std::ifstream f("/proc/self/status");
  std::string key;
  while (f >> key) {
    if (key == "VmRSS:") {
      double kb = 0;
      f >> kb;
      return kb * 1024.0;
    }
    std::getline(f, key);
  }
  return 0;
}

}  // namespace apex::bench
