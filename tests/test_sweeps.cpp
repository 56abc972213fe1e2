// The error tests still waiting to join their layer's file: the dense
// layers' (test_dense.cpp), the router's, load balancer's and MoE layer's
// (test_moe.cpp) and kappa-SwiGLU's (test_kappa_swiglu.cpp).
// The sweep machinery is in support/sweep.hpp.
#include <apex/ffn.hpp>

#include <catch2/catch.hpp>

#include "sweep.hpp"

using namespace apex;
using namespace apex::test;
using Catch::Matchers::Equals;
using Catch::Matchers::StartsWith;

TEMPLATE_TEST_CASE("RMSNorm sweep: widths and eps and gradient shapes", "[sweeps][rmsnorm]", float, double) {
  using T = TestType;
  const Index d = 6, n = 5;
  RMSNorm<T> norm(d);
  typename RMSNorm<T>::Cache cache, other;
  norm.forward(rnd<T>(n, d, 1), &cache);
  norm.forward(rnd<T>(n + 2, d, 2), &other);
  std::vector<Case> cases;
  for (Index w : {Index(0), Index(-1)})
    cases.push_back({"RMSNorm(" + std::to_string(w) + ")", [=] { (void)RMSNorm<T>(w); }, "ConfigError",
                     {"RMSNorm", "d_model", std::to_string(w)}});
  for (double eps : {-1e-6, 0.0, kNaN, kInf})
    cases.push_back({"RMSNorm eps " + std::to_string(eps), [=] { (void)RMSNorm<T>(d, T(eps)); }, "ConfigError",
                     {"RMSNorm", "eps"}});
  add_width_cases<T>(cases, "RMSNorm::forward", "x", n, d, [&](const Matrix<T>& x) { norm.forward(x); });
  add_grad_cases<T>(cases, "RMSNorm::backward", "dy", n, d, [&](const Matrix<T>& dy) { norm.backward(dy, cache); });
  cases.push_back({"RMSNorm::backward with the cache of a 7-row batch",
                   [&] { norm.backward(Matrix<T>::Ones(n, d), other); }, "ShapeError", {"RMSNorm::backward", "'dy'"}});
  run_sweep(cases);
}

TEMPLATE_TEST_CASE("SwiGLU sweep: widths and gradient shapes", "[sweeps][swiglu]", float, double) {
  using T = TestType;
  const Index d = 6, f = 10, n = 5;
  SwiGLU<T> ffn(d, f, 1);
  typename SwiGLU<T>::Cache cache, other;
  ffn.forward(rnd<T>(n, d, 1), &cache);
  ffn.forward(rnd<T>(n + 2, d, 2), &other);
  std::vector<Case> cases;
  const std::pair<Index, Index> bad_sizes[] = {{0, 6}, {-1, 6}, {4, 0}, {4, -3}};
  for (const auto& [dm, df] : bad_sizes)
    cases.push_back({"SwiGLU(" + std::to_string(dm) + ", " + std::to_string(df) + ")", [=] { (void)SwiGLU<T>(dm, df); },
                     "ConfigError", {"SwiGLU", dm <= 0 ? "d_model" : "d_ffn"}});
  add_width_cases<T>(cases, "SwiGLU::forward", "x", n, d, [&](const Matrix<T>& x) { ffn.forward(x); });
  add_grad_cases<T>(cases, "SwiGLU::backward", "dy", n, d, [&](const Matrix<T>& dy) { ffn.backward(dy, cache); });
  cases.push_back({"SwiGLU::backward with the cache of a 7-row batch", [&] { ffn.backward(Matrix<T>::Ones(n, d), other); },
                   "ShapeError", {"SwiGLU::backward", "'dy'"}});
  run_sweep(cases);
}

