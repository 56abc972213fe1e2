// The transposed product dx = dy·M of a packed matrix
// (kernels/transposed_product.hpp) and its column unpackers
// (kernels/unpack_columns.hpp, kernels/arch/avx2_unpack_columns.hpp): on every
// type and shape, any row count and every kernel path the CPU has, dx is
// bit for bit a plain std::fma chain over PanelMatrix::unpack_row's values
// (so every path gives the scalar path's bits), and close to a double
// reference; the SIMD unpacker writes the portable unpacker's bytes on
// extreme codes and scales; a mapped (read-only) matrix gives the owned
// one's bits; bad arguments are typed errors naming the problem.
#include <apex/ffn/io/file/mapped_file.hpp>
#include <apex/ffn/kernels/transposed_product.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "block_rows.hpp"
#include "temp_dir.hpp"

using namespace apex;
using namespace apex::packed;

namespace {
// The kernels group shares one anonymous namespace: these helpers live in their own.
namespace transposed_test {

constexpr Dtype kTypes[] = {Dtype::f32, Dtype::bf16, Dtype::f16,  Dtype::q8_0,
                            Dtype::q4_0, Dtype::mxfp4, Dtype::q4_k, Dtype::q6_k};

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

/// A matrix of `panels` panels of type t and reduction length K whose
/// first `outputs` lanes hold lane rows (the rest are the owner's zero
/// padding): float types from normal floats (`extreme`: random bit
/// patterns, subnormals, infinities and NaNs included), block formats from
/// block_row.
PanelMatrix make_matrix(Dtype t, Index K, Index panels, Index outputs, unsigned seed, bool extreme) {
  PanelMatrix pm(t, K, panels);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  for (Index o = 0; o < outputs; ++o) {
    const Index p = o / 32, l = o % 32;
    visit_dtype(t, [&](auto tag) {
      constexpr Dtype T = decltype(tag)::value;
      if constexpr (WeightType<T>::kQuantized) {
        pm.put_row(p, l, block_row<T>(K, seed * 1000 + unsigned(o), extreme).data());
      } else if (extreme) {  // random bits in the K stored elements, the padding left zero
        std::vector<std::byte> row(std::size_t(pm.row_bytes()));
        const Index bytes = K * Index(sizeof(typename WeightType<T>::Block));
        for (Index i = 0; i < bytes; ++i) row[std::size_t(i)] = std::byte(rng());
        pm.put_row(p, l, row.data());
      } else {
        std::vector<float> w(static_cast<std::size_t>(K));
        for (auto& v : w) v = normal(rng);
        pm.pack_row(p, l, w.data());
      }
    });
  }
  return pm;
}

/// M (32·panels × K): row 32p + l = pm.unpack_row(p, l).
std::vector<float> unpacked(const PanelMatrix& pm) {
  const Index K = pm.k(), O = 32 * pm.panels();
  std::vector<float> m(std::size_t(O * K));
  for (Index o = 0; o < O; ++o) pm.unpack_row(o / 32, o % 32, m.data() + o * K);
  return m;
}

/// The definition: dx[r][k] = fma chain over o ascending from 0 (rows × K).
std::vector<float> fma_reference(const std::vector<float>& m, Index O, Index K, const std::vector<float>& dy,
                                 Index lddy, Index rows) {
  std::vector<float> dx(std::size_t(rows * K));
  for (Index r = 0; r < rows; ++r)
    for (Index k = 0; k < K; ++k) {
      float acc = 0.0f;
      for (Index o = 0; o < O; ++o) acc = std::fma(dy[std::size_t(r * lddy + o)], m[std::size_t(o * K + k)], acc);
      dx[std::size_t(r * K + k)] = acc;
    }
  return dx;
}

/// Whether dx is within fp32 summation error of the double product:
/// |dx − Σ dy·W| ≤ O·2⁻²⁴·Σ|dy·W| + O·2⁻¹⁴⁹ entrywise.
bool near_double(const std::vector<float>& m, Index O, Index K, const std::vector<float>& dy, Index lddy,
                 const std::vector<float>& dx, Index rows) {
  for (Index r = 0; r < rows; ++r)
    for (Index k = 0; k < K; ++k) {
      double sum = 0, mag = 0;
      for (Index o = 0; o < O; ++o) {
        const double p = double(dy[std::size_t(r * lddy + o)]) * double(m[std::size_t(o * K + k)]);
        sum += p;
        mag += std::fabs(p);
      }
      const double bound = double(O) * (std::ldexp(mag, -24) + std::ldexp(1.0, -149));
      if (!(std::fabs(double(dx[std::size_t(r * K + k)]) - sum) <= bound)) return false;
    }
  return true;
}

bool same_bytes(const float* a, const float* b, Index n) {
  return n == 0 || std::memcmp(a, b, std::size_t(n) * sizeof(float)) == 0;
}

/// A NaN pattern written into dx's row padding before the product, which
/// must find it unchanged.
constexpr std::uint32_t kSentinel = 0x7FC0BEEFu;

/// Runs the product on `isa` with row strides past the row lengths and
/// returns dx (rows × K, packed); `pad_intact` says whether the stride
/// padding of dx kept its sentinel.
std::vector<float> run_product(Isa isa, const PanelMatrix& pm, const std::vector<float>& dy, Index lddy, Index rows,
                               bool& pad_intact) {
  const Index K = pm.k(), lddx = K + 5;
  float sentinel;
  std::memcpy(&sentinel, &kSentinel, sizeof sentinel);
  std::vector<float> dx(std::size_t(rows * lddx), sentinel);
  transposed_product(isa, pm, dy.data(), lddy, rows, dx.data(), lddx);
  std::vector<float> out(std::size_t(rows * K));
  pad_intact = true;
  for (Index r = 0; r < rows; ++r) {
    const float* row = dx.data() + r * lddx;
    std::memcpy(out.data() + r * K, row, std::size_t(K) * sizeof(float));
    for (Index c = K; c < lddx; ++c) pad_intact = pad_intact && same_bytes(row + c, &sentinel, 1);
  }
  return out;
}

}  // namespace transposed_test
}  // namespace

