// A gated activation defined here, outside the library: GEGLU with the tanh
// form of GELU. On the training side it composes a SwiGLU and runs the
// public gated skeleton (gated_forward / gated_backward) with its own
// activation and derivative, checked against central finite differences in
// double; on the inference side it is an epilogue policy of the packed
// kernels (kernels/epilogue.hpp), checked against a float reference on odd
// sizes, on every kernel path the CPU has and in both storage types.
#include <apex/ffn.hpp>
#include <apex/ffn/inference.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <type_traits>

#include "gradcheck.hpp"

using namespace apex;
using apex::test::check_params;
using apex::test::check_values;
using apex::test::dot_all;
using apex::test::random_matrix;

namespace {

/// GELU(g) = ½·g·(1 + tanh(c·(g + 0.044715·g³))), c = √(2/π)
template <class T>
T gelu(T g) {
  const T c = T(0.7978845608028654), t = std::tanh(c * (g + T(0.044715) * g * g * g));
  return T(0.5) * g * (T(1) + t);
}
/// GELU'(g) = ½(1 + t) + ½·g·(1 − t²)·c·(1 + 3·0.044715·g²)
template <class T>
T gelu_grad(T g) {
  const T c = T(0.7978845608028654), t = std::tanh(c * (g + T(0.044715) * g * g * g));
  return T(0.5) * (T(1) + t) + T(0.5) * g * (T(1) - t * t) * c * (T(1) + T(3 * 0.044715) * g * g);
}

/// The packed epilogue: a = GELU(g)·u, one element at a time (no SIMD forms,
/// so every path runs this same scalar code).
struct GeluTanhGate {
  static float apply(float g, float u) { return gelu(g) * u; }
};

/// A training layer with the library's contract, built on SwiGLU's skeleton.
template <class T>
class GeGLU {
 public:
  using Scalar = T;
  struct Cache {
    Matrix<T> x;     ///< N × d
    Matrix<T> work;  ///< N × 3f: [G | U | A]
  };

  GeGLU(Index d, Index f, std::uint64_t seed) : mlp_(d, f, seed) {}

  /// x: N × d → N × d.
  Matrix<T> forward(const ConstMatrixRef<T>& x, Cache* cache = nullptr) const {
    Cache local;
    Cache& c = cache ? *cache : local;
    c.x = x;
    c.work.resize(x.rows(), mlp_.work_cols());
    Matrix<T> y(x.rows(), mlp_.d_model());  // N × d
    // A = GELU(G) ⊙ U
    mlp_.gated_forward(x, c.work, y, [](auto&& g, auto&& u, auto&& a) { a = g.unaryExpr(&gelu<T>) * u; });
    return y;
  }

  /// dy: N × d → dx: N × d; adds into the weight gradients.
  Matrix<T> backward(const ConstMatrixRef<T>& dy, const Cache& c) {
    const Index f = mlp_.d_ffn();
    Matrix<T> dx(dy.rows(), mlp_.d_model());  // N × d
    mlp_.gated_backward(c.x, c.work, dy, dx, [&](auto& dh) {  // dh: N × 2f, dA in the right half
      for (Index t = 0; t < dh.rows(); ++t)
        for (Index j = 0; j < f; ++j) {
          const T g = c.work(t, j), u = c.work(t, f + j), da = dh(t, f + j);
          dh(t, j) = da * u * gelu_grad(g);  // dG = dA ⊙ U ⊙ GELU'(G)
          dh(t, f + j) = da * gelu(g);       // dU = dA ⊙ GELU(G)
        }
    });
    return dx;
  }

  ParamList<T> params() { return mlp_.params(); }
  const SwiGLU<T>& mlp() const { return mlp_; }

 private:
  SwiGLU<T> mlp_;
};

}  // namespace

TEST_CASE("a user-defined gated activation trains on the public gated skeleton", "[custom_activation][gradcheck]") {
  const Index n = 5, d = 7, f = 11;
  GeGLU<double> layer(d, f, 3);
  Matrix<double> x = random_matrix(n, d, 12, 1.5);
  const Matrix<double> r = random_matrix(n, d, 13);
  GeGLU<double>::Cache cache;
  (void)layer.forward(x, &cache);
  const Matrix<double> dx = layer.backward(r, cache);
  const auto loss = [&] { return dot_all(layer.forward(x), r); };
  APEX_CHECK_GRADS(check_params(layer.params(), loss), 1e-6);
  APEX_CHECK_GRADS(std::vector<apex::test::GradCheck>{check_values("x", x.data(), dx.data(), x.size(), loss)}, 1e-6);
}

