// κ-SwiGLU against SwiGLU at the same shapes, forward and forward + backward:
// one expert block (float and double) and a whole MoE layer (float), one
// thread — inside MoEFFN every expert block runs single-threaded and the
// threads go over experts and row tiles.
//
// The figure that matters is the overhead ratio, and benchmark hosts are often
// shared and noisy. So both layers are timed inside the same benchmark
// iteration, one right after the other (as bench_common.hpp's `interleaved`),
// with the order alternating between iterations so that neither always runs
// on caches the other warmed; a drift in clock speed or a neighbour's load
// hits both alike. Each iteration yields one ratio t_κ / t_SwiGLU, and the
// counter `overhead_pct` is the median of those ratios minus 1, in percent:
// the median ignores the iterations a neighbour disturbed. (A ratio of the two
// fastest iterations is far less stable: the two minima come from different
// moments.) `swiglu_us` and `kappa_us` are mean times; the benchmark's own
// time is the κ-SwiGLU time.
//
//     bench_kappa --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
//
// reports the median over repetitions of every counter.
#include <apex/ffn/layers/kappa_swiglu.hpp>
#include <apex/ffn/moe/moe_ffn.hpp>
#include <apex/ffn/layers/swiglu.hpp>

#include <algorithm>
#include <vector>

#include "bench_common.hpp"

namespace {

using apex::Index;
using apex::bench::Clock;

template <class T>
struct Setup {
  apex::SwiGLU<T> plain;
  apex::KappaSwiGLU<T> kappa;
  apex::Matrix<T> x, dy;
  apex::Vector<T> logit;

