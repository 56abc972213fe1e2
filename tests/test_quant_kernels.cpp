// The block formats on the packed engine (kernels/quant_types.hpp,
// kernels/quant_k_types.hpp, kernels/arch/avx2_quant.hpp): a file row goes
// into a panel and comes back bit for bit, packing from float is ggml's
// quantizer, every kernel path gives the scalar path's bits, and the
// expert equals a reference built from the dequantized weights and the
// quantized activations.
#include <apex/ffn/kernels/fused_expert.hpp>
#include <apex/ffn/quant/formats.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "gradcheck.hpp"
#include "sweep.hpp"

using namespace apex;
using namespace apex::packed;
using apex::test::random_matrix;

namespace {

constexpr Dtype kQuantTypes[] = {Dtype::q8_0, Dtype::q4_0, Dtype::mxfp4, Dtype::q4_k, Dtype::q6_k};

Index block_of(Dtype t) {
  return visit_dtype(t, [](auto tag) { return WeightType<decltype(tag)::value>::kBlockWeights; });
}

/// The ggml blocks of every row of w (rows × K), back to back: what a GGUF
/// tensor of type t holds.
std::vector<std::byte> file_tensor(Dtype t, const Matrix<float>& w) {
  return visit_dtype(t, [&](auto tag) {
    using W = WeightType<decltype(tag)::value>;
    std::vector<std::byte> out;
    if constexpr (W::kQuantized) {
      const Index per_row = w.cols() / W::kBlockWeights;
      std::vector<typename W::Block> blocks(std::size_t(per_row * w.rows()));
      for (Index r = 0; r < w.rows(); ++r) W::quantize(w.row(r).data(), blocks.data() + r * per_row, w.cols());
      out.resize(blocks.size() * sizeof(typename W::Block));
      std::memcpy(out.data(), blocks.data(), out.size());
    }
    return out;
  });
}

/// Weights with a spread of block scales, a zero row and an outlier, so
/// every scale plane and sub-block scale is exercised.
Matrix<float> weights(Index rows, Index cols, unsigned seed) {
  Matrix<float> w = random_matrix(rows, cols, seed).cast<float>();  // rows × cols
  for (Index r = 0; r < rows; ++r) w.row(r) *= float(0.25 + 0.5 * std::sin(0.7 * double(r)) * std::sin(0.7 * double(r)));
  for (Index c = 0; c < cols; ++c) w.col(c) *= float(1.0 + 0.9 * std::cos(0.05 * double(c)));
  if (rows > 2) w.row(1).setZero();
  w(0, cols / 2) = 3.5f;
  return w;
}

/// The quantize → dequantize image of x under activation format fmt.
Matrix<float> act_image(ActivationFormat fmt, const Matrix<float>& x) {
  Matrix<float> out(x.rows(), x.cols());  // N × K
  std::vector<std::int8_t> q(std::size_t(x.cols()));
  std::vector<float> d(std::size_t(x.cols()));
  std::vector<std::int32_t> s(std::size_t(x.cols()));
  const Index block = fmt == ActivationFormat::q8_0 ? 32 : 256;
  for (Index r = 0; r < x.rows(); ++r) {
    packed::detail::quantize_row(fmt, x.row(r).data(), x.cols(), q.data(), d.data(), s.data());
    for (Index k = 0; k < x.cols(); ++k) out(r, k) = float(q[std::size_t(k)]) * d[std::size_t(k / block)];
  }
  return out;
}

/// x as the products of a type-t matrix read it: quantized for a block
/// format, exact for f32 and bf16.
Matrix<float> as_read(Dtype t, const Matrix<float>& x) {
  return visit_dtype(t, [&](auto tag) {
    using W = WeightType<decltype(tag)::value>;
    if constexpr (W::kQuantized) return act_image(W::kActivation, x);
    else return x;
  });
}

/// The expert computed in double from the dequantized weights, with each
/// product's activations replaced by their quantized image (as the kernels
/// multiply them).
Matrix<float> reference(const PackedExpert& e, const Matrix<float>& x) {
  const Matrix<double> wg = e.w_gate().cast<double>(), wu = e.w_up().cast<double>(), wd = e.w_down().cast<double>();
  const Matrix<double> xq = as_read(e.dtypes().gate_up, x).cast<double>();  // N × d
  const Matrix<double> g = xq * wg.transpose(), u = xq * wu.transpose();                  // N × f
  const Matrix<double> a = (g.array() / (1.0 + (-g.array()).exp()) * u.array()).matrix();
  const Matrix<double> aq = as_read(e.dtypes().down, a.cast<float>()).cast<double>();
  return (aq * wd.transpose()).cast<float>();  // N × d
}

double rel_err(const Matrix<float>& a, const Matrix<float>& b) {
  return (a.cast<double>() - b.cast<double>()).norm() / b.cast<double>().norm();
}

/// Runs f(isa) on every SIMD path this CPU has, and says which it skipped.
template <class F>
void on_simd_paths(F&& f) {
  for (const Isa isa : kAllIsas) {
    if (isa == Isa::scalar) continue;
    if (!cpu_supports(isa)) {
      WARN("kernel path " << isa_name(isa) << " skipped: this CPU does not support it");
      continue;
    }
    f(isa);
  }
}

bool same_bits(const Matrix<float>& a, const Matrix<float>& b) {
  return a.rows() == b.rows() && a.cols() == b.cols() &&
         std::memcmp(a.data(), b.data(), std::size_t(a.size()) * sizeof(float)) == 0;
}

}  // namespace