TEMPLATE_TEST_CASE("dense layers propagate NaN and Inf to their own rows only", "[sweeps][nan]", float, double) {
  using T = TestType;
  const Index d = 6, f = 10;
  const RMSNorm<T> norm(d);
  const SwiGLU<T> ffn(d, f, 3);
  KappaSwiGLU<T> kappa(d, f, 4);
  kappa.kappa_alpha() = rnd<T>(1, f, 5);
  kappa.kappa_bias() = rnd<T>(1, f, 6);
  const FFNSublayer<T, SwiGLU<T>> sublayer(d, SwiGLU<T>(d, f, 7));
  const MultiTokenHeads<T> heads(d, 9, MultiTokenOptions{}, 8);
  // 5 rows take the matrix–vector path of linear_nt, 12 the matrix product.
  for (Index n : {Index(5), Index(12)}) {
    check_nan_stays_in_its_row<T>(n, d, [&](const Matrix<T>& x) { return norm.forward(x); });
    check_nan_stays_in_its_row<T>(n, d, [&](const Matrix<T>& x) { return ffn.forward(x); });
    const Vector<T> logit = rnd<T>(n, 1, 9);
    check_nan_stays_in_its_row<T>(n, d, [&](const Matrix<T>& x) { return kappa.forward(x, logit); });
    check_nan_stays_in_its_row<T>(n, d, [&](const Matrix<T>& x) { return sublayer.forward(x); });
    check_nan_stays_in_its_row<T>(n, d, [&](const Matrix<T>& x) { return heads.forward(x); });
  }
}

TEST_CASE("the block interface of SwiGLU and kappa-SwiGLU computes what forward does", "[sweeps][block]") {
  // Block calls are unchecked by contract (MoEFFN sizes every buffer); with
  // correct buffers they must agree with the checked entry points bitwise.
  const Index d = 6, f = 10, n = 7;
  SwiGLU<double> ffn(d, f, 1);
  KappaSwiGLU<double> kappa(d, f, 2);
  kappa.kappa_alpha() = random_matrix(1, f, 3);
  kappa.kappa_bias() = random_matrix(1, f, 4);
  const Matrix<double> x = random_matrix(n, d, 5), dy = random_matrix(n, d, 6);
  const Vector<double> logit = random_matrix(n, 1, 7);

  SwiGLU<double>::Cache c;
  const Matrix<double> y = ffn.forward(x, &c);
  Matrix<double> work(n, ffn.work_cols()), yb(n, d), dxb(n, d);
  ffn.forward_block(x, work, yb);
  CHECK(yb == y);
  CHECK(work == c.work);
  const Matrix<double> dx = ffn.backward(dy, c);
  ffn.backward_block(x, work, dy, dxb);
  CHECK(dxb == dx);

  KappaSwiGLU<double>::Cache kc;
  const Matrix<double> ky = kappa.forward(x, logit, &kc);
  Matrix<double> kwork(n, kappa.work_cols()), kyb(n, d), kdxb(n, d);
  Vector<double> kdl(n);
  kappa.forward_block(x, logit, kwork, kyb);
  CHECK(kyb == ky);
  const auto kg = kappa.backward(dy, kc);
  kappa.backward_block(x, logit, kwork, dy, kdxb, kdl);
  CHECK(kdxb == kg.dx);
  CHECK(kdl == kg.dlogit);
}

