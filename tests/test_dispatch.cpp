// The dispatch module (moe/dispatch.hpp) on its own: the plan (empty experts,
// everything on one expert, N = 0, stable order, inverse map), each movement
// against a plain loop and against its backward (adjoint identities), the
// side-input gather and scatter, shape errors; and the expert contract
// (moe/expert_contract.hpp): a user-defined expert type through MoEFFN, forward
// and backward, by finite differences.
#include <apex/ffn/moe/dispatch.hpp>
#include <apex/ffn/moe/moe_ffn.hpp>

#include <catch2/catch.hpp>

#include <vector>

#include "gradcheck.hpp"
#include "sweep.hpp"

using namespace apex;
using apex::test::check_params;
using apex::test::check_values;
using apex::test::dot_all;
using apex::test::expect;
using apex::test::moe_config;
using apex::test::outcome;
using apex::test::random_matrix;
using apex::test::topk_margin;

namespace {

IndexMatrix ids(Index n, Index k, std::initializer_list<Index> values) {
  IndexMatrix m(n, k);
  auto it = values.begin();
  for (Index t = 0; t < n; ++t)
    for (Index j = 0; j < k; ++j) m(t, j) = *it++;
  return m;
}

// Every property a plan promises, for any routing.
void check_plan_invariants(const DispatchPlan& p, const IndexMatrix& experts) {
  REQUIRE(Index(p.offset.size()) == p.n_experts + 1);
  CHECK(p.offset.front() == 0);
  CHECK(p.offset.back() == p.rows());
  for (Index e = 0; e < p.n_experts; ++e) {
    CHECK(p.count(e) >= 0);
    for (Index r = p.offset[e]; r < p.offset[e + 1]; ++r) {
      CHECK(experts(p.token[r], p.slot[r]) == e);                   // the row is a pair of expert e
      if (r > p.offset[e]) CHECK(p.token[r - 1] < p.token[r]);      // stable: token order within an expert
    }
  }
  for (Index t = 0; t < p.n_tokens; ++t)
    for (Index k = 0; k < p.n_active; ++k) {
      const Index r = p.row(t, k);  // inverse map
      CHECK(p.token[r] == t);
      CHECK(p.slot[r] == k);
    }
}

}  // namespace

TEST_CASE("DispatchPlan: empty experts, one expert, N = 0, stable order, inverse map", "[dispatch][plan]") {
  DispatchPlan p;
  SECTION("experts no token chose own no rows") {
    const IndexMatrix e = ids(3, 2, {3, 0, 0, 3, 3, 0});
    p.build(e, 5);
    CHECK(p.counts() == std::vector<Index>{3, 0, 0, 3, 0});
    check_plan_invariants(p, e);
    CHECK(p.token == std::vector<Index>{0, 1, 2, 0, 1, 2});
    CHECK(p.slot == std::vector<Index>{1, 0, 1, 0, 1, 0});
  }
  SECTION("every pair on one expert (K = 1)") {
    const IndexMatrix e = ids(4, 1, {2, 2, 2, 2});
    p.build(e, 3);
    CHECK(p.counts() == std::vector<Index>{0, 0, 4});
    check_plan_invariants(p, e);
  }
  SECTION("N = 0") {
    p.build(IndexMatrix(0, 2), 4);
    CHECK(p.rows() == 0);
    CHECK(p.counts() == std::vector<Index>(4, 0));
    CHECK(p.row_of.empty());
  }
  SECTION("random routings") {
    for (std::uint64_t seed = 1; seed <= 5; ++seed) {
      Rng rng(seed);
      Router<double> router(6, 7, 3, rng);
      Routing<double> r;
      router.route(random_matrix(40, 6, seed), RowVector<double>::Zero(7), false, r);
      p.build(r.experts, 7);
      check_plan_invariants(p, r.experts);
    }
  }
}