TEST_CASE("block formats: a file row goes into panels and back bit for bit", "[quant][layout]") {
  for (const Dtype t : kQuantTypes) {
    CAPTURE(dtype_name(t));
    const Index B = block_of(t), d = 2 * B, f = B == 32 ? 96 : 256;
    const Matrix<float> wg = weights(f, d, 1), wu = weights(f, d, 2), wd = weights(d, f, 3);
    const auto g = file_tensor(t, wg), u = file_tensor(t, wu), dn = file_tensor(t, wd);
    const PackedExpert e = PackedExpert::from_file_rows(d, f, t, g.data(), u.data(), dn.data());
    std::vector<std::byte> g2(g.size()), u2(u.size()), d2(dn.size());
    e.file_rows(g2.data(), u2.data(), d2.data());
    CHECK(g2 == g);
    CHECK(u2 == u);
    CHECK(d2 == dn);
    // packing from float is the ggml quantizer, row by row
    const PackedExpert from_float(wg, wu, wd, t);
    from_float.file_rows(g2.data(), u2.data(), d2.data());
    CHECK(g2 == g);
    CHECK(d2 == dn);
    // the bytes of the packed panels are the file's bytes (plus padding lanes)
    CHECK(e.bytes() >= g.size() + u.size() + dn.size());
    CHECK(double(e.bytes()) == Approx(bytes_per_weight(t) * double(32 * ((f + 15) / 16) * d + 32 * ((d + 31) / 32) * f)));
  }
}

TEST_CASE("block formats: Q6_K panels hold each group's codes together, at the documented bytes", "[quant][layout]") {
  // kernels/quant_k_types.hpp: per group of 16 weights 384 bytes, its 4-bit
  // codes (k counted from the group) and then its 2-bit parts.
  using W = WeightType<Dtype::q6_k>;
  W::Block blk{};
  const auto code_of = [](Index k) { return unsigned(k * 7 + 3) % 64; };
  for (Index k = 0; k < 256; ++k) W::set_file_code(blk, k, code_of(k));
  std::vector<std::byte> codes(std::size_t(kPanelLanes * W::kCodeBytes)), scales(std::size_t(kPanelLanes * W::kScaleBytes));
  const Index lane = 13;
  W::put_block(blk, 0, lane, codes.data(), scales.data());
  for (Index k = 0; k < 256; ++k) {
    CAPTURE(k);
    const Index group = 384 * (k / 16), kk = k % 16;
    const unsigned low = (unsigned(codes[std::size_t(group + 128 * (kk / 8) + 4 * lane + k % 4)]) >> (k & 4)) & 0xFu;
    const unsigned high = (unsigned(codes[std::size_t(group + 256 + 4 * lane + k % 4)]) >> (2 * (kk / 4))) & 3u;
    CHECK((low | high << 4) == code_of(k));
  }
  std::size_t set = 0;  // the other lanes' bytes are untouched
  for (std::byte b : codes) set += b != std::byte{0};
  CHECK(set <= std::size_t(16 * (4 * 2 + 4)));
  CHECK(W::get_block(codes.data(), scales.data(), 0, lane).ql[5] == blk.ql[5]);
}

