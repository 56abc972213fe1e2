// The forward product with exact float activations y = x·Mᵀ of a packed
// matrix (kernels/dequantized_product.hpp) and its panel dequantizers
// (kernels/dequantize_panel.hpp, kernels/arch/avx2_dequantize_panel.hpp,
// kernels/arch/avx512_dequantize_panel.hpp): on every type and shape, any
// row count and every kernel path the CPU has, y is bit for bit a plain
// std::fma chain over PanelMatrix::unpack_row's values (so every path gives
// the scalar path's bits), and close to a double reference; rows copied
// apart (row strides a multiple of 4 KiB) give the same bits; the SIMD
// dequantizers write the portable one's bytes on extreme codes and scales;
// bad arguments are typed errors naming the problem.
#include <apex/ffn/kernels/dequantized_product.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "block_rows.hpp"

using namespace apex;
using namespace apex::packed;

namespace {
// The kernels group shares one anonymous namespace: these helpers live in their own.
namespace dequantized_test {

constexpr Dtype kTypes[] = {Dtype::f32, Dtype::bf16, Dtype::f16,  Dtype::q8_0,
                            Dtype::q4_0, Dtype::mxfp4, Dtype::q4_k, Dtype::q6_k};

bool quantized(Dtype t) {
  return visit_dtype(t, [](auto tag) { return WeightType<decltype(tag)::value>::kQuantized; });
}

/// Reduction lengths each type is tested at (block formats hold whole blocks).
std::vector<Index> lengths(Dtype t) {
  switch (t) {
    case Dtype::q8_0:
    case Dtype::q4_0:
    case Dtype::mxfp4: return {32, 96, 256};
    case Dtype::q4_k:
    case Dtype::q6_k: return {256, 512};
    default: return {1, 37, 64, 100};
  }
}

using test::block_row;

/// A matrix of `panels` panels of type t and reduction length K, every
/// lane filled: float types from normal floats (packed with the type's
/// rounding), block formats from block_row.
PanelMatrix make_matrix(Dtype t, Index K, Index panels, unsigned seed, bool extreme) {
  PanelMatrix pm(t, K, panels);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  for (Index o = 0; o < 32 * panels; ++o)
    visit_dtype(t, [&](auto tag) {
      constexpr Dtype T = decltype(tag)::value;
      if constexpr (WeightType<T>::kQuantized) {
        pm.put_row(o / 32, o % 32, block_row<T>(K, seed * 1000 + unsigned(o), extreme).data());
      } else {
        std::vector<float> w(static_cast<std::size_t>(K));
        for (auto& v : w) v = normal(rng);
        pm.pack_row(o / 32, o % 32, w.data());
      }
    });
  return pm;
}

/// M (32·panels × K): row 32p + l = pm.unpack_row(p, l).
std::vector<float> unpacked(const PanelMatrix& pm) {
  const Index K = pm.k(), O = 32 * pm.panels();
  std::vector<float> m(std::size_t(O * K));
  for (Index o = 0; o < O; ++o) pm.unpack_row(o / 32, o % 32, m.data() + o * K);
  return m;
}

/// Normal activations, rows × ldx (the stride padding too).
std::vector<float> activations(Index rows, Index ldx, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> x(std::size_t(rows * ldx));
  for (auto& v : x) v = normal(rng);
  return x;
}

/// The definition: y[r][o] = fma chain over k ascending from 0 (rows × n).
std::vector<float> fma_reference(const std::vector<float>& m, Index K, Index n, const std::vector<float>& x,
                                 Index ldx, Index rows) {
  std::vector<float> y(std::size_t(rows * n));
  for (Index r = 0; r < rows; ++r)
    for (Index o = 0; o < n; ++o) {
      float acc = 0.0f;
      for (Index k = 0; k < K; ++k) acc = std::fma(x[std::size_t(r * ldx + k)], m[std::size_t(o * K + k)], acc);
      y[std::size_t(r * n + o)] = acc;
    }
  return y;
}

/// Whether y is within fp32 summation error of the double product:
/// |y − Σ x·W| ≤ K·2⁻²⁴·Σ|x·W| + K·2⁻¹⁴⁹ entrywise.
bool near_double(const std::vector<float>& m, Index K, Index n, const std::vector<float>& x, Index ldx,
                 const std::vector<float>& y, Index rows) {
  for (Index r = 0; r < rows; ++r)
    for (Index o = 0; o < n; ++o) {
      double sum = 0, mag = 0;
      for (Index k = 0; k < K; ++k) {
        const double p = double(x[std::size_t(r * ldx + k)]) * double(m[std::size_t(o * K + k)]);
        sum += p;
        mag += std::fabs(p);
      }
      const double bound = double(K) * (std::ldexp(mag, -24) + std::ldexp(1.0, -149));
      if (!(std::fabs(double(y[std::size_t(r * n + o)]) - sum) <= bound)) return false;
    }
  return true;
}

bool same_bytes(const float* a, const float* b, Index n) {
  return n == 0 || std::memcmp(a, b, std::size_t(n) * sizeof(float)) == 0;
}

/// A NaN pattern written into y's row padding before the product, which
/// must find it unchanged.
constexpr std::uint32_t kSentinel = 0x7FC0BEEFu;

/// Runs the product on `isa` with y's row stride n + 5 and returns y
/// (rows × n, packed); `pad_intact` says whether y's stride padding kept
/// its sentinel.
std::vector<float> run_product(Isa isa, const PanelMatrix& pm, const std::vector<float>& x, Index ldx, Index rows,
                               Index n, bool& pad_intact) {
  const Index ldy = n + 5;
  float sentinel;
  std::memcpy(&sentinel, &kSentinel, sizeof sentinel);
  std::vector<float> y(std::size_t(rows * ldy), sentinel);
  dequantized_product(isa, pm, x.data(), ldx, rows, y.data(), ldy, n);
  std::vector<float> out(std::size_t(rows * n));
  pad_intact = true;
  for (Index r = 0; r < rows; ++r) {
    const float* row = y.data() + r * ldy;
    std::memcpy(out.data() + r * n, row, std::size_t(n) * sizeof(float));
    for (Index c = n; c < ldy; ++c) pad_intact = pad_intact && same_bytes(row + c, &sentinel, 1);
  }
  return out;
}

/// The paths this CPU runs, with a warning naming each one it does not.
std::vector<Isa> supported_paths() {
  std::vector<Isa> paths;
  for (const Isa isa : kAllIsas) {
    if (cpu_supports(isa)) paths.push_back(isa);
    else WARN("kernel path " << isa_name(isa) << " skipped: this CPU does not support it");
  }
  return paths;
}

}  // namespace dequantized_test
}  // namespace

