// The packed layers on the block formats (kernels/quant_types.hpp): PackedMoE
// (SwiGLU and κ experts, shared experts of their own type, gate/up and down
// of different types), PackedSwiGLU and the packed sublayer, built from a
// trained layer or quantized while a float checkpoint loads; the same bits on
// every kernel path and thread count; the error against the float layer
// within each format's documented bound; and widths that are not whole blocks
// refused before anything is read.
#include <catch2/catch.hpp>

#include <apex/ffn/inference.hpp>
#include <apex/ffn/inference/files/checkpoint/load.hpp>
#include <apex/ffn/inference/files/checkpoint/save.hpp>
#include <apex/ffn/io/checkpoint.hpp>
#include <apex/ffn/layers/kappa_swiglu.hpp>

#include <fstream>
#include <string>
#include <vector>

#include "fixtures.hpp"
#include "packed_layers.hpp"
#include "sweep.hpp"
#include "temp_dir.hpp"

using namespace apex;
using apex::test::bitwise_equal;
using apex::test::rel;

namespace {

/// A layer whose widths are whole Q4_K/Q6_K super-blocks, with everything
/// the packed MoE computes beyond plain routing (shared experts of another
/// width, a shared gate, a balancing bias).
MoEConfig quant_config() {
  MoEConfig c = test::moe_config(6, 2, 1, 256, 256);
  c.d_shared_ffn = 512;
  c.shared_expert_gate = true;
  return c;
}

/// ‖y − y_float‖ / ‖y_float‖ each format must stay under on these random
/// layers, ≈ 1.5× what it measures (docs/quantized_formats.md: q8_0 0.012,
/// q6_k 0.027, q4_k 0.097, q4_0 0.115, mxfp4 0.28; Gaussian weights are the
/// worst case of the 4-bit grids, and MXFP4 clips a block's largest weights
/// to its largest code where ggml's power-of-two scale leaves them above it).
double error_bound(packed::Dtype t) {
  switch (t) {
    case packed::Dtype::q8_0: return 0.02;
    case packed::Dtype::q6_k: return 0.045;
    case packed::Dtype::q4_k: return 0.15;
    case packed::Dtype::q4_0: return 0.17;
    case packed::Dtype::mxfp4: return 0.40;
    default: return 0.01;
  }
}

template <class Storage, class Expert>
void check_layer(const MoEFFN<float, Expert>& moe, const Matrix<float>& x) {
  constexpr packed::Dtype t = packed::dtype_of<Storage>();
  CAPTURE(packed::dtype_name(t));
  auto layer = PackedMoE<Storage, Expert>::from(moe);
  CHECK(layer.types() == PackedTypes(t));
  const Matrix<float> want = moe.forward(x);
  const Matrix<float> y = layer.forward(x);
  CHECK(rel(y, want) < error_bound(t));
  CHECK(rel(y, want) > 0.0);  // the weights really are quantized
  // every kernel path and thread count: the same bits
  for (const packed::Isa isa : packed::kAllIsas) {
    if (!packed::cpu_supports(isa)) continue;
    for (const int threads : {1, 2}) {
      CAPTURE(packed::isa_name(isa), threads);
      layer.set_kernel_options({isa});
      layer.set_threads(threads);
      CHECK(bitwise_equal(layer.forward(x), y));
    }
  }
  // the memory the layer holds is the format's bytes
  CHECK(layer.expert_bytes() <= PackedMoE<Storage, Expert>::weight_bytes(moe.config()));
  CHECK(double(layer.expert_bytes()) < 0.3 * double(PackedMoE<float, Expert>::weight_bytes(moe.config())));
}

std::vector<unsigned char> checkpoint_bytes(const ParamList<float>& params) {
  safetensors::VectorSink sink;
  write_checkpoint(sink, params);
  return sink.bytes;
}

}  // namespace

TEST_CASE("PackedMoE on every block format: the float layer's output within the format's error",
          "[inference][quant]") {
  MoEFFN<float> moe(quant_config(), 21);
  test::set_bias(moe, 22);
  const Matrix<float> x = test::rnd<float>(37, 256, 23, 1.0);  // 37 × d
  check_layer<packed::q8_0>(moe, x);
  check_layer<packed::q4_0>(moe, x);
  check_layer<packed::q4_k>(moe, x);
  check_layer<packed::q6_k>(moe, x);
  check_layer<packed::mxfp4>(moe, x);
}

