// The skip-gated FFN sublayer at inference against the ungated sublayer with
// the same weights, at skip rates 0 %, 30 % and 60 %, for a dense SwiGLU and
// for an MoE layer (the `small` preset: d = 512, f = 1376, h = 64; MoE with
// E = 8, K = 2, one shared expert). One thread, so the figures are the
// arithmetic of docs/math.md#skip-gate and not a thread-scheduling effect.
//
// The gate's output bias b₂ is set so that exactly round(p·N) tokens of the
// batch fall below τ (the tokens with the smallest W₂-term), so the skip rate
// is exact; the counter `skip_rate` is measured from a cache.
//
// Both sublayers are timed inside the same iteration, in alternating order,
// the ungated one while the benchmark's timer is paused: the benchmark's
// (real) time is the gated sublayer's, and a neighbour's load or a clock
// drift hits both alike. Counters:
//   time_ratio   median over iterations of t_gated / t_ungated (wall time)
//   speedup      1 / time_ratio
//   cpu_ratio    the same with this thread's CPU time: on a loaded host, where
//                waiting for a core inflates wall times, it is the steadier figure
//   model_ratio  the FLOP model: (gate + (1 − p)·FFN) / FFN, matrix products only
//   skip_rate    measured share of skipped tokens
//
// Allocator: every forward allocates its temporaries (megabytes here). With
// glibc's defaults, large blocks come from fresh mmap'd or re-grown heap
// pages, and their page faults cost up to ~40 % of a forward on a loaded
// host — a cost that jumps with glibc's dynamic mmap threshold rather than
// scaling with the rows computed. main() therefore keeps freed memory in the
// heap (M_MMAP_THRESHOLD / M_TRIM_THRESHOLD), so the figures measure the
// arithmetic; pass --keep_malloc_defaults to measure with the defaults.
//
//     bench_skip_gate --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
//
// reports the median over repetitions of every counter.
#include <apex/ffn/layers/ffn_sublayer.hpp>
#include <apex/ffn/moe/moe_ffn.hpp>
#include <apex/ffn/layers/skip_gate.hpp>
#include <apex/ffn/layers/swiglu.hpp>

#include <time.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "bench_common.hpp"