TEST_CASE("block formats: unpacked weights are ggml's dequantized values", "[quant][layout]") {
  for (const Dtype t : kQuantTypes) {
    CAPTURE(dtype_name(t));
    const Index B = block_of(t), d = B == 32 ? 64 : 512, f = B == 32 ? 96 : 256;
    const Matrix<float> wg = weights(f, d, 4), wu = weights(f, d, 5), wd = weights(d, f, 6);
    const PackedExpert e(wg, wu, wd, t);
    visit_dtype(t, [&](auto tag) {
      using W = WeightType<decltype(tag)::value>;
      if constexpr (W::kQuantized) {
        std::vector<typename W::Block> blocks(std::size_t(d / B));
        std::vector<float> row(static_cast<std::size_t>(d));
        const Matrix<float> got = e.w_up();  // f × d
        for (Index j = 0; j < f; ++j) {
          W::quantize(wu.row(j).data(), blocks.data(), d);
          W::dequantize(blocks.data(), row.data(), d);
          REQUIRE(std::memcmp(row.data(), got.row(j).data(), row.size() * sizeof(float)) == 0);
        }
        // and the quantization error is the format's: a few % of the weights' norm at most
        CHECK(rel_err(got, wu) < (t == Dtype::q8_0 ? 0.01 : t == Dtype::q6_k ? 0.02 : 0.12));
      }
    });
  }
}

TEST_CASE("block formats: every kernel path gives the scalar path's bits", "[quant][isa]") {
  struct Shape {
    Index d, f;
  };
  for (const Dtype t : kQuantTypes) {
    const Index B = block_of(t);
    const std::vector<Shape> shapes =
        B == 32 ? std::vector<Shape>{{32, 32}, {96, 160}, {224, 96}} : std::vector<Shape>{{256, 256}, {512, 768}};
    for (const Shape s : shapes) {
      CAPTURE(dtype_name(t), s.d, s.f);
      const PackedExpert e(weights(s.f, s.d, 7), weights(s.f, s.d, 8), weights(s.d, s.f, 9), t);
      for (const Index m : {Index(1), Index(2), Index(3), Index(4), Index(5), Index(6), Index(9), Index(37)}) {
        const Matrix<float> x = random_matrix(m, s.d, std::uint64_t(10 + m)).cast<float>();  // m × d
        const Matrix<float> want = forward(e, x, {Isa::scalar});
        on_simd_paths([&](Isa isa) {
          CAPTURE(isa_name(isa), m);
          CHECK(same_bits(forward(e, x, {isa}), want));
        });
        // a row's bits do not depend on the other rows of the call
        if (m > 1) CHECK(same_bits(forward(e, x.bottomRows(1), {kDefaultIsa}), forward(e, x, {kDefaultIsa}).bottomRows(1)));
        // The reference forms A in double, the kernels in float: an element of A
        // that sits at a rounding boundary of its activation code can take the
        // neighbouring code (one step, ≈ 1/127 of its block's largest |a|), so
        // the two agree to ~1e-4, not to the last bit; a wrong block or scale
        // gives errors of 1e-2 and more.
        CHECK(rel_err(want, reference(e, x)) < 1e-3);
      }
    }
  }
}

namespace {
/// A type-t tensor of `rows` rows × K whose codes are random bytes (so every
/// code of the format occurs, Q8_0's −128 included, which ggml's quantizer
/// never writes but a file may hold) and whose scales are small and finite.
std::vector<std::byte> extreme_tensor(Dtype t, Index rows, Index K, std::uint32_t seed) {
  return visit_dtype(t, [&](auto tag) {
    using W = WeightType<decltype(tag)::value>;
    std::vector<std::byte> out;
    if constexpr (W::kQuantized) {
      std::vector<typename W::Block> blocks(std::size_t(rows * K / W::kBlockWeights));
      std::uint32_t state = seed;
      for (auto& blk : blocks) {
        auto* bytes = reinterpret_cast<unsigned char*>(&blk);
        for (std::size_t i = 0; i < sizeof blk; ++i) bytes[i] = static_cast<unsigned char>((state = state * 1664525u + 1013904223u) >> 24);
        const std::uint16_t small = quant::fp32_to_fp16(float(1 + (state >> 28)) * 1e-3f);
        if constexpr (decltype(tag)::value == Dtype::mxfp4) blk.e = std::uint8_t(118 + (state >> 29));
        else blk.d = small;
        if constexpr (decltype(tag)::value == Dtype::q4_k) blk.dmin = small;
      }
      out.resize(blocks.size() * sizeof(typename W::Block));
      std::memcpy(out.data(), blocks.data(), out.size());
    }
    return out;
  });
}
}  // namespace