TEST_CASE("dequantized product: y = x·Mᵀ is the fma chain over the stored weights, on every path",
          "[dequantized][kernels]") {
  namespace dt = dequantized_test;
  constexpr Index kRows[] = {0, 1, 5, 13, 33, 70};
  constexpr Index kMaxRows = 70;
  const std::vector<Isa> paths = dt::supported_paths();
  for (const Dtype t : dt::kTypes)
    for (const Index K : dt::lengths(t))
      for (Index panels = 1; panels <= 3; ++panels) {
        constexpr Index kMissing[] = {0, 5, 31};  // lanes past the n columns written
        const Index n = 32 * panels - kMissing[panels - 1], ldx = K + 3;
        CAPTURE(dtype_name(t), K, panels, n);
        const PanelMatrix pm = dt::make_matrix(t, K, panels, unsigned(K + panels), false);
        const std::vector<float> m = dt::unpacked(pm);
        const std::vector<float> x = dt::activations(kMaxRows, ldx, unsigned(7 * K + panels));
        const std::vector<float> ref = dt::fma_reference(m, K, n, x, ldx, kMaxRows);
        CHECK(dt::near_double(m, K, n, x, ldx, ref, kMaxRows));
        for (const Isa isa : paths)
          for (const Index rows : kRows) {
            CAPTURE(isa_name(isa), rows);
            bool pad_intact = false;
            const std::vector<float> y = dt::run_product(isa, pm, x, ldx, rows, n, pad_intact);
            CHECK(dt::same_bytes(y.data(), ref.data(), rows * n));
            CHECK(pad_intact);
          }
      }
}

