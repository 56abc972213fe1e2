// Packed expert engine (include/apex/ffn/packed/) against the library's
// current expert path, one SwiGLU expert at a time, single-threaded.
//
// Per (d, f, m) one benchmark times, alternately inside the same loop and in a
// rotating order (so drift and other load on a shared machine hit all alike):
//   eigen  — float weights, `detail::linear_nt` for [G | U] = X·W_guᵀ, SiLU·U,
//            `linear_nt` again for the down product (SwiGLU::forward_block);
//   f32    — packed float weights, fused kernel;
//   bf16   — packed bf16 weights, fused kernel (widened products up to 32
//            rows, `vdpbf16ps` above when the build targets AVX-512 BF16).
// The benchmark's time is bf16's; counters give each variant's rate in weight
// GB/s (logical bytes 3·d·f·sizeof) and GFLOP/s (6·m·d·f), the speedups
// f32/eigen and bf16/f32, and the fraction of the read bandwidth reached
// (`stream`: one thread summing as many cold bytes as the float expert holds,
// timed in the same loop).
//
// Caches are cold for the weights: each variant cycles through a pool of
// distinct experts of at least APEX_BENCH_POOL_MB (default 640 MB of float
// weights, twice this machine class's 300 MB L3), as a MoE decode step reads
// each expert once.
//
//   cmake --preset bench && cmake --build --preset bench --target bench_packed
//   build/bench/benchmarks/bench_packed --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
#include <apex/ffn/layers/activations.hpp>
#include <apex/ffn/layers/linear.hpp>
#include <apex/ffn/kernels/fused_expert.hpp>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "bench_common.hpp"

namespace {

using namespace apex;
using apex::bench::Clock;
using apex::bench::seconds_since;

/// The read-bandwidth baseline: one thread summing `bytes` of a 1 GiB buffer
/// allocated as the packed weights are (2 MiB-aligned, huge pages offered), a
/// different slice each call so it is cold like the experts. Timed inside the
/// same loop as the kernels, so the bandwidth fractions survive a machine
/// whose load changes during the run.
class StreamRead {
 public:
  StreamRead() : buf_(Index(1) << 28) {}  // 1 GiB of zeros
  void run(Index bytes) {
    const Index n = bytes / 4;
    if (next_ + n > buf_.size()) next_ = 0;
    float s = Eigen::Map<const Vector<float>>(buf_.data() + next_, n).sum();
    benchmark::DoNotOptimize(s);
    next_ += n;
  }