TEST_CASE("a user-defined gated activation runs on the packed engine", "[custom_activation][packed]") {
  for (const auto& [d, f] : {std::pair<Index, Index>{19, 37}, {33, 17}}) {
    const GeGLU<double> ref_layer(d, f, 5);
    const SwiGLU<double>& m = ref_layer.mlp();
    const Matrix<float> wg = m.w_gate().cast<float>(), wu = m.w_up().cast<float>(), wd = m.w_down().cast<float>();
    for (const packed::Dtype t : {packed::Dtype::f32, packed::Dtype::bf16, packed::Dtype::f16}) {
      const packed::PackedExpert e(wg, wu, wd, t);
      // the reference on exactly the packed weights, in double
      GeGLU<double> exact(d, f, 5);
      auto p = exact.params();
      p[0].value() = e.w_gate().cast<double>();
      p[1].value() = e.w_up().cast<double>();
      p[2].value() = e.w_down().cast<double>();
      for (const Index rows : {Index(1), Index(5), Index(13), Index(70)}) {
        const Matrix<float> x = random_matrix(rows, d, 20 + std::uint64_t(rows)).cast<float>();  // rows × d
        const Matrix<double> want = exact.forward(x.cast<double>());
        const Matrix<float> first = packed::forward<GeluTanhGate>(e, x, {packed::Isa::scalar});
        for (const packed::Isa isa : packed::kAllIsas) {
          if (!packed::cpu_supports(isa)) continue;
          INFO("d " << d << " f " << f << " rows " << rows << " dtype " << packed::dtype_name(t) << " path "
                    << packed::isa_name(isa));
          const Matrix<float> y = packed::forward<GeluTanhGate>(e, x, {isa});
          CHECK(y == first);  // every path: the same bits
          CHECK((y.cast<double>() - want).norm() <= 1e-5 * want.norm());
        }
        // and it is not SwiGLU in disguise
        CHECK((packed::forward(e, x, {packed::Isa::scalar}) - first).norm() > 1e-3 * first.norm());
      }
    }
  }
}

TEST_CASE("PackedSwiGLU takes a user-defined gated activation as a policy", "[custom_activation][packed]") {
  const Index d = 19, f = 37;
  const SwiGLU<float> src(d, f, 9);
  const auto gelu_layer = PackedSwiGLU<packed::bf16, GeluTanhGate>::from(src);
  const auto silu_layer = PackedSwiGLU<packed::bf16>::from(src);
  const Matrix<float> x = random_matrix(41, d, 31).cast<float>();  // 41 × d
  CHECK(gelu_layer.forward(x) == packed::forward<GeluTanhGate>(gelu_layer.weights(), x));
  CHECK(silu_layer.forward(x) == packed::forward(silu_layer.weights(), x));
}

TEST_CASE("PackedMoE runs its routed experts with a user-defined gated activation",
          "[custom_activation][packed][moe]") {
  MoEConfig cfg;
  cfg.d_model = 19;
  cfg.d_ffn = 37;
  cfg.n_experts = 5;
  cfg.n_active = 2;
  cfg.n_shared = 0;
  const MoEFFN<float> src(cfg, 11);
  const Matrix<float> x = random_matrix(23, cfg.d_model, 41).cast<float>();  // 23 × d
  const auto check = [&](const auto& layer) {
    using Layer = std::decay_t<decltype(layer)>;
    typename Layer::Cache cache;
    const Matrix<float> first = layer.forward(x, &cache);
    // The reference: every token's chosen experts one by one, weighted, in slot order.
    Matrix<float> want = Matrix<float>::Zero(x.rows(), cfg.d_model);
    for (Index t = 0; t < x.rows(); ++t)
      for (Index k = 0; k < cfg.n_active; ++k) {
        const auto& e = layer.experts()[std::size_t(cache.routing.experts(t, k))];
        want.row(t) += cache.routing.weights(t, k) * packed::forward<GeluTanhGate>(e, x.row(t), {packed::Isa::scalar});
      }
    CHECK((first - want).norm() <= 1e-6f * want.norm());
    for (const packed::Isa isa : packed::kAllIsas) {
      if (!packed::cpu_supports(isa)) continue;
      INFO("path " << packed::isa_name(isa));
      Layer on_path = layer;
      on_path.set_kernel_options({isa});
      CHECK(on_path.forward(x) == first);  // every path and tiling: the same bits
    }
    // and the activation is the policy, not SiLU in disguise
    using Silu = PackedMoE<typename Layer::StorageType>;
    CHECK((Silu::from(src).forward(x) - first).norm() > 1e-3f * first.norm());
  };
  check(PackedMoE<float, SwiGLU<float>, GeluTanhGate>::from(src));
  check(PackedMoE<packed::bf16, SwiGLU<float>, GeluTanhGate>::from(src));
}