TEST_CASE("block formats: extreme codes and activations give the scalar path's bits on every path",
          "[quant][isa]") {
  // Activations of ±1 and ±0.5, the first of each block negative: Q8_0
  // codes ±127 and Q8_K codes −128 and 127, the largest products every
  // integer step of the SIMD tiles must hold without saturating.
  for (const Dtype t : kQuantTypes) {
    const Index B = block_of(t), d = 2 * B, f = B == 32 ? 96 : 256;
    const auto g = extreme_tensor(t, f, d, 21), u = extreme_tensor(t, f, d, 22), dn = extreme_tensor(t, d, f, 23);
    const PackedExpert e = PackedExpert::from_file_rows(d, f, t, g.data(), u.data(), dn.data());
    Matrix<float> x(23, d);  // 23 × d: AMX-INT8 tiles (16 rows and more) on amx_bf16
    for (Index r = 0; r < x.rows(); ++r)
      for (Index k = 0; k < d; ++k) x(r, k) = (k % 32 == 0 || (k * 7 + r) % 3 == 0 ? -1.0f : 1.0f) * (r % 2 ? 0.5f : 1.0f);
    CAPTURE(dtype_name(t));
    const Matrix<float> want = forward(e, x, {Isa::scalar});
    REQUIRE(want.allFinite());
    CHECK(rel_err(want, reference(e, x)) < 1e-3);
    on_simd_paths([&](Isa isa) {
      CAPTURE(isa_name(isa));
      CHECK(same_bits(forward(e, x, {isa}), want));
    });
  }
}

TEST_CASE("block formats: gate/up and down of different types", "[quant][mixed]") {
  const Index d = 512, f = 256;
  const Matrix<float> wg = weights(f, d, 11), wu = weights(f, d, 12), wd = weights(d, f, 13);
  const Matrix<float> x = random_matrix(5, d, 14).cast<float>();  // 5 × d
  const Matrix<float> exact = forward(PackedExpert(wg, wu, wd, Dtype::f32), x);
  for (const ExpertDtypes types : {ExpertDtypes(Dtype::q4_k, Dtype::q6_k), ExpertDtypes(Dtype::q8_0, Dtype::bf16),
                                   ExpertDtypes(Dtype::f32, Dtype::q4_0), ExpertDtypes(Dtype::mxfp4, Dtype::q8_0)}) {
    CAPTURE(dtypes_name(types));
    const PackedExpert e(wg, wu, wd, types);
    CHECK(e.dtypes() == types);
    CHECK(e.gate_up().dtype() == types.gate_up);
    CHECK(e.down().dtype() == types.down);
    const Matrix<float> y = forward(e, x, {Isa::scalar});
    CHECK(rel_err(y, reference(e, x)) < 1e-3);  // as in the test above
    CHECK(rel_err(y, exact) < 0.15);
    for (const Isa isa : kAllIsas)
      if (isa != Isa::scalar && cpu_supports(isa)) CHECK(same_bits(forward(e, x, {isa}), y));
  }
  CHECK(dtypes_name({Dtype::q4_k, Dtype::q6_k}) == "q4_k/q6_k");
  CHECK(dtypes_name(Dtype::q8_0) == "q8_0");
}

TEST_CASE("block formats: rows that are not whole blocks are a ConfigError", "[quant][errors]") {
  const Matrix<float> w = Matrix<float>::Ones(32, 300), wd = Matrix<float>::Ones(300, 32);  // f × d, d × f
  CHECK_THROWS_AS(PackedExpert(w, w, wd, Dtype::q4_k), ConfigError);
  CHECK_THROWS_WITH(PackedExpert(w, w, wd, Dtype::q4_k),
                    Catch::Contains("reduction length 300 is not a multiple of 256, the q4_k block"));
  const Matrix<float> w33 = Matrix<float>::Ones(32, 33), wd33 = Matrix<float>::Ones(33, 32);
  CHECK_THROWS_WITH(PackedExpert(w33, w33, wd33, Dtype::q8_0),
                    Catch::Contains("reduction length 33 is not a multiple of 32, the q8_0 block"));
  // d a multiple of 32 but f not: the down matrix's rows are the ones refused
  const Matrix<float> wf = Matrix<float>::Ones(40, 64), wdf = Matrix<float>::Ones(64, 40);
  CHECK_THROWS_WITH(PackedExpert(wf, wf, wdf, Dtype::mxfp4), Catch::Contains("reduction length 40"));
  CHECK_THROWS_AS(PanelMatrix(Dtype::q8_0, 64, 1).offset(0, 0), ConfigError);
}

