// Packed expert engine (include/apex/ffn/packed/): bf16 conversion against
// hand-computed cases and an independent reference, the packed layout, and
// every kernel path the CPU supports against a double-precision reference
// loop with componentwise error bounds derived from the sizes.
#include <apex/ffn/kernels/fused_expert.hpp>
#include <apex/ffn/kernels/streamed_product.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "gradcheck.hpp"

using namespace apex;
using namespace apex::packed;

namespace {

float from_bits(std::uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}
std::uint32_t to_bits(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

/// Paths this CPU runs (the scalar one always).
std::vector<Isa> supported_isas() {
  std::vector<Isa> out;
  for (const Isa isa : kAllIsas)
    if (cpu_supports(isa)) out.push_back(isa);
  return out;
}

/// Independent float → bf16 reference: pick the nearer of the two bf16
/// neighbours by exact distance in double, ties to the even one; beyond the
/// largest bf16 the upper neighbour is 2¹²⁸ (rounds to Inf); NaN → 0x7FC0.
std::uint16_t bf16_reference(float x) {
  if (std::isnan(x)) return 0x7FC0;
  const std::uint32_t u = to_bits(x);
  const std::uint32_t sign = u & 0x80000000u, mag = u & 0x7FFFFFFFu;
  const std::uint32_t lo = mag >> 16, hi = lo + 1;
  if ((mag & 0xFFFFu) == 0) return static_cast<std::uint16_t>((sign >> 16) | lo);
  const double v = std::fabs(double(x)), vlo = double(from_bits(lo << 16));
  const double vhi = hi == 0x7F80u ? std::ldexp(1.0, 128) : double(from_bits(hi << 16));
  const double dlo = v - vlo, dhi = vhi - v;
  const std::uint32_t pick = dlo < dhi ? lo : dhi < dlo ? hi : ((lo & 1u) ? hi : lo);
  return static_cast<std::uint16_t>((sign >> 16) | pick);
}

struct F32Weights {
  static constexpr Dtype dtype = Dtype::f32;
};
struct Bf16Weights {
  static constexpr Dtype dtype = Dtype::bf16;
};

/// Double-precision reference of the expert and the componentwise bound of an
/// fp32 evaluation. For a dot product of length K accumulated by K fused
/// multiply-adds, |ŝ − s| ≤ (K + 1)·u·Σ|x||w| with u = 2⁻²⁴; rounding the
/// inputs relatively by ρ (bf16 activations: 2⁻⁹, bf16 vs float weights:
/// 2⁻⁹) adds ρ·Σ|x||w| to first order. SiLU' is bounded by 1.0998, and the
/// SiLU·u epilogue costs a few ulps (8u is allowed). The check allows twice
/// the first-order bound; a dropped term (≈ Σ|x||w|/K) exceeds it.
struct Reference {
  Matrix<double> y, bound;  // m × d
};
Reference reference(const Matrix<float>& x, const Matrix<float>& wg, const Matrix<float>& wu, const Matrix<float>& wd,
                    double rho_x, double rho_w) {
  const double u = std::ldexp(1.0, -24);
  const Index d = wg.cols(), f = wg.rows();
  const Matrix<double> X = x.cast<double>(), Wg = wg.cast<double>(), Wu = wu.cast<double>(),
                       Wd = wd.cast<double>();
  const Matrix<double> G = X * Wg.transpose(), U = X * Wu.transpose();  // m × f
  const Matrix<double> Gabs = X.cwiseAbs() * Wg.cwiseAbs().transpose(), Uabs = X.cwiseAbs() * Wu.cwiseAbs().transpose();
  const double e1 = double(d + 1) * u + rho_x + rho_w;
  const Eigen::ArrayXXd s = (1.0 + (-G.array()).exp()).inverse();
  const Eigen::ArrayXXd A = G.array() * s * U.array();                 // m × f
  const Eigen::ArrayXXd dA = 1.0998 * e1 * Gabs.array() * U.array().abs() +
                             (G.array() * s).abs() * e1 * Uabs.array() + (8 * u + rho_x) * A.abs();
  Reference r;
  r.y = A.matrix() * Wd.transpose();
  const double e2 = double(f + 1) * u + rho_x + rho_w;
  r.bound = 2.0 * (dA.matrix() * Wd.cwiseAbs().transpose() + e2 * ((A.abs() + dA).matrix() * Wd.cwiseAbs().transpose()));
  return r;
}

/// max over entries of |y − ref| / bound (≤ 1 passes).
double bound_ratio(const Matrix<float>& y, const Reference& r) {
  double worst = 0;
  for (Index i = 0; i < y.rows(); ++i)
    for (Index j = 0; j < y.cols(); ++j)
      worst = std::max(worst, std::abs(double(y(i, j)) - r.y(i, j)) / (r.bound(i, j) + 1e-300));
  return worst;
}

struct Expert {
  Matrix<float> wg, wu, wd;  // f × d, f × d, d × f
};
Expert random_expert(Index d, Index f, std::uint64_t seed) {
  return {test::random_matrix(f, d, seed, 1.0 / std::sqrt(double(d))).cast<float>(),
          test::random_matrix(f, d, seed + 1, 1.0 / std::sqrt(double(d))).cast<float>(),
          test::random_matrix(d, f, seed + 2, 1.0 / std::sqrt(double(f))).cast<float>()};
}

const Index kSizes[] = {1, 3, 17, 33, 100};
const Index kRows[] = {0, 1, 2, 7, 32, 33, 129};

}  // namespace

TEST_CASE("bf16 rounding of hand-computed cases matches PyTorch", "[packed][bf16]") {
  struct Case {
    std::uint32_t in;
    std::uint16_t out;
  };
  const Case cases[] = {
      {0x3F800000u, 0x3F80},  // 1
      {0x3F808000u, 0x3F80},  // 1 + 2⁻⁸: tie, 0x3F80 is even → down
      {0x3F818000u, 0x3F82},  // tie above the odd 0x3F81 → up to even
      {0x3F807FFFu, 0x3F80},  // just below a tie
      {0x3F808001u, 0x3F81},  // just above a tie
      {0xBF808000u, 0xBF80},  // ties to even for negatives too
      {0xBF818000u, 0xBF82},
      {0x7F7F0000u, 0x7F7F},  // largest bf16
      {0x7F7F7FFFu, 0x7F7F},
      {0x7F7F8000u, 0x7F80},  // tie at the top, 0x7F7F odd → +Inf (as PyTorch)
      {0x7F7FFFFFu, 0x7F80},  // FLT_MAX → +Inf
      {0xFF7FFFFFu, 0xFF80},  // −FLT_MAX → −Inf
      {0x00800000u, 0x0080},  // FLT_MIN
      {0x00000001u, 0x0000},  // smallest subnormal → +0
      {0x00008000u, 0x0000},  // subnormal tie, even → 0
      {0x00018000u, 0x0002},  // subnormal tie above odd → up
      {0x00008001u, 0x0001},  // smallest bf16 subnormal
      {0x80000001u, 0x8000},  // → −0
      {0x00000000u, 0x0000},
      {0x80000000u, 0x8000},
      {0x7F800000u, 0x7F80},  // +Inf
      {0xFF800000u, 0xFF80},  // −Inf
      {0x7FC00000u, 0x7FC0},  // quiet NaN
      {0xFFC00001u, 0x7FC0},  // negative NaN with payload → canonical
      {0x7F800001u, 0x7FC0},  // signalling NaN: plain rounding would give +Inf
      {0x7FFFFFFFu, 0x7FC0},  // plain rounding would overflow into the sign
  };
  for (const Case& c : cases) {
    INFO("input bits " << std::hex << c.in);
    CHECK(bf16_bits(from_bits(c.in)) == c.out);
    CHECK(bf16_reference(from_bits(c.in)) == c.out);
  }
  // Every path, with the cases repeated past a vector width so both the
  // vector bodies and the scalar tails run.
  std::vector<float> in;
  std::vector<std::uint16_t> want;
  for (int rep = 0; rep < 3; ++rep)
    for (const Case& c : cases) {
      in.push_back(from_bits(c.in));
      want.push_back(c.out);
    }
  for (const Isa isa : supported_isas()) {
    INFO("path " << isa_name(isa));
    std::vector<bf16> out(in.size());
    to_bf16(in.data(), out.data(), Index(in.size()), isa);
    std::vector<float> back(in.size());
    to_float(out.data(), back.data(), Index(in.size()), isa);
    for (std::size_t i = 0; i < in.size(); ++i) {
      CHECK(out[i].bits == want[i]);
      CHECK(to_bits(back[i]) == std::uint32_t(want[i]) << 16);  // widening is exact
    }
  }
  CHECK(to_float(bf16{0x0001}) == std::ldexp(1.0f, -133));
  CHECK(std::isnan(to_float(bf16{0x7FC0})));
}

TEST_CASE("bf16 bulk conversions equal an independent reference on random bits", "[packed][bf16]") {
  Rng rng(14);
  const Index n = 4099;  // odd: tails on every path
  std::vector<float> in(n);
  for (Index i = 0; i < n; ++i) {
    // Half arbitrary bit patterns (NaNs, subnormals, Inf included), half ordinary values.
    const auto bits = std::uint32_t(rng.uniform(0.0, 4294967295.0));
    in[std::size_t(i)] = (i & 1) ? from_bits(bits) : float(rng.uniform(-3.0, 3.0));
  }
  for (const Isa isa : supported_isas()) {
    INFO("path " << isa_name(isa));
    std::vector<bf16> out(std::size_t(n), bf16{0});
    to_bf16(in.data(), out.data(), n, isa);
    Index bad = 0;
    for (Index i = 0; i < n; ++i) bad += out[std::size_t(i)].bits != bf16_reference(in[std::size_t(i)]);
    CHECK(bad == 0);
  }
}

TEST_CASE("packing round-trips and keeps panels aligned", "[packed]") {
  for (const Index d : kSizes)
    for (const Index f : kSizes) {
      INFO("d " << d << " f " << f);
      const Expert w = random_expert(d, f, 7);
      const PackedExpert p32(w.wg, w.wu, w.wd, Dtype::f32), p16(w.wg, w.wu, w.wd, Dtype::bf16);
      CHECK(p32.d_model() == d);
      CHECK(p32.d_ffn() == f);
      CHECK(p16.dtype() == Dtype::bf16);
      CHECK(p32.w_gate() == w.wg);
      CHECK(p32.w_up() == w.wu);
      CHECK(p32.w_down() == w.wd);
      const auto rounded = [](const Matrix<float>& m) { return m.unaryExpr([](float v) { return round_to_bf16(v); }).eval(); };
      CHECK(p16.w_gate() == rounded(w.wg));
      CHECK(p16.w_up() == rounded(w.wu));
      CHECK(p16.w_down() == rounded(w.wd));
      const std::size_t up = std::size_t((f + 15) / 16), dp = std::size_t((d + 31) / 32);
      CHECK(p32.bytes() == (up * std::size_t(d) + dp * std::size_t(f)) * 32 * 4);
      CHECK(p16.bytes() == (up * std::size_t(d + (d & 1)) + dp * std::size_t(f + (f & 1))) * 32 * 2);
      for (Index q = 0; q < p16.down().panels(); ++q)
        CHECK(reinterpret_cast<std::uintptr_t>(p16.down().bf16_panel(q)) % 64 == 0);
      for (Index q = 0; q < p32.gate_up().panels(); ++q)
        CHECK(reinterpret_cast<std::uintptr_t>(p32.gate_up().f32_panel(q)) % 64 == 0);
    }
}

TEMPLATE_TEST_CASE("every kernel path matches the double reference on odd sizes", "[packed]", F32Weights,
                   Bf16Weights) {
  constexpr Dtype dtype = TestType::dtype;
  const double rho = std::ldexp(1.0, -9);  // bf16 rounding, relative
  double worst_stored = 0, worst_float = 0;
  for (const Index d : kSizes)
    for (const Index f : kSizes) {
      const Expert w = random_expert(d, f, std::uint64_t(100 * d + f));
      const PackedExpert e(w.wg, w.wu, w.wd, dtype);
      // Reference on the stored weights (tight), and for bf16 on the float
      // weights the bf16 rounding was applied to (bound widened by 2⁻⁹).
      const Matrix<float> wg = e.w_gate(), wu = e.w_up(), wd = e.w_down();
      for (const Index m : kRows) {
        const Matrix<float> x = test::random_matrix(m, d, std::uint64_t(m + 1)).cast<float>();
        const Reference exact = reference(x, wg, wu, wd, 0, 0);
        const Reference paired = reference(x, wg, wu, wd, rho, 0);
        const Reference vs_float = reference(x, w.wg, w.wu, w.wd, 0, dtype == Dtype::bf16 ? rho : 0);
        Matrix<float> y_scalar;
        for (const Isa isa : supported_isas()) {
          INFO("path " << isa_name(isa) << " dtype " << dtype_name(dtype) << " d " << d << " f " << f << " m " << m);
          const Matrix<float> y = forward(e, x, {isa, Bf16Products::widened});
          REQUIRE(y.rows() == m);
          REQUIRE(y.cols() == d);
          const double r = bound_ratio(y, exact);
          worst_stored = std::max(worst_stored, r);
          CHECK(r <= 1.0);
          worst_float = std::max(worst_float, bound_ratio(y, vs_float));
          CHECK(bound_ratio(y, vs_float) <= 1.0);
          // Same fused operations in the same order on every path: same bits.
          if (isa == Isa::scalar) y_scalar = y;
          else CHECK(y == y_scalar);
          if (has_bf16_pairs(isa) && dtype == Dtype::bf16) {
            const Matrix<float> yp = forward(e, x, {isa, Bf16Products::paired});
            CHECK(bound_ratio(yp, paired) <= 1.0);
            // automatic chooses widened products (the faster on the CPUs measured).
            CHECK(forward(e, x, {isa, Bf16Products::automatic}) == y);
          }
        }
      }
    }
  INFO("worst |error| / bound: stored weights " << worst_stored << ", float weights " << worst_float);
  CHECK(worst_stored <= 1.0);
}

TEST_CASE("the error bound catches a dropped term", "[packed]") {
  // The reference bound is what the kernels are held to; a kernel that skipped
  // one k of the reduction must exceed it.
  const Index d = 33, f = 17, m = 7;
  const Expert w = random_expert(d, f, 5);
  const Matrix<float> x = test::random_matrix(m, d, 6).cast<float>();
  const Reference r = reference(x, w.wg, w.wu, w.wd, 0, 0);
  for (const Index k : {Index(0), d / 2, d - 1}) {
    Expert dropped = w;
    dropped.wg.col(k).setZero();
    const PackedExpert e(dropped.wg, dropped.wu, dropped.wd, Dtype::f32);
    CHECK(bound_ratio(forward(e, x, {Isa::scalar}), r) > 1.0);
  }
  Expert dropped = w;
  dropped.wd.col(f - 1).setZero();
  CHECK(bound_ratio(forward(PackedExpert(dropped.wg, dropped.wu, dropped.wd, Dtype::f32), x, {Isa::scalar}), r) > 1.0);
}

TEST_CASE("bf16 weights against float weights: relative error near 3e-3", "[packed]") {
  // A realistic shape (weights U(±1/√in), inputs U(±1)): the normwise relative
  // error of the bf16 expert against the float expert, widened and paired.
  const Index d = 256, f = 512, m = 64;
  const Expert w = random_expert(d, f, 11);
  const Matrix<float> x = test::random_matrix(m, d, 12).cast<float>();
  const Reference ref = reference(x, w.wg, w.wu, w.wd, 0, 0);
  const PackedExpert e(w.wg, w.wu, w.wd, Dtype::bf16);
  for (const Isa isa : supported_isas()) {
    for (const Bf16Products products : {Bf16Products::widened, Bf16Products::paired}) {
      if (products == Bf16Products::paired && !has_bf16_pairs(isa)) continue;
      const Matrix<float> y = forward(e, x, {isa, products});
      const double rel = (y.cast<double>() - ref.y).norm() / ref.y.norm();
      INFO("path " << isa_name(isa) << (products == Bf16Products::paired ? " paired" : " widened") << ": rel " << rel);
      CHECK(rel > 1e-3);  // bf16 rounding is really there (measured ≈ 2.7e-3 widened, 3.8e-3 paired)
      CHECK(rel < (products == Bf16Products::paired ? 5e-3 : 3.5e-3));  // truncation instead of rounding fails it
    }
  }
}

TEST_CASE("rows do not depend on how a block is split across calls", "[packed]") {
  const Index d = 33, f = 100, m = 129;
  const Expert w = random_expert(d, f, 21);
  const Matrix<float> x = test::random_matrix(m, d, 22).cast<float>();
  for (const Dtype dtype : {Dtype::f32, Dtype::bf16, Dtype::f16}) {
    const PackedExpert e(w.wg, w.wu, w.wd, dtype);
    for (const Isa isa : supported_isas()) {
      for (const Bf16Products products : {Bf16Products::widened, Bf16Products::paired}) {
        if (products == Bf16Products::paired && (!has_bf16_pairs(isa) || dtype != Dtype::bf16)) continue;
        INFO("path " << isa_name(isa) << " dtype " << dtype_name(dtype));
        const Matrix<float> whole = forward(e, x, {isa, products});
        Matrix<float> split(m, d);
        const Index cuts[] = {0, 1, 34, 40, m};
        for (int c = 0; c + 1 < 5; ++c)
          forward(e, x.data() + cuts[c] * d, d, cuts[c + 1] - cuts[c], split.data() + cuts[c] * d, d, {isa, products});
        CHECK(split == whole);
        // Strided input and output (a block of a wider buffer).
        Matrix<float> xw = Matrix<float>::Zero(m, d + 5), yw = Matrix<float>::Constant(m, d + 3, 7.0f);
        xw.leftCols(d) = x;
        forward(e, xw.data(), d + 5, m, yw.data(), d + 3, {isa, products});
        CHECK(yw.leftCols(d) == whole);
        CHECK((yw.rightCols(3).array() == 7.0f).all());  // nothing written past d
      }
    }
  }
}

TEST_CASE("amx_bf16: the tiles read nothing past a panel's pairs or a row's values", "[packed]") {
  if (!cpu_supports(Isa::amx_bf16)) {
    WARN("amx_bf16: kernel path skipped (this CPU or its kernel lacks AMX-BF16)");
    return;
  }
  const ForwardOptions amx{Isa::amx_bf16, Bf16Products::paired}, dot{Isa::avx512_bf16, Bf16Products::paired};
  // f = 100: 50 pairs, so each down panel ends in a partial 16-pair chunk,
  // and the next panel's first pairs follow it in memory. Inf in the second
  // panel's weights (output features 32..63) must not reach features 0..31
  // through zero activations (0 · Inf = NaN).
  const Index d = 70, f = 100, m = 37;
  Expert w = random_expert(d, f, 31);
  w.wd.middleRows(32, 32).setConstant(std::numeric_limits<float>::infinity());
  const PackedExpert e(w.wg, w.wu, w.wd, Dtype::bf16);
  const Matrix<float> x = test::random_matrix(m, d, 32).cast<float>();
  const Matrix<float> y_amx = forward(e, x, amx), y_dot = forward(e, x, dot);
  CHECK(y_amx.leftCols(32).allFinite());
  CHECK(y_amx.rightCols(d - 64).allFinite());
  const double rel = (y_amx.leftCols(32) - y_dot.leftCols(32)).norm() / y_dot.leftCols(32).norm();
  CHECK(rel < 1e-5);  // the same bf16 products; only the order of fp32 sums may differ
  // The bf16 scratch is the thread's and reused: NaN rows of a wider call
  // must not survive in the padding a narrower call's tiles read.
  const Expert wide = random_expert(64, 40, 33);
  const PackedExpert ewide(wide.wg, wide.wu, wide.wd, Dtype::bf16);
  (void)forward(ewide, Matrix<float>::Constant(48, 64, std::numeric_limits<float>::quiet_NaN()), amx);
  const Expert narrow = random_expert(33, 17, 34);
  const PackedExpert enarrow(narrow.wg, narrow.wu, narrow.wd, Dtype::bf16);
  const Matrix<float> xn = test::random_matrix(5, 33, 35).cast<float>();
  const Matrix<float> yn = forward(enarrow, xn, amx);
  REQUIRE(yn.allFinite());
  const Matrix<float> wgn = enarrow.w_gate(), wun = enarrow.w_up(), wdn = enarrow.w_down();
  CHECK(bound_ratio(yn, reference(xn, wgn, wun, wdn, std::ldexp(1.0, -9), 0)) <= 1.0);
  // The tiles are released after each call: the vector paths run after it.
  CHECK(forward(enarrow, xn, dot).allFinite());
}

TEST_CASE("streamed product: the same bits on every path, within fp32 of the double product", "[packed]") {
  // Strided x, W and y (a block of wider buffers); K around the 16 lanes;
  // n around the four weight rows of a pass.
  const double u = std::ldexp(1.0, -24);
  for (const Index K : {1, 15, 16, 17, 33, 100, 2048})
    for (const Index n : {1, 3, 4, 5, 9})
      for (const Index m : {1, 2, 7}) {
        const Index ldx = K + 1, ldw = K + 3, ldy = n + 2;
        const Matrix<float> x = test::random_matrix(m, ldx, std::uint64_t(K + 7 * n + m)).cast<float>();
        const Matrix<float> w = test::random_matrix(n, ldw, std::uint64_t(3 * K + n)).cast<float>();
        Matrix<float> y_scalar = Matrix<float>::Constant(m, ldy, 7.0f);
        streamed_product_nt(Isa::scalar, x.data(), ldx, m, w.data(), ldw, n, K, y_scalar.data(), ldy);
        const Matrix<double> X = x.leftCols(K).cast<double>(), W = w.leftCols(K).cast<double>();
        const Matrix<double> ref = X * W.transpose(), mag = X.cwiseAbs() * W.cwiseAbs().transpose();  // m × n
        INFO("K " << K << " n " << n << " m " << m);
        CHECK(((y_scalar.leftCols(n).cast<double>() - ref).array().abs() <= 2.0 * double(K + 5) * u * mag.array())
                  .all());
        CHECK((y_scalar.rightCols(2).array() == 7.0f).all());  // nothing written past n
        for (const Isa isa : supported_isas()) {
          if (isa == Isa::scalar) continue;
          INFO("path " << isa_name(isa));
          Matrix<float> y = Matrix<float>::Constant(m, ldy, 7.0f);
          streamed_product_nt(isa, x.data(), ldx, m, w.data(), ldw, n, K, y.data(), ldy);
          CHECK(y == y_scalar);
        }
      }
}

TEST_CASE("SiLU epilogue: every path gives the same bits, limits exact", "[packed]") {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> g = {0.0f, -0.0f, 1.0f, -1.0f, 3.0f, -3.0f, 20.0f, -20.0f, 87.0f, -87.0f, -87.5f, -88.0f,
                          -100.0f, 100.0f, -1e30f, 1e30f, 1e-30f, -1e-30f, 1e-40f, -95.0f, -103.0f, -104.5f};
  Rng rng(3);
  while (g.size() < 64) g.push_back(float(rng.uniform(-30.0, 30.0)));
  for (const float v : g) {
    const float a = packed::detail::silu_mul_scalar(v, 1.0f);
    const double want = double(v) / (1.0 + std::exp(-double(v)));
    INFO("g " << v);
    // Below g ≈ −87 e^g is subnormal: its absolute error is |g|·2⁻¹⁵⁰ at most.
    CHECK(std::abs(double(a) - want) <= 4 * std::ldexp(1.0, -24) * std::abs(want) + std::abs(v) * std::ldexp(1.0, -149));
  }
  CHECK(packed::detail::silu_mul_scalar(-1e30f, 1.0f) == 0.0f);
  CHECK(std::isnan(packed::detail::silu_mul_scalar(std::nanf(""), 1.0f)));
  CHECK(packed::detail::silu_mul_scalar(inf, 1.0f) == inf);
  // The kernels apply it in registers; run it through a d = 1, f = 64 expert
  // whose gate outputs are exactly g (x = 1, w_gate = g, w_up = 1). (No Inf:
  // the down product's 0·Inf would hide the entry read back.)
  const Index f = Index(g.size());
  Matrix<float> wg(f, 1), wu = Matrix<float>::Ones(f, 1), wd = Matrix<float>::Zero(1, f);
  for (Index j = 0; j < f; ++j) wg(j, 0) = g[std::size_t(j)];
  std::vector<Matrix<float>> outs;
  for (const Isa isa : supported_isas()) {
    Matrix<float> a(1, f);
    Matrix<float> one = Matrix<float>::Ones(1, 1);
    // The down product of one hot row of W_down reads back A entry by entry.
    for (Index j = 0; j < f; ++j) {
      Matrix<float> hot = Matrix<float>::Zero(1, f);
      hot(0, j) = 1.0f;
      a(0, j) = forward(PackedExpert(wg, wu, hot, Dtype::f32), one, {isa})(0, 0);
    }
    for (Index j = 0; j < f; ++j) {
      INFO("path " << isa_name(isa) << " g " << g[std::size_t(j)]);
      // Bits, except that the down product's +0 accumulator turns −0 into +0.
      const float want = packed::detail::silu_mul_scalar(g[std::size_t(j)], 1.0f);
      CHECK((to_bits(a(0, j)) == to_bits(want) || (a(0, j) == 0.0f && want == 0.0f)));
    }
  }
}

TEST_CASE("packed experts reject bad input with typed errors", "[packed][errors]") {
  const Matrix<float> g(4, 3), u(4, 3), dn(3, 4);
  CHECK_THROWS_AS(PackedExpert(Matrix<float>(0, 3), Matrix<float>(0, 3), Matrix<float>(3, 0), Dtype::f32), ConfigError);
  CHECK_THROWS_AS(PackedExpert(Matrix<float>(4, 0), Matrix<float>(4, 0), Matrix<float>(0, 4), Dtype::bf16), ConfigError);
  CHECK_THROWS_WITH(PackedExpert(g, Matrix<float>(4, 2), dn, Dtype::f32),
                    "PackedExpert: argument 'w_up' has shape [4 x 2], expected [4 x 3]");
  CHECK_THROWS_AS(PackedExpert(g, u, Matrix<float>(4, 3), Dtype::f32), ShapeError);
  CHECK_THROWS_WITH(PackedExpert(g, u, Matrix<float>(4, 3), Dtype::f32),
                    "PackedExpert: argument 'w_down' has shape [4 x 3], expected [3 x 4]");
  const PackedExpert e(Matrix<float>::Ones(4, 3), Matrix<float>::Ones(4, 3), Matrix<float>::Ones(3, 4), Dtype::f32);
  CHECK_THROWS_WITH(forward(e, Matrix<float>(2, 5)), "packed::forward: argument 'x' has shape [2 x 5], expected [* x 3]");
  Matrix<float> x(2, 3), y(2, 3);
  CHECK_THROWS_AS(forward(e, x.data(), 3, -1, y.data(), 3), ConfigError);
  CHECK_THROWS_AS(forward(e, x.data(), 2, 2, y.data(), 3), ShapeError);
  CHECK_THROWS_AS(forward(e, x.data(), 3, 2, y.data(), 2), ShapeError);
  CHECK_THROWS_AS(forward(e, x, {Isa::scalar, Bf16Products::paired}), ConfigError);
  const PackedExpert e16(Matrix<float>::Ones(4, 3), Matrix<float>::Ones(4, 3), Matrix<float>::Ones(3, 4), Dtype::bf16);
  CHECK_THROWS_WITH(forward(e16, x, {Isa::scalar, Bf16Products::paired}),
                    "packed::forward: bf16_products = paired needs path 'avx512_bf16' or 'amx_bf16', not 'scalar'");
  for (const Isa isa : kAllIsas)
    if (!cpu_supports(isa)) CHECK_THROWS_AS(forward(e, x, {isa}), ConfigError);
  // Zero rows are fine and write nothing.
  CHECK(forward(e, Matrix<float>(0, 3)).rows() == 0);
}

namespace {
/// w with every entry rounded to binary16 and widened back (exact).
Matrix<float> round_to_f16(const Matrix<float>& w) {
  return w.unaryExpr([](float v) { return quant::fp16_to_fp32(quant::fp32_to_fp16(v)); });
}
}  // namespace

TEST_CASE("f16 weights: every path gives the f32 kernel's bits on the rounded weights", "[packed][f16]") {
  // The f16 tiles widen exactly (vcvtph2ps) and then run the f32 tiles'
  // fma order, so on every path an f16 expert equals the f32 expert of its
  // rounded weights bit for bit, on odd shapes and row counts too.
  for (const Isa isa : kAllIsas)
    if (!cpu_supports(isa)) WARN("f16: kernel path " << isa_name(isa) << " skipped (this CPU lacks it)");
  for (const auto& [d, f] : {std::pair<Index, Index>{37, 53}, {64, 128}, {5, 200}}) {
    const Expert w = random_expert(d, f, 31);
    const PackedExpert e16(w.wg, w.wu, w.wd, Dtype::f16);
    const PackedExpert e32(round_to_f16(w.wg), round_to_f16(w.wu), round_to_f16(w.wd), Dtype::f32);
    CHECK(e16.dtype() == Dtype::f16);
    CHECK(e16.w_up() == round_to_f16(w.wu));  // widened back, exactly
    for (const Index m : {1, 3, 6, 37}) {
      const Matrix<float> x = test::random_matrix(m, d, 32 + m).cast<float>();
      for (const Isa isa : supported_isas()) {
        INFO("d " << d << " f " << f << " rows " << m << " path " << isa_name(isa));
        CHECK(forward(e16, x, {isa}) == forward(e32, x, {isa}));
      }
    }
  }
}

TEST_CASE("f16 weights: file rows move unchanged, and out-of-range weights are refused", "[packed][f16]") {
  const Index d = 32, f = 48;
  const Expert w = random_expert(d, f, 41);
  const PackedExpert e(w.wg, w.wu, w.wd, Dtype::f16);
  std::vector<std::byte> g(std::size_t(f * d * 2)), u(g.size()), dn(std::size_t(d * f * 2));
  e.file_rows(g.data(), u.data(), dn.data());
  // A file row is the binary16 bits of the weights, row-major (GGUF's F16).
  std::uint16_t h = 0;
  std::memcpy(&h, g.data() + 2 * (3 * d + 7), 2);
  CHECK(h == quant::fp32_to_fp16(w.wg(3, 7)));
  const PackedExpert back = PackedExpert::from_file_rows(d, f, ExpertDtypes(Dtype::f16), g.data(), u.data(), dn.data());
  CHECK(back.w_gate() == e.w_gate());
  CHECK(back.w_down() == e.w_down());
  // 65504 is the largest half; 65520 and beyond would round to Inf.
  Matrix<float> big = w.wg;
  big(2, 5) = 65504.0f;
  CHECK_NOTHROW(PackedExpert(big, w.wu, w.wd, Dtype::f16));
  big(2, 5) = -70000.0f;
  CHECK_THROWS_WITH(PackedExpert(big, w.wu, w.wd, Dtype::f16),
                    Catch::Contains("beyond the binary16 range") && Catch::Contains("f32 or bf16"));
}
