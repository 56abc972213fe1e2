// Expert capacity (moe/capacity.hpp): a capacity factor drops the
// lowest-weighted overflow assignments, and a capacity at or above the batch
// saturates so that nothing is dropped.
#include <apex/ffn/inference.hpp>
#include <apex/ffn/io/name_maps.hpp>
#include <apex/ffn/layers/kappa_swiglu.hpp>
#include <apex/ffn/moe/families.hpp>
#include <apex/ffn/moe/moe_ffn.hpp>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <limits>

#include <unistd.h>

#include "families.hpp"
#include "fixtures.hpp"
#include "gradcheck.hpp"
#include "sweep.hpp"

using namespace apex;
using apex::test::check_params;
using apex::test::check_values;
using apex::test::dot_all;
using apex::test::random_matrix;
using apex::test::routed_config;

TEST_CASE("capacity factor drops the lowest-weighted overflow assignments", "[routing][capacity]") {
  RoutingConfig rc;
  MoEFFN<double> dropless(routed_config(4, 2, 1, rc), 9);
  MoEFFN<double>::Cache c0;
  const Matrix<double> x = random_matrix(8, 6, 10, 1.5);
  dropless.forward(x, &c0);
  CHECK(c0.dropped.empty());  // off by default
  CHECK(c0.kept_weights.size() == 0);

  rc.capacity_factor = 0.5;  // C = ceil(0.5 · 16 / 4) = 2
  MoEFFN<double> moe(routed_config(4, 2, 1, rc), 9);
  MoEFFN<double>::Cache c;
  const Matrix<double> y = moe.forward(x, &c);
  Index expected_drops = 0;
  for (Index e = 0; e < 4; ++e) expected_drops += std::max<Index>(0, c.plan.count(e) - 2);
  REQUIRE(expected_drops > 0);
  CHECK(Index(c.dropped.size()) == expected_drops);
  for (Index e = 0; e < 4; ++e) {
    // Kept: the expert's highest weights; every dropped weight ≤ every kept one.
    double min_kept = 1e9, max_dropped = -1e9;
    Index kept = 0;
    for (Index r = c.plan.offset[e]; r < c.plan.offset[e + 1]; ++r) {
      const Index t = c.plan.token[r], k = c.plan.slot[r];
      const bool is_dropped = std::binary_search(c.dropped.begin(), c.dropped.end(), t * 2 + k);
      CHECK((c.kept_weights(t, k) == 0) == is_dropped);
      if (is_dropped) max_dropped = std::max(max_dropped, c.routing.weights(t, k));
      else min_kept = std::min(min_kept, c.routing.weights(t, k)), ++kept;
    }
    CHECK(kept <= 2);
    CHECK(max_dropped <= min_kept);
  }
  // The output: shared experts plus the kept assignments only.
  Matrix<double> expected = moe.shared_experts()[0].forward(x);
  for (Index t = 0; t < 8; ++t)
    for (Index k = 0; k < 2; ++k)
      expected.row(t) += c.kept_weights(t, k) * moe.experts()[std::size_t(c.routing.experts(t, k))].forward(x.row(t));
  CHECK((y - expected).cwiseAbs().maxCoeff() < 1e-13);

  // Gradients: a dropped assignment has no effect and no gradient.
  Matrix<double> xv = x;
  const std::vector<Index> base = c.dropped;
  int changed = 0;
  const Matrix<double> rr = random_matrix(8, 6, 11);
  auto loss = [&] {
    MoEFFN<double>::Cache cc;
    const double l = dot_all(moe.forward(xv, &cc), rr);
    if (cc.dropped != base) ++changed;
    return l;
  };
  const Matrix<double> dx = moe.backward(rr, c);
  APEX_CHECK_GRADS(check_params(moe.params(), loss), 1e-6);
  APEX_CHECK_GRADS(std::vector{check_values("x", xv.data(), dx.data(), xv.size(), loss)}, 1e-6);
  CHECK(changed == 0);

  apex::test::expect(apex::test::outcome([] {
                       RoutingConfig bad;
                       bad.capacity_factor = -1;
                       MoEFFN<double> m(routed_config(4, 2, 0, bad), 1);
                     }),
                     "ConfigError", {"routing.capacity_factor"});
}

TEST_CASE("a capacity at or above the batch saturates: nothing is dropped", "[routing][capacity][regression]") {
  // moe/capacity.hpp: expert_capacity computed Index(std::ceil(φ·rows/E)) for any
  // finite φ; φ = 1e300 passed validate() and the conversion of 4e300 to an
  // integer was undefined behaviour (a negative capacity in practice:
  // expert_capacity(1e30, 10, 1) was INT64_MIN), so every routed pair was
  // dropped and MoEFFN, PackedMoE and ExpertParallelMoE returned the shared
  // experts alone. Fixed: C is computed in double and clamped to `rows`
  // before the conversion, so a capacity of at least the batch drops nothing.
  using dispatch::expert_capacity;
  CHECK(expert_capacity(1e30, 10, 1) == 10);
  CHECK(expert_capacity(1e300, 16, 4) == 16);
  CHECK(expert_capacity(std::numeric_limits<double>::max(), 7, 3) == 7);
  CHECK(expert_capacity(4.0, 16, 4) == 16);  // exactly the batch
  CHECK(expert_capacity(1e300, 0, 4) == 0);
  const Index huge = std::numeric_limits<Index>::max();
  CHECK(expert_capacity(2.0, huge, 1) == huge);  // φ·rows beyond Index: saturates too
  CHECK(expert_capacity(0.5, 16, 4) == 2);       // ordinary factors unchanged
  CHECK(expert_capacity(1.25, 10, 4) == 4);

  for (double factor : {1e300, 1e30, 4.0}) {
    INFO("capacity factor " << factor);
    RoutingConfig rc = family_routing(MoEFamily::Mixtral);
    MoEFFN<double> dropless(routed_config(4, 2, 1, rc), 9);
    rc.capacity_factor = factor;
    MoEFFN<double> capped(routed_config(4, 2, 1, rc), 9);
    const Matrix<double> x = random_matrix(8, 6, 10, 1.5);
    MoEFFN<double>::Cache c;
    const Matrix<double> y = capped.forward(x, &c);
    CHECK(c.dropped.empty());
    CHECK(y == dropless.forward(x));  // bitwise

    // The function ExpertParallelMoE applies to the whole batch (global_capacity.hpp).
    const Index cap = expert_capacity(factor, c.plan.rows(), 4);
    CHECK(dispatch::capacity_drops(c.plan, c.routing.weights, cap).empty());

    // The packed layer (float).
    MoEFFN<float> dropless_f(routed_config(4, 2, 1, family_routing(MoEFamily::Mixtral)), 9);
    MoEFFN<float> capped_f(routed_config(4, 2, 1, rc), 9);
    const Matrix<float> xf = x.cast<float>();
    CHECK(capped_f.forward(xf) == dropless_f.forward(xf));
    PackedMoE<float>::Cache pc;
    const Matrix<float> yp = PackedMoE<float>::from(capped_f).forward(xf, &pc);
    CHECK(pc.dropped.empty());
    CHECK(yp == PackedMoE<float>::from(dropless_f).forward(xf));
  }
}
