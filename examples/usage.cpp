// Using apex-ffn in your own model: one MoE FFN sublayer of APEX-1 — a skip
// gate, RMSNorm, and a mixture of κ-SwiGLU experts — trained for one step
// with plain SGD. Your model supplies the input and the gradient of its loss.
#include <apex/ffn/layers/ffn_sublayer.hpp>
#include <apex/ffn/layers/kappa_swiglu.hpp>
#include <apex/ffn/moe/moe_ffn.hpp>
#include <apex/ffn/layers/skip_gate.hpp>

#include <cstdio>

int main() {
  using namespace apex;
  using MoE = MoEFFN<float, KappaSwiGLU<float>>;

  // y = x + m ⊙ MoE(RMSNorm(x)), m from the skip gate; sizes of the `tiny` preset.
  const ModelPreset preset = ModelPreset::tiny();  // d = 64, f = 128, 4 experts, top-2, 1 shared
  Rng rng(42);
  SkipGateConfig gate;
  gate.d_model = preset.d_model;
  gate.hidden = preset.skip_hidden;
  FFNSublayer<float, MoE> layer(preset.d_model, MoE(preset.moe(), rng), SkipGate<float>(gate, rng));

  // Forward a batch of 32 tokens (one per row), keeping the activations for backward.
  Matrix<float> x(32, preset.d_model);
  fill_uniform(x, rng, 1.0);
  FFNSublayer<float, MoE>::Cache cache;
  const Matrix<float> y = layer.forward(x, &cache);

  // Backward of a toy loss L = ½‖y‖² (∂L/∂y = y): returns ∂L/∂x, adds into every parameter gradient.
  layer.zero_grad();
  const Matrix<float> dx = layer.backward(y, cache);
  add_kappa_regularizer_grad(layer.ffn());  // κ-SwiGLU's regulariser, if you train κ

  // One SGD step over the named parameter list (checkpoints use the same names, values only: param_values()).
  const float lr = 0.01f;
  for (const auto& p : layer.params()) p.value() -= lr * p.grad();

  // Auxiliary-loss-free load balancing: count the routed tokens, then move the bias.
  layer.observe(cache);
  const LoadReport load = layer.ffn().balancer().update();

  std::printf("y: %ld x %ld, dx: %ld x %ld, %zu parameter tensors, skip rate %.2f, expert load max/mean %.2f\n",
              long(y.rows()), long(y.cols()), long(dx.rows()), long(dx.cols()), layer.params().size(),
              cache.skip_rate(), load.imbalance);
  return y.allFinite() && dx.allFinite() ? 0 : 1;
}