TEST_CASE("block formats: non-finite weights are refused, non-finite activations give NaN rows", "[quant][errors]") {
  for (const Dtype t : kQuantTypes) {
    CAPTURE(dtype_name(t));
    const Index B = block_of(t), d = B, f = B;
    Matrix<float> wg = weights(f, d, 15);
    const Matrix<float> wu = weights(f, d, 16), wd = weights(d, f, 17);
    const PackedExpert e(wg, wu, wd, t);
    Matrix<float> x = random_matrix(3, d, 18).cast<float>();  // 3 × d
    x(1, 5) = std::numeric_limits<float>::quiet_NaN();
    for (const Isa isa : {Isa::scalar, kDefaultIsa}) {
      const Matrix<float> y = forward(e, x, {isa});
      CHECK(y.row(0).allFinite());
      CHECK(y.row(2).allFinite());
      CHECK(y.row(1).array().isNaN().all());
    }
    wg(3, 7) = std::numeric_limits<float>::infinity();
    CHECK_THROWS_AS(PackedExpert(wg, wu, wd, t), ValueError);
    CHECK_THROWS_WITH(PackedExpert(wg, wu, wd, t),
                      Catch::Contains(std::string("packing weights as ") + dtype_name(t) + ": weight 7 of a row is inf"));
  }
}

namespace {
/// Activation rows that reach every branch of the two activation
/// quantizers: exact ties of both roundings, a largest |x| held by two
/// elements of opposite sign, zero, −0, NaN and Inf blocks, scales too small
/// to invert, the largest floats, and ordinary values of every magnitude.
Matrix<float> activation_cases(Index block, Index blocks) {
  Matrix<float> x = random_matrix(12, block * blocks, 31).cast<float>();  // 12 × K
  const float tiny = std::numeric_limits<float>::denorm_min(), inf = std::numeric_limits<float>::infinity();
  for (Index r = 0; r < x.rows(); ++r) {
    float* row = x.row(r).data();
    for (Index k = 0; k < x.cols(); ++k) row[k] *= std::pow(10.0f, float(r % 7) * 3.0f - 9.0f);
  }
  auto blk = [&](Index r, Index b) { return x.row(r).data() + b * block; };
  for (Index b = 0; b < blocks; ++b)  // row 0: ties (Q8_0: largest 127 gives id 1; Q8_K: max −127 gives iscale 1)
    for (Index k = 0; k < block; ++k) blk(0, b)[k] = k == 0 ? -127.0f : float(k % 60) - 29.5f;
  for (Index b = 0; b < blocks; ++b)  // row 1: the same with largest +127 (Q8_K: iscale −1)
    for (Index k = 0; k < block; ++k) blk(1, b)[k] = k == 1 ? 127.0f : 0.5f + float(k % 9) * (k % 2 ? 1.0f : -1.0f);
  for (Index b = 0; b < blocks; ++b) {  // row 2: |max| twice, signs either way round
    blk(2, b)[3] = (b % 2 ? -1 : 1) * 40.0f;
    blk(2, b)[block - 2] = (b % 2 ? 1 : -1) * 40.0f;
  }
  x.row(3).setZero();                                 // all-zero blocks
  x.row(4).setConstant(-0.0f);                        // −0
  blk(5, 0)[5] = std::numeric_limits<float>::quiet_NaN();
  blk(5, blocks - 1)[block - 1] = -inf;
  x.row(6) /= x.row(6).cwiseAbs().maxCoeff();  // largest |x| 1: then 1e-38, where 1/d overflows
  x.row(6) *= 1e-38f;
  x.row(7).setConstant(tiny);
  blk(7, 0)[0] = -tiny;
  x.row(8) /= x.row(8).cwiseAbs().maxCoeff();  // largest |x| 1: then 1e38, near FLT_MAX (3.4e38)
  x.row(8) *= 1e38f;
  return x;
}
}  // namespace

