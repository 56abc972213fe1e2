// Model files: loading a medium-preset MoE layer (d 2048, f 5504, K 4,
// S 2) from its pack-once file (map_packed_moe: the expert weights are a
// mapping, inference/files/pack_once/file.hpp) against today's load through
// the float loader (load_packed_moe from an F32 file, packing each expert
// to bf16), the two alternated in one loop; the counter `map_over_float_load`
// is the ratio (target ≤ 0.01). Both files are in the page cache (warm:
// the first iteration reads them), so the figure is the loaders' own cost,
// not the disk's.
//
// The routed experts default to 8 of the preset's 64 (argument E): an F32
// file of all 64 is 9 GB, more than a shared machine's page cache should
// hold for a benchmark. The float load scales with E (every expert is read
// and packed); the map's cost is the header and the float parts, so the
// ratio at 64 is smaller still.
//
// Residency counters (smaps Rss of the mapping's VMA, this process's
// resident pages of it): before the first forward, and after a forward of
// one token (K = 4 routed experts and the 2 shared ones touched).
#include <apex/ffn/inference.hpp>
#include <apex/ffn/inference/files/pack_once/file.hpp>
#include <apex/ffn/inference/files/checkpoint/load.hpp>
#include <apex/ffn/io/checkpoint.hpp>

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>

#include "bench_common.hpp"

using namespace apex;
using apex::bench::random_matrix;
using apex::packed::bf16;

namespace {

/// Rss bytes of the mapping starting at `base` (/proc/self/smaps), -1 if none.
double mapping_rss(const void* base) {
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool in = false;
  while (std::getline(smaps, line)) {
    unsigned long long start = 0, end = 0;
    char dash = 0;
    std::istringstream head(line);
    if (head >> std::hex >> start >> dash >> end && dash == '-') {
      in = start == reinterpret_cast<std::uintptr_t>(base);
      continue;
    }
    if (in && line.rfind("Rss:", 0) == 0) return double(std::stoll(line.substr(4))) * 1024;
  }
  return -1;
}

/// An F32 checkpoint of a random layer of `c`, written tensor by tensor
/// (never a float copy of the whole layer in memory).
void write_f32_file(const std::string& path, const MoEConfig& c) {
  using safetensors::DType;
  const auto u = [](Index n) { return std::uint64_t(n); };
  std::vector<safetensors::RawTensor> ts;
  const auto add = [&](std::string name, Index rows, Index cols, std::uint64_t seed) {
    ts.push_back({std::move(name), DType::F32, {u(rows), u(cols)}, [=](safetensors::ByteSink& out) {
                    const Matrix<float> m = random_matrix<float>(rows, cols, seed, 0.02);  // rows × cols
                    out.write(m.data(), std::size_t(m.size()) * 4);
                  }});
  };
  add(state_names::kRouter, c.n_experts, c.d_model, 1);
  for (Index e = 0; e < c.n_experts + c.n_shared; ++e) {
    const bool shared = e >= c.n_experts;
    const std::string q = shared ? state_names::shared_expert(e - c.n_experts) : state_names::routed_expert(e);
    const Index f = shared ? c.shared_ffn() : c.d_ffn;
    add(q + state_names::kGate, f, c.d_model, 10 + u(e));
    add(q + state_names::kUp, f, c.d_model, 100 + u(e));
    add(q + state_names::kDown, c.d_model, f, 1000 + u(e));
  }
  safetensors::save_raw(path, ts);
}

void BM_MapPackOnceFile(benchmark::State& state) {
  MoEConfig c = ModelPreset::medium().moe();
  c.n_experts = Index(state.range(0));
  c.n_active = std::min<Index>(c.n_active, c.n_experts);
  const std::string dir = std::filesystem::temp_directory_path() / ("apex_bench_map_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string f32 = dir + "/layer.f32.safetensors", packed = dir + "/layer.panels.safetensors";
  write_f32_file(f32, c);
  save_packed_layout(packed, load_packed_moe<bf16>(f32, c));
  std::optional<PackedMoE<bf16>> mapped, owned;
  apex::bench::interleaved(
      state, "map_over_float_load", [&] { mapped.emplace(map_packed_moe<bf16>(packed, c)); },
      [&] { owned.emplace(load_packed_moe<bf16>(f32, c)); });
  owned.reset();
  // Residency, untimed, on a fresh mapping.
  mapped.emplace(map_packed_moe<bf16>(packed, c));
  const void* base = mapped->experts()[0].gate_up().mapping()->data();
  const double before = mapping_rss(base);
  benchmark::DoNotOptimize(mapped->forward(random_matrix<float>(1, c.d_model, 9)).data());
  const double after = mapping_rss(base);
  const double touched = double(std::size_t(c.n_active) * mapped->experts()[0].bytes() +
                                std::size_t(c.n_shared) * mapped->shared_experts()[0].bytes());
  state.counters["rss_before_forward_MiB"] = before / 1048576;
  state.counters["rss_after_1_token_MiB"] = after / 1048576;
  state.counters["touched_experts_MiB"] = touched / 1048576;
  state.counters["weights_MiB"] = double(PackedMoE<bf16>::weight_bytes(c)) / 1048576;
  state.SetLabel(std::string("medium E") + std::to_string(c.n_experts) + "/bf16/" +
                 packed::isa_name(packed::kDefaultIsa));
  std::filesystem::remove_all(dir);
}
BENCHMARK(BM_MapPackOnceFile)->Arg(8)->Iterations(3)->UseManualTime()->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