TEMPLATE_TEST_CASE("Router and LoadBalancer sweep: configurations and setters and inputs",
                   "[sweeps][router][balancer]", float, double) {
  using T = TestType;
  const Index d = 6, e = 4, k = 2;
  Rng rng(1);
  const Router<T> router(d, e, k, rng);
  LoadBalancer<T> balancer(e, k, 0.01);
  RowVector<T> bias(e);
  bias << T(0.5), T(-0.25), T(0), T(1);
  balancer.set_bias(bias);
  Routing<T> routing;
  std::vector<Case> cases;

  struct Shape3 {
    Index d, e, k;
    const char* field;
  };
  for (const Shape3& s : {Shape3{0, 4, 2, "d_model"}, Shape3{-1, 4, 2, "d_model"}, Shape3{6, 0, 1, "n_experts"},
                          Shape3{6, -1, 1, "n_experts"}, Shape3{6, 4, 0, "n_active"}, Shape3{6, 4, 5, "n_active"},
                          Shape3{6, 4, -1, "n_active"}})
    cases.push_back({"Router(" + std::to_string(s.d) + ", " + std::to_string(s.e) + ", " + std::to_string(s.k) + ")",
                     [=] {
                       Rng r(0);
                       (void)Router<T>(s.d, s.e, s.k, r);
                     },
                     "ConfigError", {"Router", s.field}});
  for (double v : {kNaN, kInf, -kInf})
    for (Index rows : {Index(3), Index(12)})
      cases.push_back({"Router::route with " + std::to_string(v) + " in x of " + std::to_string(rows) + " rows",
                       [=, &router, &routing, &bias] {
                         Matrix<T> x = rnd<T>(rows, d, 2);
                         x(rows - 1, 2) = T(v);
                         router.route(x, bias, false, routing);
                       },
                       "ValueError", {"Router::route", "not finite"}});

  const std::pair<Index, Index> bad_balancers[] = {{0, 1}, {4, 0}, {4, 5}, {4, -2}};
  for (const auto& [be, bk] : bad_balancers)
    cases.push_back({"LoadBalancer(" + std::to_string(be) + ", " + std::to_string(bk) + ")",
                     [=] { (void)LoadBalancer<T>(be, bk); }, "ConfigError", {"LoadBalancer", be < 1 ? "n_experts" : "n_active"}});
  for (double a : {-1e-3, kNaN, kInf}) {
    cases.push_back({"LoadBalancer alpha " + std::to_string(a), [=] { (void)LoadBalancer<T>(e, k, a); }, "ConfigError",
                     {"LoadBalancer", "alpha"}});
    cases.push_back({"LoadBalancer::set_alpha(" + std::to_string(a) + ")", [=, &balancer] { balancer.set_alpha(a); },
                     "ConfigError", {"LoadBalancer::set_alpha", "alpha"}});
  }
  for (Index len : {e - 1, e + 1, Index(0)})
    cases.push_back({"LoadBalancer::set_bias of length " + std::to_string(len),
                     [=, &balancer] { balancer.set_bias(RowVector<T>::Zero(len)); }, "ShapeError",
                     {"LoadBalancer::set_bias", "'bias'", shape(1, len)}});
  for (double v : {kNaN, kInf, -kInf})
    cases.push_back({"LoadBalancer::set_bias with " + std::to_string(v),
                     [=, &balancer] {
                       RowVector<T> b = RowVector<T>::Zero(e);
                       b(2) = T(v);
                       balancer.set_bias(b);
                     },
                     "ValueError", {"LoadBalancer::set_bias", "'bias'", "NaN or Inf"}});
  for (std::size_t len : {std::size_t(e - 1), std::size_t(e + 1), std::size_t(0)})
    cases.push_back({"LoadBalancer::observe with " + std::to_string(len) + " counts",
                     [=, &balancer] { balancer.observe(std::vector<Index>(len, 1), 1); }, "ShapeError",
                     {"LoadBalancer::observe", "'counts'"}});
  cases.push_back({"LoadBalancer::observe with counts not summing to N*K",
                   [&] { balancer.observe({1, 1, 1, 0}, 1); }, "ValueError", {"LoadBalancer::observe", "counts", "N*K"}});
  run_sweep(cases);

  // A rejected call changes nothing.
  CHECK(balancer.bias() == bias);
  CHECK(balancer.alpha() == 0.01);
  CHECK(balancer.report().tokens == 0);
}

