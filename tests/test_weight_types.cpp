// The weight-type table (kernels/weight_types.hpp): entries, runtime
// dispatch, sizes every storage decision reads from it, panels with their
// (empty) scale arrays, and the loader's dtype list.
#include <apex/ffn/inference.hpp>
#include <apex/ffn/inference/files/checkpoint/read.hpp>
#include <apex/ffn/kernels/fused_expert.hpp>

#include <catch2/catch.hpp>

#include <cstdint>
#include <type_traits>

#include "gradcheck.hpp"

using namespace apex;
using namespace apex::packed;
using apex::test::random_matrix;

namespace {
template <class T, class = void>
struct complete : std::false_type {};
template <class T>
struct complete<T, std::void_t<decltype(sizeof(T))>> : std::true_type {};
}  // namespace

// A value outside the list has no entry and no tiles: using it is a compile
// error, not a silent default (this is what the primary templates buy).
static_assert(!complete<WeightType<Dtype(100)>>::value, "a type without an entry must stay incomplete");
static_assert(!complete<apex::packed::detail::Tiles<Dtype(100), Isa::avx2>>::value, "no tiles without an entry");
static_assert(complete<WeightType<Dtype::f32>>::value && complete<WeightType<Dtype::bf16>>::value);
#if APEX_PACKED_X86
static_assert(complete<apex::packed::detail::Tiles<Dtype::f32, Isa::avx2>>::value &&
              complete<apex::packed::detail::Tiles<Dtype::bf16, Isa::avx512>>::value);
#endif
static_assert(dtype_of<float>() == Dtype::f32 && dtype_of<bf16>() == Dtype::bf16 && dtype_of<f16>() == Dtype::f16);
static_assert(packed_dtype<float>() == Dtype::f32 && packed_dtype<bf16>() == Dtype::bf16);
static_assert(std::is_same_v<WeightType<Dtype::bf16>::Element, bf16>);

TEST_CASE("weight-type table entries: names and bytes per weight", "[weight_types]") {
  CHECK(std::string(dtype_name(Dtype::f32)) == "f32");
  CHECK(std::string(dtype_name(Dtype::bf16)) == "bf16");
  CHECK(std::string(dtype_name(Dtype::f16)) == "f16");
  CHECK(dtype_names() == "f32, bf16, q8_0, q4_0, q4_k, q6_k, mxfp4, f16");
  CHECK(bytes_per_weight(Dtype::f32) == 4.0);
  CHECK(bytes_per_weight(Dtype::bf16) == 2.0);
  CHECK(bytes_per_weight(Dtype::f16) == 2.0);
  CHECK(file_dtypes().size() == 2);
}

TEST_CASE("a dtype outside the table is a ConfigError at run time", "[weight_types][errors]") {
  CHECK_THROWS_WITH(dtype_name(Dtype(70)), Catch::Contains("dtype 70 is not in the weight-type table"));
  CHECK_THROWS_AS(PanelMatrix(Dtype(70), 4, 1), ConfigError);
  const Matrix<float> w = Matrix<float>::Ones(2, 3), wd = Matrix<float>::Ones(3, 2);  // f × d, d × f
  CHECK_THROWS_AS(PackedExpert(w, w, wd, Dtype(90)), ConfigError);
}