TEST_CASE("dispatch movements equal plain loops and are adjoint to their backward", "[dispatch]") {
  const Index n = 9, d = 4, e = 5, k = 2;
  Rng rng(3);
  Router<double> router(d, e, k, rng);
  Routing<double> r;
  const Matrix<double> x = random_matrix(n, d, 4);
  router.route(x, RowVector<double>::Zero(e), false, r);
  DispatchPlan p;
  p.build(r.experts, e);
  const int threads = 2;

  Matrix<double> xs;
  dispatch::gather_rows(p, x, xs, threads);
  const Matrix<double> ys = random_matrix(p.rows(), d, 5), dense = random_matrix(n, d, 6);
  Matrix<double> y(n, d);
  dispatch::combine(p, r.weights, ys, {dense}, y, threads);
  for (Index t = 0; t < n; ++t) {
    Matrix<double> want = dense.row(t);
    for (Index j = 0; j < k; ++j) {
      CHECK(xs.row(p.row(t, j)) == x.row(t));
      want += r.weights(t, j) * ys.row(p.row(t, j));
    }
    CHECK((y.row(t) - want).norm() < 1e-14);
  }

  // combine_backward is the adjoint of combine: ⟨dy, y⟩ = ⟨dy_sorted, ys⟩ + ⟨dy, dense⟩,
  // and ∂L/∂g_tk = ⟨dy_t, ys[row(t,k)]⟩.
  const Matrix<double> dy = random_matrix(n, d, 7);
  Matrix<double> dw, dys(p.rows(), d);
  dispatch::combine_backward(p, r.weights, dy, ys, dw, dys, threads);
  CHECK(std::abs(dot_all(dy, y) - dot_all(dys, ys) - dot_all(dy, dense)) < 1e-12);
  for (Index t = 0; t < n; ++t)
    for (Index j = 0; j < k; ++j) CHECK(dw(t, j) == dy.row(t).dot(ys.row(p.row(t, j))));

  // gather_backward is the adjoint of gather_rows: ⟨dx, x⟩ = ⟨dx_sorted, x_sorted⟩ (+ the dense terms).
  const Matrix<double> dxs = random_matrix(p.rows(), d, 8), dd = random_matrix(2 * n, d, 9);
  Matrix<double> dx = Matrix<double>::Zero(n, d);
  dispatch::gather_backward(p, dxs, dd, 2, dx, threads);
  CHECK(std::abs(dot_all(dx, x) - dot_all(dxs, xs) - dot_all(dd.topRows(n), x) - dot_all(dd.bottomRows(n), x)) <
        1e-12);

  // The router logit of each pair, and its gradient back in token order.
  Vector<double> side;
  dispatch::gather_side_input(RouterLogitInput{}, p, r, side);
  REQUIRE(side.size() == p.rows());
  for (Index t = 0; t < n; ++t)
    for (Index j = 0; j < k; ++j) CHECK(side(p.row(t, j)) == r.logits(t, r.experts(t, j)));
  Matrix<double> d_pair;
  dispatch::scatter_side_grad(RouterLogitInput{}, p, side, d_pair);
  for (Index t = 0; t < n; ++t)
    for (Index j = 0; j < k; ++j) CHECK(d_pair(t, j) == r.logits(t, r.experts(t, j)));
  dispatch::gather_side_input(NoSideInput{}, p, r, side);
  dispatch::scatter_side_grad(NoSideInput{}, p, side, d_pair);
  CHECK(side.size() == 0);
  CHECK(d_pair.size() == 0);

  // Shapes are checked against the plan.
  expect(outcome([&] { dispatch::gather_rows(p, Matrix<double>(n + 1, d), xs, 1); }), "ShapeError",
         {"dispatch::gather_rows", "'plan'"});
  Matrix<double> wide(n, d + 1);
  expect(outcome([&] { dispatch::combine(p, r.weights, ys, {}, wide, 1); }), "ShapeError",
         {"dispatch::combine", "'y_sorted'"});
  expect(outcome([&] { dispatch::combine_backward(p, Matrix<double>(n, k + 1), dy, ys, dw, dys, 1); }), "ShapeError",
         {"dispatch::combine_backward", "'weights'"});
  expect(outcome([&] { dispatch::gather_backward(p, dxs, dd, 1, dx, 1); }), "ShapeError",
         {"dispatch::gather_backward", "'dense_dx'"});
  expect(outcome([&] { dispatch::scatter_side_grad(RouterLogitInput{}, p, Vector<double>(3), d_pair); }),
         "ShapeError", {"dispatch::scatter_side_grad", "'d_side_sorted'"});
}

