// model_file: opens one MoE layer of a llama.cpp GGUF model file, runs it,
// and keeps it as a pack-once file that later opens as a mapping.
//
//   model_file FILE.gguf [--block N] [--tokens T]
//   model_file --sample DIR [--tokens T]
//
// The second form first writes DIR/sample.gguf, a Qwen3-MoE block with Q4_K
// gate/up and Q6_K down projections (a "Q4_K_M" file's experts), so the
// example runs without a downloaded model. It prints what the file holds,
// the time and resident memory of each step, and checks that the mapped
// pack-once layer computes the loaded layer's bits (docs/model_files.md).
#include <apex/ffn/inference.hpp>
#include <apex/ffn/inference/files/gguf/load.hpp>
#include <apex/ffn/inference/files/gguf/save.hpp>
#include <apex/ffn/inference/files/pack_once/file.hpp>
#include <apex/ffn/io/gguf.hpp>
#include <apex/ffn/moe/moe_ffn.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <string>

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

/// This process's resident memory in MiB (/proc/self/statm), 0 where there is none.
double resident_mib() {
  std::ifstream statm("/proc/self/statm");
  double pages = 0, resident = 0;
  if (!(statm >> pages >> resident)) return 0;
  return resident * 4096.0 / (1 << 20);
}

struct Args {
  std::string file, sample_dir;
  apex::Index block = 0, tokens = 4;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    const bool has_value = i + 1 < argc;
    if (s == "--sample" && has_value) a.sample_dir = argv[++i];
    else if (s == "--block" && has_value) a.block = std::atol(argv[++i]);
    else if (s == "--tokens" && has_value) a.tokens = std::atol(argv[++i]);
    else if (s.rfind("--", 0) != 0 && a.file.empty()) a.file = s;
    else throw apex::ConfigError("model_file: unknown argument '" + s + "' (see the comment at the top of model_file.cpp)");
  }
  if (a.file.empty() == a.sample_dir.empty())
    throw apex::ConfigError("model_file: give a GGUF file, or --sample DIR to write one first");
  if (a.tokens < 1) throw apex::ConfigError("model_file: --tokens must be at least 1");
  return a;
}

/// Writes a Qwen3-MoE block (d = 512, f = 256, 16 experts, 4 per token) with
/// Q4_K gate/up and Q6_K down experts; returns its path.
std::string write_sample(const std::string& dir) {
  apex::MoEConfig c = apex::family_preset(apex::MoEFamily::Qwen3MoE);
  c.d_model = 512, c.d_ffn = 256, c.n_experts = 16, c.n_active = 4;
  const apex::MoEFFN<float> trained(c, 7);
  const apex::PackedTypes q4_k_m(apex::packed::ExpertDtypes{apex::packed::Dtype::q4_k, apex::packed::Dtype::q6_k});
  apex::GgufSaveOptions o;
  o.family = apex::MoEFamily::Qwen3MoE;
  const std::string path = dir + "/sample.gguf";
  apex::save_gguf_moe(path, trained, q4_k_m, o);
  return path;
}

void report_file(const apex::gguf::File& file, apex::Index block) {
  std::printf("%s: GGUF v%u, architecture %s, %zu tensors, %zu metadata keys\n", file.description().c_str(),
              file.version(), file.architecture().c_str(), file.tensors().size(), file.metadata().size());
  const std::string prefix = "blk." + std::to_string(block) + ".";
  for (const auto& t : file.tensors())
    if (t.name.rfind(prefix + "ffn", 0) == 0)
      std::printf("  %-28s %-6s %-18s %9.2f MiB\n", t.name.c_str(), apex::gguf::type_name(t.type),
                  t.shape_string().c_str(), double(t.nbytes) / (1 << 20));
}

int run(const Args& a) {
  const std::string path = a.sample_dir.empty() ? a.file : write_sample(a.sample_dir);
  auto t0 = Clock::now();
  const apex::gguf::File file = apex::gguf::File::open(path);
  std::printf("opened (mapped, header validated) in %.2f ms, resident %.1f MiB\n", ms_since(t0), resident_mib());
  report_file(file, a.block);

  // The file's rows are not in the kernels' panel order: packed once, in the file's own types.
  t0 = Clock::now();
  const auto layer = apex::load_gguf_moe(file, a.block);
  const apex::MoEConfig& c = layer.config();
  std::printf("block %ld: d = %ld, f = %ld, %ld experts, %ld per token, %ld shared; types %s\n", long(a.block),
              long(c.d_model), long(c.d_ffn), long(c.n_experts), long(c.n_active), long(c.n_shared),
              apex::packed_types_name(layer.types()).c_str());
  std::printf("packed once in %.1f ms, resident %.1f MiB\n", ms_since(t0), resident_mib());

  const apex::Matrix<float> x = apex::Matrix<float>::Random(a.tokens, c.d_model);  // tokens × d
  t0 = Clock::now();
  const apex::Matrix<float> y = layer.forward(x);  // tokens × d
  std::printf("forward of %ld tokens: %.2f ms, |y| = %.6g (kernel path %s)\n", long(a.tokens), ms_since(t0),
              double(y.norm()), apex::packed::isa_name(apex::packed::kDefaultIsa));

  // Kept in the panel order, the layer opens again as a mapping: no read, no copy.
  const std::string packed_path = path + ".apex-panels.safetensors";
  apex::save_packed_layout(packed_path, layer);
  t0 = Clock::now();
  const auto mapped = apex::map_packed_moe<float>(packed_path, c);
  std::printf("pack-once file mapped in %.3f ms, resident %.1f MiB\n", ms_since(t0), resident_mib());
  const bool same = mapped.forward(x) == y;
  std::printf("mapped layer's forward %s the loaded layer's bits\n", same ? "gives" : "DOES NOT give");
  return same ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "model_file: %s\n", e.what());
    return 2;
  }
}
