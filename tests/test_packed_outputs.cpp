// What the packed inference layers (docs/inference.md) write and hold:
// the size checks add their byte counts with overflow checks.
#include <catch2/catch.hpp>

#include <apex/ffn/inference.hpp>
#include <apex/ffn/kappa_swiglu.hpp>
#include <apex/ffn/memory_budget.hpp>

#include <cstdint>
#include <limits>
#include <string>

#include "fixtures.hpp"
#include "sweep.hpp"

using namespace apex;
using apex::packed::bf16;

namespace {

/// Gated shared experts of their own width, sigmoid routing with groups and
/// a capacity limit that drops: every part of the packed MoE's forward.
MoEConfig full_config() {
  MoEConfig c = test::moe_config(6, 2, 1, 37, 53);
  c.d_shared_ffn = 43;
  c.shared_expert_gate = true;
  c.routing.scoring = Scoring::Sigmoid;
  c.routing.n_groups = 2;
  c.routing.topk_group = 1;
  c.routing.capacity_factor = 0.8;
  return c;
}

}  // namespace

TEST_CASE("packed size checks reject byte counts that overflow", "[inference][memory][sweeps]") {
  // check_fits added weight_bytes + staging unchecked: a staging near 2^64
  // wrapped to a small total and the check passed.
  constexpr std::uint64_t kHuge = std::numeric_limits<std::uint64_t>::max() - 100;
  const MoEConfig cfg = full_config();
  using test::expect;
  using test::outcome_isolated;
  expect(outcome_isolated([&] { PackedMoE<bf16>::check_fits("X", cfg, kHuge); }), "ConfigError", {"X", "bytes"});
  expect(outcome_isolated([&] { PackedMoE<float, KappaSwiGLU<float>>::check_fits("X", cfg, kHuge); }),
         "ConfigError", {"X", "bytes"});
  expect(outcome_isolated([&] { PackedSwiGLU<float>::check_fits("X", 37, 53, kHuge); }), "ConfigError",
         {"X", "bytes"});
  expect(outcome_isolated([&] { PackedSwiGLU<bf16>::check_fits("X", 37, 53, std::uint64_t(1) << 63); }),
         "ConfigError", {"X", "bytes"});
  // Sizes at the index limit: the padding of d and f to panels must not
  // overflow either (it did, silently, before the product was checked).
  constexpr Index kMax = std::numeric_limits<Index>::max();
  for (Index d : {kMax, kMax - 1, kMax / 2}) {
    INFO("d " << d);
    expect(outcome_isolated([&] { PackedSwiGLU<bf16>::check_fits("X", d, 3, 0); }), "ConfigError", {"X"});
    expect(outcome_isolated([&] { PackedSwiGLU<float>::check_fits("X", 3, d, 0); }), "ConfigError", {"X"});
    MoEConfig wide = test::moe_config(4, 2, 1, 8, 6);
    wide.d_shared_ffn = d;
    expect(outcome_isolated([&] { PackedMoE<bf16>::check_fits("X", wide, 0); }), "ConfigError", {"X"});
    MoEConfig many = test::moe_config(4, 2, 1, 8, 6);
    many.d_ffn = d;
    expect(outcome_isolated([&] { PackedMoE<float, KappaSwiGLU<float>>::check_fits("X", many, 0); }),
           "ConfigError", {"X"});
  }
  // A sum that fits still passes (the override skips only the memory comparison).
  ::setenv(kAllowOvercommitEnv, "1", 1);
  CHECK_NOTHROW(PackedMoE<bf16>::check_fits("X", cfg, 1u << 20));
  ::unsetenv(kAllowOvercommitEnv);
}