TEST_CASE("PackedMoE with kappa experts on block formats", "[inference][quant][kappa]") {
  MoEFFN<float, KappaSwiGLU<float>> moe(quant_config(), 24);
  test::perturb_kappa(moe, 25);
  const Matrix<float> x = test::rnd<float>(9, 256, 26, 1.0);  // 9 × d
  check_layer<packed::q8_0>(moe, x);
  check_layer<packed::q4_k>(moe, x);
}

TEST_CASE("PackedMoE: routed gate/up, routed down and shared experts each of their own type",
          "[inference][quant][mixed]") {
  MoEFFN<float> moe(quant_config(), 27);
  const Matrix<float> x = test::rnd<float>(11, 256, 28, 1.0);  // 11 × d
  const PackedTypes types{{packed::Dtype::q4_k, packed::Dtype::q6_k}, packed::Dtype::q8_0};
  const auto layer = PackedMoE<packed::q4_k>::from(moe, types);
  CHECK(layer.types() == types);
  CHECK(layer.experts().front().down().dtype() == packed::Dtype::q6_k);
  CHECK(layer.shared_experts().front().dtype() == packed::Dtype::q8_0);
  const auto uniform = PackedMoE<packed::q4_k>::from(moe);
  CHECK(layer.expert_bytes() > uniform.expert_bytes());  // Q6_K down and Q8_0 shared hold more bits
  CHECK(layer.expert_bytes() <= PackedMoE<packed::q4_k>::weight_bytes(moe.config(), "test", types));
  CHECK(rel(layer.forward(x), moe.forward(x)) < rel(uniform.forward(x), moe.forward(x)));
  // experts of mixed types in one list are refused
  std::vector<packed::PackedExpert> experts = layer.experts();
  experts[2] = uniform.experts()[2];
  CHECK_THROWS_CONTAINING(PackedMoE<packed::q4_k>(moe.config(), moe.router().weight(), moe.balancer().bias(),
                                                  experts, {}, layer.shared_experts(), moe.shared_gate_weight()),
                          ConfigError, "argument 'experts' mixes storage types: expert 2 is q4_k, expert 0 is q4_k/q6_k");
  CHECK(packed_types_name(types) == "routed q4_k/q6_k, shared q8_0");
}

TEST_CASE("packed loads quantize F32 and BF16 checkpoints as from() does", "[inference][quant][checkpoint]") {
  MoEFFN<float> moe(quant_config(), 29);
  const auto bytes = checkpoint_bytes(moe.param_values());
  const auto file = test::reader(bytes);
  const Matrix<float> x = test::rnd<float>(5, 256, 30, 1.0);  // 5 × d
  const auto loaded = load_packed_moe<packed::q6_k>(file, moe.config());
  CHECK(bitwise_equal(loaded.forward(x), PackedMoE<packed::q6_k>::from(moe).forward(x)));
  PackedLoadOptions o;
  o.types = PackedTypes{{packed::Dtype::mxfp4, packed::Dtype::q8_0}, packed::Dtype::bf16};
  const auto mixed = load_packed_moe<float>(file, moe.config(), o);
  CHECK(mixed.types() == *o.types);
  CHECK(bitwise_equal(mixed.forward(x), PackedMoE<float>::from(moe, *o.types).forward(x)));
  // the dense layer and the sublayer
  SwiGLU<float> dense(256, 512, 31);
  const auto dense_file = checkpoint_bytes(dense.param_values());
  const auto pd = load_packed_swiglu<packed::q4_0>(test::reader(dense_file), 256, 512);
  CHECK(bitwise_equal(pd.forward(x), PackedSwiGLU<packed::q4_0>::from(dense).forward(x)));
  CHECK(rel(pd.forward(x), dense.forward(x)) < error_bound(packed::Dtype::q4_0));
  FFNSublayer<float, MoEFFN<float>> sub(256, MoEFFN<float>(quant_config(), 32));
  const auto ps = pack_sublayer<packed::q8_0>(sub);
  CHECK(rel(ps.forward(x), sub.forward(x)) < error_bound(packed::Dtype::q8_0));
}