TEST_CASE("transposed product: dx = dy·M is the fma chain over the stored weights, on every path",
          "[transposed][kernels]") {
  namespace tt = transposed_test;
  constexpr Index kRows[] = {0, 1, 5, 13, 33, 70};
  constexpr Index kMaxRows = 70;
  for (const Isa isa : kAllIsas) {
    SECTION(std::string("path ") + isa_name(isa)) {
      if (!cpu_supports(isa)) {
        WARN("kernel path " << isa_name(isa) << " skipped: this CPU does not support it");
        continue;
      }
      for (const Dtype t : tt::kTypes)
        for (const Index K : tt::lengths(t))
          for (Index panels = 1; panels <= 3; ++panels) {
            constexpr Index kPadding[] = {0, 5, 31};  // lanes past the logical outputs
            const Index O = 32 * panels, outputs = O - kPadding[panels - 1], lddy = O + 3;
            CAPTURE(dtype_name(t), K, panels, outputs);
            const PanelMatrix pm = tt::make_matrix(t, K, panels, outputs, unsigned(K + panels), false);
            const std::vector<float> m = tt::unpacked(pm);
            std::mt19937 rng(unsigned(7 * K + panels));
            std::normal_distribution<float> normal;
            std::vector<float> dy(std::size_t(kMaxRows * lddy));
            for (auto& v : dy) v = normal(rng);  // padding lanes' columns too: finite, weights zero
            const std::vector<float> ref = tt::fma_reference(m, O, K, dy, lddy, kMaxRows);
            for (const Index rows : kRows) {
              CAPTURE(rows);
              bool pad_intact = false;
              const std::vector<float> dx = tt::run_product(isa, pm, dy, lddy, rows, pad_intact);
              CHECK(tt::same_bytes(dx.data(), ref.data(), rows * K));
              CHECK(pad_intact);
              if (rows == kMaxRows) CHECK(tt::near_double(m, O, K, dy, lddy, dx, rows));
            }
          }
    }
  }
}

