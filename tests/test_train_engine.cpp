// The float training layers on the packed engine (layers/gated_products.hpp,
// kernels/packed_products.hpp): SwiGLU, κ-SwiGLU and MoEFFN forward, ∂L/∂x and weight
// gradients against the Eigen path within float rounding, on every kernel path
// the CPU has, on odd sizes and N = 0, 1, 13, 300; bitwise equality across the
// paths, across runs and across thread counts; the products themselves
// against a double reference.
#include <apex/ffn/layers/kappa_swiglu.hpp>
#include <apex/ffn/moe/moe_ffn.hpp>
#include <apex/ffn/kernels/packed_products.hpp>
#include <apex/ffn/layers/swiglu.hpp>

#include <catch2/catch.hpp>

#include <vector>

#include "fixtures.hpp"
#include "gradcheck.hpp"

using namespace apex;
using apex::test::moe_config;
using apex::test::random_matrix;
using packed::Isa;
using packed::TrainingEngine;

namespace {

// ‖new − old‖ / ‖old‖ (Frobenius) between the engine and the Eigen path. Both
// are fp32 dot products of length K ≤ 2f = 150 in a different summation
// order; measured ≤ 3.4e-7 here. The bound leaves a 10× margin and is still
// far below any real error (a dropped term, a wrong lane, a stale weight
// gives ≥ 1e-2). κ-SwiGLU's ∂L/∂ℓ is one sum over f per row whose terms
// cancel (measured 1.3e-5 at N = 1), so it gets its own bound, 10× that.
constexpr double kRelBound = 3e-6;
constexpr double kRelBoundLogit = 1e-4;

double rel(const Matrix<float>& a, const Matrix<float>& b) {
  const double nb = b.cast<double>().norm();
  const double diff = (a.cast<double>() - b.cast<double>()).norm();
  return nb == 0.0 ? diff : diff / nb;
}

std::vector<Isa> supported() {
  std::vector<Isa> out;
  for (const Isa isa : packed::kAllIsas)
    if (packed::cpu_supports(isa)) out.push_back(isa);
  return out;
}

/// Sets the engine for the scope of one test and restores the previous setting.
struct EngineScope {
  TrainingEngine saved = packed::training_engine();
  explicit EngineScope(const TrainingEngine& e) { packed::set_training_engine(e); }
  void set(const TrainingEngine& e) { packed::set_training_engine(e); }
  ~EngineScope() { packed::set_training_engine(saved); }
};
TrainingEngine eigen_path() {
  TrainingEngine e;
  e.enabled = false;
  return e;
}
TrainingEngine engine_path(Isa isa) {
  TrainingEngine e;
  e.enabled = true;
  e.isa = isa;
  e.min_rows = 0;  // every row count on the engine, also 1 and 13
  e.forward = e.dx = true;
  return e;
}

/// Every gradient of a parameter list, concatenated into one row.
Matrix<float> all_grads(const ParamList<float>& ps) {
  Matrix<float> g(1, parameter_count(ps));
  Index at = 0;
  for (const auto& p : ps) {
    g.block(0, at, 1, p.size()) = Eigen::Map<const Matrix<float>>(p.grad_data, 1, p.size());
    at += p.size();
  }
  return g;
}

struct Result {
  Matrix<float> y, dx, grads, extra;  // extra: κ-SwiGLU's ∂L/∂ℓ
};

// (d, f): neither a multiple of 16 nor 32; one f below a single panel.
struct Dims {
  Index d, f;
};
const Dims kDims[] = {{37, 75}, {19, 11}, {70, 45}};
const Index kRows[] = {0, 1, 13, 300};

// A dense layer takes the engine only in a single-threaded context (with more
// OpenMP threads Eigen threads the product itself): run it as a MoE task does.
template <class Fn>
Result single_threaded(Fn&& fn) {
  Result r;
  detail::serial([&] { r = fn(); });
  return r;
}

Result run_swiglu(Index d, Index f, Index n) {
  return single_threaded([&] {
    SwiGLU<float> layer(d, f, 3);
    const Matrix<float> x = random_matrix(n, d, 4).cast<float>(), dy = random_matrix(n, d, 5).cast<float>();
    SwiGLU<float>::Cache cache;
    Result r;
    r.y = layer.forward(x, &cache);
    r.dx = layer.backward(dy, cache);
    r.grads = all_grads(layer.params());
    return r;
  });
}

Result run_kappa(Index d, Index f, Index n) {
  return single_threaded([&] {
    KappaSwiGLU<float> layer(d, f, 6);
    layer.kappa_alpha() = random_matrix(1, f, 7).cast<float>();
    layer.kappa_bias() = random_matrix(1, f, 8, 0.5).cast<float>();
    const Matrix<float> x = random_matrix(n, d, 9).cast<float>(), dy = random_matrix(n, d, 10).cast<float>();
    const Vector<float> logit = random_matrix(n, 1, 11, 3.0).cast<float>();
    KappaSwiGLU<float>::Cache cache;
    Result r;
    r.y = layer.forward(x, logit, &cache);
    const auto g = layer.backward(dy, cache);
    r.dx = g.dx;
    r.extra = g.dlogit.transpose();
    r.grads = all_grads(layer.params());
    return r;
  });
}

Result run_moe(Index d, Index f, Index n, int threads) {
  MoEFFN<float> moe(moe_config(4, 2, 1, d, f), 12);
  moe.set_threads(threads);
  const Matrix<float> x = random_matrix(n, d, 13).cast<float>(), dy = random_matrix(n, d, 14).cast<float>();
  MoEFFN<float>::Cache cache;
  Result r;
  r.y = moe.forward(x, &cache);
  r.dx = moe.backward(dy, cache);
  r.grads = all_grads(moe.params());
  return r;
}

void check_close(const Result& engine, const Result& eigen) {
  CHECK(rel(engine.y, eigen.y) <= kRelBound);
  CHECK(rel(engine.dx, eigen.dx) <= kRelBound);
  CHECK(rel(engine.grads, eigen.grads) <= kRelBound);
  CHECK(rel(engine.extra, eigen.extra) <= kRelBoundLogit);
}
void check_equal(const Result& a, const Result& b) {
  CHECK(a.y == b.y);
  CHECK(a.dx == b.dx);
  CHECK(a.grads == b.grads);
  CHECK(a.extra == b.extra);
}

template <class Run>
void engine_against_eigen(Run&& run) {
  EngineScope scope(eigen_path());
  for (const Dims dims : kDims)
    for (const Index n : kRows) {
      scope.set(eigen_path());
      const Result eigen = run(dims.d, dims.f, n);
      Result first;
      bool have_first = false;
      for (const Isa isa : supported()) {
        INFO("path " << packed::isa_name(isa) << " d " << dims.d << " f " << dims.f << " n " << n);
        scope.set(engine_path(isa));
        const Result r = run(dims.d, dims.f, n);
        check_close(r, eigen);
        if (n == 300) CHECK(r.y != eigen.y);  // the engine ran: another summation order
        // every path gives the same bits (fused multiply-adds in one order)
        if (have_first) check_equal(r, first);
        first = r;
        have_first = true;
      }
    }
}

}  // namespace

