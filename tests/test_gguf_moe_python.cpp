// GGUF MoE blocks written by llama.cpp's own Python writer (PyPI gguf) by
// llama.cpp's conventions, with a numpy reference of llama.cpp's routing
// (tests/gguf_moe_reference.py, run from CTest by tests/gguf_interop.cmake):
// every architecture in every tensor type opens into PackedMoE and the float
// MoEFFN, and both give the reference output. Skipped with a message unless
// APEX_FFN_GGUF_PY_DIR names the script's output folder.
#include <catch2/catch.hpp>

#include <apex/ffn/inference/files/gguf/load.hpp>
#include <apex/ffn/io/gguf.hpp>

#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

using namespace apex;

namespace {

template <class T>
Matrix<T> read_raw(const std::string& path, Index rows, Index cols) {
  Matrix<T> m(rows, cols);
  std::ifstream in(path, std::ios::binary);
  REQUIRE(in.good());
  in.read(reinterpret_cast<char*>(m.data()), std::streamsize(sizeof(T) * std::size_t(m.size())));
  REQUIRE(in.gcount() == std::streamsize(sizeof(T) * std::size_t(m.size())));
  return m;
}

/// The relative error a file type's packed layer may have against the
/// exact output of its own weights: the activations' quantization only.
double bound(const std::string& type) {
  // Measured (seeds of gguf_moe_reference.py): f32, f16, bf16 5e-7 to 9e-7
  // (bf16 weights, float activations); the block formats 0.8 to 2.0e-2.
  if (type == "F32" || type == "F16" || type == "BF16") return 1e-5;
  if (type == "Q6_K") return 3e-2;
  return 2e-2;  // Q8_0, Q4_0, Q4_K, MXFP4
}

}  // namespace

TEST_CASE("gguf_moe: blocks written by gguf-py give llama.cpp's reference output", "[gguf_moe][python]") {
  const char* dir = std::getenv("APEX_FFN_GGUF_PY_DIR");
  if (!dir) {
    WARN("SKIP: APEX_FFN_GGUF_PY_DIR is not set (tests/gguf_interop.cmake sets it when PyPI gguf is installed)");
    return;
  }
  constexpr Index kN = 7, kD = 256, kBlock = 1;
  for (const char* arch : {"qwen3moe", "qwen2moe", "olmoe", "llama", "deepseek2"}) {
    for (const char* type : {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q6_K", "MXFP4"}) {
      INFO(arch << " " << type);
      const std::string base = std::string(dir) + "/" + arch + "_" + type;
      const gguf::File file = gguf::File::open(base + ".gguf");
      const Matrix<float> x = read_raw<float>(base + ".x", kN, kD);
      const Matrix<double> y = read_raw<double>(base + ".y", kN, kD);
      const auto packed = load_gguf_moe(file, kBlock);
      const auto dbl = load_gguf_moe_float<double>(file, kBlock);
      const auto sub = load_gguf_sublayer(file, kBlock);
      CHECK(sub.norm().eps() == Approx(1e-6f));
      const double e_packed = (packed.forward(x).cast<double>() - y).norm() / y.norm();
      const double e_double = (dbl.forward(x.cast<double>()) - y).norm() / y.norm();
      CHECK(e_double < 1e-9);
      CHECK(e_packed < bound(type));
      if (std::string(arch) == "deepseek2")  // block 0 is a leading dense block
        CHECK_THROWS_AS(load_gguf_moe(file, 0), ConfigError);
    }
  }
}
