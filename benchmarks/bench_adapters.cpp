// LoRA adapters trained on frozen packed experts (adapters/lora_moe.hpp):
//
//  BM_LoraStep/<type>/shape/N/threads — one training step (forward with a
//    cache, backward) of LoraMoE over a packed layer, alternated in one loop
//    with two baselines on the same input:
//      fwdbwd_over_fwd   the step's time / the same layer's forward with a cache
//      float_over_lora   the float training layer MoEFFN<float> (same shape, its
//                        forward and backward, every weight gradient) / the step
//  BM_LoraResident/<type> — resident bytes of a packed LoRA layer after a step,
//    against its parts: packed weights + adapters + AdamW's two moments +
//    the cache's activations.
//
// Shapes: fine (d 1024, f 512, E 64, K 8, S 2) and qwen3 (d 2048, f 768,
// E 128, K 8, S 0: Qwen3-30B-A3B's MoE block). Every figure is a median of
// the iterations, the label names the kernel path that ran.
//
//   cmake --workflow --preset bench
//   build/bench/benchmarks/bench_adapters --benchmark_repetitions=3 --benchmark_report_aggregates_only=true

#include <apex/ffn/adapters.hpp>
#include <apex/ffn/inference.hpp>
#include <apex/ffn/moe/moe_ffn.hpp>

#include <algorithm>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "bench_common.hpp"

using namespace apex;
using apex::bench::Clock;
using apex::bench::random_matrix;
using apex::bench::seconds_since;
using apex::bench::vm_rss;