namespace {

// A user-defined expert meeting the contract (moe/expert_contract.hpp) without
// any side input: y = ReLU(x·Wᵀ), W: d × d; work holds the pre-activation.
template <class T>
class ReluExpert {
 public:
  using Scalar = T;
  ReluExpert(Index d_model, Index /*d_ffn*/, Rng& rng)
      : w_(d_model, d_model), grad_(Matrix<T>::Zero(d_model, d_model)) {
    init_linear(w_, rng);
  }
  Index d_model() const { return w_.rows(); }
  Index work_cols() const { return w_.rows(); }
  template <class Work, class Y>
  void forward_block(const ConstMatrixRef<T>& x, const Eigen::MatrixBase<Work>& work_,
                     const Eigen::MatrixBase<Y>& y_) const {
    auto& work = const_cast<Eigen::MatrixBase<Work>&>(work_);
    work.noalias() = x * w_.transpose();                                      // z = x·Wᵀ
    const_cast<Eigen::MatrixBase<Y>&>(y_) = work.cwiseMax(T(0));             // y = ReLU(z)
  }
  template <class DX>
  void backward_block(const ConstMatrixRef<T>& x, const ConstMatrixRef<T>& work, const ConstMatrixRef<T>& dy,
                      const Eigen::MatrixBase<DX>& dx) {
    const Matrix<T> dz = (work.array() > T(0)).select(dy, T(0));  // ∂L/∂z = dy ⊙ [z > 0]
    detail::linear_nt_backward(dz, x, w_, grad_, dx);
  }
  ParamList<T> params() { return {detail::make_param<T>("weight", w_, grad_)}; }
  void zero_grad() { grad_.setZero(); }

 private:
  Matrix<T> w_, grad_;  // d × d
};

// The same with the router logit as side input: y = ℓ·(x·Wᵀ), ∂L/∂ℓ = ⟨dy, x·Wᵀ⟩.
template <class T>
class LogitScaledExpert {
 public:
  using Scalar = T;
  using SideInput = RouterLogitInput;
  LogitScaledExpert(Index d_model, Index, Rng& rng) : w_(d_model, d_model), grad_(Matrix<T>::Zero(d_model, d_model)) {
    init_linear(w_, rng);
  }
  Index d_model() const { return w_.rows(); }
  Index work_cols() const { return w_.rows(); }
  template <class Work, class Y>
  void forward_block(const ConstMatrixRef<T>& x, const ConstVectorRef<T>& logit, const Eigen::MatrixBase<Work>& work_,
                     const Eigen::MatrixBase<Y>& y_) const {
    auto& work = const_cast<Eigen::MatrixBase<Work>&>(work_);
    work.noalias() = x * w_.transpose();                                  // z = x·Wᵀ
    const_cast<Eigen::MatrixBase<Y>&>(y_) = logit.asDiagonal() * work;   // y = ℓ·z
  }
  template <class DX, class DL>
  void backward_block(const ConstMatrixRef<T>& x, const ConstVectorRef<T>& logit, const ConstMatrixRef<T>& work,
                      const ConstMatrixRef<T>& dy, const Eigen::MatrixBase<DX>& dx, const Eigen::MatrixBase<DL>& dl) {
    const_cast<Eigen::MatrixBase<DL>&>(dl) = (dy.array() * work.array()).rowwise().sum().matrix();  // ⟨dy, z⟩
    const Matrix<T> dz = logit.asDiagonal() * dy;                                                   // ℓ·dy
    detail::linear_nt_backward(dz, x, w_, grad_, dx);
  }
  ParamList<T> params() { return {detail::make_param<T>("weight", w_, grad_)}; }
  void zero_grad() { grad_.setZero(); }

