// The packed inference layers compute the same bits whatever runs them:
// one thread or two, and every kernel path the CPU supports (docs/inference.md).
#include <catch2/catch.hpp>

#include <apex/ffn/inference.hpp>
#include <apex/ffn/layers/kappa_swiglu.hpp>

#include "fixtures.hpp"
#include "packed_layers.hpp"

using namespace apex;
using apex::packed::bf16;
using apex::test::bitwise_equal;
using apex::test::odd_config;
using apex::test::perturb_kappa;

TEST_CASE("packed layers are bitwise identical across thread counts and kernel paths", "[inference][threads]") {
  MoEFFN<float, KappaSwiGLU<float>> kmoe(odd_config(2), 15);
  perturb_kappa(kmoe, 40);
  MoEFFN<float> moe(odd_config(2), 15);
  auto a = PackedMoE<bf16>::from(moe);
  auto k = PackedMoE<float, KappaSwiGLU<float>>::from(kmoe);
  for (Index n : {Index(1), Index(4), Index(600)}) {
    const Matrix<float> x = test::rnd<float>(n, 37, 400 + n);
    a.set_threads(1);
    k.set_threads(1);
    const Matrix<float> ya = a.forward(x), yk = k.forward(x);
    a.set_threads(2);
    k.set_threads(2);
    CHECK(bitwise_equal(a.forward(x), ya));
    CHECK(bitwise_equal(k.forward(x), yk));
    for (packed::Isa isa : packed::kAllIsas) {
      if (!packed::cpu_supports(isa)) continue;
      INFO("path " << packed::isa_name(isa) << ", rows " << n);
      a.set_kernel_options({isa, packed::Bf16Products::widened});
      k.set_kernel_options({isa, packed::Bf16Products::widened});
      CHECK(bitwise_equal(a.forward(x), ya));
      CHECK(bitwise_equal(k.forward(x), yk));
    }
  }
}