TEST_CASE("transposed product: dy rows a multiple of 4 KiB apart (copied apart first) give the same bits",
          "[transposed][kernels]") {
  namespace tt = transposed_test;
  for (const Dtype t : {Dtype::f32, Dtype::q4_0}) {
    const Index K = t == Dtype::f32 ? 37 : 64, panels = 32, O = 32 * panels;  // O = 1024 floats: 4 KiB
    const PanelMatrix pm = tt::make_matrix(t, K, panels, O, 21, false);
    const std::vector<float> m = tt::unpacked(pm);
    for (const Index lddy : {O, 2 * O}) {
      std::mt19937 rng(static_cast<unsigned>(lddy));
      std::normal_distribution<float> normal;
      std::vector<float> dy(std::size_t(13 * lddy));
      for (auto& v : dy) v = normal(rng);
      const std::vector<float> ref = tt::fma_reference(m, O, K, dy, lddy, 13);
      for (const Isa isa : kAllIsas) {
        if (!cpu_supports(isa)) continue;  // named by the first test case
        for (const Index rows : {1, 2, 13}) {
          CAPTURE(dtype_name(t), lddy, isa_name(isa), rows);
          bool pad_intact = false;
          const std::vector<float> dx = tt::run_product(isa, pm, dy, lddy, rows, pad_intact);
          CHECK(tt::same_bytes(dx.data(), ref.data(), rows * K));
          CHECK(pad_intact);
        }
      }
    }
  }
}

TEST_CASE("transposed product: the SIMD column unpacker writes the portable one's bytes on extreme codes and scales",
          "[transposed][kernels]") {
  namespace tt = transposed_test;
  namespace pd = apex::packed::detail;
  std::vector<Isa> simd;  // the AVX2 unpacker serves every SIMD path
  if (cpu_supports(Isa::avx2)) simd.push_back(Isa::avx2);
  else WARN("column unpacker avx2 skipped: this CPU does not support it");
  for (const Dtype t : tt::kTypes) {
    // 8 blocks of 32 lanes: every MXFP4 exponent; two K-quant super-blocks; a partial float chunk
    const bool quantized = visit_dtype(t, [](auto tag) { return WeightType<decltype(tag)::value>::kQuantized; });
    const Index K = t == Dtype::q4_k || t == Dtype::q6_k ? 512 : quantized ? 256 : 261;
    CAPTURE(dtype_name(t), K);
    const PanelMatrix pm = tt::make_matrix(t, K, 2, 64, 11, true);
    const std::vector<float> m = tt::unpacked(pm);
    apex::packed::detail::AlignedArray<float> scalar_buf(32 * 32), vec_buf(32 * 32);  // the unpackers store aligned
    float* scalar = scalar_buf.data();
    float* vec = vec_buf.data();
    bool definition = true;  // the portable unpacker against unpack_row
    std::vector<bool> same(simd.size(), true);
    visit_dtype(t, [&](auto tag) {
      constexpr Dtype T = decltype(tag)::value;
      for (Index p = 0; p < pm.panels(); ++p)
        for (Index j = 0; j < column_chunks(K); ++j) {
          pd::unpack_columns_scalar<T>(pm.panel<T>(p), pm.scales(p), K, j, scalar);
          for (Index l = 0; l < 32; ++l)
            for (Index c = 0; c < 32; ++c) {
              const Index k = 32 * j + c;
              const float want = k < K ? m[std::size_t((32 * p + l) * K + k)] : 0.0f;
              definition = definition && tt::same_bytes(&scalar[std::size_t(l * 32 + c)], &want, 1);
            }
          for (std::size_t i = 0; i < simd.size(); ++i) {
            std::fill(vec, vec + 32 * 32, -1.0f);
            pd::unpack_columns<T>(simd[i], pm.panel<T>(p), pm.scales(p), K, j, vec);
            same[i] = same[i] && tt::same_bytes(vec, scalar, 32 * 32);
          }
        }
    });
    CHECK(definition);
    for (std::size_t i = 0; i < simd.size(); ++i) {
      INFO("column unpacker " << isa_name(simd[i]));
      CHECK(same[i]);
    }
  }
}

