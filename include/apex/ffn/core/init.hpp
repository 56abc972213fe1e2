#pragma once
/// \file core/init.hpp
/// Seeded, platform-independent initialisation.
///
/// `std::uniform_real_distribution` and `std::normal_distribution` are allowed
/// to differ between standard libraries; the conversion from the 64-bit
/// Mersenne Twister to a real number is written here so that the same seed
/// gives the same weights everywhere.

#include <cmath>
#include <cstdint>
#include <random>

#include "errors.hpp"
#include "types.hpp"

namespace apex {

/// Deterministic random source for initialisation and sampling.
class Rng {
 public:
  explicit Rng(std::uint64_t seed = 0) : engine_(seed) {}

  /// Uniform in [0, 1) with 53 random bits.
  double uniform() { return double(engine_() >> 11) * 0x1.0p-53; }

  /// Uniform in [lo, hi).
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }

  /// Standard normal (Box–Muller; one value per call).
  double normal() {
    const double u1 = 1.0 - uniform();  // (0, 1]: log is finite
    const double u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

  /// Uniform integer in [0, n). Throws ValueError for n = 0 (an empty range;
  /// the modulo would divide by zero).
  std::uint64_t index(std::uint64_t n) {
    if (n == 0) throw ValueError("Rng::index: argument 'n' is 0, expected a range of >= 1 values");
    return std::uint64_t(uniform() * double(n)) % n;
  }

  std::mt19937_64& engine() { return engine_; }

 private:
  std::mt19937_64 engine_;
};

/// Fills `m` with U(−bound, bound).
template <class Derived>
void fill_uniform(Eigen::DenseBase<Derived>& m, Rng& rng, double bound) {
  for (Index i = 0; i < m.rows(); ++i)
    for (Index j = 0; j < m.cols(); ++j)
      m(i, j) = typename Derived::Scalar(rng.uniform(-bound, bound));
}

/// PyTorch's `nn.Linear` default for a `[out, in]` weight: U(−1/√in, 1/√in).
template <class Derived>
void init_linear(Eigen::DenseBase<Derived>& weight, Rng& rng) {
  fill_uniform(weight, rng, 1.0 / std::sqrt(double(weight.cols() > 0 ? weight.cols() : 1)));
}

}  // namespace apex
