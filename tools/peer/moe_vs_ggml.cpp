// One MoE step of apex-ffn's PackedMoE against the same step in ggml's CPU
// backend, in one process, on the same weights in the same storage type.
//
// The step is llama.cpp's MoE FFN (build_moe_ffn): router logits (float),
// top-K of them, weights = softmax over the selected K (ggml: softmax over all
// E, top-K, renormalised — the same numbers), SwiGLU experts (gate, up, down),
// the weighted sum. No shared experts. Both engines quantize the activations
// to their weights' dot-product type as ggml does, so their outputs agree to
// rounding (printed as rel_diff, a check that they computed the same thing).
//
// Each repetition runs apex, ggml (and ggml with its repacked CPU weights,
// when the type has them) in an order rotated per repetition, each on fresh
// tokens (so fresh routing) and each after a buffer twice the L3 is
// rewritten (cold caches, as a decode step finds them); the medians are
// printed with ratio = ggml time / apex time (> 1: apex faster).
//
// Build (ggml from its own source tree; not part of the library's build):
//   cmake -S tools/peer -B build/peer -DGGML_SOURCE_DIR=/path/to/ggml -DCMAKE_BUILD_TYPE=Release
//   cmake --build build/peer -j2
//   build/peer/moe_vs_ggml [--d 2048] [--f 768] [--experts 128] [--k 8] [--reps 15]
//                          [--types q4_0,q8_0,q4_k,q6_k,mxfp4,bf16] [--n 1,4,16,512] [--threads 1,2]
//                          [--isa avx2|avx512|avx512_vnni|avx512_bf16] [--settle 3]
//                          [--bf16-products automatic|widened|paired]
// --isa runs the library on that kernel path (the default: the build's best).
// --bf16-products paired multiplies bf16 weights as both peers do, the
// activations rounded to bf16 (`vdpbf16ps`); the default keeps them exact.
// The same harness builds against ik_llama.cpp's ggml fork (GGML_SOURCE_DIR =
// its ggml/ folder; CMakeLists.txt sees its iqk/ kernels and defines
// APEX_PEER_IK): its step is the one ik_llama's llm_build_moe_ffn builds
// (the fused gate/up op ggml_moe_up_gate, the down product, the weighted sum
// ggml_mul_multi_add), and the repacked column is its row-interleaved types
// (q4_0_r8, q8_0_r8, q4_k_r4, q6_k_r4, mxfp4_r8, bf16_r16) made from the
// plain bytes by its run-time repack (iqk_repack_tensor, llama's -rtr).
// To compare a path with ggml built for the same instructions, configure with
// -DGGML_PEER_ARCH=avx2 or avx512 (AVX-512F/BW/DQ/VL, no VNNI or BF16) in a
// build directory of its own (the harness is then built for x86-64-v3 / -v4,
// so that path is its default); ggml has no run-time switch on that build.
#include <apex/ffn/inference.hpp>
#include <apex/ffn/moe/moe_ffn.hpp>

#include <ggml-alloc.h>
#include <ggml-backend.h>
#if !APEX_PEER_IK
#include <ggml-cpu.h>
#endif
#include <ggml.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using namespace apex;
using Clock = std::chrono::steady_clock;

struct Options {
  Index d = 2048, f = 768, experts = 128, k = 8;
  int reps = 15;
  std::vector<std::string> types{"q4_0", "q8_0", "q4_k", "q6_k", "mxfp4", "bf16"};
  std::vector<Index> n{1, 4, 16, 512};
  std::vector<int> threads{1, 2};
  packed::Isa isa = packed::kDefaultIsa;  // the library's kernel path (--isa)
  packed::Bf16Products bf16_products = packed::Bf16Products::automatic;  // --bf16-products
  double settle_seconds = 3;              // untimed steps before a type's first cell (--settle)
};

/// `v`, the value of `option`, as a number; a clear error if it is not one.
template <class T>
T number(const std::string& option, const std::string& v) {
  try {
    std::size_t used = 0;
    if constexpr (std::is_floating_point_v<T>) {
      const T x = T(std::stod(v, &used));
      if (used == v.size()) return x;
    } else {
      const long long x = std::stoll(v, &used);
      if (used == v.size() && x >= std::numeric_limits<T>::min() && x <= std::numeric_limits<T>::max()) return T(x);
    }
  } catch (const std::logic_error&) {  // std::stoll's own errors name only the function
  }
  throw std::invalid_argument("option " + option + ": '" + v + "' is not a number in range");
}

