// Writes the raw bytes of outputs, dx and every gradient of the library's
// layers into a folder, one file per array, so two revisions can be compared
// with `cmp` (compare.sh). Includes the umbrella headers and the GGUF MoE
// loaders and the transposed product, whose paths have not moved, so the
// same source builds against old and new revisions.
//
//   dump OUT_DIR      → OUT_DIR/<case>.<array>.bin, and OUT_DIR/paths.txt
//
// Every input is seeded; nothing depends on time, threads or the CPU beyond
// the kernel paths named in paths.txt (a path the CPU lacks is skipped and
// listed there as skipped).

#include <apex/ffn.hpp>
#include <apex/ffn/inference.hpp>
#include <apex/ffn/inference/files/gguf/load.hpp>
#include <apex/ffn/inference/files/gguf/save.hpp>
#include <apex/ffn/kernels/transposed_product.hpp>

#include <cstdio>
#include <unistd.h>
#include <fstream>
#include <string>
#include <vector>

#include "dump_files.hpp"

namespace {

using namespace apex;

using dump::g_dir;
using dump::g_files;
using dump::put_m;
using dump::rnd;

/// Every gradient of `layer`'s params().
template <class L>
void put_grads(const std::string& tag, L& layer) {
  for (const auto& p : layer.params()) put_m(tag + ".grad." + p.name, p.grad());
}

/// forward with a cache, backward of a seeded dy: y, dx, every gradient.
template <class L, class T>
void train_case(const std::string& tag, L& layer, const Matrix<T>& x, std::uint64_t seed) {
  typename L::Cache cache;
  const Matrix<T> y = layer.forward(x, &cache);
  put_m(tag + ".y", y);
  const Matrix<T> dy = rnd<T>(y.rows(), y.cols(), seed);
  put_m(tag + ".dx", layer.backward(dy, cache));
  put_grads(tag, layer);
  put_m(tag + ".y_nocache", layer.forward(x));
}

MoEConfig config(Index e, Index k, Index s, Index d, Index f, bool shared_gate) {
  MoEConfig c;
  c.d_model = d;
  c.d_ffn = f;
  c.n_experts = e;
  c.n_active = k;
  c.n_shared = s;
  c.shared_expert_gate = shared_gate;
  return c;
}

/// κ parameters away from their zero init, so κ varies per unit and token
/// (SwiGLU experts have none).
template <class T>
void perturb_one(SwiGLU<T>&, std::uint64_t&) {}
template <class T>
void perturb_one(KappaSwiGLU<T>& e, std::uint64_t& seed) {
  e.kappa_alpha() = rnd<T>(1, e.d_ffn(), seed++, 2.0);
  e.kappa_bias() = rnd<T>(1, e.d_ffn(), seed++, 1.0);
}
template <class M>
void perturb_kappa(M& moe, std::uint64_t seed) {
  for (auto& e : moe.experts()) perturb_one(e, seed);
}

std::vector<packed::Isa> supported_paths(std::ofstream& log) {
  std::vector<packed::Isa> out;
  for (packed::Isa isa : packed::kAllIsas) {
    const bool ok = packed::cpu_supports(isa);
    log << packed::isa_name(isa) << (ok ? " run" : " skipped (CPU lacks it)") << "\n";
    if (ok) out.push_back(isa);
  }
  return out;
}

/// The float training layers on every training-engine setting (Eigen, and
/// the packed micro-kernels on each path), plus double.
template <class Expert>
void moe_training(const std::string& name, const std::vector<packed::Isa>& isas, bool kappa) {
  const MoEConfig cfg = config(6, 2, 1, 19, 37, true);
  {
    MoEFFN<double, typename Expert::template Rebind<double>> m(cfg, 11);
    if (kappa) perturb_kappa(m, 100);
    train_case(name + ".double", m, rnd<double>(53, cfg.d_model, 7), 8);
  }
  std::vector<std::pair<std::string, packed::TrainingEngine>> engines;
  packed::TrainingEngine off = packed::training_engine();
  off.enabled = false;
  engines.push_back({"eigen", off});
  for (packed::Isa isa : isas) {
    if (isa == packed::Isa::avx512_bf16) continue;  // float products: same kernels as avx512
    packed::TrainingEngine e = packed::training_engine();
    e.enabled = true;
    e.isa = isa;
    engines.push_back({packed::isa_name(isa), e});
  }
  const packed::TrainingEngine saved = packed::training_engine();
  for (const auto& [ename, eng] : engines) {
    packed::set_training_engine(eng);
    MoEFFN<float, typename Expert::template Rebind<float>> m(cfg, 11);
    if (kappa) perturb_kappa(m, 100);
    train_case(name + ".float." + ename, m, rnd<float>(53, cfg.d_model, 7), 8);
  }
  packed::set_training_engine(saved);
}

template <class T>
struct SwiGLUOf {
  template <class U>
  using Rebind = SwiGLU<U>;
};
struct KappaOf {
  template <class U>
  using Rebind = KappaSwiGLU<U>;
};

/// PackedMoE in float and bf16 storage on each path and bf16 product mode.
template <class Expert>
void packed_moe(const std::string& name, const std::vector<packed::Isa>& isas, bool kappa) {
  const MoEConfig cfg = config(6, 2, 2, 19, 37, true);
  MoEFFN<float, Expert> m(cfg, 21);
  if (kappa) perturb_kappa(m, 200);
  auto pf = PackedMoE<float, Expert>::from(m);
  auto pb = PackedMoE<packed::bf16, Expert>::from(m);
  for (Index n : {Index(1), Index(5), Index(77)}) {
    const Matrix<float> x = rnd<float>(n, cfg.d_model, 30 + std::uint64_t(n));
    put_m(name + ".n" + std::to_string(n) + ".float_layer", m.forward(x));
    for (packed::Isa isa : isas) {
      for (auto prod : {packed::Bf16Products::widened, packed::Bf16Products::paired}) {
        if (prod == packed::Bf16Products::paired && (isa != packed::Isa::avx512_bf16 || kappa)) continue;
        const std::string tag = name + ".n" + std::to_string(n) + "." + packed::isa_name(isa) +
                                (prod == packed::Bf16Products::paired ? ".paired" : "");
        if (prod != packed::Bf16Products::paired) {
          pf.set_kernel_options({isa, prod});
          put_m(tag + ".f32", pf.forward(x));
        }
        pb.set_kernel_options({isa, prod});
        put_m(tag + ".bf16", pb.forward(x));
      }
    }
  }
}

void packed_dense(const std::vector<packed::Isa>& isas) {
  for (auto [d, f] : {std::pair<Index, Index>{19, 37}, {64, 96}}) {
    SwiGLU<float> s(d, f, 5);
    const auto pf = PackedSwiGLU<float>::from(s);
    const auto pb = PackedSwiGLU<packed::bf16>::from(s);
    for (Index n : {Index(1), Index(3), Index(40), Index(130)}) {
      const Matrix<float> x = rnd<float>(n, d, 40 + std::uint64_t(n));
      for (packed::Isa isa : isas) {
        auto a = pf;
        auto b = pb;
        a.set_kernel_options({isa, packed::Bf16Products::widened});
        b.set_kernel_options({isa, packed::Bf16Products::widened});
        const std::string tag = "packed_swiglu.d" + std::to_string(d) + ".n" + std::to_string(n) + "." + packed::isa_name(isa);
        put_m(tag + ".f32", a.forward(x));
        put_m(tag + ".bf16", b.forward(x));
        if (isa == packed::Isa::avx512_bf16) {
          b.set_kernel_options({isa, packed::Bf16Products::paired});
          put_m(tag + ".bf16_paired", b.forward(x));
        }
      }
    }
  }
}

template <class T>
void sublayers() {
  const std::string t = sizeof(T) == 4 ? "float" : "double";
  const Index d = 19;
  SkipGateConfig g;
  g.d_model = d;
  g.hidden = 7;
  g.threshold = 0.45;
  {
    FFNSublayer<T, MoEFFN<T>> s(d, MoEFFN<T>(config(5, 2, 1, d, 23, false), 3), SkipGate<T>(g, 4));
    train_case("sublayer.moe." + t, s, rnd<T>(41, d, 9), 10);
    s.set_mode(SublayerMode::inference);
    put_m("sublayer.moe." + t + ".inference_y", s.forward(rnd<T>(41, d, 9)));
  }
  {
    FFNSublayer<T, MoEFFN<T, KappaSwiGLU<T>>> s(d, MoEFFN<T, KappaSwiGLU<T>>(config(5, 2, 1, d, 23, true), 13),
                                                SkipGate<T>(g, 14));
    perturb_kappa(s.ffn(), 300);
    train_case("sublayer.kappa_moe." + t, s, rnd<T>(41, d, 19), 20);
  }
  {
    FFNSublayer<T, SwiGLU<T>> s(d, SwiGLU<T>(d, 29, 6), SkipGate<T>(g, 7));
    train_case("sublayer.swiglu." + t, s, rnd<T>(33, d, 29), 30);
  }
}

template <class T>
void mtp() {
  const std::string t = sizeof(T) == 4 ? "float" : "double";
  MultiTokenOptions o;
  o.num_heads = 3;
  MultiTokenHeads<T> h(19, 23, o, 5);
  train_case("mtp." + t, h, rnd<T>(17, 19, 50), 51);
}

void packed_sublayer(const std::vector<packed::Isa>& isas) {
  const Index d = 19;
  SkipGateConfig g;
  g.d_model = d;
  g.hidden = 7;
  g.threshold = 0.45;
  FFNSublayer<float, MoEFFN<float>> s(d, MoEFFN<float>(config(5, 2, 1, d, 23, true), 3), SkipGate<float>(g, 4));
  auto pf = pack_sublayer<float>(s);
  auto pb = pack_sublayer<packed::bf16>(s);
  const Matrix<float> x = rnd<float>(41, d, 61);
  for (packed::Isa isa : isas) {
    pf.ffn().set_kernel_options({isa, packed::Bf16Products::widened});
    pb.ffn().set_kernel_options({isa, packed::Bf16Products::widened});
    put_m(std::string("packed_sublayer.") + packed::isa_name(isa) + ".f32", pf.forward(x));
    put_m(std::string("packed_sublayer.") + packed::isa_name(isa) + ".bf16", pb.forward(x));
  }
}

/// Every storage type of the weight-type table besides f32 and bf16 (and a
/// mixed K-quant pair) on each path: PackedMoE outputs, the transposed
/// product of an expert's matrices (the column unpacker), and a GGUF file of
/// the layer loaded packed and decoded to float.
void block_formats(const std::vector<packed::Isa>& isas) {
  using packed::Dtype;
  MoEConfig cfg = config(4, 2, 0, 256, 512, false);  // whole Q4_K / Q6_K super-blocks
  cfg.routing = family_routing(MoEFamily::Qwen3MoE);
  const MoEFFN<float> m(cfg, 41);
  const std::vector<std::pair<std::string, PackedTypes>> types = {
      {"f16", Dtype::f16},   {"q8_0", Dtype::q8_0},   {"q4_0", Dtype::q4_0}, {"q4_k", Dtype::q4_k},
      {"q6_k", Dtype::q6_k}, {"mxfp4", Dtype::mxfp4}, {"q4_k_q6_k", packed::ExpertDtypes(Dtype::q4_k, Dtype::q6_k)}};
  const std::string gguf = "/tmp/apex_refactor_dump_" + std::to_string(::getpid()) + ".gguf";
  for (const auto& [name, t] : types) {
    PackedMoE<float> p = PackedMoE<float>::from(m, t);
    const std::string tag = "block_formats." + name;
    for (Index n : {Index(1), Index(5), Index(77)}) {
      const Matrix<float> x = rnd<float>(n, cfg.d_model, 70 + std::uint64_t(n));
      for (packed::Isa isa : isas) {
        p.set_kernel_options({isa, packed::Bf16Products::widened});
        put_m(tag + ".n" + std::to_string(n) + "." + packed::isa_name(isa) + ".y", p.forward(x));
      }
    }
    const packed::PackedExpert& e = p.experts()[1];
    const Matrix<float> dy_gu = rnd<float>(7, 32 * e.gate_up().panels(), 80);
    const Matrix<float> dy_dn = rnd<float>(7, 32 * e.down().panels(), 81);
    for (packed::Isa isa : isas) {
      put_m(tag + ".gate_up_t." + packed::isa_name(isa), packed::transposed_product(e.gate_up(), dy_gu, isa));
      put_m(tag + ".down_t." + packed::isa_name(isa), packed::transposed_product(e.down(), dy_dn, isa));
    }
    GgufSaveOptions o;
    o.family = MoEFamily::Qwen3MoE;
    save_gguf_moe(gguf, p, o);
    const gguf::File file = gguf::File::open(gguf);
    const Matrix<float> x = rnd<float>(9, cfg.d_model, 90);
    put_m(tag + ".gguf_packed.y", load_gguf_moe(file, 0).forward(x));
    MoEFFN<float> f = load_gguf_moe_float(file, 0);
    put_m(tag + ".gguf_float.y", f.forward(x));
    for (const auto& q : f.param_values()) put_m(tag + ".gguf_float." + q.name, q.value());
  }
  std::remove(gguf.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT_DIR\n", argv[0]);
    return 2;
  }
  g_dir = argv[1];
  std::ofstream log(g_dir + "/paths.txt");
  const std::vector<packed::Isa> isas = supported_paths(log);
  moe_training<SwiGLUOf<void>>("moe.swiglu", isas, false);
  moe_training<KappaOf>("moe.kappa", isas, true);
  packed_moe<SwiGLU<float>>("packed_moe.swiglu", isas, false);
  packed_moe<KappaSwiGLU<float>>("packed_moe.kappa", isas, true);
  packed_dense(isas);
  packed_sublayer(isas);
  block_formats(isas);
  sublayers<float>();
  sublayers<double>();
  mtp<float>();
  mtp<double>();
  log << "files " << g_files << "\n";
  std::printf("%d files\n", g_files);
  return 0;
}
