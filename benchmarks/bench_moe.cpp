// Expert-dispatch benchmark suite: MoE forward and forward+backward over
// layer shapes × tokens × routing × threads, each with baselines timed in the
// same binary:
//   (a) x_dense   — the same active FLOPs as one dense product X·Wᵀ with the
//                   same GEMM engine (Eigen): M = N·(K+S) rows, d → 3f
//                   (forward; forward+backward, with 3× the FLOPs, is
//                   compared with three such products);
//   (b) x_loop    — the plain per-expert loop (scan all tokens,
//                   gather, expert product, scatter-add), forward only;
//   (c) bw_frac   — for N ≤ 16 (decode): (weight bytes the layer must read)
//                   / (DRAM read bandwidth measured here) divided by the
//                   measured time, i.e. the fraction of the memory-bandwidth
//                   bound reached. Decode steps start with cold caches (a
//                   1 GiB buffer is rewritten before each, untimed), as in a
//                   model whose weights do not fit in cache.
// Batch steps alternate with the dense baseline inside one loop; the plain
// loop and the decode baselines are measured once per configuration. Counters: tokens/s, GFLOP/s (active), x_dense, x_loop,
// bw_frac, and for forward+backward fb_over_f (total / forward time).
//
// Shapes: small (preset 512/1376/E8/K2/S1), medium (2048/5504/E64/K4/S2),
// fine (1024/512/E64/K8/S2), coarse (1024/3584/E8/K2/S0).
#include <apex/ffn/moe/moe_ffn.hpp>
#include <apex/ffn/kernels/packed_products.hpp>

#include <algorithm>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "read_probe.hpp"

namespace {

using namespace apex;
using apex::bench::Clock;
using apex::bench::random_matrix;
using apex::bench::seconds_since;
using T = float;

struct Shape {
  const char* name;
  Index d, f, experts, k, shared;
};
const Shape kShapes[] = {{"small", 512, 1376, 8, 2, 1},
                         {"medium", 2048, 5504, 64, 4, 2},
                         {"fine", 1024, 512, 64, 8, 2},
                         {"coarse", 1024, 3584, 8, 2, 0}};
constexpr Index kDecodeTokens = 16;  ///< N at or below which a forward is a decode step

enum RoutingKind { kUniform = 0, kZipf = 1, kOne = 2 };
const char* kRoutingNames[] = {"uniform", "zipf", "one"};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <class Fn>
double median_time(int reps, Fn&& fn) {
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = Clock::now();
    fn();
    t.push_back(seconds_since(t0));
  }
  return median(t);
}

// One layer per shape, built once (the medium layer holds 8.9 GB of weights).
MoEFFN<T>& layer(int shape_index) {
  static std::map<int, std::unique_ptr<MoEFFN<T>>> layers;
  auto& slot = layers[shape_index];
  if (!slot) {
    layers.clear();  // keep one large layer alive at a time
    const Shape& s = kShapes[shape_index];
    MoEConfig c{s.d, s.f, s.experts, s.k, s.shared};
    auto& fresh = layers[shape_index];
    fresh = std::make_unique<MoEFFN<T>>(c, 7);
    return *fresh;
  }
  return *slot;
}

// Steers routing through the balancing bias (|b| ≤ 1 against logits of std ≈ 0.3):
// uniform: b = 0; Zipf-like: b_e = −0.5·ln(e + 1); one: expert 0 takes every token.
void set_routing(MoEFFN<T>& moe, RoutingKind routing) {
  const Index e_count = moe.config().n_experts;
  RowVector<T> b = RowVector<T>::Zero(e_count);
  for (Index e = 0; e < e_count; ++e) {
    if (routing == kZipf) b(e) = T(-0.5 * std::log(double(e + 1)));
    if (routing == kOne) b(e) = e == 0 ? T(1) : T(-1);
  }
  moe.balancer().set_bias(b);
}