TEST_CASE("transposed product: a mapped read-only matrix gives the owned matrix's bits", "[transposed][kernels]") {
  namespace tt = transposed_test;
  apex::test::TempDir dir;
  for (const Dtype t : tt::kTypes) {
    CAPTURE(dtype_name(t));
    const Index K = tt::lengths(t).back(), panels = 2, O = 64, rows = 9;
    const PanelMatrix owned = tt::make_matrix(t, K, panels, O - 3, 5, false);
    const std::string path = dir / (std::string(dtype_name(t)) + ".bin");
    const std::uint64_t scales_at = (std::uint64_t(owned.codes_bytes()) + 63) / 64 * 64;
    {
      const std::vector<char> zeros(64 + std::size_t(scales_at) - std::size_t(owned.codes_bytes()), 0);
      std::ofstream out(path, std::ios::binary);
      out.write(reinterpret_cast<const char*>(owned.codes_data()), std::streamsize(owned.codes_bytes()));
      out.write(zeros.data(), std::streamsize(scales_at) - std::streamsize(owned.codes_bytes()));
      out.write(reinterpret_cast<const char*>(owned.scales_data()), std::streamsize(owned.scales_bytes()));
      out.write(zeros.data(), 64);  // never an empty file, even for an empty scale array
    }
    const PanelMatrix mapped =
        PanelMatrix::view(t, K, panels, io::MappedFile::open("panel file", path), 0, scales_at, "test", "m");
    REQUIRE(mapped.mapped());
    std::mt19937 rng(3);
    std::normal_distribution<float> normal;
    Matrix<float> dy(rows, O);  // rows × O
    for (Index i = 0; i < dy.size(); ++i) dy.data()[i] = normal(rng);
    for (const Isa isa : kAllIsas) {
      if (!cpu_supports(isa)) continue;  // named by the first test case
      INFO("path " << isa_name(isa));
      const Matrix<float> a = transposed_product(mapped, dy, isa), b = transposed_product(owned, dy, isa);
      CHECK(tt::same_bytes(a.data(), b.data(), a.size()));
    }
  }
}

TEST_CASE("transposed product: bad arguments are typed errors naming the problem", "[transposed][kernels][errors]") {
  const PanelMatrix pm(Dtype::q8_0, 64, 1);  // K = 64, O = 32
  std::vector<float> dy(2 * 32), dx(2 * 64);
  using Catch::Matchers::Message;
  CHECK_THROWS_MATCHES(transposed_product(Isa::scalar, pm, dy.data(), 32, -1, dx.data(), 64), ConfigError,
                       Message("packed::transposed_product: row count rows = -1 is negative"));
  CHECK_THROWS_MATCHES(transposed_product(Isa::scalar, pm, dy.data(), 31, 2, dx.data(), 64), ShapeError,
                       Message("packed::transposed_product: argument 'dy (row stride)' has shape [2 x 31], expected "
                               "[2 x 32]"));
  CHECK_THROWS_MATCHES(transposed_product(Isa::scalar, pm, dy.data(), 32, 2, dx.data(), 63), ShapeError,
                       Message("packed::transposed_product: argument 'dx (row stride)' has shape [2 x 63], expected "
                               "[2 x 64]"));
  CHECK_THROWS_MATCHES(transposed_product(Isa(99), pm, dy.data(), 32, 2, dx.data(), 64), ConfigError,
                       Message("packed::transposed_product: isa must be one of scalar, avx2, avx512, avx512_vnni, "
                               "avx512_bf16, amx_bf16, got 99"));
  CHECK_THROWS_MATCHES(transposed_product(pm, Matrix<float>::Zero(2, 33)), ShapeError,
                       Message("packed::transposed_product: argument 'dy' has shape [2 x 33], expected [* x 32]"));
  // no panels: every dx is the empty chain, +0; no columns: nothing to write
  const PanelMatrix none(Dtype::f32, 5, 0);
  std::vector<float> dx0(3 * 5, 7.0f);
  transposed_product(kDefaultIsa, none, dy.data(), 0, 3, dx0.data(), 5);
  CHECK(std::all_of(dx0.begin(), dx0.end(), [](float v) { return v == 0.0f && !std::signbit(v); }));
  CHECK(transposed_product(PanelMatrix(Dtype::bf16, 0, 2), Matrix<float>::Ones(3, 64)).size() == 0);
  // rows = 0 writes nothing
  std::fill(dx.begin(), dx.end(), 7.0f);
  transposed_product(Isa::scalar, pm, dy.data(), 32, 0, dx.data(), 64);
  CHECK(dx[0] == 7.0f);
}
