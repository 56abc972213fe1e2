// Concurrency: a layer's const forward is re-entrant (GUIDE.md, "the shape
// of the library"). Every layer's forward runs from several std::threads at
// once — without a cache, and with one cache per thread reused across its
// calls — and every output and cache must be bitwise identical to a
// single-threaded reference. MoE layers also run their own OpenMP dispatch
// (1 and 2 threads) inside each std::thread. Finally, per-thread copies of
// a layer train (forward, backward, observe) at the same time and must reach
// the sequential gradients: backward keeps no state outside its layer.
//
// Threads only record what they saw; Catch2's assertions run on the main
// thread after the join (Catch2 is not thread-safe).
#include <apex/ffn.hpp>
#include <apex/ffn/layers/ffn_sublayer.hpp>
#include <apex/ffn/layers/kappa_swiglu.hpp>
#include <apex/ffn/layers/skip_gate.hpp>
#include <apex/ffn/kernels/panel_heap.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "fixtures.hpp"

using namespace apex;
using apex::test::gate_config;
using apex::test::moe_config;
using apex::test::random_matrix;
using apex::test::rnd;

namespace {

constexpr int kThreads = 4;
constexpr int kCalls = 20;

/// Same shape and the same bits (so −0 ≠ +0, and a NaN equals itself).
template <class A, class B>
bool bitwise_equal(const A& a, const B& b) {
  static_assert(std::is_same<typename A::Scalar, typename B::Scalar>::value, "same scalar type");
  return a.rows() == b.rows() && a.cols() == b.cols() &&
         (a.size() == 0 || std::memcmp(a.data(), b.data(), sizeof(typename A::Scalar) * std::size_t(a.size())) == 0);
}

/// Runs call(thread, i) for i < kCalls on kThreads std::threads, released
/// together. `call` returns "" when its result matched, else what differed.
/// Returns the first failure of every thread that had one.
template <class Call>
std::vector<std::string> run_concurrently(Call call) {
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::vector<std::string> failure(kThreads);
  std::vector<std::thread> pool;
  pool.reserve(kThreads);
  for (int th = 0; th < kThreads; ++th)
    pool.emplace_back([&, th] {
      ++ready;
      while (!go.load()) std::this_thread::yield();
      try {
        for (int i = 0; i < kCalls && failure[std::size_t(th)].empty(); ++i) {
          std::string f = call(th, i);
          if (!f.empty()) failure[std::size_t(th)] = "thread " + std::to_string(th) + ", call " + std::to_string(i) + ": " + f;
        }
      } catch (const std::exception& e) {
        failure[std::size_t(th)] = "thread " + std::to_string(th) + " threw: " + e.what();
      }
    });
  while (ready.load() < kThreads) std::this_thread::yield();
  go = true;
  for (auto& t : pool) t.join();
  failure.erase(std::remove(failure.begin(), failure.end(), std::string()), failure.end());
  return failure;
}

template <class Call>
void check_concurrently(Call call) {
  const std::vector<std::string> failures = run_concurrently(call);
  for (const std::string& f : failures) FAIL_CHECK(f);
  CHECK(failures.empty());
}

/// The re-entrancy check of one layer. `forward(i, cache)` runs the layer
/// on input i (cache may be null) and returns its output; `key(cache)`
/// returns cache contents that must match too. References come from this
/// thread first; then kThreads threads alternate inputs, with and without
/// their own cache.
template <class Cache, class Forward, class Key>
void check_reentrant(const std::string& layer, std::size_t n_inputs, Forward forward, Key key) {
  using Out = decltype(forward(std::size_t(0), static_cast<Cache*>(nullptr)));
  using KeyOut = decltype(key(std::declval<const Cache&>()));
  std::vector<Out> y_ref;
  std::vector<KeyOut> key_ref;
  for (std::size_t i = 0; i < n_inputs; ++i) {
    Cache c;
    y_ref.push_back(forward(i, nullptr));
    REQUIRE(bitwise_equal(forward(i, &c), y_ref[i]));  // a cache does not change the output
    key_ref.push_back(key(c));
  }
  std::vector<Cache> caches(kThreads);
  check_concurrently([&](int th, int call) -> std::string {
    const std::size_t i = std::size_t(th + call) % n_inputs;
    Cache* c = call % 2 == 1 ? &caches[std::size_t(th)] : nullptr;
    const std::string what = layer + (c ? " forward with a cache" : " forward without a cache") + " on input " +
                             std::to_string(i);
    if (!bitwise_equal(forward(i, c), y_ref[i])) return what + ": output differs from the single-threaded reference";
    if (c && !bitwise_equal(key(*c), key_ref[i])) return what + ": cache differs from the single-threaded reference";
    return "";
  });
}

/// Sets τ halfway between the two middle gate values of x, so about half
/// the tokens are skipped; returns how many are.
template <class T>
Index skip_half(SkipGate<T>& gate, const Matrix<T>& x) {
  Vector<T> g = gate.forward(x);
  std::sort(g.data(), g.data() + g.size());
  const Index mid = g.size() / 2;
  gate.set_threshold((g(mid - 1) + g(mid)) / T(2));
  const Vector<T> again = gate.forward(x);
  Index skipped = 0;
  for (Index t = 0; t < x.rows(); ++t) skipped += gate.keep(again(t)) ? 0 : 1;
  return skipped;
}

/// Every gradient of `params` in one 1 × P row.
template <class T>
Matrix<T> flat_grads(const ParamList<T>& params) {
  Matrix<T> out(1, parameter_count(params));
  Index at = 0;
  for (const auto& p : params) {
    out.block(0, at, 1, p.size()) = Eigen::Map<const Matrix<T>>(p.grad_data, 1, p.size());
    at += p.size();
  }
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------
// Const forward from several threads

TEMPLATE_TEST_CASE("RMSNorm SwiGLU SkipGate and Router forwards are re-entrant", "[concurrency][dense]", float, double) {
  using T = TestType;
  const Index d = 16, f = 24;
  // 3 rows take linear_nt's matrix–vector path, 40 rows the matrix product.
  const std::vector<Matrix<T>> x = {rnd<T>(3, d, 1), rnd<T>(40, d, 2)};

  RMSNorm<T> norm(d);
  norm.gain() = rnd<T>(1, d, 3);
  check_reentrant<typename RMSNorm<T>::Cache>(
      "RMSNorm", x.size(), [&](std::size_t i, typename RMSNorm<T>::Cache* c) { return norm.forward(x[i], c); },
      [](const typename RMSNorm<T>::Cache& c) { return c.x_hat; });

  const SwiGLU<T> ffn(d, f, 4);
  check_reentrant<typename SwiGLU<T>::Cache>(
      "SwiGLU", x.size(), [&](std::size_t i, typename SwiGLU<T>::Cache* c) { return ffn.forward(x[i], c); },
      [](const typename SwiGLU<T>::Cache& c) { return c.work; });

  const SkipGate<T> gate(gate_config(d, 8), 5);
  check_reentrant<typename SkipGate<T>::Cache>(
      "SkipGate", x.size(), [&](std::size_t i, typename SkipGate<T>::Cache* c) { return gate.forward(x[i], c); },
      [](const typename SkipGate<T>::Cache& c) { return c.z; });

  Rng rng(6);
  const Router<T> router(d, 6, 2, rng);
  RowVector<T> bias = rnd<T>(1, 6, 7, 0.1);
  check_reentrant<Routing<T>>(
      "Router::route", x.size(),
      [&](std::size_t i, Routing<T>* c) {
        Routing<T> local;
        Routing<T>& r = c ? *c : local;
        router.route(x[i], bias, false, r);
        return r.weights;
      },
      [](const Routing<T>& r) { return r.experts; });
}

TEMPLATE_TEST_CASE("KappaSwiGLU forward is re-entrant", "[concurrency][kappa]", float, double) {
  using T = TestType;
  const Index d = 16, f = 24;
  const std::vector<Matrix<T>> x = {rnd<T>(3, d, 1), rnd<T>(40, d, 2)};
  const std::vector<Vector<T>> logit = {rnd<T>(3, 1, 3, 3.0), rnd<T>(40, 1, 4, 3.0)};
  KappaSwiGLU<T> layer(d, f, 5);
  layer.kappa_alpha() = rnd<T>(1, f, 6);  // κ ≠ 1: the sharpness path runs
  layer.kappa_bias() = rnd<T>(1, f, 7);
  check_reentrant<typename KappaSwiGLU<T>::Cache>(
      "KappaSwiGLU", x.size(),
      [&](std::size_t i, typename KappaSwiGLU<T>::Cache* c) { return layer.forward(x[i], logit[i], c); },
      [](const typename KappaSwiGLU<T>::Cache& c) { return c.work; });
}

TEMPLATE_TEST_CASE("MoEFFN forward is re-entrant while its own OpenMP dispatch runs", "[concurrency][moe]", float,
                   double) {
  using T = TestType;
  const Index d = 16, f = 24;
  MoEFFN<T> moe(moe_config(6, 2, 1, d, f), 1);
  // A busy expert: with 1100 tokens its block spans two row tiles (kMaxTileRows = 1024).
  moe.router().weight().row(2).array() += T(0.5);
  RowVector<T> bias = rnd<T>(1, 6, 2, 0.05);
  moe.balancer().set_bias(bias);
  const std::vector<Matrix<T>> x = {rnd<T>(3, d, 3), rnd<T>(1100, d, 4) + Matrix<T>::Constant(1100, d, T(0.3))};
  using Cache = typename MoEFFN<T>::Cache;
  // The reference is taken with one dispatch thread; the results are
  // bitwise the same for any thread count, so it serves both runs.
  moe.set_threads(1);
  std::vector<Matrix<T>> ref;
  for (const auto& xi : x) ref.push_back(moe.forward(xi));
  for (int omp : {1, 2}) {
    INFO("MoEFFN dispatch threads: " << omp);
    moe.set_threads(omp);
    for (std::size_t i = 0; i < x.size(); ++i) REQUIRE(bitwise_equal(moe.forward(x[i]), ref[i]));
    check_reentrant<Cache>(
        "MoEFFN", x.size(), [&](std::size_t i, Cache* c) { return moe.forward(x[i], c); },
        [](const Cache& c) { return c.y_sorted; });
  }

  // Rejections are per call too: the ValueError raised inside one caller's
  // OpenMP region reaches that caller only, and the next call is unaffected.
  Matrix<T> bad = x[1];
  bad(7, 3) = std::numeric_limits<T>::quiet_NaN();
  moe.set_threads(2);
  check_concurrently([&](int th, int call) -> std::string {
    if ((th + call) % 2 == 0) return bitwise_equal(moe.forward(x[1]), ref[1]) ? "" : "output after a rejection differs";
    try {
      moe.forward(bad);
    } catch (const ValueError&) {
      return "";
    }
    return "NaN input was not rejected";
  });
}

TEMPLATE_TEST_CASE("MoE of kappa-SwiGLU experts forward is re-entrant", "[concurrency][moe][kappa]", float, double) {
  using T = TestType;
  const Index d = 16, f = 24;
  MoEFFN<T, KappaSwiGLU<T>> moe(moe_config(4, 2, 1, d, f), 1);
  std::uint64_t seed = 10;
  for (auto& e : moe.experts()) {
    e.kappa_alpha() = rnd<T>(1, f, seed++);
    e.kappa_bias() = rnd<T>(1, f, seed++);
  }
  const std::vector<Matrix<T>> x = {rnd<T>(5, d, 2), rnd<T>(90, d, 3)};
  using Cache = typename MoEFFN<T, KappaSwiGLU<T>>::Cache;
  for (int omp : {1, 2}) {
    INFO("MoEFFN dispatch threads: " << omp);
    moe.set_threads(omp);
    check_reentrant<Cache>(
        "kappa MoEFFN", x.size(), [&](std::size_t i, Cache* c) { return moe.forward(x[i], c); },
        [](const Cache& c) { return c.work; });
  }
}

TEMPLATE_TEST_CASE("gated FFNSublayer forward is re-entrant in inference and training mode",
                   "[concurrency][skip_gate]", float, double) {
  using T = TestType;
  const Index d = 16, f = 24, h = 8;
  const std::vector<Matrix<T>> x = {rnd<T>(3, d, 1), rnd<T>(40, d, 2)};

  using Dense = FFNSublayer<T, SwiGLU<T>>;
  Dense dense(d, SwiGLU<T>(d, f, 3), SkipGate<T>(gate_config(d, h), 4));
  const Index skipped = skip_half(*dense.skip_gate(), x[1]);
  INFO(skipped << " of 40 tokens skipped");
  REQUIRE(skipped > 0);
  REQUIRE(skipped < 40);
  for (SublayerMode mode : {SublayerMode::inference, SublayerMode::training}) {
    const bool infer = mode == SublayerMode::inference;
    INFO((infer ? "inference" : "training") << " mode");
    dense.set_mode(mode);
    check_reentrant<typename Dense::Cache>(
        infer ? "gated dense FFNSublayer (inference)" : "gated dense FFNSublayer (training)", x.size(),
        [&](std::size_t i, typename Dense::Cache* c) { return dense.forward(x[i], c); },
        [infer](const typename Dense::Cache& c) { return infer ? Matrix<T>(c.gate.g) : c.f; });
  }

  using MoE = FFNSublayer<T, MoEFFN<T>>;
  MoE moe(d, MoEFFN<T>(moe_config(4, 2, 1, d, f), 5), SkipGate<T>(gate_config(d, h), 6));
  REQUIRE(skip_half(*moe.skip_gate(), x[1]) > 0);
  moe.set_mode(SublayerMode::inference);
  for (int omp : {1, 2}) {
    INFO("MoEFFN dispatch threads: " << omp);
    moe.ffn().set_threads(omp);
    check_reentrant<typename MoE::Cache>(
        "gated MoE FFNSublayer (inference)", x.size(),
        [&](std::size_t i, typename MoE::Cache* c) { return moe.forward(x[i], c); },
        // Without kept tokens the FFN does not run and its cache is left as it was.
        [](const typename MoE::Cache& c) { return c.ffn_ran ? c.ffn.y_sorted : Matrix<T>(); });
  }
}

TEMPLATE_TEST_CASE("MultiTokenHeads forward and drafting and the loss are re-entrant", "[concurrency][mtp]", float,
                   double) {
  using T = TestType;
  const Index d = 16, v = 11, n = 12;
  MultiTokenOptions opt;
  opt.num_heads = 3;
  const MultiTokenHeads<T> heads(d, v, opt, 1);
  const std::vector<Matrix<T>> h = {rnd<T>(2, d, 2), rnd<T>(n, d, 3)};
  check_reentrant<typename MultiTokenHeads<T>::Cache>(
      "MultiTokenHeads", h.size(),
      [&](std::size_t i, typename MultiTokenHeads<T>::Cache* c) { return heads.forward(h[i], c); },
      [](const typename MultiTokenHeads<T>::Cache& c) { return c.h; });

  // forward_into a per-thread buffer, greedy drafts from it, and the loss.
  const Matrix<T> main = rnd<T>(n, v, 4);
  TokenIds labels(n);
  for (Index t = 0; t < n; ++t) labels(t) = (3 * t + 1) % v;
  labels(4) = kIgnoreIndex;
  const Matrix<T> y_ref = heads.forward(h[1]);
  const std::vector<Index> draft_ref = draft_greedy(heads.draft_logits(y_ref, n - 1)).tokens;
  Matrix<T> dmain_ref, dheads_ref;
  const double loss_ref = heads.loss(main, y_ref, labels, &dmain_ref, &dheads_ref).total;
  std::vector<Matrix<T>> buffers(kThreads, Matrix<T>(n, heads.num_heads() * v));
  check_concurrently([&](int th, int) -> std::string {
    Matrix<T>& y = buffers[std::size_t(th)];
    heads.forward_into(h[1], y);
    if (!bitwise_equal(y, y_ref)) return "forward_into differs";
    if (draft_greedy(heads.draft_logits(y, n - 1)).tokens != draft_ref) return "greedy drafts differ";
    Matrix<T> dmain, dheads;
    const MultiTokenLoss loss = multi_token_loss(main, y, labels, opt, &dmain, &dheads);
    if (loss.total != loss_ref) return "multi-token loss differs";
    if (!bitwise_equal(dmain, dmain_ref) || !bitwise_equal(dheads, dheads_ref)) return "loss gradients differ";
    return "";
  });
}

// ---------------------------------------------------------------------------
// Training on per-thread copies

TEST_CASE("per-thread copies of an MoE layer train concurrently to the sequential gradients",
          "[concurrency][moe][backward]") {
  const Index d = 12, f = 16, n = 30;
  MoEFFN<double> proto(moe_config(4, 2, 1, d, f), 1);
  proto.set_threads(2);
  const Matrix<double> x = random_matrix(n, d, 2), dy = random_matrix(n, d, 3);
  // Sequential reference: one step of forward, backward, observe, update.
  MoEFFN<double> ref = proto;
  MoEFFN<double>::Cache rc;
  const Matrix<double> y_ref = ref.forward(x, &rc);
  const Matrix<double> dx_ref = ref.backward(dy, rc);
  const Matrix<double> g_ref = flat_grads(ref.params());
  ref.observe(rc);
  ref.balancer().update();
  const RowVector<double> bias_ref = ref.balancer().bias();

  check_concurrently([&](int, int) -> std::string {
    MoEFFN<double> mine = proto;  // a fresh copy per step: every step must equal the reference
    MoEFFN<double>::Cache c;
    if (!bitwise_equal(mine.forward(x, &c), y_ref)) return "forward differs";
    if (!bitwise_equal(mine.backward(dy, c), dx_ref)) return "dx differs";
    if (!bitwise_equal(flat_grads(mine.params()), g_ref)) return "parameter gradients differ";
    mine.observe(c);
    mine.balancer().update();
    if (!bitwise_equal(mine.balancer().bias(), bias_ref)) return "balancer bias differs";
    return "";
  });
}

TEST_CASE("per-thread copies of a gated sublayer train concurrently to the sequential gradients",
          "[concurrency][skip_gate][backward]") {
  const Index d = 12, f = 16, n = 30;
  using Layer = FFNSublayer<double, MoEFFN<double, KappaSwiGLU<double>>>;
  Layer proto(d, MoEFFN<double, KappaSwiGLU<double>>(moe_config(4, 2, 1, d, f), 1),
              SkipGate<double>(gate_config(d, 6), 2));
  const Matrix<double> x = random_matrix(n, d, 3), dy = random_matrix(n, d, 4);
  REQUIRE(skip_half(*proto.skip_gate(), x) > 0);
  std::uint64_t seed = 20;
  for (auto& e : proto.ffn().experts()) {
    e.kappa_alpha() = random_matrix(1, f, seed++);
    e.kappa_bias() = random_matrix(1, f, seed++);
  }
  Layer ref = proto;
  Layer::Cache rc;
  const Matrix<double> y_ref = ref.forward(x, &rc);
  const Matrix<double> dx_ref = ref.backward(dy, rc);
  const Matrix<double> g_ref = flat_grads(ref.params());

  check_concurrently([&](int th, int) -> std::string {
    Layer mine = proto;
    mine.ffn().set_threads(1 + th % 2);
    Layer::Cache c;
    if (!bitwise_equal(mine.forward(x, &c), y_ref)) return "forward differs";
    if (!bitwise_equal(mine.backward(dy, c), dx_ref)) return "dx differs";
    if (!bitwise_equal(flat_grads(mine.params()), g_ref)) return "parameter gradients differ";
    return "";
  });
}

// The panel heap (kernels/panel_heap.hpp) hands out chunk space under a lock:
// arrays taken from several threads at once never overlap, and each keeps its
// bytes while the others are written and released.
TEST_CASE("panel arrays taken from several threads at once never overlap", "[concurrency][packed]") {
  using packed::detail::PanelArray;
  const Index big = Index(PanelArray::kChunkedBytes) + 3;
  std::vector<std::vector<PanelArray>> kept(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&kept, big, t] {
      for (int i = 0; i < 64; ++i) {
        kept[t].emplace_back(big);
        std::memset(kept[t].back().data(), t + 1, std::size_t(big));
        if (i % 4 == 3) kept[t].erase(kept[t].begin() + i / 4);  // release one: its pages go back
      }
    });
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) {
    INFO("thread " << t);
    CHECK(kept[t].size() == 48);
    CHECK(std::all_of(kept[t].begin(), kept[t].end(), [&](const PanelArray& x) {
      return std::all_of(x.data(), x.data() + big, [&](std::byte c) { return c == std::byte(t + 1); });
    }));
  }
}
