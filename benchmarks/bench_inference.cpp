// Inference layers on packed weights (docs/inference.md): PackedMoE in float
// and bf16 against the float training layer MoEFFN<float>, timed alternately
// in the same loop (the same cold-cache treatment for both), and the resident
// memory of a forward-only medium-preset packed layer.
//
// Counters:
//   x_float  — packed time / MoEFFN<float> time (forward, same inputs, same
//              threads; < 1 is faster);
//   bw_frac  — decode (N ≤ 16): bytes the step must read at the storage
//              dtype (router + every expert used, packed, padding included)
//              / DRAM read bandwidth measured here with the same threads /
//              measured time: the fraction of the bandwidth bound reached;
//   float_bw_frac — the same for the float layer at 4-byte weights;
//   rel_err  — ‖y − y_float‖ / ‖y_float‖ of the last step;
//   rss_over_weights — BM_Resident, BM_ResidentTraining: (VmRSS after
//              construction − VmRSS before) / the layer's weight bytes.
// Decode steps start with cold caches (a 1 GiB buffer is rewritten before
// each timed step, untimed), as in a model whose weights do not fit in cache.
//
//   cmake --preset bench && cmake --build --preset bench --target bench_inference
//   build/bench/benchmarks/bench_inference --benchmark_filter=BM_Packed --benchmark_repetitions=5
//       --benchmark_report_aggregates_only=true   (one line)
//   build/bench/benchmarks/bench_inference --benchmark_filter=BM_Resident   # 4.3 GB, 8.6 GB, then 8.9 GB
//
// Shapes: small (preset 512/1376/E8/K2/S1), fine (1024/512/E64/K8/S2),
// coarse (1024/3584/E8/K2/S0); medium (2048/5504/E64/K4/S2) for memory only.
#include <apex/ffn/inference.hpp>
#include <apex/ffn/moe/moe_ffn.hpp>

#include <algorithm>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "bench_common.hpp"