TEMPLATE_TEST_CASE("MoEConfig and MoEFFN sweep: fields and inputs and caches", "[sweeps][moe]", float, double) {
  using T = TestType;
  const Index d = 6, f = 5, n = 5;
  MoEFFN<T> moe(moe_config(4, 2, 1, d, f), 1);
  moe.set_threads(2);
  typename MoEFFN<T>::Cache cache, other;
  moe.forward(rnd<T>(n, d, 2), &cache);
  moe.forward(rnd<T>(n + 2, d, 3), &other);
  std::vector<Case> cases;

  struct Field {
    const char* field;
    std::function<void(MoEConfig&)> spoil;
  };
  const std::vector<Field> fields = {
      {"d_model", [](MoEConfig& c) { c.d_model = 0; }},
      {"d_model", [](MoEConfig& c) { c.d_model = -3; }},
      {"d_ffn", [](MoEConfig& c) { c.d_ffn = 0; }},
      {"n_experts", [](MoEConfig& c) { c.n_experts = 0; }},
      {"n_experts", [](MoEConfig& c) { c.n_experts = -1; }},
      {"n_active", [](MoEConfig& c) { c.n_active = 0; }},
      {"n_active", [](MoEConfig& c) { c.n_active = 5; }},  // K > E
      {"n_shared", [](MoEConfig& c) { c.n_shared = -1; }},
      {"balancer_alpha", [](MoEConfig& c) { c.balancer_alpha = -0.1; }},
      {"balancer_alpha", [](MoEConfig& c) { c.balancer_alpha = kNaN; }},
      {"balancer_alpha", [](MoEConfig& c) { c.balancer_alpha = kInf; }},
  };
  for (const Field& fl : fields) {
    MoEConfig bad = moe_config(4, 2, 1, d, f);
    fl.spoil(bad);
    cases.push_back({std::string("MoEConfig::validate with a bad ") + fl.field, [=] { bad.validate(); }, "ConfigError",
                     {"MoEConfig", fl.field}});
    cases.push_back({std::string("MoEFFN with a bad ") + fl.field, [=] { (void)MoEFFN<T>(bad); }, "ConfigError",
                     {"MoEFFN", fl.field}});
  }
  cases.push_back({"ModelPreset::by_name(\"huge\")", [] { (void)ModelPreset::by_name("huge"); }, "ConfigError",
                   {"ModelPreset::by_name", "huge"}});

  add_width_cases<T>(cases, "MoEFFN::forward", "x", n, d, [&](const Matrix<T>& x) { moe.forward(x); });
  for (double v : {kNaN, kInf, -kInf})
    cases.push_back({"MoEFFN::forward with " + std::to_string(v) + " in x",
                     [=, &moe] {
                       Matrix<T> x = rnd<T>(n, d, 4);
                       x(2, 3) = T(v);
                       moe.forward(x);
                     },
                     "ValueError", {"not finite"}});
  add_grad_cases<T>(cases, "MoEFFN::backward", "dy", n, d, [&](const Matrix<T>& dy) { moe.backward(dy, cache); });
  cases.push_back({"MoEFFN::backward with the cache of a 7-row batch", [&] { moe.backward(Matrix<T>::Ones(n, d), other); },
                   "ShapeError", {"MoEFFN::backward", "'dy'"}});
  for (std::size_t len : {std::size_t(n - 1), std::size_t(n + 1), std::size_t(0)})
    cases.push_back({"MoEFFN::observe with a mask of " + std::to_string(len),
                     [=, &moe, &cache] { moe.observe(cache, std::vector<bool>(len, true)); }, "ShapeError",
                     {"MoEFFN::observe", "'token_counted'"}});
  run_sweep(cases);
  CHECK(moe.balancer().report().tokens == 0);  // no rejected observe counted anything
}