/// A comma-separated list, the value of `option`.
template <class T>
std::vector<T> split(const std::string& option, const std::string& s) {
  std::vector<T> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');) {
    if constexpr (std::is_same_v<T, std::string>) out.push_back(item);
    else out.push_back(number<T>(option, item));
  }
  return out;
}

/// --bf16-products: how the library multiplies bf16 weights (paired: as ggml
/// and ik_llama do, activations rounded to bf16, on avx512_bf16 only).
packed::Bf16Products bf16_products_named(const std::string& name) {
  if (name == "automatic") return packed::Bf16Products::automatic;
  if (name == "widened") return packed::Bf16Products::widened;
  if (name == "paired") return packed::Bf16Products::paired;
  throw std::invalid_argument("--bf16-products: '" + name + "' is not automatic, widened or paired");
}

/// The kernel path called `name` (packed::isa_name), one this CPU runs.
packed::Isa isa_named(const std::string& name) {
  for (packed::Isa i : packed::kAllIsas)
    if (name == packed::isa_name(i)) {
      if (!packed::cpu_supports(i)) throw std::invalid_argument("this CPU does not run kernel path " + name);
      return i;
    }
  throw std::invalid_argument("unknown kernel path " + name + " (scalar, avx2, avx512, avx512_vnni, avx512_bf16)");
}

constexpr const char* kUsage =
    "usage: moe_vs_ggml [--d 2048] [--f 768] [--experts 128] [--k 8] [--reps 15]\n"
    "                   [--types q4_0,q8_0,q4_k,q6_k,mxfp4,bf16] [--n 1,4,16,512] [--threads 1,2]\n"
    "                   [--isa avx2|avx512|avx512_vnni|avx512_bf16] [--settle 3]\n"
    "                   [--bf16-products automatic|widened|paired]\n";

/// The options; --help prints the usage and exits. An unknown option, one
/// without its value or a value that is not a number fails, naming it.
Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (i + 1 == argc) throw std::invalid_argument("option " + a + " needs a value\n" + kUsage);
    const std::string v = argv[i + 1];
    if (a == "--d") o.d = number<Index>(a, v);
    else if (a == "--f") o.f = number<Index>(a, v);
    else if (a == "--experts") o.experts = number<Index>(a, v);
    else if (a == "--k") o.k = number<Index>(a, v);
    else if (a == "--reps") o.reps = number<int>(a, v);
    else if (a == "--types") o.types = split<std::string>(a, v);
    else if (a == "--n") o.n = split<Index>(a, v);
    else if (a == "--threads") o.threads = split<int>(a, v);
    else if (a == "--isa") o.isa = isa_named(v);
    else if (a == "--settle") o.settle_seconds = number<double>(a, v);
    else if (a == "--bf16-products") o.bf16_products = bf16_products_named(v);
    else throw std::invalid_argument("unknown option " + a + "\n" + kUsage);
  }
  if (o.reps < 1) throw std::invalid_argument("--reps must be at least 1 (the medians need a repetition)");
  return o;
}

ggml_type ggml_type_of(packed::Dtype t) {
  switch (t) {
    case packed::Dtype::f32: return GGML_TYPE_F32;
    case packed::Dtype::bf16: return GGML_TYPE_BF16;
    case packed::Dtype::f16: return GGML_TYPE_F16;
    case packed::Dtype::q8_0: return GGML_TYPE_Q8_0;
    case packed::Dtype::q4_0: return GGML_TYPE_Q4_0;
    case packed::Dtype::q4_k: return GGML_TYPE_Q4_K;
    case packed::Dtype::q6_k: return GGML_TYPE_Q6_K;
    case packed::Dtype::mxfp4: return GGML_TYPE_MXFP4;
  }
  throw std::invalid_argument("no ggml type");
}

#if APEX_PEER_IK
constexpr const char* kPeer = "ik_llama";
extern "C" void iqk_repack_tensor(ggml_tensor* tensor);  // ik_llama's run-time repack (iqk/iqk_quantize.h)
#else
constexpr const char* kPeer = "ggml";
#endif