namespace {

using namespace apex;
using apex::bench::Clock;
using apex::bench::random_matrix;
using apex::bench::seconds_since;
using apex::packed::bf16;

struct Shape {
  const char* name;
  Index d, f, experts, k, shared;
};
const Shape kShapes[] = {{"small", 512, 1376, 8, 2, 1}, {"fine", 1024, 512, 64, 8, 2}, {"coarse", 1024, 3584, 8, 2, 0}};
constexpr Index kDecodeTokens = 16;

// One float layer per shape with its packed copies, built once; one shape alive at a time.
struct Layers {
  std::unique_ptr<MoEFFN<float>> f32;
  std::unique_ptr<PackedMoE<float>> packed_f32;
  std::unique_ptr<PackedMoE<bf16>> packed_bf16;
};
Layers& layers(int shape_index) {
  static std::map<int, Layers> all;
  if (!all.count(shape_index)) {
    all.clear();
    const Shape& s = kShapes[shape_index];
    Layers& l = all[shape_index];
    l.f32 = std::make_unique<MoEFFN<float>>(MoEConfig{s.d, s.f, s.experts, s.k, s.shared}, 7);
    l.packed_f32 = std::make_unique<PackedMoE<float>>(PackedMoE<float>::from(*l.f32));
    l.packed_bf16 = std::make_unique<PackedMoE<bf16>>(PackedMoE<bf16>::from(*l.f32));
  }
  return all[shape_index];
}
template <class S>
PackedMoE<S>& packed_of(Layers& l) {
  if constexpr (std::is_same_v<S, float>) return *l.packed_f32;
  else return *l.packed_bf16;
}

Vector<float>& big_buffer() {
  static Vector<float> buf = Vector<float>::Constant(Index(1) << 28, 1.0f);  // 1 GiB, larger than L3
  return buf;
}
// Rewrites the 1 GiB buffer on the step's own threads (see bench_moe.cpp).
void evict_caches(int threads) {
  Vector<float>& buf = big_buffer();
  const Index chunk = buf.size() / threads;
  detail::parallel_for(threads, threads, [&](Index i) { buf.segment(i * chunk, chunk).array() += 1.0f; });
  benchmark::ClobberMemory();
}
// Best of 7 passes summing the 1 GiB buffer with `threads` threads.
double read_bandwidth(int threads) {
  static std::map<int, double> cache;
  if (cache.count(threads)) return cache[threads];
  const Vector<float>& buf = big_buffer();
  const Index chunk = buf.size() / threads;
  std::vector<float> partial(static_cast<std::size_t>(threads));
  double best = 0;
  for (int pass = 0; pass < 8; ++pass) {
    const auto t0 = Clock::now();
    detail::parallel_for(threads, threads, [&](Index i) { partial[std::size_t(i)] = buf.segment(i * chunk, chunk).sum(); });
    benchmark::DoNotOptimize(partial.data());
    const double t = seconds_since(t0);
    if (pass > 0) best = std::max(best, double(buf.size()) * sizeof(float) / t);
  }
  return cache[threads] = best;
}

// Bytes a forward of x must read: router (float) + the used experts (packed
// bytes, or 4-byte float weights for the float layer) + shared experts.
template <class S>
double step_bytes(const PackedMoE<S>& p, const Matrix<float>& x, bool float_layer) {
  Routing<float> r;
  p.router().route(x, p.bias(), false, r);
  std::set<Index> used(r.experts.data(), r.experts.data() + r.experts.size());
  const MoEConfig& c = p.config();
  const double router = 4.0 * double(c.n_experts * c.d_model);
  const double expert = float_layer ? 12.0 * double(c.d_model * c.d_ffn) : double(p.experts().front().bytes());
  return router + expert * double(used.size() + std::size_t(c.n_shared));
}

template <class S>
void BM_Packed(benchmark::State& state) {
  const Shape& s = kShapes[state.range(0)];
  const Index n = state.range(1);
  const int threads = int(state.range(2));
  Layers& l = layers(int(state.range(0)));
  PackedMoE<S>& p = packed_of<S>(l);
  p.set_threads(threads);
  l.f32->set_threads(threads);
  const Matrix<float> x = random_matrix<float>(n, s.d, 100 + n);
  Matrix<float> y(n, s.d), y0(n, s.d);
  p.forward_into(x, y);  // warm-up: output, scratch
  l.f32->forward_into(x, y0);
  const bool decode = n <= kDecodeTokens;
  double total = 0, base = 0;
  for (auto _ : state) {
    if (decode) evict_caches(threads);
    auto t0 = Clock::now();
    p.forward_into(x, y);
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
    const double t = seconds_since(t0);
    state.SetIterationTime(t);
    total += t;
    if (decode) evict_caches(threads);
    t0 = Clock::now();
    l.f32->forward_into(x, y0);
    benchmark::DoNotOptimize(y0.data());
    benchmark::ClobberMemory();
    base += seconds_since(t0);
  }
  const double it = double(state.iterations());
  state.SetLabel(std::string(s.name) + "/" + (std::is_same_v<S, float> ? "f32" : "bf16"));
  state.counters["tokens/s"] = benchmark::Counter(double(n), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["x_float"] = total / base;
  // ‖y − y_float‖ / ‖y_float‖: the accuracy at this shape
  state.counters["rel_err"] = (y - y0).norm() / std::max(y0.norm(), 1e-30f);
  if (decode) {
    const double bw = read_bandwidth(threads);
    state.counters["bw_frac"] = step_bytes(p, x, false) / bw / (total / it);
    state.counters["float_bw_frac"] = step_bytes(p, x, true) / bw / (base / it);
  }
}

// Decode steps evict the caches twice per iteration (~80 ms, untimed), so
// they run a fixed number of steps; the others run for a minimum time.
template <bool Decode>
void packed_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"shape", "N", "threads"})->UseManualTime()->Unit(benchmark::kMillisecond);
  for (int s = 0; s < 3; ++s)
    for (Index n : {1, 4, 16, 128, 2048})
      if ((n <= kDecodeTokens) == Decode)
        for (int t : {1, 2}) b->Args({s, n, t});
  if (Decode) b->Iterations(30);
  else b->MinTime(0.3);
}
BENCHMARK_TEMPLATE(BM_Packed, float)->Apply(packed_args<true>);
BENCHMARK_TEMPLATE(BM_Packed, bf16)->Apply(packed_args<true>);
BENCHMARK_TEMPLATE(BM_Packed, float)->Apply(packed_args<false>);
BENCHMARK_TEMPLATE(BM_Packed, bf16)->Apply(packed_args<false>);