TEST_CASE("dequantized product: x rows a multiple of 4 KiB apart (copied apart first) give the same bits",
          "[dequantized][kernels]") {
  namespace dt = dequantized_test;
  constexpr Index K = 1024, panels = 2, n = 64;
  for (const Dtype t : {Dtype::f32, Dtype::bf16, Dtype::q4_0, Dtype::q6_k}) {
    const PanelMatrix pm = dt::make_matrix(t, K, panels, 21, false);
    const std::vector<float> m = dt::unpacked(pm);
    for (const Index ldx : {K, 2 * K}) {
      // past kSpreadRowBlock rows: the rows are copied and multiplied a block at a time
      const Index max_rows = kSpreadRowBlock + 3;
      const std::vector<float> x = dt::activations(max_rows, ldx, unsigned(ldx));
      const std::vector<float> ref = dt::fma_reference(m, K, n, x, ldx, max_rows);
      Isa widest = Isa::scalar;
      for (const Isa isa : kAllIsas)
        if (cpu_supports(isa)) widest = isa;
      for (const Isa isa : kAllIsas) {
        if (!cpu_supports(isa)) continue;  // named by the first test case
        for (const Index rows : {Index(1), Index(2), Index(13), Index(70), max_rows}) {
          if (rows == max_rows && isa != widest && isa != Isa::scalar) continue;  // the blocking is not per path
          CAPTURE(dtype_name(t), ldx, isa_name(isa), rows);
          bool pad_intact = false;
          const std::vector<float> y = dt::run_product(isa, pm, x, ldx, rows, n, pad_intact);
          CHECK(dt::same_bytes(y.data(), ref.data(), rows * n));
          CHECK(pad_intact);
        }
      }
    }
  }
}

TEST_CASE("dequantized product: the SIMD panel dequantizers write the portable one's bytes on extreme codes and "
          "scales",
          "[dequantized][kernels]") {
  namespace dt = dequantized_test;
  namespace pd = apex::packed::detail;
  std::vector<Isa> simd;  // the AVX2 dequantizer serves avx2, the AVX-512 one the three AVX-512 paths
  for (const Isa isa : {Isa::avx2, Isa::avx512}) {
    if (cpu_supports(isa)) simd.push_back(isa);
    else WARN("panel dequantizer " << isa_name(isa) << " skipped: this CPU does not support it");
  }
  for (const Dtype t : dt::kTypes) {
    if (!dt::quantized(t)) continue;
    // 8 blocks of 64 lanes: every MXFP4 exponent; two K-quant super-blocks
    const Index K = t == Dtype::q4_k || t == Dtype::q6_k ? 512 : 256;
    CAPTURE(dtype_name(t), K);
    const PanelMatrix pm = dt::make_matrix(t, K, 2, 11, true);
    const std::vector<float> m = dt::unpacked(pm);
    pd::AlignedArray<float> scalar_buf(32 * 32), vec_buf(32 * 32);  // the SIMD dequantizers store aligned
    float* scalar = scalar_buf.data();
    float* vec = vec_buf.data();
    bool definition = true;  // the portable dequantizer against unpack_row
    std::vector<bool> same(simd.size(), true);
    visit_dtype(t, [&](auto tag) {
      constexpr Dtype T = decltype(tag)::value;
      if constexpr (WeightType<T>::kQuantized)
        for (Index p = 0; p < pm.panels(); ++p)
          for (Index j = 0; j < K / 32; ++j) {
            pd::dequantize_chunk_scalar<T>(pm.panel<T>(p), pm.scales(p), j, scalar);
            for (Index c = 0; c < 32; ++c)
              for (Index l = 0; l < 32; ++l) {
                const float want = m[std::size_t((32 * p + l) * K + 32 * j + c)];
                definition = definition && dt::same_bytes(&scalar[std::size_t(c * 32 + l)], &want, 1);
              }
            for (std::size_t i = 0; i < simd.size(); ++i) {
              std::fill(vec, vec + 32 * 32, -1.0f);
              pd::dequantize_chunk<T>(simd[i], pm.panel<T>(p), pm.scales(p), j, vec);
              same[i] = same[i] && dt::same_bytes(vec, scalar, 32 * 32);
            }
          }
    });
    CHECK(definition);
    for (std::size_t i = 0; i < simd.size(); ++i) {
      INFO("panel dequantizer of path " << isa_name(simd[i]));
      CHECK(same[i]);
    }
  }
}

TEST_CASE("dequantized product: whole panels dequantized on every path are unpack_row's values, prefetching past "
          "the last panel included",
          "[dequantized][kernels]") {
  namespace dt = dequantized_test;
  namespace pd = apex::packed::detail;
  for (const Dtype t : dt::kTypes) {
    if (!dt::quantized(t)) continue;
    const Index K = dt::lengths(t).back(), panels = 3;
    CAPTURE(dtype_name(t), K);
    const PanelMatrix pm = dt::make_matrix(t, K, panels, 5, true);
    const std::vector<float> m = dt::unpacked(pm);
    pd::AlignedArray<float> buf(K * 32);
    for (const Isa isa : kAllIsas) {
      if (!cpu_supports(isa)) continue;  // named by the first test case
      INFO("path " << isa_name(isa));
      bool same = true;
      visit_dtype(t, [&](auto tag) {
        constexpr Dtype T = decltype(tag)::value;
        if constexpr (WeightType<T>::kQuantized)
          for (Index p = 0; p < panels; ++p) {
            pd::dequantize_panel<T>(isa, pm, p, buf.data());
            for (Index k = 0; k < K; ++k)
              for (Index l = 0; l < 32; ++l)
                same = same && dt::same_bytes(&buf.data()[k * 32 + l], &m[std::size_t((32 * p + l) * K + k)], 1);
          }
      });
      CHECK(same);
    }
  }
}