TEST_CASE("activation quantizers: every path gives the reference quantizers' bytes", "[quant][isa][activations]") {
  for (const ActivationFormat fmt : {ActivationFormat::q8_0, ActivationFormat::q8_k}) {
    const Index block = fmt == ActivationFormat::q8_0 ? 32 : 256, blocks = fmt == ActivationFormat::q8_0 ? 37 : 5;
    const Matrix<float> x = activation_cases(block, blocks);  // 12 × K
    const Index K = x.cols();
    CAPTURE(fmt == ActivationFormat::q8_0 ? "q8_0" : "q8_k");
    for (Index r = 0; r < x.rows(); ++r) {
      CAPTURE(r);
      const auto nk = static_cast<std::size_t>(K), nb = static_cast<std::size_t>(blocks);
      std::vector<std::int8_t> q0(nk), q(nk);
      std::vector<float> d0(nb), d(nb);
      std::vector<std::int32_t> s0(nk / 16), s(nk / 16);
      packed::detail::quantize_row(fmt, x.row(r).data(), K, q0.data(), d0.data(), s0.data());
      if (r == 0) {  // the ties are ties: Q8_0 rounds them away from zero, Q8_K to even
        const bool away = fmt == ActivationFormat::q8_0;
        CHECK(int(q0[1]) == (away ? -29 : -28));  // −28.5
        CHECK(int(q0[3]) == (away ? -27 : -26));  // −26.5
      }
      on_simd_paths([&](Isa isa) {
        CAPTURE(isa_name(isa));
        packed::detail::quantize_row(isa, fmt, x.row(r).data(), K, q.data(), d.data(), s.data());
        CHECK(std::memcmp(q.data(), q0.data(), q.size()) == 0);
        CHECK(std::memcmp(d.data(), d0.data(), d.size() * sizeof(float)) == 0);
        CHECK(s == s0);
      });
    }
  }
}

#if APEX_PACKED_X86
TEST_CASE("activation quantizers: the vector step takes ordinary blocks and hands the rest to the reference",
          "[quant][isa][activations]") {
  // The byte comparison above would pass if every block fell back to the
  // reference; this checks which blocks the vector step itself quantizes.
  if (!cpu_supports(Isa::avx2)) {
    WARN("kernel path avx2 skipped: this CPU does not support it");
    return;
  }
  std::int8_t q[256];
  float d = 0;
  const Matrix<float> x0 = activation_cases(32, 1), xk = activation_cases(256, 1);  // 12 × 32, 12 × 256
  for (const Index r : {0, 1, 2, 3, 4, 8, 9, 10, 11}) {
    CAPTURE(r);
    CHECK(packed::detail::quantize_q8_0_block_avx2(x0.row(r).data(), q, &d));
    CHECK(packed::detail::quantize_q8_k_block_avx2(xk.row(r).data(), q, &d));
  }
  for (const Index r : {5, 6}) {  // NaN and −Inf; 1/d overflows
    CAPTURE(r);
    CHECK_FALSE(packed::detail::quantize_q8_0_block_avx2(x0.row(r).data(), q, &d));
    CHECK_FALSE(packed::detail::quantize_q8_k_block_avx2(xk.row(r).data(), q, &d));
  }
  CHECK_FALSE(packed::detail::quantize_q8_k_block_avx2(xk.row(7).data(), q, &d));  // −127/denorm overflows
}
#endif

namespace {
/// w[i] = a·((i mod 7) − 3)/3 for one block of B: ±a, ±2a/3, ±a/3, 0 (the
/// fixed vector of the scale-range boundaries below).
void ramp_block(float a, Index B, float* w) {
  for (Index i = 0; i < B; ++i) w[i] = a * (float((i % 7) - 3) / 3.0f);
}
float float_of_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
/// A B × 2B gate matrix whose row 2, block 1 is ramp_block(a), the rest small.
Matrix<float> gate_with_block(float a, Index B) {
  Matrix<float> w = Matrix<float>::Constant(B, 2 * B, 0.25f);  // f × d, f = B
  ramp_block(a, B, w.row(2).data() + B);
  return w;
}
}  // namespace