namespace {

struct Shape {
  const char* name;
  Index d, f, e, k, shared;
};
const Shape kShapes[] = {{"fine", 1024, 512, 64, 8, 2}, {"qwen3", 2048, 768, 128, 8, 0}};

MoEConfig config_of(const Shape& s) {
  MoEConfig c;
  c.d_model = s.d;
  c.d_ffn = s.f;
  c.n_experts = s.e;
  c.n_active = s.k;
  c.n_shared = s.shared;
  return c;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// One float training layer per shape (the baseline, and the source of the packed weights).
MoEFFN<float>& float_layer(int shape) {
  static std::map<int, std::unique_ptr<MoEFFN<float>>> layers;
  auto& slot = layers[shape];
  if (!slot) slot = std::make_unique<MoEFFN<float>>(config_of(kShapes[shape]), 7);
  return *slot;
}

LoraOptions options() {
  LoraOptions o;
  o.rank = 8;
  o.alpha = 16;
  return o;  // gate_up and down of every routed and shared expert, router frozen
}

template <class S>
void BM_LoraStep(benchmark::State& state) {
  const int shape = int(state.range(0));
  const Index n = state.range(1);
  const int threads = int(state.range(2));
  const Shape& s = kShapes[shape];
  MoEFFN<float>& full = float_layer(shape);
  LoraMoE<PackedMoE<S>> lora(PackedMoE<S>::from(full), options(), Rng(3));
  for (auto& p : lora.param_values())  // B ≠ 0, as after some training
    if (p.name.find("lora_B") != std::string::npos) p.value() = random_matrix<float>(p.rows, p.cols, 4, 0.01);
  lora.set_threads(threads);
  full.set_threads(threads);
  const Matrix<float> x = random_matrix<float>(n, s.d, 5), dy = random_matrix<float>(n, s.d, 6, 0.01);
  typename LoraMoE<PackedMoE<S>>::Cache lc;
  MoEFFN<float>::Cache fc;
  const auto lora_step = [&] {
    lora.forward(x, &lc);
    benchmark::DoNotOptimize(lora.backward(dy, lc).data());
  };
  const auto lora_forward = [&] { benchmark::DoNotOptimize(lora.forward(x, &lc).data()); };
  const auto float_step = [&] {
    full.forward(x, &fc);
    benchmark::DoNotOptimize(full.backward(dy, fc).data());
  };
  lora.zero_grad();
  full.zero_grad();
  lora_step();  // warm-up: workspaces and caches sized
  float_step();
  std::vector<double> ts, tf, tb;
  for (auto _ : state) {
    auto t0 = Clock::now();
    lora_step();
    ts.push_back(seconds_since(t0));
    t0 = Clock::now();
    lora_forward();
    tf.push_back(seconds_since(t0));
    t0 = Clock::now();
    float_step();
    tb.push_back(seconds_since(t0));
    state.SetIterationTime(ts.back());
  }
  state.counters["fwdbwd_over_fwd"] = median(ts) / median(tf);
  state.counters["float_over_lora"] = median(tb) / median(ts);
  state.counters["step_ms"] = median(ts) * 1e3;
  state.SetLabel(std::string(packed::dtype_name(packed_dtype<S>())) + " " + s.name + " isa=" +
                 packed::isa_name(packed::kDefaultIsa));
}

void step_args(benchmark::internal::Benchmark* b) {
  for (int shape : {0, 1})
    for (int threads : {1, 2}) b->Args({shape, 512, threads});
  b->ArgNames({"shape", "N", "threads"})->UseManualTime()->Unit(benchmark::kMillisecond)->Iterations(5);
}
BENCHMARK_TEMPLATE(BM_LoraStep, packed::q4_0)->Apply(step_args);
BENCHMARK_TEMPLATE(BM_LoraStep, packed::bf16)->Apply(step_args);
BENCHMARK_TEMPLATE(BM_LoraStep, packed::q8_0)->Apply(step_args);
BENCHMARK_TEMPLATE(BM_LoraStep, packed::q4_k)->Apply(step_args);
BENCHMARK_TEMPLATE(BM_LoraStep, packed::q6_k)->Apply(step_args);
BENCHMARK_TEMPLATE(BM_LoraStep, packed::mxfp4)->Apply(step_args);
BENCHMARK_TEMPLATE(BM_LoraStep, float)->Apply(step_args);

// A qwen3-shaped packed layer built expert by expert (never a float copy of
// the layer), adapters on it, one step at N = 512 with AdamW-sized moments:
// resident growth against the parts it must hold.
template <class S>
void BM_LoraResident(benchmark::State& state) {
  const MoEConfig c = config_of(kShapes[1]);
  for (auto _ : state) {
    const double before = vm_rss();
    double parts = 0, after = 0;
    {
      std::vector<packed::PackedExpert> experts;
      for (Index e = 0; e < c.n_experts; ++e) {
        const Matrix<float> gu = random_matrix<float>(2 * c.d_ffn, c.d_model, 10 + std::uint64_t(e), 0.02);
        const Matrix<float> dn = random_matrix<float>(c.d_model, c.d_ffn, 1000 + std::uint64_t(e), 0.02);
        experts.emplace_back(gu.topRows(c.d_ffn), gu.bottomRows(c.d_ffn), dn, packed_dtype<S>());
      }
      PackedMoE<S> base(c, random_matrix<float>(c.n_experts, c.d_model, 3, 0.02), RowVector<float>::Zero(c.n_experts),
                        std::move(experts), {}, {});
      const double packed_bytes = double(base.expert_bytes());
      LoraMoE<PackedMoE<S>> lora(std::move(base), options(), Rng(3));
      lora.set_threads(2);
      const ParamList<float> params = lora.params();
      std::vector<Matrix<float>> m, v;  // AdamW's moments
      for (const auto& p : params) {
        m.push_back(Matrix<float>::Zero(p.rows, p.cols));
        v.push_back(Matrix<float>::Zero(p.rows, p.cols));
      }
      const Matrix<float> x = random_matrix<float>(512, c.d_model, 5), dy = random_matrix<float>(512, c.d_model, 6);
      typename LoraMoE<PackedMoE<S>>::Cache cache;
      lora.forward(x, &cache);
      benchmark::DoNotOptimize(lora.backward(dy, cache).data());
      after = vm_rss();
      const double adapters = 4.0 * double(parameter_count(params));
      // activations: the cache, x, dy and dx, and the backward's plan-order workspaces (g·dy, ∂L/∂x: NK × d each)
      double activations = 4.0 * double(cache.x.size() + cache.x_sorted.size() + cache.work.size() +
                                        cache.y_sorted.size() + cache.routing.logits.size());
      activations += 4.0 * (3 * double(x.size()) + 2 * double(cache.y_sorted.size()));
      // adapters: values, gradients, and AdamW's m and v: 4× their bytes
      parts = packed_bytes + 4 * adapters + activations;
      state.counters["packed_MB"] = packed_bytes * 1e-6;
      state.counters["adapters_MB"] = adapters * 1e-6;
      state.counters["activations_MB"] = activations * 1e-6;
    }
    state.counters["rss_MB"] = (after - before) * 1e-6;
    state.counters["rss_over_parts"] = (after - before) / parts;
  }
  state.SetLabel(std::string(packed::dtype_name(packed_dtype<S>())) + " qwen3 N=512 isa=" +
                 packed::isa_name(packed::kDefaultIsa));
}
BENCHMARK_TEMPLATE(BM_LoraResident, packed::q4_0)->Iterations(1)->Unit(benchmark::kSecond);
BENCHMARK_TEMPLATE(BM_LoraResident, packed::q4_k)->Iterations(1)->Unit(benchmark::kSecond);
BENCHMARK_TEMPLATE(BM_LoraResident, packed::bf16)->Iterations(1)->Unit(benchmark::kSecond);

}  // namespace

BENCHMARK_MAIN();