// The plain per-expert dispatch (docs/math.md#mixture-of-experts), in C++.
Matrix<T> plain_loop(const MoEFFN<T>& moe, const Matrix<T>& x) {
  Routing<T> routing;
  moe.router().route(x, moe.balancer().bias(), false, routing);
  Matrix<T> out = Matrix<T>::Zero(x.rows(), x.cols());
  std::vector<Index> rows, slots;
  for (Index e = 0; e < moe.config().n_experts; ++e) {
    rows.clear();
    slots.clear();
    for (Index t = 0; t < x.rows(); ++t)  // token_mask = topk_idx == e; nonzero()
      for (Index k = 0; k < moe.config().n_active; ++k)
        if (routing.experts(t, k) == e) {
          rows.push_back(t);
          slots.push_back(k);
        }
    if (rows.empty()) continue;
    Matrix<T> xe(Index(rows.size()), x.cols());  // gather
    for (std::size_t i = 0; i < rows.size(); ++i) xe.row(Index(i)) = x.row(rows[i]);
    const Matrix<T> ye = moe.experts()[e].forward(xe);
    for (std::size_t i = 0; i < rows.size(); ++i)  // index_add_
      out.row(rows[i]) += routing.weights(rows[i], slots[i]) * ye.row(Index(i));
  }
  for (const auto& s : moe.shared_experts()) out += s.forward(x);
  return out;
}

// A buffer larger than the last-level cache (this machine reports 508 MB of
// L3): streaming through it evicts the layer's weights, and summing it
// measures DRAM read bandwidth.
Vector<T>& big_buffer() {
  static Vector<T> buf = Vector<T>::Constant(Index(1) << 28, T(1));  // 1 GiB
  return buf;
}

// Decode runs with cold weights, as in a model whose layers do not all fit
// in cache: before each timed decode step, this rewrites the 1 GiB buffer.
// It runs on the step's own threads, so none of them sits idle for the
// ~40 ms beforehand: on this virtual machine an idle vCPU is descheduled and
// waking it for the step's first parallel region cost ~2 ms, more than a
// whole decode step. (In a model the threads are busy with the layer before.)
void evict_caches(int threads) {
  Vector<T>& buf = big_buffer();
  const Index chunk = buf.size() / threads;
  detail::parallel_for(threads, threads, [&](Index i) { buf.segment(i * chunk, chunk).array() += T(1); });
  benchmark::ClobberMemory();
}

// DRAM read bandwidth with `threads` threads: the 1 GiB buffer read by the
// multi-stream vector probe (read_probe.hpp), each thread its share. The
// bound is the best of 7 passes after a warm-up pass, so a pass that lost
// its core to another tenant of the machine does not lower it.
double read_bandwidth(int threads) {
  static std::map<int, double> cache;
  if (cache.count(threads)) return cache[threads];
  const Vector<T>& buf = big_buffer();
  const Index chunk = buf.size() / threads;
  std::vector<T> partial(threads);
  double best = 0;
  for (int pass = 0; pass < 8; ++pass) {
    const auto t0 = Clock::now();
    detail::parallel_for(threads, threads,
                         [&](Index i) { partial[i] = bench::multi_stream_sum(buf.data() + i * chunk, chunk); });
    benchmark::DoNotOptimize(partial.data());
    const double t = seconds_since(t0);
    if (pass > 0) best = std::max(best, double(buf.size()) * sizeof(T) / t);
  }
  return cache[threads] = best;
}

// Bytes of weights a forward must read: the router and every expert used.
double weight_bytes(const MoEFFN<T>& moe, const Matrix<T>& x) {
  Routing<T> r;
  moe.router().route(x, moe.balancer().bias(), false, r);
  std::set<Index> used(r.experts.data(), r.experts.data() + r.experts.size());
  const MoEConfig& c = moe.config();
  const double expert = 3.0 * double(c.d_model) * double(c.d_ffn);
  return sizeof(T) * (double(c.n_experts) * double(c.d_model) + expert * double(used.size() + c.n_shared));
}

// (a) The roofline: one dense product X·Wᵀ, X: N·(K+S) × d, W: 3f × d — the
// forward's active FLOPs — with Eigen's own threading at the step's thread
// budget.
struct DenseBaseline {
  bench::DenseProduct<T> product;
  int threads;
  DenseBaseline(const Shape& s, Index n, int threads_) : product(n * (s.k + s.shared), s.d, 3 * s.f), threads(threads_) {}
  double time_one() {
    Eigen::setNbThreads(threads);
    const auto t0 = Clock::now();
    product.run();
    const double t = seconds_since(t0);
    Eigen::setNbThreads(0);
    return t;
  }
};

