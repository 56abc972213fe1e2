// Smallest program that proves the package works: build a SwiGLU, run it,
// check the output shape and that it is finite.
#include <apex/ffn.hpp>

#include <cstdio>

int main() {
  apex::SwiGLU<float> ffn(16, apex::default_ffn_width(16), /*seed=*/1);
  const apex::Matrix<float> x = apex::Matrix<float>::Ones(3, 16);
  const apex::Matrix<float> y = ffn.forward(x);
  if (y.rows() != 3 || y.cols() != 16 || !y.allFinite()) {
    std::puts("consumer: unexpected output");
    return 1;
  }
  std::printf("consumer: ok (%d params)\n", int(apex::parameter_count(ffn.param_values())));
  return 0;
}