TEST_CASE("block formats: a block beyond the format's range is refused when packed, naming the row and block",
          "[quant][errors][regression]") {
  // kernels/quant_types.hpp packed finite weights whose block scale left
  // fp16's range (Q8_0 from |w| ≈ 8.3e6: d = 65520 → Inf) into panels whose
  // outputs were Inf or NaN, and Q4_K/Q6_K blocks of |w| ≳ 1e13 (whose
  // search's sums overflow) as zeros. BlockFormat::check_range refuses them.
  // The boundaries are ggml's quantizers' on ramp_block: the largest a whose
  // stored scales are finite, and the next float.
  struct Bound {
    Dtype t;
    std::uint32_t ok, refused;  // float bits
    const char* scale;
  };
  const Bound bounds[] = {
      {Dtype::q8_0, 0x4afdf01fu, 0x4afdf020u, "its scale d = inf in fp16"},     // 8321039.5, 8321040
      {Dtype::q4_0, 0x48ffefffu, 0x48fff000u, "its scale d = inf in fp16"},     // 524159.97, 524160
      {Dtype::q4_k, 0x4a812c8eu, 0x4a812c8fu, "its scale dmin = inf in fp16"},  // 4232775, 4232775.5
      {Dtype::q6_k, 0x4d7c15bau, 0x4d7c15bbu, "its scale d = inf in fp16"}};    // 264330144, 264330160
  for (const Bound& b : bounds) {
    CAPTURE(dtype_name(b.t));
    const Index B = block_of(b.t), d = 2 * B, f = B;
    const Matrix<float> wu = Matrix<float>::Constant(f, d, 0.5f), wd = Matrix<float>::Constant(d, f, 0.5f);
    const PackedExpert ok(gate_with_block(float_of_bits(b.ok), B), wu, wd, b.t);
    CHECK(ok.w_gate().allFinite());
    CHECK(ok.w_gate()(2, B) == Approx(-float_of_bits(b.ok)).epsilon(0.05));  // −a, held
    const std::string got =
        test::outcome([&] { (void)PackedExpert(gate_with_block(float_of_bits(b.refused), B), wu, wd, b.t); });
    test::expect(got, "ValueError",
                 {"PackedExpert: w_gate row 2: packing weights as " + std::string(dtype_name(b.t)) +
                      ": block 1 (weights " + std::to_string(B) + ".." + std::to_string(2 * B - 1) + ")",
                  "beyond the format's range", b.scale, "values would not be finite"});
  }
  // K-quants above 2^32: refused before the search (Q6_K gave a zero block for 1e13).
  for (const Dtype t : {Dtype::q4_k, Dtype::q6_k}) {
    CAPTURE(dtype_name(t));
    Matrix<float> w = Matrix<float>::Constant(1, 256, 0.0f);
    ramp_block(1e13f, 256, w.data());
    PanelMatrix pm(t, 256, 1);
    test::expect(test::outcome([&] { pm.pack_row(0, 0, w.data()); }), "ValueError",
                 {"block 0", "no finite scale of the format reaches it"});
    ramp_block(4294967296.0f, 256, w.data());
    test::expect(test::outcome([&] { pm.pack_row(0, 0, w.data()); }), "ValueError", {"largest |w| = 4.29497e+09"});
  }
  // MXFP4: no finite float row leaves its range (e ≤ 252 up to the largest float).
  Matrix<float> top(1, 32);
  ramp_block(std::numeric_limits<float>::max(), 32, top.data());
  PanelMatrix mx(Dtype::mxfp4, 32, 1);
  mx.pack_row(0, 0, top.data());
  std::vector<float> back(32);
  mx.unpack_row(0, 0, back.data());
  for (float v : back) CHECK(std::isfinite(v));
  // f16 storage: the same rule per weight (|w| ≥ 65520 becomes Inf), as before.
  PanelMatrix h(Dtype::f16, 32, 1);
  std::vector<float> row(32, 65519.99f);
  h.pack_row(0, 0, row.data());
  row[5] = 65520.0f;
  test::expect(test::outcome([&] { h.pack_row(0, 0, row.data()); }), "ValueError", {"beyond the binary16 range"});
  // bf16 storage turned a finite weight past its range into Inf; now the same rule: 0x7F7F7FFF rounds to the
  // largest bf16, 0x7F7F8000 (the halfway point, a tie to even) to Inf.
  PanelMatrix b16(Dtype::bf16, 32, 1);
  std::vector<float> wide(32, -float_of_bits(0x7F7F7FFFu));
  b16.pack_row(0, 0, wide.data());
  b16.unpack_row(0, 0, back.data());
  CHECK(back[0] == -float_of_bits(0x7F7F0000u));
  wide[9] = -float_of_bits(0x7F7F8000u);
  test::expect(test::outcome([&] { b16.pack_row(0, 0, wide.data()); }), "ValueError",
               {"packed bf16: weight -3.39618e+38 at k = 9 is beyond the bfloat16 range"});
}