// Decode steps compare with the bandwidth bound instead; their x_dense uses
// the median of 7 warm dense products, measured once per configuration.
double decode_dense_time(const Shape& s, Index n, int threads) {
  DenseBaseline dense(s, n, threads);
  dense.time_one();
  return median_time(7, [&] { dense.time_one(); });
}

void configure(benchmark::State& state, MoEFFN<T>*& moe, Matrix<T>& x, const Shape*& s, Index& n, int& threads) {
  const int shape_index = int(state.range(0));
  s = &kShapes[shape_index];
  n = state.range(1);
  const auto routing = RoutingKind(state.range(2));
  threads = int(state.range(3));
  moe = &layer(shape_index);
  moe->set_threads(threads);
  set_routing(*moe, routing);
  x = random_matrix<T>(n, s->d, 100 + n);
  state.SetLabel(std::string(s->name) + "/" + kRoutingNames[routing] + " bw_probe=" + bench::kReadProbeName);
}

void common_counters(benchmark::State& state, Index n, double flops) {
  state.counters["tokens/s"] = benchmark::Counter(double(n), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["GFLOP/s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_MoE_Forward(benchmark::State& state) {
  MoEFFN<T>* moe;
  Matrix<T> x;
  const Shape* s;
  Index n;
  int threads;
  configure(state, moe, x, s, n, threads);
  const double flops = 6.0 * double(n) * double(s->k + s->shared) * double(s->d) * double(s->f);
  // Like the dense baseline, the output buffer is the caller's and reused
  // (forward_into); warm-up (untimed) touches it and the per-thread workspace.
  Matrix<T> y(n, s->d);
  moe->forward_into(x, y);
  const bool decode = n <= kDecodeTokens;
  // Batch steps alternate with the dense baseline in the same loop, so load
  // from other tenants of the machine hits both alike.
  std::unique_ptr<DenseBaseline> dense;
  if (!decode) {
    dense = std::make_unique<DenseBaseline>(*s, n, threads);
    dense->time_one();
  }
  double total = 0, dense_total = 0;
  for (auto _ : state) {
    if (decode) evict_caches(threads);
    const auto t0 = Clock::now();
    moe->forward_into(x, y);
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
    const double t = seconds_since(t0);
    state.SetIterationTime(t);
    total += t;
    if (dense) dense_total += dense->time_one();
  }
  const double mean = total / double(state.iterations());
  common_counters(state, n, flops);
  state.counters["x_dense"] = dense ? total / dense_total : mean / decode_dense_time(*s, n, threads);
  dense.reset();
  // (b) The plain loop, at the same thread budget through Eigen's own threading.
  Eigen::setNbThreads(threads);
  const double loop = median_time(3, [&] { benchmark::DoNotOptimize(plain_loop(*moe, x).data()); });
  Eigen::setNbThreads(0);
  state.counters["x_loop"] = mean / loop;
  if (decode) state.counters["bw_frac"] = weight_bytes(*moe, x) / read_bandwidth(threads) / mean;
}

void BM_MoE_ForwardBackward(benchmark::State& state) {
  MoEFFN<T>* moe;
  Matrix<T> x;
  const Shape* s;
  Index n;
  int threads;
  configure(state, moe, x, s, n, threads);
  const Matrix<T> dy = random_matrix<T>(n, s->d, 200 + n);
  const double flops = 18.0 * double(n) * double(s->k + s->shared) * double(s->d) * double(s->f);
  MoEFFN<T>::Cache cache;
  // Warm-up (untimed): first touch of the cache, scratch and gradient buffers.
  benchmark::DoNotOptimize(moe->forward(x, &cache).data());
  benchmark::DoNotOptimize(moe->backward(dy, cache).data());
  // Forward+backward has 3× the forward's FLOPs: each step alternates with
  // one forward-sized dense product, counted three times.
  DenseBaseline dense(*s, n, threads);
  dense.time_one();
  Matrix<T> y(n, s->d);
  double total = 0, forward = 0, dense_total = 0;
  for (auto _ : state) {
    const auto t0 = Clock::now();
    moe->forward_into(x, y, &cache);
    const double tf = seconds_since(t0);
    Matrix<T> dx = moe->backward(dy, cache);
    benchmark::DoNotOptimize(dx.data());
    const double t = seconds_since(t0);
    state.SetIterationTime(t);
    total += t;
    forward += tf;
    dense_total += dense.time_one();
  }
  moe->zero_grad();
  common_counters(state, n, flops);
  state.counters["x_dense"] = total / (3.0 * dense_total);
  state.counters["fb_over_f"] = total / forward;
}

// The training products on the packed engine (kernels/packed_products.hpp) against
// Eigen's GEMM, in one binary: every iteration runs the step once with the
// engine and once without, in alternating order, so load from other tenants
// of the machine hits both alike. x_eigen = engine time / Eigen time.
// pass 0: forward with a cache (training forward); pass 1: forward+backward.
void BM_MoE_TrainingEngine(benchmark::State& state) {
  const int shape_index = int(state.range(0));
  const Shape& s = kShapes[shape_index];
  const Index n = state.range(1);
  const int threads = int(state.range(2));
  const bool backward = state.range(3) == 1;
  MoEFFN<T>& moe = layer(shape_index);
  moe.set_threads(threads);
  set_routing(moe, RoutingKind(0));
  const Matrix<T> x = random_matrix<T>(n, s.d, 100 + n);
  const Matrix<T> dy = random_matrix<T>(n, s.d, 200 + n);
  MoEFFN<T>::Cache cache;
  Matrix<T> y(n, s.d);
  const packed::TrainingEngine on = packed::training_engine();
  packed::TrainingEngine off = on;
  off.enabled = false;
  const auto step = [&](const packed::TrainingEngine& e) {
    packed::set_training_engine(e);
    const auto t0 = Clock::now();
    moe.forward_into(x, y, &cache);
    if (backward) benchmark::DoNotOptimize(moe.backward(dy, cache).data());
    benchmark::ClobberMemory();
    return seconds_since(t0);
  };
  step(on);  // warm-up (untimed): cache, scratch and gradient buffers
  step(off);
  double engine = 0, eigen = 0;
  bool engine_first = true;
  for (auto _ : state) {
    double te, tg;
    if (engine_first) {
      te = step(on);
      tg = step(off);
    } else {
      tg = step(off);
      te = step(on);
    }
    engine_first = !engine_first;
    state.SetIterationTime(te);
    engine += te;
    eigen += tg;
  }
  packed::set_training_engine(on);
  moe.zero_grad();
  state.SetLabel(std::string(s.name) + (backward ? "/fwd+bwd" : "/fwd"));
  state.counters["x_eigen"] = engine / eigen;
}
BENCHMARK(BM_MoE_TrainingEngine)
    ->ArgNames({"shape", "N", "threads", "backward"})
    ->ArgsProduct({{0, 2}, {16, 128, 2048}, {1, 2}, {0, 1}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(0.5);

// Decode (N ≤ 16) forwards evict the caches before every step (~40 ms,
// untimed), so they run a fixed number of steps; the other runs last a
// minimum time. Forward+backward runs warm at every N.
enum class Tokens { kDecode, kBatch, kAll };
void moe_args(benchmark::internal::Benchmark* b, Tokens which) {
  b->ArgNames({"shape", "N", "routing", "threads"});
  for (int s = 0; s < 4; ++s)
    for (int r = 0; r < 3; ++r)
      for (Index n : {1, 4, 16, 128, 2048})
        if (which == Tokens::kAll || (which == Tokens::kDecode) == (n <= kDecodeTokens))
          for (int t : {1, 2}) b->Args({s, n, r, t});
  b->UseManualTime()->Unit(benchmark::kMillisecond);
  if (which == Tokens::kDecode)
    b->Iterations(10);
  else
    b->MinTime(0.5);
}

BENCHMARK(BM_MoE_Forward)->Apply([](benchmark::internal::Benchmark* b) { moe_args(b, Tokens::kDecode); });
BENCHMARK(BM_MoE_Forward)->Apply([](benchmark::internal::Benchmark* b) { moe_args(b, Tokens::kBatch); });
BENCHMARK(BM_MoE_ForwardBackward)->Apply([](benchmark::internal::Benchmark* b) { moe_args(b, Tokens::kAll); });

}  // namespace

BENCHMARK_MAIN();