TEST_CASE("expert bytes come from the table and equal the packed panels", "[weight_types]") {
  // Panel arithmetic written out once here: gate/up ⌈f/16⌉ panels over d, down ⌈d/32⌉ panels over f,
  // 32 lanes, 4 bytes (f32) or 2 bytes with K padded to even (bf16).
  struct Case {
    Index d, f;
    std::uint64_t f32, bf16;
  };
  for (const Case c : {Case{19, 37, 3 * 19 * 32 * 4 + 1 * 37 * 32 * 4, 3 * 20 * 32 * 2 + 1 * 38 * 32 * 2},
                       Case{1, 1, 1 * 1 * 32 * 4 + 1 * 1 * 32 * 4, 1 * 2 * 32 * 2 + 1 * 2 * 32 * 2},
                       Case{64, 96, 6 * 64 * 32 * 4 + 2 * 96 * 32 * 4, 6 * 64 * 32 * 2 + 2 * 96 * 32 * 2}}) {
    INFO("d " << c.d << " f " << c.f);
    CHECK(std::uint64_t(apex::detail::inference::packed_expert_bytes("t", Dtype::f32, c.d, c.f)) == c.f32);
    CHECK(std::uint64_t(apex::detail::inference::packed_expert_bytes("t", Dtype::bf16, c.d, c.f)) == c.bf16);
    const Matrix<float> wg = random_matrix(c.f, c.d, 1).cast<float>(), wu = random_matrix(c.f, c.d, 2).cast<float>();
    const Matrix<float> wd = random_matrix(c.d, c.f, 3).cast<float>();
    CHECK(PackedExpert(wg, wu, wd, Dtype::f32).bytes() == c.f32);
    CHECK(PackedExpert(wg, wu, wd, Dtype::bf16).bytes() == c.bf16);
  }
  CHECK_THROWS_WITH(apex::detail::inference::packed_expert_bytes("where", Dtype::f32, Index(1) << 40, Index(1) << 40),
                    Catch::Contains("where"));
}

TEST_CASE("panels pack rows through the table and carry a scale array", "[weight_types]") {
  const Index K = 7;
  const Matrix<float> w = random_matrix(3, K, 4).cast<float>();  // 3 lanes × K
  for (const Dtype t : {Dtype::f32, Dtype::bf16}) {
    INFO("dtype " << dtype_name(t));
    PanelMatrix pm(t, K, 2);
    CHECK(pm.k() == K);
    CHECK(pm.k_padded() == (t == Dtype::bf16 ? 8 : 7));
    CHECK(pm.bytes() == std::size_t(2 * pm.k_padded() * 32 * (t == Dtype::f32 ? 4 : 2)));  // no scales
    for (Index l = 0; l < 3; ++l) pm.pack_row(1, 5 + l, w.row(l).data());
    for (Index l = 0; l < 3; ++l)
      for (Index k = 0; k < K; ++k) {
        const float want = t == Dtype::f32 ? w(l, k) : round_to_bf16(w(l, k));
        CHECK(pm.get(1, k, 5 + l) == want);
        CHECK(pm.get(0, k, 5 + l) == 0.0f);  // other panel untouched
      }
    for (Index k = 0; k < pm.k_padded(); ++k) CHECK(pm.get(1, k, 4) == 0.0f);  // other lanes zero
    CHECK(reinterpret_cast<std::uintptr_t>(t == Dtype::f32 ? static_cast<const void*>(pm.f32_panel(1))
                                                           : static_cast<const void*>(pm.bf16_panel(1))) % 64 == 0);
    CHECK(pm.scales(1) == pm.scales(0));  // f32 and bf16 blocks hold no scale bytes
  }
}

TEST_CASE("the packed loader's dtype list comes from the table", "[weight_types][load]") {
  CHECK(apex::detail::inference::packed_file_dtype_names() == "F32, F64 and BF16");
  CHECK(apex::detail::inference::packed_file_dtype(safetensors::DType::BF16));
  CHECK_FALSE(apex::detail::inference::packed_file_dtype(safetensors::DType::F16));
  CHECK_FALSE(apex::detail::inference::packed_file_dtype(safetensors::DType::I8));
}

TEST_CASE("every path runs each table type to the same bits", "[weight_types][paths]") {
  const Index d = 19, f = 37;
  const Matrix<float> wg = random_matrix(f, d, 5).cast<float>(), wu = random_matrix(f, d, 6).cast<float>();
  const Matrix<float> wd = random_matrix(d, f, 7).cast<float>();
  const Matrix<float> x = random_matrix(13, d, 8).cast<float>();
  for (const Dtype t : {Dtype::f32, Dtype::bf16}) {
    const PackedExpert e(wg, wu, wd, t);
    const Matrix<float> ref = forward(e, x, {Isa::scalar});
    for (const Isa isa : kAllIsas) {
      if (!cpu_supports(isa)) continue;
      INFO("dtype " << dtype_name(t) << " path " << isa_name(isa));
      CHECK(forward(e, x, {isa}) == ref);
    }
  }
}