TEMPLATE_TEST_CASE("KappaSwiGLU sweep: options and setters and inputs", "[sweeps][kappa]", float, double) {
  using T = TestType;
  const Index d = 6, f = 8, n = 5;
  KappaSwiGLU<T> layer(d, f, 1);
  const Vector<T> logit = rnd<T>(n, 1, 2);
  typename KappaSwiGLU<T>::Cache cache, other;
  layer.forward(rnd<T>(n, d, 3), logit, &cache);
  layer.forward(rnd<T>(n + 2, d, 4), rnd<T>(n + 2, 1, 5), &other);
  std::vector<Case> cases;

  struct Option {
    const char* field;
    std::function<void(KappaOptions&)> spoil;
  };
  const std::vector<Option> options = {
      {"U must", [](KappaOptions& o) { o.U = 0.999; }},   {"U must", [](KappaOptions& o) { o.U = 0; }},
      {"U must", [](KappaOptions& o) { o.U = -4; }},      {"U must", [](KappaOptions& o) { o.U = kNaN; }},
      {"U must", [](KappaOptions& o) { o.U = kInf; }},    {"c must", [](KappaOptions& o) { o.c = kNaN; }},
      {"c must", [](KappaOptions& o) { o.c = -kInf; }},   {"rho must", [](KappaOptions& o) { o.rho = -0.1; }},
      {"rho must", [](KappaOptions& o) { o.rho = kNaN; }}, {"rho must", [](KappaOptions& o) { o.rho = kInf; }},
      {"reg_weight must", [](KappaOptions& o) { o.reg_weight = -1e-2; }},
      {"reg_weight must", [](KappaOptions& o) { o.reg_weight = kNaN; }},
  };
  for (const Option& op : options) {
    KappaOptions bad;
    op.spoil(bad);
    cases.push_back({std::string("KappaSwiGLU with ") + op.field, [=] { (void)KappaSwiGLU<T>(d, f, 0, bad); },
                     "ConfigError", {"KappaSwiGLU", op.field}});
    cases.push_back({std::string("KappaSwiGLU::set_options with ") + op.field, [=, &layer] { layer.set_options(bad); },
                     "ConfigError", {"KappaSwiGLU::set_options", op.field}});
  }
  for (double u : {0.5, 0.0, -1.0, kNaN, kInf})
    cases.push_back({"KappaSwiGLU::set_U(" + std::to_string(u) + ")", [=, &layer] { layer.set_U(u); }, "ConfigError",
                     {"KappaSwiGLU::set_options", "U must"}});
  cases.push_back({"KappaSwiGLU(0, f)", [=] { (void)KappaSwiGLU<T>(0, f); }, "ConfigError", {"d_model"}});
  cases.push_back({"KappaSwiGLU(d, 0)", [=] { (void)KappaSwiGLU<T>(d, 0); }, "ConfigError", {"d_ffn"}});

  add_width_cases<T>(cases, "KappaSwiGLU::forward", "x", n, d, [&](const Matrix<T>& x) { layer.forward(x, logit); });
  for (Index len : {n - 1, n + 1, Index(0)})
    cases.push_back({"KappaSwiGLU::forward with " + std::to_string(len) + " logits for " + std::to_string(n) + " rows",
                     [=, &layer] { layer.forward(Matrix<T>::Ones(n, d), Vector<T>::Zero(len)); }, "ShapeError",
                     {"KappaSwiGLU::forward", "'logit'", shape(len, 1)}});
  for (double v : {kNaN, kInf, -kInf})
    cases.push_back({"KappaSwiGLU::forward with logit " + std::to_string(v),
                     [=, &layer] {
                       Vector<T> l = Vector<T>::Zero(n);
                       l(1) = T(v);
                       layer.forward(Matrix<T>::Ones(n, d), l);
                     },
                     "ValueError", {"KappaSwiGLU::forward", "'logit'", "NaN or Inf"}});
  add_grad_cases<T>(cases, "KappaSwiGLU::backward", "dy", n, d, [&](const Matrix<T>& dy) { layer.backward(dy, cache); });
  cases.push_back({"KappaSwiGLU::backward with the cache of a 7-row batch",
                   [&] { layer.backward(Matrix<T>::Ones(n, d), other); }, "ShapeError", {"KappaSwiGLU::backward", "'dy'"}});

  // Inside an MoE layer.
  MoEFFN<T, KappaSwiGLU<T>> moe(moe_config(4, 2, 1, d, f), 6);
  cases.push_back({"set_kappa_U(moe, 0.5)", [&] { set_kappa_U(moe, 0.5); }, "ConfigError", {"U must"}});
  cases.push_back({"kappa MoE forward with NaN", [&] {
                     Matrix<T> x = rnd<T>(n, d, 7);
                     x(0, 0) = T(kNaN);
                     moe.forward(x);
                   },
                   "ValueError", {"not finite"}});
  add_width_cases<T>(cases, "MoEFFN::forward", "x", n, d, [&](const Matrix<T>& x) { moe.forward(x); });
  run_sweep(cases);

  // Rejected options change nothing.
  CHECK(layer.U() == 4.0);
  CHECK(layer.options().rho == 0.1);
  for (const auto& ex : moe.experts()) CHECK(ex.U() == 4.0);
}