 private:
  packed::detail::AlignedArray<float> buf_;
  Index next_ = 0;
};

StreamRead& stream_read() {
  static StreamRead s;
  return s;
}

/// The three forms of one expert.
struct ExpertForms {
  Matrix<float> w_gate_up;  // 2f × d, [W_gate; W_up] as SwiGLU stores them
  Matrix<float> w_down;     // d × f
  packed::PackedExpert f32, bf16;
};

struct Pool {
  Index d = 0, f = 0;
  std::vector<std::unique_ptr<ExpertForms>> experts;
};

/// Pool of distinct experts for (d, f), rebuilt when the shape changes.
Pool& pool_for(Index d, Index f) {
  static Pool pool;
  if (pool.d == d && pool.f == f) return pool;
  pool.experts.clear();
  const char* env = std::getenv("APEX_BENCH_POOL_MB");
  const double mb = env ? std::atof(env) : 640.0;
  const auto n = std::max<Index>(1, Index(mb * 1e6 / (3.0 * double(d) * double(f) * 4)));
  for (Index e = 0; e < n; ++e) {
    const Matrix<float> wg = bench::random_matrix<float>(f, d, 10 + 3 * e, 1 / std::sqrt(double(d)));
    const Matrix<float> wu = bench::random_matrix<float>(f, d, 11 + 3 * e, 1 / std::sqrt(double(d)));
    const Matrix<float> wd = bench::random_matrix<float>(d, f, 12 + 3 * e, 1 / std::sqrt(double(f)));
    Matrix<float> gu(2 * f, d);
    gu << wg, wu;
    pool.experts.push_back(std::make_unique<ExpertForms>(ExpertForms{
        gu, wd, packed::PackedExpert(wg, wu, wd, packed::Dtype::f32), packed::PackedExpert(wg, wu, wd, packed::Dtype::bf16)}));
  }
  pool.d = d;
  pool.f = f;
  return pool;
}

/// SwiGLU::forward_block on float weights (the library's current path).
void eigen_forward(const ExpertForms& e, const Matrix<float>& x, Matrix<float>& work, Matrix<float>& y) {
  const Index f = e.w_down.cols();
  auto gu = work.leftCols(2 * f);  // n × 2f: [G | U]
  detail::linear_nt(x, e.w_gate_up, gu, false);
  const auto g = work.leftCols(f).array();
  work.rightCols(f).array() = g * array::sigmoid(g) * work.middleCols(f, f).array();
  detail::linear_nt(work.rightCols(f), e.w_down, y, false);
}

void BM_expert(benchmark::State& state) {
  const Index d = state.range(0), f = state.range(1), m = state.range(2);
  Eigen::setNbThreads(1);  // the engine is single-threaded per call; compare like with like
  Pool& pool = pool_for(d, f);
  const Matrix<float> x = bench::random_matrix<float>(m, d, 3);  // m × d
  Matrix<float> work(m, 3 * f), y_eigen(m, d), y32(m, d), y16(m, d);  // m × 3f, m × d
  StreamRead& stream = stream_read();
  const auto w32_bytes = Index(12) * d * f;
  double t[4] = {0, 0, 0, 0};  // eigen, f32, bf16, stream
  std::size_t next = 0, turn = 0;
  for (auto _ : state) {
    const ExpertForms& e = *pool.experts[next];
    next = (next + 1) % pool.experts.size();
    double s[4];
    for (int k = 0; k < 4; ++k) {
      const int v = int((turn + std::size_t(k)) % 4);
      const auto t0 = Clock::now();
      if (v == 0) eigen_forward(e, x, work, y_eigen);
      else if (v == 1) packed::forward(e.f32, x.data(), d, m, y32.data(), d);
      else if (v == 2) packed::forward(e.bf16, x.data(), d, m, y16.data(), d);
      else stream.run(w32_bytes);
      s[v] = seconds_since(t0);
    }
    ++turn;
    benchmark::DoNotOptimize(y_eigen.data());
    benchmark::DoNotOptimize(y32.data());
    benchmark::DoNotOptimize(y16.data());
    benchmark::ClobberMemory();
    for (int v = 0; v < 4; ++v) t[v] += s[v];
    state.SetIterationTime(s[2]);
  }
  const double it = double(state.iterations());
  const double flops = 6.0 * double(m) * double(d) * double(f), w32 = 12.0 * double(d) * double(f);
  const double bytes[3] = {w32, w32, w32 / 2};
  const char* names[3] = {"eigen", "f32", "bf16"};
  for (int v = 0; v < 3; ++v) {
    const double per_call = t[v] / it;
    state.counters[std::string(names[v]) + "_GBps"] = bytes[v] / per_call / 1e9;
    state.counters[std::string(names[v]) + "_GFLOPs"] = flops / per_call / 1e9;
  }
  state.counters["speedup_f32_vs_eigen"] = t[0] / t[1];
  state.counters["speedup_bf16_vs_f32"] = t[1] / t[2];
  state.counters["speedup_bf16_vs_eigen"] = t[0] / t[2];
  // Fractions of the read bandwidth (same bytes, same loop): the decode
  // figure of merit; above a few rows the product is no longer bound by it.
  state.counters["stream_GBps"] = w32 / (t[3] / it) / 1e9;
  state.counters["f32_bw_frac"] = t[3] / t[1];
  state.counters["bf16_bw_frac"] = 0.5 * t[3] / t[2];
  state.SetLabel(packed::isa_name(packed::kDefaultIsa));
}

void shapes(benchmark::internal::Benchmark* b) {
  for (const auto& [d, f] : {std::pair<long, long>{512, 1376}, {1024, 512}})
    for (const long m : {1, 4, 16, 128, 1024}) b->Args({d, f, m});
}
BENCHMARK(BM_expert)->Apply(shapes)->UseManualTime()->Unit(benchmark::kMicrosecond)->MinTime(0.3);

}  // namespace

BENCHMARK_MAIN();