  Setup(Index d, Index f, Index n)
      : plain(d, f, 1),
        kappa(d, f, 1),
        x(apex::bench::random_matrix<T>(n, d, 2)),
        dy(apex::bench::random_matrix<T>(n, d, 3)),
        logit(n) {
    apex::Rng rng(4);
    for (Index t = 0; t < n; ++t) logit(t) = T(rng.normal() * 2.0);
    // A trained state: α, b away from 0 (the cost does not depend on their values).
    apex::fill_uniform(kappa.kappa_alpha(), rng, 0.5);
    apex::fill_uniform(kappa.kappa_bias(), rng, 0.5);
  }
};

/// Times `plain` and `kappa` alternately (order flipping every iteration) and
/// sets the counters described at the top.
template <class Plain, class Kappa>
void compare(benchmark::State& state, Plain&& plain, Kappa&& kappa) {
  auto seconds = [](auto&& fn) {
    const auto t0 = Clock::now();
    fn();
    return apex::bench::seconds_since(t0);
  };
  plain();  // warm caches and allocator
  kappa();
  std::vector<double> ratios;
  double sum_plain = 0, sum_kappa = 0;
  bool kappa_first = false;
  for (auto _ : state) {
    double tp, tk;
    if (kappa_first) {
      tk = seconds(kappa);
      tp = seconds(plain);
    } else {
      tp = seconds(plain);
      tk = seconds(kappa);
    }
    kappa_first = !kappa_first;
    state.SetIterationTime(tk);
    ratios.push_back(tk / tp);
    sum_plain += tp;
    sum_kappa += tk;
  }
  std::nth_element(ratios.begin(), ratios.begin() + ratios.size() / 2, ratios.end());
  const double iters = double(state.iterations());
  state.counters["overhead_pct"] = 100.0 * (ratios[ratios.size() / 2] - 1.0);
  state.counters["swiglu_us"] = 1e6 * sum_plain / iters;
  state.counters["kappa_us"] = 1e6 * sum_kappa / iters;
}

/// One expert block: SwiGLU against κ-SwiGLU.
template <class T>
void run(benchmark::State& state, bool backward) {
  const Index d = state.range(0), f = state.range(1), n = state.range(2);
  Setup<T> s(d, f, n);
  typename apex::SwiGLU<T>::Cache pc;
  typename apex::KappaSwiGLU<T>::Cache kc;
  compare(
      state,
      [&] {
        apex::Matrix<T> y = s.plain.forward(s.x, backward ? &pc : nullptr);
        benchmark::DoNotOptimize(y.data());
        if (backward) {
          apex::Matrix<T> dx = s.plain.backward(s.dy, pc);
          benchmark::DoNotOptimize(dx.data());
        }
      },
      [&] {
        apex::Matrix<T> y = s.kappa.forward(s.x, s.logit, backward ? &kc : nullptr);
        benchmark::DoNotOptimize(y.data());
        if (backward) {
          auto g = s.kappa.backward(s.dy, kc);
          benchmark::DoNotOptimize(g.dx.data());
        }
      });
  // Matrix-product work (the same for both): 6ndf forward, 18ndf with backward.
  const double flops = double(backward ? 18 : 6) * double(n * d * f);
  state.counters["GFLOP/s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(backward ? "forward+backward" : "forward");
}

/// A whole MoE layer (`small` preset shapes: d = 512, f = 1376, E = 8, K = 2,
/// one shared expert), one thread: MoEFFN<float> against
/// MoEFFN<float, KappaSwiGLU<float>>. The router and the shared expert are
/// common to both, so the layer's overhead is below the expert's.
void MoELayer(benchmark::State& state) {
  const bool backward = state.range(0) != 0;
  const Index n = state.range(1);
  apex::MoEConfig cfg = apex::ModelPreset::small().moe();
  apex::MoEFFN<float> plain(cfg, 1);
  apex::MoEFFN<float, apex::KappaSwiGLU<float>> kappa(cfg, 1);
  plain.set_threads(1);
  kappa.set_threads(1);
  apex::Rng rng(5);
  for (auto& e : kappa.experts()) {
    apex::fill_uniform(e.kappa_alpha(), rng, 0.5);
    apex::fill_uniform(e.kappa_bias(), rng, 0.5);
  }
  const apex::Matrix<float> x = apex::bench::random_matrix<float>(n, cfg.d_model, 6);
  const apex::Matrix<float> dy = apex::bench::random_matrix<float>(n, cfg.d_model, 7);
  apex::MoEFFN<float>::Cache pc;
  apex::MoEFFN<float, apex::KappaSwiGLU<float>>::Cache kc;
  compare(
      state,
      [&] {
        apex::Matrix<float> y = plain.forward(x, &pc);
        benchmark::DoNotOptimize(y.data());
        if (backward) {
          apex::Matrix<float> dx = plain.backward(dy, pc);
          benchmark::DoNotOptimize(dx.data());
        }
      },
      [&] {
        apex::Matrix<float> y = kappa.forward(x, &kc);
        benchmark::DoNotOptimize(y.data());
        if (backward) {
          apex::Matrix<float> dx = kappa.backward(dy, kc);
          benchmark::DoNotOptimize(dx.data());
        }
      });
  state.counters["tokens/s"] = benchmark::Counter(double(n), benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(backward ? "forward+backward" : "forward");
}

void Forward(benchmark::State& state) { run<float>(state, false); }
void ForwardBackward(benchmark::State& state) { run<float>(state, true); }
void ForwardDouble(benchmark::State& state) { run<double>(state, false); }
void ForwardBackwardDouble(benchmark::State& state) { run<double>(state, true); }

// {d, f, rows}: realistic expert blocks (d = 1024, f = 512; the `small`
// preset's d = 512, f = 1376) at 256 rows, and a decode-sized block.
void Shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"d", "f", "rows"});
  b->Args({1024, 512, 256});
  b->Args({512, 1376, 256});
  b->Args({512, 1376, 16});
  b->UseManualTime()->Unit(benchmark::kMicrosecond);
}

}  // namespace

BENCHMARK(Forward)->Apply(Shapes);
BENCHMARK(ForwardBackward)->Apply(Shapes);
BENCHMARK(ForwardDouble)->Apply(Shapes);
BENCHMARK(ForwardBackwardDouble)->Apply(Shapes);
BENCHMARK(MoELayer)
    ->ArgNames({"backward", "tokens"})
    ->Args({0, 512})
    ->Args({1, 512})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

int main(int argc, char** argv) {
  Eigen::setNbThreads(1);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