TEST_CASE("dequantized product: bad arguments are typed errors naming the problem",
          "[dequantized][kernels][errors]") {
  const PanelMatrix pm(Dtype::q8_0, 64, 2);  // K = 64, 64 lanes
  std::vector<float> x(3 * 64), y(3 * 64, 7.0f);
  using Catch::Matchers::Message;
  CHECK_THROWS_MATCHES(dequantized_product(Isa::scalar, pm, x.data(), 64, -1, y.data(), 64, 64), ConfigError,
                       Message("packed::dequantized_product: row count rows = -1 is negative"));
  CHECK_THROWS_MATCHES(dequantized_product(Isa::scalar, pm, x.data(), 64, 2, y.data(), 64, 65), ConfigError,
                       Message("packed::dequantized_product: column count n = 65 does not match the 2 panels of "
                               "32 lanes (needs 33 to 64)"));
  CHECK_THROWS_MATCHES(dequantized_product(Isa::scalar, pm, x.data(), 64, 2, y.data(), 64, 32), ConfigError,
                       Message("packed::dequantized_product: column count n = 32 does not match the 2 panels of "
                               "32 lanes (needs 33 to 64)"));
  CHECK_THROWS_MATCHES(dequantized_product(Isa::scalar, pm, x.data(), 63, 2, y.data(), 64, 64), ShapeError,
                       Message("packed::dequantized_product: argument 'x (row stride)' has shape [2 x 63], "
                               "expected [2 x 64]"));
  CHECK_THROWS_MATCHES(dequantized_product(Isa::scalar, pm, x.data(), 64, 2, y.data(), 49, 50), ShapeError,
                       Message("packed::dequantized_product: argument 'y (row stride)' has shape [2 x 49], "
                               "expected [2 x 50]"));
  CHECK_THROWS_MATCHES(dequantized_product(Isa(99), pm, x.data(), 64, 2, y.data(), 64, 64), ConfigError,
                       Message("packed::dequantized_product: isa must be one of scalar, avx2, avx512, avx512_vnni, "
                               "avx512_bf16, amx_bf16, got 99"));
  CHECK_THROWS_MATCHES(dequantized_product(pm, Matrix<float>::Zero(2, 65)), ShapeError,
                       Message("packed::dequantized_product: argument 'x' has shape [2 x 65], expected [* x 64]"));
  CHECK(std::all_of(y.begin(), y.end(), [](float v) { return v == 7.0f; }));  // nothing written by a rejected call
  // rows = 0 writes nothing
  dequantized_product(Isa::scalar, pm, x.data(), 64, 0, y.data(), 64, 64);
  CHECK(y[0] == 7.0f);
  // no panels: n = 0 and nothing to write; n = 1 is an error
  const PanelMatrix none(Dtype::q4_0, 32, 0);
  dequantized_product(kDefaultIsa, none, x.data(), 32, 3, y.data(), 0, 0);
  CHECK(dequantized_product(none, Matrix<float>::Ones(3, 32)).size() == 0);
  CHECK_THROWS_MATCHES(dequantized_product(Isa::scalar, none, x.data(), 32, 3, y.data(), 1, 1), ConfigError,
                       Message("packed::dequantized_product: column count n = 1 does not match the 0 panels of "
                               "32 lanes (needs 0 to 0)"));
  // K = 0: every output is the empty chain, +0
  for (const Dtype t : {Dtype::q6_k, Dtype::f32}) {
    CAPTURE(dtype_name(t));
    const Matrix<float> y0 = dequantized_product(PanelMatrix(t, 0, 2), Matrix<float>::Zero(3, 0));
    REQUIRE(y0.rows() == 3);
    REQUIRE(y0.cols() == 64);
    CHECK(std::all_of(y0.data(), y0.data() + y0.size(), [](float v) { return v == 0.0f && !std::signbit(v); }));
  }
}