TEST_CASE("block formats refuse widths that are not whole blocks, before reading", "[inference][quant][errors]") {
  MoEFFN<float> moe(test::moe_config(4, 2, 1, 256, 96), 33);  // f = 96: 3 blocks of 32, not a super-block
  CHECK_NOTHROW(PackedMoE<packed::q8_0>::from(moe));
  CHECK_THROWS_CONTAINING(PackedMoE<packed::q4_k>::from(moe), ConfigError,
                          "reduction length 96 is not a multiple of 256, the q4_k block");
  const auto bytes = checkpoint_bytes(moe.param_values());
  CHECK_THROWS_CONTAINING(load_packed_moe<packed::q6_k>(test::reader(bytes), moe.config()), ConfigError,
                          "reduction length 96 is not a multiple of 256, the q6_k block");
  CHECK_THROWS_CONTAINING(PackedMoE<packed::q4_k>::weight_bytes(moe.config()), ConfigError, "q4_k block");
  SwiGLU<float> dense(40, 64, 34);  // d = 40: gate/up rows are not whole blocks of 32
  CHECK_THROWS_CONTAINING(PackedSwiGLU<packed::mxfp4>::from(dense), ConfigError, "reduction length 40");
}

TEST_CASE("PackedMoE::from refuses a block beyond its format's range, naming the expert, row and block",
          "[inference][quant][errors][regression]") {
  // Finite weights of magnitude 1e7 packed as Q8_0 had a block scale beyond
  // fp16 (d = 1e7/127 → Inf): the packed layer's output was Inf where the
  // float layer's was finite. The pack is refused instead.
  MoEFFN<float> moe(test::moe_config(4, 2, 1, 64, 32), 35);  // d = 64, f = 32
  moe.experts()[2].w_gate()(5, 40) = 1e7f;                   // row 5, block 1
  const std::string got = test::outcome([&] { (void)PackedMoE<packed::q8_0>::from(moe); });
  test::expect(
      got, "ValueError",
      {"PackedMoE::from: expert 2: PackedExpert: w_gate row 5: packing weights as q8_0: block 1 (weights 32..63) "
       "of a row has largest |w| = 1e+07, beyond the format's range: its scale d = inf in fp16"});
  CHECK_NOTHROW(PackedMoE<float>::from(moe));  // f32 and bf16 hold it
  CHECK_NOTHROW(PackedMoE<packed::bf16>::from(moe));
  moe.experts()[2].w_gate()(5, 40) = 0.5f;
  moe.shared_experts()[0].w_down()(1, 0) = -3e5f;  // Q4_0: 3e5 / 8 fits fp16, 6e5 / 8 does not
  CHECK_NOTHROW(PackedMoE<packed::q4_0>::from(moe));
  moe.shared_experts()[0].w_down()(1, 0) = -6e5f;
  test::expect(test::outcome([&] { (void)PackedMoE<packed::q4_0>::from(moe); }), "ValueError",
               {"PackedMoE::from: shared expert 0: PackedExpert: w_down row 1: packing weights as q4_0: block 0"});
  // The packed loaders name the expert's tensors too.
  const auto bytes = checkpoint_bytes(moe.param_values());
  test::expect(test::outcome([&] { (void)load_packed_moe<packed::q4_0>(test::reader(bytes), moe.config()); }),
               "ValueError", {"expert 'shared_experts.0.'", "w_down row 1", "block 0"});
  // A quantized checkpoint's block whose fp16 scale is Inf is refused as it moves in, not loaded.
  moe.shared_experts()[0].w_down()(1, 0) = 0.5f;
  test::TempDir dir;
  const std::string path = (dir.path / "q8.safetensors").string();
  save_packed_moe(path, PackedMoE<packed::q8_0>::from(moe));
  {
    const safetensors::Reader file(path);
    const auto& t = file.at("experts.1.w_up.weight");  // U8 [f, d/32 · 34]: block 1 of row 2
    const std::uint16_t inf = 0x7C00;
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(std::streamoff(file.header().data_offset() + t.begin + 2 * (64 / 32 * 34) + 34));
    f.write(reinterpret_cast<const char*>(&inf), 2);
  }
  test::expect(test::outcome([&] { (void)load_packed_moe<packed::q8_0>(path, moe.config()); }), "ValueError",
               {"expert 'experts.1.': PackedExpert::from_file_rows: up row 2: block 1 of a q8_0 row: its scale d = "
                "inf in fp16"});
}