TEST_CASE("block formats: file blocks whose values would not be finite are refused as they move in",
          "[quant][errors][regression]") {
  // PanelMatrix::put_row moved any bytes: a GGUF or quantized-checkpoint
  // block with an fp16 scale of Inf or NaN, or an MXFP4 exponent whose
  // largest code overflows float, gave non-finite outputs.
  const auto put = [](Dtype t, const void* block) {
    return test::outcome([&] {
      PanelMatrix pm(t, block_of(t), 1);
      pm.put_row(0, 0, static_cast<const std::byte*>(block));
    });
  };
  for (const Dtype t : {Dtype::q8_0, Dtype::q4_0, Dtype::q6_k, Dtype::q4_k}) {
    CAPTURE(dtype_name(t));
    // The block's bytes: zero codes and scales; d (and Q4_K's dmin) set below.
    std::vector<unsigned char> blk(
        visit_dtype(t, [](auto tag) { return sizeof(typename WeightType<decltype(tag)::value>::Block); }));
    const std::size_t d_at = t == Dtype::q6_k ? blk.size() - 2 : 0;  // Q6_K's d is its last field
    const auto with_d = [&](std::uint16_t bits, std::size_t at) {
      std::vector<unsigned char> b = blk;
      std::memcpy(b.data() + at, &bits, 2);
      return b;
    };
    CHECK(put(t, with_d(0x7BFF, d_at).data()) == "returned");  // 65504, the largest half
    test::expect(
        put(t, with_d(0x7C00, d_at).data()), "ValueError",
        {"block 0 of a " + std::string(dtype_name(t)) + " row: its scale d = inf in fp16", "would not be finite"});
    test::expect(put(t, with_d(0x7E00, d_at).data()), "ValueError", {"its scale d = nan in fp16"});
    if (t == Dtype::q4_k)
      test::expect(put(t, with_d(0xFC00, 2).data()), "ValueError", {"its scale dmin = -inf in fp16"});
  }
  // MXFP4: 2^(e−128)·v for the doubled E2M1 value v; the last finite code of each top exponent, then the next.
  struct Case {
    std::uint8_t e, ok_code, bad_code;  // codes: v = 6 (code 5), 8 (6); 3 (3), 4 (4); 1 (1), 2 (2)
  };
  for (const Case c : {Case{253, 5, 6}, Case{254, 3, 4}, Case{255, 1, 2}}) {
    CAPTURE(int(c.e));
    quant::BlockMXFP4 b{};
    b.e = c.e;
    b.qs[7] = std::uint8_t(c.ok_code | (8 + c.ok_code) << 4);  // +v and −v
    CHECK(put(Dtype::mxfp4, &b) == "returned");
    CHECK(quant::mxfp4_block_finite(b));
    b.qs[3] = std::uint8_t(8 + c.bad_code);  // −v: the sign does not matter
    CHECK_FALSE(quant::mxfp4_block_finite(b));
    test::expect(put(Dtype::mxfp4, &b), "ValueError",
                 {"block 0 of a mxfp4 row: its E8M0 exponent e = " + std::to_string(c.e), "overflows float"});
  }
}

TEST_CASE("packing checks shapes before values, the same for every type", "[quant][errors][regression]") {
  // PackedExpert made Q4_K/Q6_K panels (ConfigError: reduction length)
  // before it compared the three shapes, while Q8_0 reported the shape; and
  // a block format's pack_row read the values before the row length. The
  // order is docs/error_model.md#order-of-checks: shapes (ShapeError), then
  // sizes for the type (ConfigError), then values (ValueError).
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // d = 64: not whole K-quant blocks
  Matrix<float> g = Matrix<float>::Ones(32, 64), u_bad = Matrix<float>::Ones(31, 64);
  const Matrix<float> u = Matrix<float>::Ones(32, 64), dn = Matrix<float>::Ones(64, 32);
  g(0, 0) = nan;
  for (const Dtype t :
       {Dtype::f32, Dtype::bf16, Dtype::f16, Dtype::q8_0, Dtype::q4_0, Dtype::mxfp4, Dtype::q4_k, Dtype::q6_k}) {
    CAPTURE(dtype_name(t));
    test::expect(test::outcome([&] { (void)PackedExpert(g, u_bad, dn, t); }), "ShapeError",
                 {"PackedExpert: argument 'w_up' has shape [31 x 64], expected [32 x 64]"});
    const std::string sizes_then_values = test::outcome([&] { (void)PackedExpert(g, u, dn, t); });
    if (t == Dtype::q4_k || t == Dtype::q6_k)
      test::expect(sizes_then_values, "ConfigError", {"reduction length 64 is not a multiple of 256"});
    else if (visit_dtype(t, [](auto tag) { return WeightType<decltype(tag)::value>::kQuantized; }))
      test::expect(sizes_then_values, "ValueError", {"PackedExpert: w_gate row 0: packing weights as", "is nan"});
  }
  std::vector<float> w(33, 1.0f);
  w[0] = nan;
  std::vector<std::byte> codes(4096), scales(4096);
  test::expect(test::outcome([&] { WeightType<Dtype::q8_0>::pack_row(w.data(), 33, 0, codes.data(), scales.data()); }),
               "ConfigError", {"reduction length 33 is not a multiple of 32"});
}