TEST_CASE("LoadBalancer with a negative expert count raises ConfigError", "[sweeps][regression][balancer]") {
  // load_balancer.hpp, constructor: the member initialisers built
  // `bias_(RowVector<T>::Zero(n_experts))` and `counts_(n_experts, 0)` before
  // the body's require_config ran, so n_experts = -1 tripped Eigen's size
  // assertion (abort; undefined behaviour with NDEBUG) instead of raising
  // ConfigError. Fixed: the first member initialiser validates every argument.
  expect(outcome_isolated([] { (void)LoadBalancer<double>(-1, 1); }), "ConfigError", {"LoadBalancer", "n_experts"});
  expect(outcome_isolated([] { (void)LoadBalancer<double>(-5, -6); }), "ConfigError", {"LoadBalancer", "n_experts"});
}

TEST_CASE("Router::route checks the width of x and the bias", "[sweeps][regression][router]") {
  // router.hpp, Router::route: neither `x` (N × d) nor `bias` (1 × E) was
  // checked. A wrong width of x failed an eigen_assert in linear_nt (abort;
  // out-of-bounds reads with NDEBUG); a short bias was read past its end
  // (`bias(e)`); a NaN bias silently yielded NaN routing weights. route is
  // public (the tests and the plain-loop reference call it). Fixed: route
  // checks the shapes of x and bias and that the bias is finite.
  const auto route = [](Index rows, Index cols, Index bias_len, double bias_value) {
    return [=] {
      Rng rng(0);
      const Router<double> router(6, 4, 2, rng);
      Routing<double> out;
      RowVector<double> bias = RowVector<double>::Zero(bias_len);
      if (bias_len > 0) bias(0) = bias_value;
      router.route(Matrix<double>::Ones(rows, cols), bias, false, out);
    };
  };
  for (Index rows : {Index(3), Index(20)})  // both paths of linear_nt
    for (Index cols : {Index(5), Index(7), Index(0)}) {
      INFO("x " << shape(rows, cols));
      expect(outcome_isolated(route(rows, cols, 4, 0)), "ShapeError", {"Router::route", "'x'"});
    }
  for (Index len : {Index(3), Index(0), Index(5)}) {
    INFO("bias of length " << len);
    expect(outcome_isolated(route(3, 6, len, 0)), "ShapeError", {"Router::route", "'bias'"});
  }
  for (double b : {kNaN, kInf}) {
    INFO("bias " << b);
    expect(outcome_isolated(route(3, 6, 4, b)), "ValueError", {"Router::route", "'bias'"});
  }
}

TEST_CASE("Router::softmax_backward and Router::backward check their shapes", "[sweeps][regression][router]") {
  // router.hpp: softmax_backward(routing, d_weights, d_logits) and
  // backward(x, d_logits) checked nothing; d_weights that is not N × K,
  // d_logits that is not N × E or x that is not N × d failed eigen_asserts or
  // read and wrote out of bounds. Fixed: softmax_backward checks the routing,
  // d_weights (N × K) and d_logits (N × E); backward (now one call from ∂L/∂g)
  // checks x (N × d), the routing, d_weights and d_pair_logits (N × K).
  const auto setup = [] {
    Rng rng(0);
    Router<double> router(6, 4, 2, rng);
    Routing<double> r;
    router.route(random_matrix(3, 6, 1), RowVector<double>::Zero(4), false, r);
    return std::make_pair(router, r);
  };
  expect(outcome_isolated([&] {
           auto [router, r] = setup();
           Matrix<double> dl = Matrix<double>::Zero(3, 4);
           router.softmax_backward(r, Matrix<double>::Zero(2, 2), dl);
         }),
         "ShapeError", {"Router::softmax_backward", "'d_weights'"});
  expect(outcome_isolated([&] {
           auto [router, r] = setup();
           Matrix<double> dl = Matrix<double>::Zero(3, 3);
           router.softmax_backward(r, Matrix<double>::Zero(3, 2), dl);
         }),
         "ShapeError", {"Router::softmax_backward", "'d_logits'"});
  expect(outcome_isolated([&] {
           auto [router, r] = setup();
           router.backward(Matrix<double>::Ones(3, 6), r, Matrix<double>::Zero(3, 2), Matrix<double>::Zero(3, 3));
         }),
         "ShapeError", {"Router::backward", "'d_pair_logits'"});
  expect(outcome_isolated([&] {
           auto [router, r] = setup();
           router.backward(Matrix<double>::Ones(3, 5), r, Matrix<double>::Zero(3, 2));
         }),
         "ShapeError", {"Router::backward", "'x'"});
  // A routing made by a router of another K or E would scatter past d_logits.
  for (const auto& [e, k] : {std::pair<Index, Index>{5, 2}, std::pair<Index, Index>{4, 3}}) {
    INFO("routing of a router with E = " << e << " and K = " << k);
    expect(outcome_isolated([e = e, k = k] {
             Rng rng(0);
             Router<double> router(6, 4, 2, rng), other(6, e, k, rng);
             Routing<double> r;
             other.route(random_matrix(3, 6, 1), RowVector<double>::Zero(e), false, r);
             Matrix<double> dl = Matrix<double>::Zero(3, 4);
             router.softmax_backward(r, Matrix<double>::Zero(3, 2), dl);
           }),
           "ShapeError", {"Router::softmax_backward", "'routing."});
  }
}

