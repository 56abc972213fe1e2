// ExpertParallelLora against the single-process LoraMoE on the concatenation
// of every rank's tokens: outputs, dx and every trainable gradient (this
// rank's experts' adapters, the shared experts', a tied adapter, the router)
// in double over a float base, and in float over packed bases of every
// weight type — the frozen experts sharded, each rank running only its own.
#include <apex/ffn/adapters.hpp>
#include <apex/ffn/inference.hpp>
#include <apex/ffn/moe/gpt_oss.hpp>
#include <apex/ffn/mpi/expert_parallel_lora.hpp>

#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "mpi_fixtures.hpp"

using namespace apex;
using apex::mpi::Communicator;
using apex::mpi::ExpertParallelLora;

namespace {

/// B ≠ 0 everywhere (as after some training), the same on every rank and in the reference.
template <class T>
void draw_b(const ParamList<T>& params) {
  for (const auto& p : params)
    if (p.name.find("lora_B") != std::string::npos) {
      std::uint64_t seed = 1;
      for (char ch : p.name) seed = seed * 131 + std::uint64_t(ch);
      p.value() = test::random_matrix(p.rows, p.cols, seed, 0.5).template cast<T>();
    }
}

/// One scenario: two steps of forward and backward on the rank's slice
/// against the reference on the whole batch.
template <class Base>
void compare(const MoEConfig& cfg, Base base_ref, Base base_ep, const LoraOptions& o, double tol) {
  using T = typename LoraMoE<Base>::Scalar;
  Communicator comm;
  const test::Slice s = test::slice_of(comm, {3, 0, 5, 2});
  const Matrix<T> x_all = test::random_matrix(s.total, cfg.d_model, 11).template cast<T>();
  const Matrix<T> dy_all = test::random_matrix(s.total, cfg.d_model, 12).template cast<T>();
  const Matrix<T> x = x_all.middleRows(s.begin, s.rows), dy = dy_all.middleRows(s.begin, s.rows);
  LoraMoE<Base> ref(std::move(base_ref), o, Rng(5));
  ExpertParallelLora<Base> ep(std::move(base_ep), o, comm, Rng(5));
  draw_b(ref.param_values());
  draw_b(ep.params());
  ref.zero_grad();
  ep.zero_grad();
  for (int step = 0; step < 2; ++step) {
    INFO("step " << step);
    typename LoraMoE<Base>::Cache rc, c;
    const Matrix<T> y_ref = ref.forward(x_all, &rc), y = ep.forward(x, &c);
    CHECK(c.routing.experts == rc.routing.experts.middleRows(s.begin, s.rows));
    CHECK(test::rel_error(y, y_ref.middleRows(s.begin, s.rows)) <= tol);
    const Matrix<T> dx_ref = ref.backward(dy_all, rc), dx = ep.backward(dy, c);
    CHECK(test::rel_error(dx, dx_ref.middleRows(s.begin, s.rows)) <= tol);
    test::check_params_match(ep.params(), ref.params(), tol);
    ref.observe(rc);
    ep.observe(c);
    ref.balancer().update();
    ep.balancer().update();
    CHECK(ep.balancer().bias() == ref.balancer().bias());
  }
}

LoraOptions lora_options(bool per_expert, bool router) {
  LoraOptions o;
  o.rank = 2;
  o.alpha = 3;
  o.per_expert = per_expert;
  o.train_router = router;
  return o;
}

}  // namespace

TEST_CASE("ExpertParallelLora equals LoraMoE on the concatenated batch: float base in double", "[mpi][lora]") {
  MoEConfig cfg = test::moe_config(5, 2, 1, 6, 5);
  cfg.shared_expert_gate = true;
  for (bool per_expert : {true, false}) {
    INFO("per_expert " << per_expert);
    compare(cfg, MoEFFN<double>(cfg, 3), MoEFFN<double>(cfg, 3), lora_options(per_expert, true), 1e-12);
  }
  MoEConfig gpt = test::moe_config(4, 2, 0, 6, 5);
  gpt.router_bias = true;
  compare(gpt, GptOssMoE<double>(gpt, 4), GptOssMoE<double>(gpt, 4), lora_options(true, true), 1e-12);
  compare(cfg, MoEFFN<double, KappaSwiGLU<double>>(cfg, 6), MoEFFN<double, KappaSwiGLU<double>>(cfg, 6),
          lora_options(true, false), 1e-12);
}

TEST_CASE("ExpertParallelLora over packed experts of every type equals LoraMoE", "[mpi][lora][packed]") {
  for (packed::Dtype t : {packed::Dtype::bf16, packed::Dtype::q4_0, packed::Dtype::q4_k}) {
    const Index w = t == packed::Dtype::q4_k ? 256 : 64;
    const MoEConfig cfg = test::moe_config(5, 2, 1, w, w);
    const MoEFFN<float> trained(cfg, 7);
    INFO(packed::dtype_name(t));
    compare(cfg, PackedMoE<float>::from(trained, t), PackedMoE<float>::from(trained, t), lora_options(true, true),
            1e-5);
  }
}
