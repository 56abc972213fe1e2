// Packed expert engine (include/apex/ffn/packed/) against the library's
// current expert path, one SwiGLU expert at a time, single-threaded.
//
// Per (d, f, m) one benchmark times, alternately inside the same loop and in a
// rotating order (so drift and other load on a shared machine hit all alike):
//   eigen  — float weights, `detail::linear_nt` for [G | U] = X·W_guᵀ, SiLU·U,
//            `linear_nt` again for the down product (SwiGLU::forward_block);
//   f32    — packed float weights, fused kernel;
//   bf16   — packed bf16 weights, fused kernel, widened products (the
//            default: exact fp32 activations);
//   bf16p  — the same weights with paired products (`vdpbf16ps`, X and A
//            rounded to bf16; Bf16Products::paired), when the CPU has
//            AVX-512 BF16 (otherwise not timed, and the label says so);
//   bf16amx — the paired products on AMX-BF16 tiles (path amx_bf16), when
//            the CPU has them and Linux grants them (otherwise skipped, and
//            the label says so).
// The benchmark's time is bf16's; counters give each variant's rate in weight
// GB/s (logical bytes 3·d·f·sizeof) and GFLOP/s (6·m·d·f), the speedups
// f32/eigen, bf16/f32, bf16p/f32 and bf16amx/f32, and the fraction of the read bandwidth reached
// (`stream`: one thread summing as many cold bytes as the float expert holds,
// timed in the same loop).
//
// Caches are cold for the weights: each variant cycles through a pool of
// distinct experts of at least APEX_BENCH_POOL_MB (default 640 MB of float
// weights, twice this machine class's 300 MB L3), as a MoE decode step reads
// each expert once.
//
// BM_transposed times the transposed product dx = dy·M of one packed matrix
// (kernels/transposed_product.hpp, the backward through frozen weights)
// against the forward y = x·Mᵀ of the same matrix, and against the forward
// of an f32 matrix of the same shape (the tiles the transposed product
// runs): per type, rows 1, 32, 512, on the shapes of a Qwen3-30B-A3B expert
// (d 2048, f 768: gate_up M is 1536 × 2048, down M 2048 × 768). Forwards
// run rows in blocks as packed::forward does (run_matrix, plain epilogue).
// Counters: t_over_fwd (transposed time / forward time, same matrix),
// t_over_f32fwd, and each variant's GFLOP/s (2·rows·O·K per call). The
// matrices are cycled through a pool of copies as above, and each variant
// reads its own copy, so the weights are cold. The label names the path (the
// compiler's default) and the tiles the block formats' forward runs.
//
// BM_dequantized times the forward with exact float activations of a
// block-format matrix (kernels/dequantized_product.hpp: each panel
// dequantized, then the f32 tiles; the forward of LoRA training through
// frozen weights) against the inference forward of the same matrix
// (quantized activations, the block formats' integer tiles) and the
// forward of an f32 matrix of the same shape (the tiles it runs), on the
// shapes and row counts of BM_transposed, the weights cold as above.
// Counters: dq_over_fwd, dq_over_f32fwd (time ratios) and each variant's
// GFLOP/s.
//
// Both take their counters from the thread's CPU time per call (medians:
// ThreeTimes says why), the benchmark's time is wall time.
//
//   cmake --preset bench && cmake --build --preset bench --target bench_packed
//   build/bench/benchmarks/bench_packed --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
#include <apex/ffn/layers/activations.hpp>
#include <apex/ffn/layers/linear.hpp>
#include <apex/ffn/kernels/dequantized_product.hpp>
#include <apex/ffn/kernels/fused_expert.hpp>
#include <apex/ffn/kernels/transposed_product.hpp>

#include <algorithm>
#include <cstdlib>
#include <ctime>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bench_common.hpp"
#include "read_probe.hpp"