packed::Dtype dtype_named(const std::string& name) {
  for (packed::Dtype t : {packed::Dtype::f32, packed::Dtype::bf16, packed::Dtype::f16, packed::Dtype::q8_0,
                          packed::Dtype::q4_0, packed::Dtype::q4_k, packed::Dtype::q6_k, packed::Dtype::mxfp4})
    if (name == packed::dtype_name(t)) return t;
  throw std::invalid_argument("unknown type " + name);
}

double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

/// Rewrites a buffer twice the L3 (64 MiB here: 32 MiB L3 on the machines this ran on).
void evict_caches() {
  static std::vector<float> buf(std::size_t(16) << 20, 1.0f);
  for (float& v : buf) v += 1.0f;
  asm volatile("" : : "r"(buf.data()) : "memory");
}

/// The step in ggml: weights quantized from the float layer by ggml itself,
/// in a plain CPU buffer or in the CPU backend's repacked one (mainline;
/// ik_llama's repacked types are types of their own in a plain buffer).
class GgmlMoE {
 public:
  GgmlMoE(const MoEFFN<float>& layer, packed::Dtype dtype, bool repack) {
    const ggml_type type = ggml_type_of(dtype);
    const MoEConfig& c = layer.config();
    d_ = c.d_model, f_ = c.d_ffn, e_ = c.n_experts, k_ = c.n_active;
    backend_ = ggml_backend_cpu_init();
    ggml_init_params wp{ggml_tensor_overhead() * 8, nullptr, true};
    wctx_ = ggml_init(wp);
    rctx_ = ggml_init(wp);
    gate_ = ggml_new_tensor_3d(wctx_, type, d_, f_, e_);
    up_ = ggml_new_tensor_3d(wctx_, type, d_, f_, e_);
    down_ = ggml_new_tensor_3d(wctx_, type, f_, d_, e_);
    router_ = ggml_new_tensor_2d(rctx_, GGML_TYPE_F32, d_, e_);
    ggml_backend_buffer_type_t buft = ggml_backend_get_default_buffer_type(backend_);
#if !APEX_PEER_IK
    if (repack) buft = repack_buffer_type();
    if (!buft) throw std::runtime_error("no repacked buffer type");
#endif
    wbuf_ = ggml_backend_alloc_ctx_tensors_from_buft(wctx_, buft);
    ggml_backend_buffer_set_usage(wbuf_, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    // the router stays float in a plain buffer (ggml repacks quantized matrices only)
    rbuf_ = ggml_backend_alloc_ctx_tensors(rctx_, backend_);
    set_experts(layer, dtype);
#if APEX_PEER_IK
    if (repack)
      for (ggml_tensor* t : {gate_, up_, down_}) {
        iqk_repack_tensor(t);  // in place, to the type's row-interleaved _r type
        if (t->type == type) throw std::runtime_error("ik_llama did not repack " + std::string(ggml_type_name(type)));
      }
#endif
    std::vector<char> router(ggml_nbytes(router_));
    std::memcpy(router.data(), layer.router().weight().data(), router.size());
    ggml_backend_tensor_set(router_, router.data(), 0, router.size());
  }
  ~GgmlMoE() {
    free_graph();
    ggml_backend_buffer_free(wbuf_);
    ggml_backend_buffer_free(rbuf_);
    ggml_free(wctx_);
    ggml_free(rctx_);
    ggml_backend_free(backend_);
  }

  void set_threads(int threads) { ggml_backend_cpu_set_n_threads(backend_, threads); }

  /// The step's graph for n tokens.
  void set_tokens(Index n) {
    free_graph();
    n_ = n;
    build_graph();
  }

  /// y (n × d) from x (n × d), both row-major (ggml's [d, n]).
  void forward(const Matrix<float>& x, Matrix<float>& y) {
    ggml_backend_tensor_set(x_, x.data(), 0, ggml_nbytes(x_));
    ggml_backend_graph_compute(backend_, graph_);
    ggml_backend_tensor_get(out_, y.data(), 0, ggml_nbytes(out_));
  }

 private:
#if !APEX_PEER_IK
  static ggml_backend_buffer_type_t repack_buffer_type() {
    ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    auto get = reinterpret_cast<ggml_backend_buffer_type_t* (*)(ggml_backend_dev_t)>(
        ggml_backend_reg_get_proc_address(ggml_backend_dev_backend_reg(dev), "ggml_backend_dev_get_extra_bufts"));
    if (!get) return nullptr;
    for (ggml_backend_buffer_type_t* b = get(dev); b && *b; ++b)
      if (std::strstr(ggml_backend_buft_name(*b), "REPACK")) return *b;
    return nullptr;
  }
#endif

  /// Every expert's matrix (rows × cols float, row-major) in `dtype`, set
  /// whole: a repacked buffer takes a tensor in one piece. Mainline: its own
  /// reference quantizers (ggml_quantize_chunk), whose bytes the library's
  /// are. ik_llama quantizes the same formats to other bytes (its own
  /// searches), so its block types get the library's bytes, ggml's, and the
  /// two engines read the same weights; the float types are its rounding.
  template <class MatrixOf>
  void set_stacked(ggml_tensor* t, packed::Dtype dtype, Index rows, Index cols, MatrixOf matrix_of) {
    const ggml_type type = ggml_type_of(dtype);
    const std::size_t row_bytes = ggml_row_size(type, cols), one = row_bytes * std::size_t(rows);
    std::vector<char> bytes(one * std::size_t(e_));
    for (Index e = 0; e < e_; ++e) {
      const Matrix<float> m = matrix_of(e);
      char* dst = bytes.data() + one * std::size_t(e);
#if APEX_PEER_IK
      bool blocks = false;
      packed::visit_dtype(dtype, [&](auto tag) {
        using W = packed::WeightType<decltype(tag)::value>;
        if constexpr (W::kBlockWeights > 1) {
          blocks = true;
          for (Index r = 0; r < rows; ++r)
            W::quantize(m.data() + r * cols, reinterpret_cast<typename W::Block*>(dst + std::size_t(r) * row_bytes), cols);
        }
      });
      if (!blocks) ggml_quantize_chunk(type, m.data(), dst, 0, rows, cols, nullptr, nullptr);
#else
      ggml_quantize_chunk(type, m.data(), dst, 0, rows, cols, nullptr);
#endif
    }
    ggml_backend_tensor_set(t, bytes.data(), 0, bytes.size());
  }

  void set_experts(const MoEFFN<float>& layer, packed::Dtype dtype) {
    const auto& ex = layer.experts();
    set_stacked(gate_, dtype, f_, d_, [&](Index e) { return Matrix<float>(ex[std::size_t(e)].w_gate()); });
    set_stacked(up_, dtype, f_, d_, [&](Index e) { return Matrix<float>(ex[std::size_t(e)].w_up()); });
    set_stacked(down_, dtype, d_, f_, [&](Index e) { return Matrix<float>(ex[std::size_t(e)].w_down()); });
  }

  void free_graph() {
    if (alloc_) ggml_gallocr_free(alloc_);
    if (ctx_) ggml_free(ctx_);
    alloc_ = nullptr, ctx_ = nullptr;
  }

  void build_graph() {
    ggml_init_params p{ggml_tensor_overhead() * 256 + ggml_graph_overhead(), nullptr, true};
    ctx_ = ggml_init(p);
    x_ = ggml_new_tensor_2d(ctx_, GGML_TYPE_F32, d_, n_);
    ggml_set_input(x_);
    ggml_tensor* logits = ggml_mul_mat(ctx_, router_, x_);                      // [E, n]
    ggml_tensor* probs = ggml_soft_max(ctx_, logits);                            // [E, n]
#if APEX_PEER_IK
    ggml_tensor* selected = ggml_top_k(ctx_, probs, int(k_));                   // [K, n] i32
#else
    ggml_tensor* selected = ggml_argsort_top_k(ctx_, probs, int(k_));           // [K, n] i32
#endif
    ggml_tensor* w = ggml_get_rows(ctx_, ggml_reshape_3d(ctx_, probs, 1, e_, n_), selected);  // [1, K, n]
    w = ggml_reshape_2d(ctx_, w, k_, n_);
    w = ggml_div(ctx_, w, ggml_sum_rows(ctx_, w));                               // renormalised over the K
    w = ggml_reshape_3d(ctx_, w, 1, k_, n_);
    ggml_tensor* cur = ggml_reshape_3d(ctx_, x_, d_, 1, n_);
#if APEX_PEER_IK
    // ik_llama's llm_build_moe_ffn: the fused gate/up product and the fused weighted sum
    ggml_tensor* a = ggml_moe_up_gate(ctx_, up_, gate_, cur, selected, GGML_UNARY_OP_SILU);  // [f, K, n]
    ggml_tensor* experts = ggml_mul_mat_id(ctx_, down_, a, selected);                       // [d, K, n]
    out_ = ggml_mul_multi_add(ctx_, experts, w);                                            // [d, n]
#else
    ggml_tensor* g = ggml_mul_mat_id(ctx_, gate_, cur, selected);               // [f, K, n]
    ggml_tensor* u = ggml_mul_mat_id(ctx_, up_, cur, selected);
    ggml_tensor* a = ggml_swiglu_split(ctx_, g, u);                              // SiLU(g) ⊙ u
    ggml_tensor* experts = ggml_mul_mat_id(ctx_, down_, a, selected);           // [d, K, n]
    experts = ggml_mul(ctx_, experts, w);
    ggml_tensor* sum = ggml_view_2d(ctx_, experts, d_, n_, experts->nb[2], 0);
    for (Index i = 1; i < k_; ++i)
      sum = ggml_add(ctx_, sum, ggml_view_2d(ctx_, experts, d_, n_, experts->nb[2], std::size_t(i) * experts->nb[1]));
    out_ = sum;
#endif
    ggml_set_output(out_);
    graph_ = ggml_new_graph(ctx_);
    ggml_build_forward_expand(graph_, out_);
    alloc_ = ggml_gallocr_new(ggml_backend_get_default_buffer_type(backend_));
    if (!ggml_gallocr_alloc_graph(alloc_, graph_)) throw std::runtime_error("ggml: graph allocation failed");
  }

  Index n_ = 0, d_ = 0, f_ = 0, e_ = 0, k_ = 0;
  ggml_backend_t backend_ = nullptr;
  ggml_context *wctx_ = nullptr, *rctx_ = nullptr, *ctx_ = nullptr;
  ggml_backend_buffer_t wbuf_ = nullptr, rbuf_ = nullptr;
  ggml_tensor *gate_ = nullptr, *up_ = nullptr, *down_ = nullptr, *router_ = nullptr, *x_ = nullptr, *out_ = nullptr;
  ggml_cgraph* graph_ = nullptr;
  ggml_gallocr_t alloc_ = nullptr;
};

/// x (n × d) of fresh tokens: N(0, 1) entries.
Matrix<float> tokens(Index n, Index d, std::mt19937& rng) {
  std::normal_distribution<float> normal;
  Matrix<float> x(n, d);
  for (Index i = 0; i < x.size(); ++i) x.data()[i] = normal(rng);
  return x;
}

/// Untimed one-token steps of every engine in turn for o.settle_seconds.
/// Right after a type's three engines were built (gigabytes of weights
/// quantized and written), the first timed cell of the type was up to 2×
/// slower for the library in some runs, over most of its repetitions, and
/// not in a second cell of the same shape run right after it; a layer
/// packed and stepped alone shows no slow first steps
/// (docs/performance.md). The settle keeps that from a type's first cell.
template <class S>
void settle(const Options& o, PackedMoE<S>& apex_layer, GgmlMoE& plain, GgmlMoE* repacked) {
  std::mt19937 rng(7);
  Matrix<float> y(1, o.d);
  plain.set_tokens(1);
  if (repacked) repacked->set_tokens(1);
  const auto t0 = Clock::now();
  while (std::chrono::duration<double>(Clock::now() - t0).count() < o.settle_seconds) {
    const Matrix<float> x = tokens(1, o.d, rng);
    apex_layer.forward_into(x, y);
    plain.forward(x, y);
    if (repacked) repacked->forward(x, y);
  }
}

template <class S>
void run_type(const Options& o, const MoEFFN<float>& layer, packed::Dtype t) {
  PackedMoE<S> apex_layer = PackedMoE<S>::from(layer);
  // paired applies to bf16 weights only (the block formats reject it)
  apex_layer.set_kernel_options(
      {o.isa, t == packed::Dtype::bf16 ? o.bf16_products : packed::Bf16Products::automatic});
  GgmlMoE plain(layer, t, false);
  std::unique_ptr<GgmlMoE> repacked;
  // the types the peer repacks: ik_llama every one here; ggml on x86 Q4_0,
  // Q4_K and MXFP4 (repack.cpp: Q6_K and Q8_0 only on ARM)
  if (APEX_PEER_IK || t == packed::Dtype::q4_0 || t == packed::Dtype::q4_k || t == packed::Dtype::mxfp4)
    repacked = std::make_unique<GgmlMoE>(layer, t, true);
  settle(o, apex_layer, plain, repacked.get());
  for (int threads : o.threads) {
    apex_layer.set_threads(threads);
    plain.set_threads(threads);
    if (repacked) repacked->set_threads(threads);
    for (Index n : o.n) {
      plain.set_tokens(n);
      if (repacked) repacked->set_tokens(n);
      std::mt19937 rng(std::uint32_t(1000 + n));
      std::vector<double> ta, tg, tr;
      double diff = 0, diff_r = 0;
      Matrix<float> ya(n, o.d), yg(n, o.d), yr(n, o.d);
      for (int rep = -1; rep < o.reps; ++rep) {  // rep -1: warm-up (outputs, scratch, threads)
        for (int slot = 0; slot < 3; ++slot) {
          const int which = (slot + std::max(rep, 0)) % 3;
          if (which == 2 && !repacked) continue;
          const Matrix<float> x = tokens(n, o.d, rng);
          evict_caches();
          const auto t0 = Clock::now();
          if (which == 0) apex_layer.forward_into(x, ya);
          else if (which == 1) plain.forward(x, yg);
          else repacked->forward(x, yr);
          const double s = std::chrono::duration<double>(Clock::now() - t0).count();
          if (rep >= 0) (which == 0 ? ta : which == 1 ? tg : tr).push_back(s);
        }
      }
      const Matrix<float> x = tokens(n, o.d, rng);  // the agreement check: one input through all
      apex_layer.forward_into(x, ya);
      plain.forward(x, yg);
      diff = (ya - yg).norm() / yg.norm();
      if (repacked) repacked->forward(x, yr), diff_r = (ya - yr).norm() / yr.norm();
      const double a = median(ta), g = median(tg);
      std::printf("%-6s N %4lld threads %d  apex %8.3f ms  %s %8.3f ms (%5.2fx)", packed::dtype_name(t),
                  static_cast<long long>(n), threads, a * 1e3, kPeer, g * 1e3, g / a);
      if (repacked) std::printf("  %s repacked %8.3f ms (%5.2fx)", kPeer, median(tr) * 1e3, median(tr) / a);
      std::printf("  rel_diff %.1e", diff);
      if (repacked) std::printf(" / %.1e", diff_r);
      std::printf("\n");
      std::fflush(stdout);
    }
  }
}

}  // namespace

