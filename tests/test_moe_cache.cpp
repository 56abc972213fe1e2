// The one cache of the MoE pipeline (moe/moe_cache.hpp, moe/pipeline.hpp):
// MoEFFN and PackedMoE share its type; a cache another layer filled — a
// forward-only layer's, one of another shape, one whose exchange plan says
// its experts ran elsewhere — is a ShapeError naming it; a rejected backward
// allocates nothing and adds to no gradient.
#include <apex/ffn/inference.hpp>
#include <apex/ffn/layers/kappa_swiglu.hpp>
#include <apex/ffn/moe/moe_ffn.hpp>

#include <catch2/catch.hpp>

#include <type_traits>

#include "fixtures.hpp"

using namespace apex;
using apex::test::moe_config;

namespace {

template <class T>
Matrix<T> moe_cache_input(Index rows, Index d, std::uint64_t seed) {
  return apex::test::random_matrix(rows, d, seed).cast<T>();
}

}  // namespace

TEST_CASE("MoEFFN and PackedMoE keep one cache type", "[moe][cache]") {
  STATIC_REQUIRE(std::is_same_v<MoEFFN<float>::Cache, MoECache<float>>);
  STATIC_REQUIRE(std::is_same_v<PackedMoE<float>::Cache, MoECache<float>>);
  STATIC_REQUIRE(std::is_same_v<PackedMoE<packed::bf16, KappaSwiGLU<float>>::Cache, MoECache<float>>);
  STATIC_REQUIRE(std::is_same_v<MoEFFN<double, KappaSwiGLU<double>>::Cache, MoECache<double>>);
}

TEST_CASE("A forward-only layer's cache is rejected by the trainable layer's backward and observe",
          "[moe][cache][regression]") {
  const MoEConfig cfg = moe_config(4, 2, 1, 6, 5);
  MoEFFN<float> layer(cfg, 3);
  const auto packed = PackedMoE<float>::from(layer);
  const Matrix<float> x = moe_cache_input<float>(7, cfg.d_model, 11);
  MoECache<float> cache;
  packed.forward(x, &cache);
  const Matrix<float> dy = moe_cache_input<float>(7, cfg.d_model, 12);
  CHECK_THROWS_AS(layer.backward(dy, cache), ShapeError);
  CHECK_THROWS_AS(layer.observe(cache), ShapeError);
  // Nothing was allocated or added by the rejected step.
  CHECK_FALSE(layer.has_gradients());

  // A trainable layer's cache reused by the packed layer is emptied of what
  // backward needs, so it cannot pass for the trainable layer's forward.
  MoECache<float> reused;
  layer.forward(x, &reused);
  packed.forward(x, &reused);
  CHECK(reused.x.size() == 0);
  CHECK(reused.work.size() == 0);
  CHECK_THROWS_AS(layer.backward(dy, reused), ShapeError);
  CHECK_FALSE(layer.has_gradients());
}

TEST_CASE("A cache that says its experts ran on other ranks is rejected by a local layer",
          "[moe][cache][regression]") {
  const MoEConfig cfg = moe_config(4, 2, 1, 6, 5);
  MoEFFN<double> layer(cfg, 5);
  const Matrix<double> x = moe_cache_input<double>(5, cfg.d_model, 21);
  const Matrix<double> dy = moe_cache_input<double>(5, cfg.d_model, 22);
  MoECache<double> cache;
  layer.forward(x, &cache);
  cache.exchange.send_rows = {cache.plan.rows()};
  cache.exchange.recv_rows = {cache.plan.rows()};
  try {
    layer.backward(dy, cache);
    FAIL("backward accepted a cache with an exchange plan");
  } catch (const ShapeError& e) {
    CHECK_THAT(e.what(), Catch::Contains("MoEFFN::backward") && Catch::Contains("cache.exchange"));
  }
  cache.exchange = RowExchange{};
  const Matrix<double> dx = layer.backward(dy, cache);  // the same cache, repaired, is accepted
  CHECK(dx.rows() == x.rows());
  CHECK(layer.has_gradients());
}

TEST_CASE("A rejected backward leaves the gradients as they were", "[moe][cache][lazy]") {
  const MoEConfig cfg = moe_config(4, 2, 1, 6, 5);
  MoEFFN<double, KappaSwiGLU<double>> layer(cfg, 7);
  const Matrix<double> x = moe_cache_input<double>(6, cfg.d_model, 31);
  const Matrix<double> dy = moe_cache_input<double>(6, cfg.d_model, 32);
  MoECache<double> cache;
  layer.forward(x, &cache);
  // A wrong dy is caught before anything is allocated.
  CHECK_THROWS_AS(layer.backward(dy.leftCols(cfg.d_model - 1), cache), ShapeError);
  CHECK_FALSE(layer.has_gradients());
  layer.backward(dy, cache);
  std::vector<Matrix<double>> before;
  for (const auto& p : layer.params()) before.emplace_back(p.grad());
  // A cache of another width: rejected, and no gradient changes.
  MoECache<double> other = cache;
  other.work.resize(other.work.rows(), other.work.cols() + 1);
  CHECK_THROWS_AS(layer.backward(dy, other), ShapeError);
  std::size_t i = 0;
  for (const auto& p : layer.params()) CHECK(p.grad() == before[i++]);
}