namespace {

using namespace apex;
using apex::bench::Clock;
using apex::bench::seconds_since;

/// The read-bandwidth baseline: one thread reading `bytes` of a 1 GiB buffer
/// allocated as the packed weights are (2 MiB-aligned, huge pages offered) by
/// the multi-stream vector probe (read_probe.hpp), a different slice each
/// call so it is cold like the experts. Timed inside the same loop as the
/// kernels, so the bandwidth fractions survive a machine whose load changes
/// during the run.
class StreamRead {
 public:
  StreamRead() : buf_(Index(1) << 28) {}  // 1 GiB of zeros
  void run(Index bytes) {
    const Index n = bytes / 4;
    if (next_ + n > buf_.size()) next_ = 0;
    float s = bench::multi_stream_sum(buf_.data() + next_, n);
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
  const bool paired = packed::cpu_supports(packed::Isa::avx512_bf16);
  const bool amx = packed::cpu_supports(packed::Isa::amx_bf16);
  const packed::ForwardOptions pairs{packed::Isa::avx512_bf16, packed::Bf16Products::paired};
  const packed::ForwardOptions tiles{packed::Isa::amx_bf16, packed::Bf16Products::paired};
  enum Variant { kEigen, kF32, kBf16, kBf16Paired, kBf16Amx, kStream, kVariants };
  double t[kVariants] = {};
  std::size_t next = 0, turn = 0;
  for (auto _ : state) {
    const ExpertForms& e = *pool.experts[next];
    next = (next + 1) % pool.experts.size();
    double s[kVariants] = {};
    for (int k = 0; k < kVariants; ++k) {
      const int v = int((turn + std::size_t(k)) % kVariants);
      if ((v == kBf16Paired && !paired) || (v == kBf16Amx && !amx)) continue;
      const auto t0 = Clock::now();
      if (v == kEigen) eigen_forward(e, x, work, y_eigen);
      else if (v == kF32) packed::forward(e.f32, x.data(), d, m, y32.data(), d);
      else if (v == kBf16) packed::forward(e.bf16, x.data(), d, m, y16.data(), d);
      else if (v == kBf16Paired) packed::forward(e.bf16, x.data(), d, m, y16.data(), d, pairs);
      else if (v == kBf16Amx) packed::forward(e.bf16, x.data(), d, m, y16.data(), d, tiles);
      else stream.run(w32_bytes);
      s[v] = seconds_since(t0);
    }
    ++turn;
    benchmark::DoNotOptimize(y_eigen.data());
    benchmark::DoNotOptimize(y32.data());
    benchmark::DoNotOptimize(y16.data());
    benchmark::ClobberMemory();
    for (int v = 0; v < kVariants; ++v) t[v] += s[v];
    state.SetIterationTime(s[kBf16]);
  }
  const double it = double(state.iterations());
  const double flops = 6.0 * double(m) * double(d) * double(f), w32 = 12.0 * double(d) * double(f);
  const double bytes[5] = {w32, w32, w32 / 2, w32 / 2, w32 / 2};
  const char* names[5] = {"eigen", "f32", "bf16", "bf16p", "bf16amx"};
  for (int v = 0; v < kStream; ++v) {
    if ((v == kBf16Paired && !paired) || (v == kBf16Amx && !amx)) continue;
    const double per_call = t[v] / it;
    state.counters[std::string(names[v]) + "_GBps"] = bytes[v] / per_call / 1e9;
    state.counters[std::string(names[v]) + "_GFLOPs"] = flops / per_call / 1e9;
  }
  state.counters["speedup_f32_vs_eigen"] = t[kEigen] / t[kF32];
  state.counters["speedup_bf16_vs_f32"] = t[kF32] / t[kBf16];
  state.counters["speedup_bf16_vs_eigen"] = t[kEigen] / t[kBf16];
  if (paired) state.counters["speedup_bf16p_vs_f32"] = t[kF32] / t[kBf16Paired];
  if (amx) state.counters["speedup_bf16amx_vs_f32"] = t[kF32] / t[kBf16Amx];
  // Fractions of the read bandwidth (same bytes, same loop): the decode
  // figure of merit; above a few rows the product is no longer bound by it.
  state.counters["stream_GBps"] = w32 / (t[kStream] / it) / 1e9;
  state.counters["f32_bw_frac"] = t[kStream] / t[kF32];
  state.counters["bf16_bw_frac"] = 0.5 * t[kStream] / t[kBf16];
  if (paired) state.counters["bf16p_bw_frac"] = 0.5 * t[kStream] / t[kBf16Paired];
  if (amx) state.counters["bf16amx_bw_frac"] = 0.5 * t[kStream] / t[kBf16Amx];
  state.SetLabel(std::string(packed::isa_name(packed::kDefaultIsa)) + " bw_probe=" + bench::kReadProbeName +
                 (paired ? "" : " bf16p: skipped, the CPU has no AVX-512 BF16") +
                 (amx ? " bf16amx: amx_bf16" : " bf16amx: skipped, no AMX-BF16 (CPU or kernel)"));
}

void shapes(benchmark::internal::Benchmark* b) {
  for (const auto& [d, f] : {std::pair<long, long>{512, 1376}, {1024, 512}})
    for (const long m : {1, 4, 16, 128, 1024}) b->Args({d, f, m});
  // A Qwen3-30B-A3B expert at a batch's rows per expert (N = 512, top-8 of 128: 32).
  for (const long m : {1, 32, 512}) b->Args({2048, 768, m});
}
BENCHMARK(BM_expert)->Apply(shapes)->UseManualTime()->Unit(benchmark::kMicrosecond)->MinTime(0.3);

/// Copies of one O × K matrix of type t (the lanes from normal floats)
/// adding up to at least APEX_BENCH_POOL_MB of its bytes, so the weights
/// are cold when a call reads them. The last pool of each type (f32 or
/// not) is kept for the next benchmark of the same shape.
const std::vector<packed::PanelMatrix>& matrix_pool(packed::Dtype t, Index O, Index K) {
  struct Pool {
    packed::Dtype t{};
    Index O = 0, K = 0;
    std::vector<packed::PanelMatrix> copies;
  };
  static Pool pools[2];  // f32, the others
  Pool& pool = pools[t == packed::Dtype::f32 ? 0 : 1];
  if (!pool.copies.empty() && pool.t == t && pool.O == O && pool.K == K) return pool.copies;
  pool.copies.clear();
  packed::PanelMatrix m(t, K, O / packed::kPanelLanes);
  std::vector<float> w(static_cast<std::size_t>(K));
  Rng rng(7);
  for (Index o = 0; o < O; ++o) {
    for (float& v : w) v = float(rng.normal() / std::sqrt(double(K)));
    m.pack_row(o / packed::kPanelLanes, o % packed::kPanelLanes, w.data());
  }
  const char* env = std::getenv("APEX_BENCH_POOL_MB");
  const double mb = env ? std::atof(env) : 640.0;
  const auto n = std::max<Index>(1, Index(mb * 1e6 / double(m.bytes())));
  pool = Pool{t, O, K, std::vector<packed::PanelMatrix>(std::size_t(n), m)};
  return pool.copies;
}

/// y = x·Mᵀ (rows × O) as packed::forward runs a matrix: rows in blocks.
void forward_product(const packed::PanelMatrix& m, const float* x, Index rows, float* y) {
  const Index O = packed::kPanelLanes * m.panels(), block = rows <= packed::kSmallRows ? rows : packed::kRowBlock;
  for (Index r0 = 0; r0 < rows; r0 += block) {
    const Index n = std::min(block, rows - r0);
    packed::detail::run_matrix<packed::PlainEpilogue>(packed::kDefaultIsa, m, x + r0 * m.k(), m.k(), n, y + r0 * O, O,
                                                      packed::kPanelLanes, O);
  }
}

/// CPU time of the calling thread, in seconds.
double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

/// Per-call times of the three variants of a comparison, run back to back
/// in each iteration in an order rotating with the iteration (drift hits
/// all alike). The machine is shared: a call is often preempted for whole
/// time slices of other jobs (4 ms here), which wall time counts and the
/// thread's CPU time does not. So the counters come from CPU times: the
/// ratios are the median over iterations of the ratio within one, the rates
/// use each variant's median call. The benchmark's own time is wall time.
struct ThreeTimes {
  std::vector<double> cpu[3];
  /// Runs the variants once each; returns variant 0's wall time.
  template <class F>
  double run(std::size_t turn, F&& variant) {
    double wall0 = 0;
    for (int k = 0; k < 3; ++k) {
      const int v = int((turn + std::size_t(k)) % 3);
      const double c0 = thread_cpu_seconds();
      const auto t0 = Clock::now();
      variant(v);
      if (v == 0) wall0 = seconds_since(t0);
      cpu[v].push_back(thread_cpu_seconds() - c0);
    }
    return wall0;
  }
  static double median(std::vector<double> s) {
    std::nth_element(s.begin(), s.begin() + std::ptrdiff_t(s.size() / 2), s.end());
    return s[s.size() / 2];
  }
  /// Each variant's GFLOP/s and variant 0's time over the others' (named
  /// `ratio`_over_<name>).
  void counters(benchmark::State& state, const char* const* names, const char* ratio, double flops) const {
    for (int v = 0; v < 3; ++v) state.counters[std::string(names[v]) + "_GFLOPs"] = flops / median(cpu[v]) / 1e9;
    for (int v = 1; v < 3; ++v) {
      std::vector<double> r(cpu[0].size());
      for (std::size_t i = 0; i < r.size(); ++i) r[i] = cpu[0][i] / cpu[v][i];
      state.counters[std::string(ratio) + "_over_" + names[v]] = median(r);
    }
  }
};

std::string matrix_label(packed::Dtype t, Index O, Index K) {
  return std::string(packed::dtype_name(t)) + " " + std::to_string(O) + "x" + std::to_string(K) +
         " isa=" + packed::isa_name(packed::kDefaultIsa) +
         " block_tiles=" + packed::block_format_tiles(packed::kDefaultIsa);
}

void BM_transposed(benchmark::State& state) {
  const auto t = packed::Dtype(state.range(0));
  const Index O = state.range(1), K = state.range(2), rows = state.range(3);
  const std::vector<packed::PanelMatrix>& pool = matrix_pool(t, O, K);
  const std::vector<packed::PanelMatrix>& pool32 = matrix_pool(packed::Dtype::f32, O, K);
  const Matrix<float> dy = bench::random_matrix<float>(rows, O, 3), x = bench::random_matrix<float>(rows, K, 4);
  Matrix<float> dx(rows, K), y(rows, O), y32(rows, O);  // rows × K, rows × O
  ThreeTimes times;  // transposed, forward, f32 forward
  std::size_t next = 0, next32 = 0, turn = 0;
  for (auto _ : state) {
    const packed::PanelMatrix& m = pool[next];
    const packed::PanelMatrix& m_fwd = pool[(next + pool.size() / 2) % pool.size()];  // another copy: cold too
    const packed::PanelMatrix& m32 = pool32[next32];
    next = (next + 1) % pool.size();
    next32 = (next32 + 1) % pool32.size();
    const double t0 = times.run(turn++, [&](int v) {
      if (v == 0) packed::transposed_product(packed::kDefaultIsa, m, dy.data(), O, rows, dx.data(), K);
      else if (v == 1) forward_product(m_fwd, x.data(), rows, y.data());
      else forward_product(m32, x.data(), rows, y32.data());
    });
    benchmark::DoNotOptimize(dx.data());
    benchmark::DoNotOptimize(y.data());
    benchmark::DoNotOptimize(y32.data());
    benchmark::ClobberMemory();
    state.SetIterationTime(t0);
  }
  const char* names[3] = {"transposed", "fwd", "f32fwd"};
  times.counters(state, names, "t", 2.0 * double(rows) * double(O) * double(K));
  state.SetLabel(matrix_label(t, O, K));
}

void BM_dequantized(benchmark::State& state) {
  const auto t = packed::Dtype(state.range(0));
  const Index O = state.range(1), K = state.range(2), rows = state.range(3);
  const std::vector<packed::PanelMatrix>& pool = matrix_pool(t, O, K);
  const std::vector<packed::PanelMatrix>& pool32 = matrix_pool(packed::Dtype::f32, O, K);
  const Matrix<float> x = bench::random_matrix<float>(rows, K, 4);  // rows × K
  Matrix<float> ydq(rows, O), y(rows, O), y32(rows, O);             // rows × O
  ThreeTimes times;  // dequantized, forward, f32 forward
  std::size_t next = 0, next32 = 0, turn = 0;
  for (auto _ : state) {
    const packed::PanelMatrix& m = pool[next];
    const packed::PanelMatrix& m_fwd = pool[(next + pool.size() / 2) % pool.size()];  // another copy: cold too
    const packed::PanelMatrix& m32 = pool32[next32];
    next = (next + 1) % pool.size();
    next32 = (next32 + 1) % pool32.size();
    const double t0 = times.run(turn++, [&](int v) {
      if (v == 0) packed::dequantized_product(packed::kDefaultIsa, m, x.data(), K, rows, ydq.data(), O, O);
      else if (v == 1) forward_product(m_fwd, x.data(), rows, y.data());
      else forward_product(m32, x.data(), rows, y32.data());
    });
    benchmark::DoNotOptimize(ydq.data());
    benchmark::DoNotOptimize(y.data());
    benchmark::DoNotOptimize(y32.data());
    benchmark::ClobberMemory();
    state.SetIterationTime(t0);
  }
  const char* names[3] = {"dq", "fwd", "f32fwd"};
  times.counters(state, names, "dq", 2.0 * double(rows) * double(O) * double(K));
  state.SetLabel(matrix_label(t, O, K));
}

/// Every type or the block formats, on the expert shapes, rows 1, 32, 512.
void matrix_shapes(benchmark::internal::Benchmark* b, bool block_formats_only) {
  for (const packed::Dtype t : {packed::Dtype::f32, packed::Dtype::bf16, packed::Dtype::f16, packed::Dtype::q8_0,
                                packed::Dtype::q4_0, packed::Dtype::mxfp4, packed::Dtype::q4_k, packed::Dtype::q6_k}) {
    const bool float_type = t == packed::Dtype::f32 || t == packed::Dtype::bf16 || t == packed::Dtype::f16;
    if (block_formats_only && float_type) continue;
    for (const auto& [O, K] : {std::pair<long, long>{1536, 2048}, {2048, 768}})
      for (const long rows : {1, 32, 512}) b->Args({long(t), O, K, rows});
  }
}
void transposed_shapes(benchmark::internal::Benchmark* b) { matrix_shapes(b, false); }
// f32, bf16 and f16 run their own tiles there: the dequantized product is the forward.
void dequantized_shapes(benchmark::internal::Benchmark* b) { matrix_shapes(b, true); }
BENCHMARK(BM_transposed)->Apply(transposed_shapes)->UseManualTime()->Unit(benchmark::kMicrosecond)->MinTime(0.3);
BENCHMARK(BM_dequantized)->Apply(dequantized_shapes)->UseManualTime()->Unit(benchmark::kMicrosecond)->MinTime(0.3);

}  // namespace

BENCHMARK_MAIN();