int main(int argc, char** argv) try {
  const Options o = parse(argc, argv);
#if !APEX_PEER_IK
  ggml_log_set([](ggml_log_level level, const char* text, void*) {  // warnings and errors only
    if (level == GGML_LOG_LEVEL_WARN || level == GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);
  }, nullptr);
  ggml_cpu_init();
#endif
  MoEFFN<float> layer(MoEConfig{o.d, o.f, o.experts, o.k, 0}, 7);
  std::printf("apex-ffn kernel path %s (block tiles %s); %s CPU backend built for AVX2 %d AVX-512 %d VNNI %d "
              "BF16 %d; d %lld f %lld experts %lld top-%lld; "
              "medians of %d, cold caches, fresh tokens each step; ratio = %s / apex\n",
              packed::isa_name(o.isa), packed::block_format_tiles(o.isa), kPeer, ggml_cpu_has_avx2(),
              ggml_cpu_has_avx512(), ggml_cpu_has_avx512_vnni(), ggml_cpu_has_avx512_bf16(),
              static_cast<long long>(o.d), static_cast<long long>(o.f), static_cast<long long>(o.experts),
              static_cast<long long>(o.k), o.reps, kPeer);
  for (const std::string& name : o.types) {
    const packed::Dtype t = dtype_named(name);
    packed::visit_dtype(t, [&](auto tag) {
      using S = typename packed::WeightType<decltype(tag)::value>::Storage;
      run_type<S>(o, layer, t);
    });
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "moe_vs_ggml: %s\n", e.what());
  return 1;
}