TEST_CASE("SwiGLU and KappaSwiGLU and MoEFFN backward reject a cache that no forward filled",
          "[sweeps][regression][cache]") {
  // The same defect, before the fix:
  //  - swiglu.hpp SwiGLU::backward and kappa_swiglu.hpp KappaSwiGLU::backward:
  //    work.leftCols(f) of a 0 × 0 work failed an eigen_assert;
  //  - moe.hpp MoEFFN::backward: plan.count(e) indexed the empty plan.offset (null dereference).
  // Fixed: each backward checks its cache's own shapes (cache.x columns = d,
  // work columns = work_cols(), for MoEFFN the plan against E), raising
  // ShapeError naming 'cache'.
  const Index d = 4;
  const Matrix<double> dy = Matrix<double>::Zero(0, d);
  expect_cache_rejected(
      {
          {"SwiGLU", [&] { SwiGLU<double>(d, 6).backward(dy, SwiGLU<double>::Cache{}); }},
          {"KappaSwiGLU", [&] { KappaSwiGLU<double>(d, 6).backward(dy, KappaSwiGLU<double>::Cache{}); }},
          {"MoEFFN",
           [&] {
             MoEFFN<double> moe(moe_config(4, 2, 1, d, 6));
             moe.set_threads(1);
             moe.backward(dy, MoEFFN<double>::Cache{});
           }},
      },
      "an unfilled cache and an empty batch");
}

TEST_CASE("backward rejects a cache filled by a layer of another shape", "[sweeps][regression][cache]") {
  // Caches are plain structs, so one layer's cache can reach another
  // layer's backward. With the same batch size the dy check passes, and
  // before the fix:
  //  - swiglu.hpp SwiGLU::backward with the cache of a SwiGLU whose d_ffn is
  //    6 (work 3 × 18) in a layer with d_ffn 8 read columns 0–8, 8–16 and
  //    10–18 of that work as G, U and A: no error, wrong gradients;
  //  - moe.hpp MoEFFN::backward with the cache of an MoE of 4 experts in one
  //    of 6 read plan.offset[5] and [6] past the end, then took blocks of
  //    the sorted buffers at those garbage offsets (an eigen_assert in a
  //    debug build, a heap-buffer-overflow under AddressSanitizer).
  // Fixed: as in the previous test, the cache's shapes are checked against the layer.
  expect(outcome_isolated([] {
           SwiGLU<double> a(4, 6, 1), b(4, 8, 2);
           SwiGLU<double>::Cache c;
           a.forward(Matrix<double>::Ones(3, 4), &c);
           b.backward(Matrix<double>::Ones(3, 4), c);
         }),
         "ShapeError", {"SwiGLU::backward", "cache"});
  MoEFFN<double> a(moe_config(4, 2, 1, 4, 6), 1), b(moe_config(6, 2, 1, 4, 6), 2);
  MoEFFN<double>::Cache c;
  a.forward(Matrix<double>::Ones(3, 4), &c);
  b.set_threads(1);
  expect(outcome_isolated([&] { b.backward(Matrix<double>::Ones(3, 4), c); }), "ShapeError",
         {"MoEFFN::backward", "cache"});
}