// VmRSS of this process in bytes (/proc/self/status), 0 where unknown.
double vm_rss() {
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

// A medium-preset packed layer built expert by expert from random weights
// (as the checkpoint loader builds it: one expert's float staging at a
// time), never a float copy of the whole layer: resident set after
// construction and after a forward, against the weight bytes.
template <class S>
void BM_Resident(benchmark::State& state) {
  const MoEConfig c = ModelPreset::medium().moe();
  for (auto _ : state) {
    const double before = vm_rss();
    std::uint64_t weights = 0;
    double after = 0, after_forward = 0;
    {
      std::vector<packed::PackedExpert> experts, shared;
      for (Index e = 0; e < c.n_experts + c.n_shared; ++e) {
        const Matrix<float> gu = random_matrix<float>(2 * c.d_ffn, c.d_model, 10 + std::uint64_t(e), 0.02);
        const Matrix<float> dn = random_matrix<float>(c.d_model, c.d_ffn, 1000 + std::uint64_t(e), 0.02);
        (e < c.n_experts ? experts : shared)
            .emplace_back(gu.topRows(c.d_ffn), gu.bottomRows(c.d_ffn), dn, packed_dtype<S>());
      }
      PackedMoE<S> p(c, random_matrix<float>(c.n_experts, c.d_model, 3, 0.02), RowVector<float>::Zero(c.n_experts),
                           std::move(experts), {}, std::move(shared));
      weights = p.expert_bytes() + std::uint64_t(4 * c.n_experts * c.d_model);
      after = vm_rss();
      p.set_threads(2);
      const Matrix<float> x = random_matrix<float>(16, c.d_model, 5);
      benchmark::DoNotOptimize(p.forward(x).data());
      after_forward = vm_rss();
    }
    state.counters["weight_GB"] = double(weights) * 1e-9;
    state.counters["rss_GB"] = (after - before) * 1e-9;
    state.counters["rss_over_weights"] = (after - before) / double(weights);
    state.counters["rss_after_forward_over_weights"] = (after_forward - before) / double(weights);
  }
  state.SetLabel(std::string("medium/") + (std::is_same_v<S, float> ? "f32" : "bf16"));
}
BENCHMARK_TEMPLATE(BM_Resident, bf16)->Iterations(1)->Unit(benchmark::kSecond);
BENCHMARK_TEMPLATE(BM_Resident, float)->Iterations(1)->Unit(benchmark::kSecond);

// The float training layer of the medium preset used for forward only: its
// gradients are allocated lazily (core/param.hpp), so it holds its weights and
// nothing more — resident set ≈ 1.0× the weight bytes (≈ 2× while every
// layer allocated its gradients at construction). grads_allocated must stay 0.
void BM_ResidentTraining(benchmark::State& state) {
  const MoEConfig c = ModelPreset::medium().moe();
  for (auto _ : state) {
    const double before = vm_rss();
    const std::uint64_t weights = MoEFFN<float>::weight_bytes(c);
    double after = 0, after_forward = 0;
    bool grads = true;
    {
      MoEFFN<float> moe(c, 1);
      after = vm_rss();
      moe.set_threads(2);
      const Matrix<float> x = random_matrix<float>(16, c.d_model, 5);
      benchmark::DoNotOptimize(moe.forward(x).data());
      after_forward = vm_rss();
      grads = moe.has_gradients();
    }
    state.counters["weight_GB"] = double(weights) * 1e-9;
    state.counters["rss_GB"] = (after - before) * 1e-9;
    state.counters["rss_over_weights"] = (after - before) / double(weights);
    state.counters["rss_after_forward_over_weights"] = (after_forward - before) / double(weights);
    state.counters["grads_allocated"] = grads ? 1 : 0;
  }
  state.SetLabel("medium/MoEFFN<float>, forward only");
}
BENCHMARK(BM_ResidentTraining)->Iterations(1)->Unit(benchmark::kSecond);

}  // namespace

BENCHMARK_MAIN();