namespace {

using apex::Index;
using apex::Matrix;
using apex::bench::Clock;
using T = float;

constexpr Index kD = 512, kF = 1376, kH = 64;  // the `small` preset
constexpr Index kExperts = 8, kActive = 2, kShared = 1;

apex::SkipGateConfig gate_config() {
  apex::SkipGateConfig c;
  c.d_model = kD;
  c.hidden = kH;
  return c;
}

apex::MoEConfig moe_config() {
  apex::MoEConfig c;
  c.d_model = kD;
  c.d_ffn = kF;
  c.n_experts = kExperts;
  c.n_active = kActive;
  c.n_shared = kShared;
  return c;
}

/// CPU time of the calling thread, in seconds.
double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

/// Wall and thread-CPU seconds of one call.
struct Times {
  double wall, cpu;
};
template <class Fn>
Times measure(Fn&& fn) {
  const double c0 = thread_cpu_seconds();
  const auto t0 = Clock::now();
  fn();
  return {apex::bench::seconds_since(t0), thread_cpu_seconds() - c0};
}

double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

/// Sets b₂ so that exactly round(share·N) rows of x have g < τ.
void set_skip_share(apex::SkipGate<T>& gate, const Matrix<T>& x, double share) {
  typename apex::SkipGate<T>::Cache c;
  gate.forward(x, &c);
  std::vector<double> s0(std::size_t(x.rows()));
  for (Index t = 0; t < x.rows(); ++t) s0[std::size_t(t)] = double(c.s(t) - gate.b2());
  std::sort(s0.begin(), s0.end());
  const std::size_t k = std::size_t(std::lround(share * double(x.rows())));
  const double tau = double(gate.threshold());
  const double cut = k == 0 ? s0.front() - 2.0 : (k == s0.size() ? s0.back() + 2.0 : 0.5 * (s0[k - 1] + s0[k]));
  gate.b2() = T(std::log(tau / (1 - tau)) - cut);
}

template <class Sublayer>
void run(benchmark::State& state, Sublayer& gated, Sublayer& plain, double ffn_flops_per_token) {
  const double share = double(state.range(0)) / 100.0;
  const Index n = state.range(1);
  const Matrix<T> x = apex::bench::random_matrix<T>(n, kD, 7, 1.7);  // unit-variance features
  set_skip_share(*gated.skip_gate(), x, share);
  gated.set_mode(apex::SublayerMode::inference);
  plain.set_mode(apex::SublayerMode::inference);

  typename Sublayer::Cache cache;
  gated.forward(x, &cache);
  const double skip_rate = cache.skip_rate();

  auto run_gated = [&] {
    Matrix<T> y = gated.forward(x);
    benchmark::DoNotOptimize(y.data());
  };
  auto run_plain = [&] {
    Matrix<T> y = plain.forward(x);
    benchmark::DoNotOptimize(y.data());
  };
  run_gated();  // warm caches and allocator
  run_plain();

  std::vector<double> ratios, cpu_ratios;
  bool plain_first = false;
  for (auto _ : state) {
    Times tp{}, tg{};
    if (plain_first) {
      state.PauseTiming();
      tp = measure(run_plain);
      state.ResumeTiming();
      tg = measure(run_gated);
    } else {
      tg = measure(run_gated);
      state.PauseTiming();
      tp = measure(run_plain);
      state.ResumeTiming();
    }
    plain_first = !plain_first;
    ratios.push_back(tg.wall / tp.wall);
    cpu_ratios.push_back(tg.cpu / tp.cpu);
  }
  const double ratio = median(ratios);
  const double gate_flops = 2.0 * double(kD * kH + kH);
  state.counters["time_ratio"] = ratio;
  state.counters["speedup"] = 1.0 / ratio;
  state.counters["cpu_ratio"] = median(cpu_ratios);
  state.counters["model_ratio"] = (gate_flops + (1.0 - skip_rate) * ffn_flops_per_token) / ffn_flops_per_token;
  state.counters["skip_rate"] = skip_rate;
  state.SetItemsProcessed(state.iterations() * n);
}

void SwiGLUSublayer(benchmark::State& state) {
  apex::FFNSublayer<T, apex::SwiGLU<T>> gated(kD, apex::SwiGLU<T>(kD, kF, 1), apex::SkipGate<T>(gate_config(), 2));
  apex::FFNSublayer<T, apex::SwiGLU<T>> plain(kD, apex::SwiGLU<T>(kD, kF, 1));
  run(state, gated, plain, 6.0 * double(kD * kF));
}

void MoESublayer(benchmark::State& state) {
  using MoE = apex::MoEFFN<T>;
  MoE moe_gated(moe_config(), 1), moe_plain(moe_config(), 1);
  moe_gated.set_threads(1);
  moe_plain.set_threads(1);
  apex::FFNSublayer<T, MoE> gated(kD, std::move(moe_gated), apex::SkipGate<T>(gate_config(), 2));
  apex::FFNSublayer<T, MoE> plain(kD, std::move(moe_plain));
  // Router 2·d·E plus K routed and the shared experts, 6·d·f each.
  run(state, gated, plain, 2.0 * double(kD * kExperts) + double(kActive + kShared) * 6.0 * double(kD * kF));
}

// {skip %, tokens}
void Rates(benchmark::internal::Benchmark* b) {
  b->ArgNames({"skip_pct", "tokens"});
  for (Index n : {256, 32})
    for (Index p : {0, 30, 60}) b->Args({p, n});
  b->UseRealTime()->Unit(benchmark::kMillisecond);
}

}  // namespace

BENCHMARK(SwiGLUSublayer)->Apply(Rates);
BENCHMARK(MoESublayer)->Apply(Rates);

int main(int argc, char** argv) {
  Eigen::setNbThreads(1);
  bool keep_malloc_defaults = false;
  int kept_args = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--keep_malloc_defaults")
      keep_malloc_defaults = true;
    else
      argv[kept_args++] = argv[i];
  }
  argc = kept_args;
#ifdef __GLIBC__
  if (!keep_malloc_defaults) {
    // 32 MiB is the largest mmap threshold glibc accepts on 64-bit hosts;
    // every temporary here is smaller.
    if (mallopt(M_MMAP_THRESHOLD, 32 << 20) != 1 || mallopt(M_TRIM_THRESHOLD, 1 << 30) != 1)
      std::fprintf(stderr, "bench_skip_gate: mallopt failed; running with the allocator's defaults\n");
  }
#else
  (void)keep_malloc_defaults;
#endif
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
