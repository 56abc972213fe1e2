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
//              / DRAM read bandwidth measured here with the same threads
//              (the multi-stream vector probe of read_probe.hpp; the label's
//              bw_probe names its width) / measured time: the fraction of the
//              bandwidth bound reached;
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
//
// BM_BlockFormats/<shape>/N:<n>/threads:<t> — every storage type (f32, bf16,
// f16, q8_0, q4_0, q4_k, q6_k, mxfp4) of one layer, all run once per iteration in
// a rotating order; manual time is bf16's. Block formats need whole blocks
// along d_model and d_ffn (32 weights; 256 for q4_k, q6_k), so small
// (d_ffn 1376 = 43·32) skips q4_k and q6_k (named in the label), and
// small_f1280 (512/1280/E8/K2/S1, the nearest whole number of 256-weight
// super-blocks) runs all eight. The label names the kernel path
// (packed::kDefaultIsa, or `--isa=<path>`, e.g. --isa=amx_bf16) and the
// tiles the block formats ran on it (packed::block_format_tiles).
// Counters per type T, as "T:counter":
//   x_bf16, x_f32, x_q8_0 (4- and 6-bit types) — T's time / that type's
//              time, each the median over the same iterations (< 1: T is
//              faster);
//   bw_frac  — N ≤ 16 (cold): the time of a cold read of T's step bytes
//              (router + every expert used + shared, at T's true packed
//              size, padding and block scales included; MB), timed in the
//              same loop right after T's step with the same threads, by the
//              multi-stream vector probe (read_probe.hpp: four
//              streams per thread, full-width loads into eight accumulators;
//              the label's bw_probe names its width) / T's time (medians);
//   x_bound  — N = 16: T's time / the larger of its bandwidth bound (above)
//              and its compute bound, 16 × T's time per token at N = 2048
//              in this run (needs N:2048 of the shape in the filter);
//   rel_err  — ‖y_T − y_float‖ / ‖y_float‖ against MoEFFN<float>.
//
//   build/bench/benchmarks/bench_inference --benchmark_filter=BM_BlockFormats --benchmark_repetitions=3
//       --benchmark_out=block_formats.json    (≈ 35 min on 2 busy cores; ≈ 2.5 GB)
//   (docs/performance.md lists the subsets its tables ran.)
#include <apex/ffn/inference.hpp>
#include <apex/ffn/moe/gpt_oss.hpp>
#include <apex/ffn/moe/moe_ffn.hpp>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <unistd.h>
#include <vector>

#include "bench_common.hpp"
#include "read_probe.hpp"