TEST_CASE("LoadBalancer::observe rejects negative counts and token numbers", "[sweeps][regression][balancer]") {
  // load_balancer.hpp, observe: only the length of `counts` and its sum
  // (= n_tokens·K) were checked. {−2, 4, 0, 0} for one token with K = 2 sums
  // to 2 and was accepted, making expert 0's load −1; {−1, −1, 0, 0} with
  // n_tokens = −1 was accepted too, and the next update() moved the bias
  // from a window of −1 tokens. Fixed: ValueError unless n_tokens ≥ 0 and
  // every count is in [0, n_tokens] (a token picks K distinct experts).
  LoadBalancer<double> balancer(4, 2);
  expect(outcome([&] { balancer.observe({-2, 4, 0, 0}, 1); }), "ValueError", {"LoadBalancer::observe", "counts"});
  expect(outcome([&] { balancer.observe({-1, -1, 0, 0}, -1); }), "ValueError", {"LoadBalancer::observe", "n_tokens"});
  expect(outcome([&] { balancer.observe({3, 0, 0, 1}, 2); }), "ValueError", {"LoadBalancer::observe", "counts"});
  CHECK(balancer.report().tokens == 0);  // a rejected observe counts nothing
  // The bounds are inclusive: one expert may take every token, and an empty batch counts nothing.
  CHECK_NOTHROW(balancer.observe({2, 2, 0, 0}, 2));
  CHECK_NOTHROW(balancer.observe({0, 0, 0, 0}, 0));
  CHECK(balancer.report().tokens == 2);
  balancer = LoadBalancer<double>(4, 2);
  CHECK(balancer.update().tokens == 0);
  CHECK(balancer.bias().isZero(0));
}

TEMPLATE_TEST_CASE("RMSNorm never turns a finite input into NaN", "[sweeps][regression][rmsnorm]", float, double) {
  // rms_norm.hpp: eps = 0 was accepted ("eps must be finite and >= 0"); an
  // all-zero row then gave r = 1/sqrt(0) = inf and x̂ = 0·inf = NaN, so a
  // valid configuration turned a finite input into NaN. Fixed: eps must be
  // > 0 (ConfigError), and any positive eps, even the smallest subnormal,
  // keeps a zero row finite in forward and backward.
  using T = TestType;
  expect(outcome([] { (void)RMSNorm<T>(4, T(0)); }), "ConfigError", {"RMSNorm", "eps"});
  expect(outcome([] { (void)RMSNorm<T>(4, -T(0)); }), "ConfigError", {"RMSNorm", "eps"});
  for (T eps : {std::numeric_limits<T>::denorm_min(), std::numeric_limits<T>::min(), T(1e-6)}) {
    INFO("eps " << eps);
    RMSNorm<T> norm(4, eps);
    typename RMSNorm<T>::Cache cache;
    Matrix<T> x = Matrix<T>::Zero(3, 4);
    x.row(1).setOnes();
    const Matrix<T> y = norm.forward(x, &cache);
    CHECK(y.allFinite());
    CHECK(y.row(0).isZero(0));
    CHECK(norm.backward(Matrix<T>::Ones(3, 4), cache).allFinite());
  }
}

TEST_CASE("KappaSwiGLU of float rejects options beyond the range of float", "[sweeps][regression][kappa]") {
  // kappa_swiglu.hpp: KappaOptions::validate checked U and c for finiteness
  // as doubles; KappaSwiGLU<float> converts them with T(opt_.c), T(opt_.U).
  // c = 1e39 is finite as a double but inf as a float, so s = c·ℓ was inf
  // (NaN for ℓ = 0), u = b + α·s = 0·inf = NaN and the output NaN for a
  // finite input. Fixed: the constructor and set_options also require the
  // options to lie within the range of T.
  const std::string got = outcome([] {
    KappaOptions o;
    o.c = 1e39;
    const KappaSwiGLU<float> layer(4, 6, 0, o);
    const Matrix<float> y = layer.forward(Matrix<float>::Ones(2, 4), Vector<float>::Zero(2));
    if (!y.allFinite()) throw std::runtime_error("NaN output from a finite input");
  });
  CHECK_THAT(got, Equals("returned") || StartsWith("ConfigError: "));
}
