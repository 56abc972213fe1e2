// Dense SwiGLU forward and forward+backward: GFLOP/s, and the ratio to one
// dense matrix product of the same FLOPs timed in the same loop.
//
//   forward          6·N·d·f FLOPs  ≡  X (N×d) · W (3f×d)ᵀ
//   forward+backward 18·N·d·f FLOPs ≡  X (N×d) · W (9f×d)ᵀ
#include <apex/ffn/layers/swiglu.hpp>

#include "bench_common.hpp"

namespace {

using namespace apex;
using apex::bench::DenseProduct;
using apex::bench::random_matrix;

void swiglu_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"N", "d", "f"});
  for (auto shape : {std::pair<Index, Index>{512, 1376}, {1024, 2816}})
    for (Index n : {1, 16, 256, 2048}) b->Args({n, shape.first, shape.second});
  b->UseManualTime()->Unit(benchmark::kMillisecond);
}

void BM_SwiGLU_Forward(benchmark::State& state) {
  const Index n = state.range(0), d = state.range(1), f = state.range(2);
  SwiGLU<float> ffn(d, f, 1);
  const Matrix<float> x = random_matrix<float>(n, d, 3);
  DenseProduct<float> dense(n, d, 3 * f);
  bench::interleaved(
      state, "x_dense",
      [&] {
        Matrix<float> y = ffn.forward(x);
        benchmark::DoNotOptimize(y.data());
      },
      [&] { dense.run(); });
  state.counters["GFLOP/s"] = benchmark::Counter(dense.flops() * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["tokens/s"] = benchmark::Counter(double(n), benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_SwiGLU_Forward)->Apply(swiglu_args);

void BM_SwiGLU_ForwardBackward(benchmark::State& state) {
  const Index n = state.range(0), d = state.range(1), f = state.range(2);
  SwiGLU<float> ffn(d, f, 1);
  const Matrix<float> x = random_matrix<float>(n, d, 3);
  const Matrix<float> dy = random_matrix<float>(n, d, 4);
  DenseProduct<float> dense(n, d, 9 * f);
  SwiGLU<float>::Cache cache;
  bench::interleaved(
      state, "x_dense",
      [&] {
        Matrix<float> y = ffn.forward(x, &cache);
        Matrix<float> dx = ffn.backward(dy, cache);
        benchmark::DoNotOptimize(dx.data());
      },
      [&] { dense.run(); });
  state.counters["GFLOP/s"] = benchmark::Counter(dense.flops() * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["tokens/s"] = benchmark::Counter(double(n), benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_SwiGLU_ForwardBackward)->Apply(swiglu_args);

}  // namespace

BENCHMARK_MAIN();