namespace {

using namespace apex;
using apex::bench::Clock;
using apex::bench::kReadProbeName;
using apex::bench::multi_stream_sum;
using apex::bench::random_matrix;
using apex::bench::seconds_since;
using apex::bench::vm_rss;
using apex::packed::bf16;

struct Shape {
  const char* name;
  Index d, f, experts, k, shared;
};
// small_f1280: small with d_ffn 1280, the nearest whole number of 256-weight
// super-blocks to 1376, for Q4_K and Q6_K (BM_BlockFormats only).
const Shape kShapes[] = {{"small", 512, 1376, 8, 2, 1},
                         {"fine", 1024, 512, 64, 8, 2},
                         {"coarse", 1024, 3584, 8, 2, 0},
                         {"small_f1280", 512, 1280, 8, 2, 1}};
constexpr Index kDecodeTokens = 16;

// A packed copy of the float layer at one storage type, behind one interface
// so a loop can alternate every type.
struct PackedBase {
  virtual ~PackedBase() = default;
  virtual void forward_into(const Matrix<float>& x, Matrix<float>& y) = 0;
  virtual void set_threads(int threads) = 0;
  // Bytes a forward of x reads at this type's true size: router (float) +
  // every expert some row chose + the shared experts, packed (padding and
  // block scales included).
  virtual double true_step_bytes(const Matrix<float>& x) const = 0;
};
/// The kernel path the packed layers run (`--isa=<name>`; the compile-time
/// default otherwise).
packed::Isa& bench_isa() {
  static packed::Isa isa = packed::kDefaultIsa;
  return isa;
}

template <class S>
struct PackedOf final : PackedBase {
  PackedMoE<S> p;
  explicit PackedOf(const MoEFFN<float>& f) : p(PackedMoE<S>::from(f)) { p.set_kernel_options({bench_isa()}); }
  void forward_into(const Matrix<float>& x, Matrix<float>& y) override { p.forward_into(x, y); }
  void set_threads(int threads) override { p.set_threads(threads); }
  double true_step_bytes(const Matrix<float>& x) const override {
    Routing<float> r;
    p.router().route(x, p.bias(), false, r);
    const std::set<Index> used(r.experts.data(), r.experts.data() + r.experts.size());
    double bytes = 4.0 * double(p.config().n_experts * p.config().d_model);
    for (Index e : used) bytes += double(p.experts()[std::size_t(e)].bytes());
    for (const auto& e : p.shared_experts()) bytes += double(e.bytes());
    return bytes;
  }
};

// One float layer per shape with its packed copies (built on first use);
// one shape alive at a time.
struct Layers {
  std::unique_ptr<MoEFFN<float>> f32;
  std::map<packed::Dtype, std::unique_ptr<PackedBase>> packed;
  PackedBase& get(packed::Dtype t) {
    auto& slot = packed[t];
    if (!slot)
      slot = packed::visit_dtype(t, [&](auto tag) -> std::unique_ptr<PackedBase> {
        using S = typename packed::WeightType<decltype(tag)::value>::Storage;
        return std::make_unique<PackedOf<S>>(*f32);
      });
    return *slot;
  }
};
Layers& layers(int shape_index) {
  static std::map<int, Layers> all;
  if (!all.count(shape_index)) {
    all.clear();
    const Shape& s = kShapes[shape_index];
    Layers& l = all[shape_index];
    l.f32 = std::make_unique<MoEFFN<float>>(MoEConfig{s.d, s.f, s.experts, s.k, s.shared}, 7);
  }
  return all[shape_index];
}
template <class S>
PackedMoE<S>& packed_of(Layers& l) {
  return static_cast<PackedOf<S>&>(l.get(packed_dtype<S>())).p;
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
// Best of 7 passes reading the 1 GiB buffer with `threads` threads, each its
// share through the multi-stream probe (read_probe.hpp).
double read_bandwidth(int threads) {
  static std::map<int, double> cache;
  if (cache.count(threads)) return cache[threads];
  const Vector<float>& buf = big_buffer();
  const Index chunk = buf.size() / threads;
  std::vector<float> partial(static_cast<std::size_t>(threads));
  double best = 0;
  for (int pass = 0; pass < 8; ++pass) {
    const auto t0 = Clock::now();
    detail::parallel_for(threads, threads,
                         [&](Index i) { partial[std::size_t(i)] = multi_stream_sum(buf.data() + i * chunk, chunk); });
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
  state.SetLabel(std::string(s.name) + "/" + (std::is_same_v<S, float> ? "f32" : "bf16") +
                 (decode ? std::string(" bw_probe=") + kReadProbeName : std::string()));
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

// ---------------------------------------------------------------------------
// Every storage type of the packed engine (f32, bf16 and ggml's block
// formats) on one shape, N and thread count, alternated in one loop: each
// iteration runs every type once, in an order rotated by one type per
// iteration, so drift and other load on the machine hit all alike. Decode
// and N = 16 start each step with cold caches, and after each step time a
// cold read of that type's bytes (its bandwidth bound) in the same loop.

// Elements rewritten to evict the caches: 8× the L3 (at least 64 MiB, at
// most half the 1 GiB buffer); the other half holds the cold reads.
Index evict_elements() {
  static const Index n = [] {
    long l3 = 0;
#ifdef _SC_LEVEL3_CACHE_SIZE
    l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
#endif
    const Index half = big_buffer().size() / 2;
    if (l3 <= 0) return half;
    return std::clamp(Index(8) * Index(l3) / Index(sizeof(float)), Index(1) << 24, half);
  }();
  return n;
}
void evict_first(int threads) {
  Vector<float>& buf = big_buffer();
  const Index chunk = evict_elements() / threads;
  detail::parallel_for(threads, threads, [&](Index i) { buf.segment(i * chunk, chunk).array() += 1.0f; });
  benchmark::ClobberMemory();
}
// Time of reading `bytes` of the buffer past the eviction region with
// `threads` threads, each a contiguous share, right after an eviction: the
// time a layer reading that many weight bytes, cold, cannot beat.
double cold_read_seconds(double bytes, int threads) {
  const Vector<float>& buf = big_buffer();
  const Index n = std::min(Index(bytes / sizeof(float)), buf.size() - evict_elements());
  const Index chunk = n / threads;
  std::vector<float> partial(std::size_t(threads), 0.0f);
  const auto t0 = Clock::now();
  detail::parallel_for(threads, threads, [&](Index i) {
    partial[std::size_t(i)] = multi_stream_sum(buf.data() + evict_elements() + i * chunk, chunk);
  });
  benchmark::DoNotOptimize(partial.data());
  benchmark::ClobberMemory();
  const double t = seconds_since(t0);
  return t * bytes / (double(chunk) * threads * sizeof(float));  // a clamped read scaled to the full count
}

constexpr packed::Dtype kAllTypes[] = {packed::Dtype::f32,  packed::Dtype::bf16, packed::Dtype::f16, packed::Dtype::q8_0,
                                       packed::Dtype::q4_0, packed::Dtype::q4_k, packed::Dtype::q6_k,
                                       packed::Dtype::mxfp4};
// Weights per block of t (1 for f32 and bf16): both reduction lengths
// (d_model, d_ffn) must be whole blocks.
Index block_of(packed::Dtype t) {
  return packed::visit_dtype(t, [](auto tag) -> Index {
    using W = packed::WeightType<decltype(tag)::value>;
    if constexpr (W::kQuantized) return W::kBlockWeights;
    else return 1;
  });
}
// Time per token at N = 2048 of (shape, type, threads), from this process's
// batch runs: the compute bound N = 16 is compared with.
std::map<std::tuple<int, int, int>, double>& batch_seconds_per_token() {
  static std::map<std::tuple<int, int, int>, double> m;
  return m;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const std::size_t h = v.size() / 2;
  return v.size() % 2 ? v[h] : 0.5 * (v[h - 1] + v[h]);
}

void BM_BlockFormats(benchmark::State& state, int shape_index, Index n, int threads) {
  const Shape& s = kShapes[shape_index];
  std::string skipped;
  std::vector<packed::Dtype> types;
  for (packed::Dtype t : kAllTypes) {
    if (s.d % block_of(t) == 0 && s.f % block_of(t) == 0) types.push_back(t);
    else skipped += std::string(skipped.empty() ? "" : ",") + packed::dtype_name(t);
  }
  Layers& l = layers(shape_index);
  l.f32->set_threads(threads);
  std::vector<PackedBase*> run;
  for (packed::Dtype t : types) {
    run.push_back(&l.get(t));
    run.back()->set_threads(threads);
  }
  const std::size_t nt = types.size();
  const Matrix<float> x = random_matrix<float>(n, s.d, 100 + n);
  Matrix<float> y0(n, s.d);
  l.f32->forward_into(x, y0);
  std::vector<Matrix<float>> y(nt, Matrix<float>(n, s.d));
  for (std::size_t i = 0; i < nt; ++i) run[i]->forward_into(x, y[i]);  // warm-up: outputs, scratch
  const bool cold = n <= kDecodeTokens;
  std::vector<double> bytes(nt, 0);
  std::vector<std::vector<double>> times(nt), bounds(nt);  // per iteration
  for (std::size_t i = 0; i < nt; ++i) bytes[i] = run[i]->true_step_bytes(x);
  std::size_t rotation = 0;
  for (auto _ : state) {
    double reference = 0;
    for (std::size_t k = 0; k < nt; ++k) {
      const std::size_t i = (rotation + k) % nt;
      if (cold) evict_first(threads);
      const auto t0 = Clock::now();
      run[i]->forward_into(x, y[i]);
      benchmark::DoNotOptimize(y[i].data());
      benchmark::ClobberMemory();
      const double t = seconds_since(t0);
      times[i].push_back(t);
      if (types[i] == packed::Dtype::bf16) reference = t;
      if (cold) {
        evict_first(threads);
        bounds[i].push_back(cold_read_seconds(bytes[i], threads));
      }
    }
    state.SetIterationTime(reference);
    ++rotation;
  }
  // Medians over the iterations: a step another process preempted moves a
  // sum, not a median.
  std::vector<double> total(nt), bound(nt);
  for (std::size_t i = 0; i < nt; ++i) {
    total[i] = median(times[i]);
    bound[i] = cold ? median(bounds[i]) : 0.0;
  }
  const auto time_of = [&](packed::Dtype t) {
    for (std::size_t i = 0; i < nt; ++i)
      if (types[i] == t) return total[i];
    return 0.0;
  };
  for (std::size_t i = 0; i < nt; ++i) {
    const std::string name = packed::dtype_name(types[i]);
    auto& c = state.counters;
    if (types[i] != packed::Dtype::bf16) c[name + ":x_bf16"] = total[i] / time_of(packed::Dtype::bf16);
    if (types[i] != packed::Dtype::f32) c[name + ":x_f32"] = total[i] / time_of(packed::Dtype::f32);
    if (block_of(types[i]) > 1 && types[i] != packed::Dtype::q8_0)
      c[name + ":x_q8_0"] = total[i] / time_of(packed::Dtype::q8_0);
    c[name + ":rel_err"] = (y[i] - y0).norm() / std::max(y0.norm(), 1e-30f);
    const auto key = std::make_tuple(shape_index, int(types[i]), threads);
    if (n == 2048) batch_seconds_per_token()[key] = total[i] / double(n);
    if (cold) {
      c[name + ":bw_frac"] = bound[i] / total[i];
      c[name + ":MB"] = bytes[i] * 1e-6;
      if (n > 4 && batch_seconds_per_token().count(key)) {
        const double compute = batch_seconds_per_token()[key] * double(n);
        c[name + ":x_bound"] = total[i] / std::max(bound[i], compute);
      }
    }
  }
  state.counters["tokens/s(bf16)"] = benchmark::Counter(double(n), benchmark::Counter::kIsIterationInvariantRate);
  std::string label = std::string(s.name) + " isa=" + packed::isa_name(bench_isa()) +
                      " block_tiles=" + packed::block_format_tiles(bench_isa());
  if (cold) label += std::string(" bw_probe=") + kReadProbeName;
  if (!skipped.empty()) label += " skipped=" + skipped + " (d_ffn " + std::to_string(s.f) + " not whole blocks)";
  state.SetLabel(label);
}

// Shape by shape (one shape's layers alive at a time), N = 2048 first (the
// compute bound of N = 16 is its time per token), then 128, 16, 4, 1. Cold
// steps run a fixed number of iterations (each evicts the caches twice per
// type); batches run a few iterations of every type.
void register_block_formats() {
  for (int si : {0, 3, 1, 2})
    for (Index n : {2048, 128, 16, 4, 1})
      for (int t : {1, 2}) {
        const std::string name = std::string("BM_BlockFormats/") + kShapes[si].name + "/N:" + std::to_string(n) +
                                 "/threads:" + std::to_string(t);
        benchmark::RegisterBenchmark(name.c_str(), BM_BlockFormats, si, n, t)
            ->UseManualTime()
            ->Unit(benchmark::kMillisecond)
            ->Iterations(n == 2048 ? 3 : n == 128 ? 10 : 12);
      }
}

// gpt-oss's experts (the clamped kind, inference/engine/kinds/clamped_swiglu.hpp) against
// SwiGLU experts on the same packed weights, decode (cold caches): what the
// kind's extra pass (biases and clamped activation between the gate/up and
// down passes) costs where time is bytes of weights over bandwidth. One MoE
// block of gpt-oss-20b's widths (d = f = 2880) with 8 of its 32 experts,
// K = 4; the router's logit bias is 0, so both layers route alike and read
// the same experts.
struct KindLayers {
  std::unique_ptr<GptOssMoE<float>> clamped_f32;
  std::unique_ptr<MoEFFN<float>> swiglu_f32;
  KindLayers() {
    const MoEConfig g = gpt_oss_moe(2880, 2880, 8, 4);
    clamped_f32 = std::make_unique<GptOssMoE<float>>(g, 9);
    swiglu_f32 = std::make_unique<MoEFFN<float>>(MoEConfig{g.d_model, g.d_ffn, g.n_experts, g.n_active, 0}, 9);
    swiglu_f32->router().weight() = clamped_f32->router().weight();
    for (std::size_t e = 0; e < clamped_f32->experts().size(); ++e) {
      auto& c = clamped_f32->experts()[e];
      c.b_gate() = random_matrix<float>(1, g.d_ffn, 50 + e, 1.0).row(0);
      c.b_up() = random_matrix<float>(1, g.d_ffn, 60 + e, 1.0).row(0);
      c.b_down() = random_matrix<float>(1, g.d_model, 70 + e, 0.1).row(0);
      swiglu_f32->experts()[e] = c.swiglu();
    }
  }
};

KindLayers& kind_layers() {
  static KindLayers l;  // one float pair for every storage type
  return l;
}

template <class S>
void BM_ExpertKinds(benchmark::State& state) {
  const Index n = state.range(0);
  const int threads = int(state.range(1));
  KindLayers& l = kind_layers();
  auto clamped = PackedMoE<S, ClampedSwiGLU<float>>::from(*l.clamped_f32);
  auto swiglu = PackedMoE<S>::from(*l.swiglu_f32);
  clamped.set_threads(threads);
  swiglu.set_threads(threads);
  const Matrix<float> x = random_matrix<float>(n, 2880, 300 + n);
  Matrix<float> yc(n, 2880), ys(n, 2880);
  clamped.forward_into(x, yc);  // warm-up: scratch
  swiglu.forward_into(x, ys);
  Routing<float> r;
  swiglu.router().route(x, swiglu.bias(), false, r);
  const std::set<Index> used(r.experts.data(), r.experts.data() + r.experts.size());
  const double extra = double(detail::inference::kind_extra_bytes<ExpertKind<ClampedSwiGLU<float>>>(
      "bench", 2880, 2880));
  double bytes = 4.0 * 8 * 2880;  // the router
  for (Index e : used) bytes += double(swiglu.experts()[std::size_t(e)].bytes());
  std::vector<double> tc, ts, bound;
  bool clamped_first = true;
  for (auto _ : state) {
    for (int k = 0; k < 2; ++k) {  // alternated, each after an eviction
      const bool c = (k == 0) == clamped_first;
      evict_first(threads);
      const auto t0 = Clock::now();
      if (c) clamped.forward_into(x, yc);
      else swiglu.forward_into(x, ys);
      benchmark::ClobberMemory();
      (c ? tc : ts).push_back(seconds_since(t0));
    }
    evict_first(threads);
    bound.push_back(cold_read_seconds(bytes, threads));
    state.SetIterationTime(tc.back());
    clamped_first = !clamped_first;
  }
  const double mc = median(tc), ms = median(ts), mb = median(bound);
  state.counters["clamped:x_swiglu"] = mc / ms;
  state.counters["clamped:bw_frac"] = mb * (bytes + extra * double(used.size())) / bytes / mc;
  state.counters["swiglu:bw_frac"] = mb / ms;
  state.counters["MB"] = bytes * 1e-6;
  state.SetLabel(std::string(packed::dtype_name(packed_dtype<S>())) + " d=f=2880 E=8 K=4 isa=" +
                 packed::isa_name(packed::kDefaultIsa) + " bw_probe=" + kReadProbeName);
}
void expert_kind_args(benchmark::internal::Benchmark* b) {
  for (int t : {1, 2})
    for (int n : {1, 4}) b->Args({n, t});
  b->ArgNames({"N", "threads"})->UseManualTime()->Unit(benchmark::kMillisecond)->Iterations(15);
}
BENCHMARK_TEMPLATE(BM_ExpertKinds, bf16)->Apply(expert_kind_args);
BENCHMARK_TEMPLATE(BM_ExpertKinds, packed::q8_0)->Apply(expert_kind_args);
BENCHMARK_TEMPLATE(BM_ExpertKinds, packed::mxfp4)->Apply(expert_kind_args);

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

/// Takes `--isa=<path>` out of argv into bench_isa(); false (with a message)
/// for a path this CPU cannot run or a name no path has.
bool take_isa_flag(int& argc, char** argv) {
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--isa=", 0) != 0) {
      argv[kept++] = argv[i];
      continue;
    }
    const std::string name = arg.substr(6);
    bool found = false;
    for (const packed::Isa isa : packed::kAllIsas)
      if (name == packed::isa_name(isa)) bench_isa() = isa, found = true;
    if (!found || !packed::cpu_supports(bench_isa())) {
      std::fprintf(stderr, "bench_inference: --isa=%s: %s\n", name.c_str(),
                   found ? "this CPU cannot run that path" : "no such kernel path");
      return false;
    }
  }
  argc = kept;
  return true;
}

int main(int argc, char** argv) {
  if (!take_isa_flag(argc, argv)) return 1;
  register_block_formats();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::AddCustomContext("packed_isa", apex::packed::isa_name(bench_isa()));
  benchmark::AddCustomContext("block_format_tiles", apex::packed::block_format_tiles(bench_isa()));
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