 private:
  Matrix<T> w_, grad_;  // d × d
};

static_assert(check_expert_contract<ReluExpert<double>, double>());
static_assert(check_expert_contract<LogitScaledExpert<double>, double>());
static_assert(check_expert_contract<SwiGLU<float>, float>());

template <class Expert>
void check_custom_expert_gradients() {
  for (const Index n : {0, 1, 7, 20}) {
    INFO("N = " << n);
    MoEFFN<double, Expert> moe(moe_config(4, 2, 1), 31);
    moe.balancer().set_bias(random_matrix(1, 4, 32, 0.3));
    Matrix<double> x;
    for (std::uint64_t seed = 200;; ++seed) {  // a clear top-K margin: ±ε never flips the choice
      x = random_matrix(n, 6, seed, 1.5);
      if (topk_margin(moe, x) > 1e-2) break;
    }
    const Matrix<double> r = random_matrix(n, 6, 33);
    auto loss = [&] { return dot_all(moe.forward(x), r); };
    typename MoEFFN<double, Expert>::Cache cache;
    moe.forward(x, &cache);
    const Matrix<double> dx = moe.backward(r, cache);
    APEX_CHECK_GRADS(check_params(moe.params(), loss), 1e-6);
    APEX_CHECK_GRADS(std::vector{check_values("x", x.data(), dx.data(), x.size(), loss)}, 1e-6);
    if (n > 0) CHECK(moe.router().weight_grad().norm() > 0);
  }
}

}  // namespace

TEST_CASE("a user-defined expert type runs through MoEFFN, forward and backward", "[dispatch][contract][gradcheck]") {
  SECTION("without a side input") { check_custom_expert_gradients<ReluExpert<double>>(); }
  SECTION("with the router logit as side input") { check_custom_expert_gradients<LogitScaledExpert<double>>(); }
}

// ---- error handling (sweeps) ----
using apex::test::outcome_isolated;

TEST_CASE("DispatchPlan::build rejects expert ids out of range", "[sweeps][regression][dispatch]") {
  // moe/dispatch.hpp, DispatchPlan::build(experts, n_experts) incremented
  // offset[experts(t, k) + 1] unchecked: an id ≥ n_experts or < 0 wrote out
  // of bounds (heap-buffer-overflow). The struct is public; MoEFFN only
  // feeds it router output. Fixed: ValueError on an id outside
  // [0, n_experts) or a negative n_experts, and the plan is left empty.
  for (Index bad : {Index(7), Index(4), Index(-1)}) {
    INFO("expert id " << bad);
    expect(outcome_isolated([bad] {
             IndexMatrix ids(2, 2);
             ids << 0, bad, 1, 2;
             DispatchPlan plan;
             plan.build(ids, 4);
           }),
           "ValueError", {"DispatchPlan::build", "'experts'", std::to_string(bad)});
  }
  expect(outcome_isolated([] {
           DispatchPlan plan;
           plan.build(IndexMatrix::Zero(2, 1), -1);
         }),
         "ValueError", {"DispatchPlan::build", "n_experts"});
  // A rejected build leaves an empty plan, not a half-built one.
  IndexMatrix ids(2, 2);
  ids << 0, 3, 1, 2;
  DispatchPlan plan;
  plan.build(ids, 4);
  CHECK(plan.counts() == std::vector<Index>{1, 1, 1, 1});
  ids(1, 1) = 4;
  CHECK_THROWS_AS(plan.build(ids, 4), ValueError);
  CHECK(plan.rows() == 0);
  CHECK(plan.offset.empty());
}