TEST_CASE("the default engine runs the float training products on this CPU", "[engine]") {
  const TrainingEngine e = packed::training_engine();
  INFO("default path " << packed::isa_name(e.isa) << ", enabled " << e.enabled);
  CHECK(e.enabled == (packed::best_float_isa() != Isa::scalar));
  CHECK(e.min_rows == packed::kTrainingMinRows);
  CHECK_THROWS_AS(packed::set_training_engine({true, Isa::scalar, -1}), ConfigError);
}

TEST_CASE("packed linear products match a double reference on every path", "[engine]") {
  for (const Index out : {1, 31, 32, 33, 77})
    for (const Index K : {1, 7, 8, 9, 45}) {
      const Matrix<float> x = random_matrix(13, K + 2, 20).cast<float>();  // row stride K + 2
      const Matrix<float> w = random_matrix(out, K + 3, 21).cast<float>();
      const Matrix<float> wt = random_matrix(K, out + 5, 22).cast<float>();
      const Matrix<double> ref_nt = x.leftCols(K).cast<double>() * w.leftCols(K).cast<double>().transpose();
      const Matrix<double> ref_nn = x.leftCols(K).cast<double>() * wt.leftCols(out).cast<double>();
      for (const Isa isa : supported()) {
        INFO("path " << packed::isa_name(isa) << " out " << out << " K " << K);
        Matrix<float> y = Matrix<float>::Constant(13, out + 4, 7.0f);  // row stride out + 4; the pad untouched
        packed::linear_nt(isa, x.data(), K + 2, 13, w.data(), K + 3, out, K, y.data(), out + 4);
        const double bound = 2.0 * double(K) * 0x1p-24;  // componentwise, relative to Σ|x||w|
        const Matrix<double> mag_nt = x.leftCols(K).cast<double>().cwiseAbs() *
                                      w.leftCols(K).cast<double>().cwiseAbs().transpose();
        CHECK(((y.leftCols(out).cast<double>() - ref_nt).cwiseAbs().array() <= bound * mag_nt.array()).all());
        CHECK((y.rightCols(4).array() == 7.0f).all());
        packed::linear_nn(isa, x.data(), K + 2, 13, wt.data(), out + 5, out, K, y.data(), out + 4);
        const Matrix<double> mag_nn = x.leftCols(K).cast<double>().cwiseAbs() *
                                      wt.leftCols(out).cast<double>().cwiseAbs();
        CHECK(((y.leftCols(out).cast<double>() - ref_nn).cwiseAbs().array() <= bound * mag_nn.array()).all());
        CHECK((y.rightCols(4).array() == 7.0f).all());
      }
    }
}

TEST_CASE("SwiGLU<float> on the engine matches the Eigen path", "[engine][swiglu]") {
  engine_against_eigen([](Index d, Index f, Index n) { return run_swiglu(d, f, n); });
}

TEST_CASE("kappa-SwiGLU<float> on the engine matches the Eigen path", "[engine][kappa]") {
  engine_against_eigen([](Index d, Index f, Index n) { return run_kappa(d, f, n); });
}

TEST_CASE("MoEFFN<float> on the engine matches the Eigen path", "[engine][moe]") {
  engine_against_eigen([](Index d, Index f, Index n) { return run_moe(d, f, n, 1); });
}

TEST_CASE("MoEFFN<float> on the engine is bitwise identical across runs and thread counts", "[engine][moe][determinism]") {
  EngineScope scope(engine_path(packed::best_float_isa()));
  for (const Dims dims : kDims)
    for (const Index n : kRows) {
      INFO("d " << dims.d << " f " << dims.f << " n " << n);
      const Result a = run_moe(dims.d, dims.f, n, 1);
      check_equal(run_moe(dims.d, dims.f, n, 1), a);
      check_equal(run_moe(dims.d, dims.f, n, 2), a);
    }
}
