#pragma once
// Reusable finite-difference gradient checker (double, central differences).
//
// A layer's analytic gradient is compared with
//     (L(θ + ε) − L(θ − ε)) / 2ε
// entry by entry, for every entry of every parameter in `params()` and of the
// input. The figure of merit per tensor is the norm-wise relative error
//     ‖g_fd − g_an‖₂ / max(‖g_fd‖₂, ‖g_an‖₂),
// which is scale-free and not fooled by individual entries that are ~0.
// Tests use the scalar loss L = Σ_ij y_ij · R_ij for a fixed random R, so
// ∂L/∂y = R.

#include <apex/ffn/core/init.hpp>
#include <apex/ffn/core/param.hpp>
#include <apex/ffn/core/types.hpp>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

namespace apex::test {

struct GradCheck {
  std::string name;
  double rel_error = 0;   // norm-wise relative error
  double analytic_norm = 0;
  Index checked = 0;      // entries compared
};

/// Central-difference check of `n` values at `value` against `analytic`.
/// `loss` re-evaluates the scalar loss from the current values.
inline GradCheck check_values(std::string name, double* value, const double* analytic, Index n,
                              const std::function<double()>& loss, double eps = 1e-5) {
  double diff2 = 0, fd2 = 0, an2 = 0;
  for (Index i = 0; i < n; ++i) {
    const double saved = value[i];
    value[i] = saved + eps;
    const double up = loss();
    value[i] = saved - eps;
    const double down = loss();
    value[i] = saved;
    const double fd = (up - down) / (2 * eps);
    diff2 += (fd - analytic[i]) * (fd - analytic[i]);
    fd2 += fd * fd;
    an2 += analytic[i] * analytic[i];
  }
  GradCheck r{std::move(name), 0, std::sqrt(an2), n};
  const double scale = std::max(std::sqrt(fd2), std::sqrt(an2));
  r.rel_error = scale > 0 ? std::sqrt(diff2) / scale : 0.0;
  return r;
}

/// Checks every parameter of `params` (their `grad()` must already hold the
/// analytic gradient of `loss`).
inline std::vector<GradCheck> check_params(const ParamList<double>& params, const std::function<double()>& loss,
                                           double eps = 1e-5) {
  std::vector<GradCheck> out;
  for (const auto& p : params) {
    const Matrix<double> analytic = p.grad();  // copy: loss() may not touch grads, but be safe
    out.push_back(check_values(p.name, p.value_data, analytic.data(), p.size(), loss, eps));
  }
  return out;
}

/// Random matrix with entries U(−scale, scale), seeded.
inline Matrix<double> random_matrix(Index rows, Index cols, std::uint64_t seed, double scale = 1.0) {
  Rng rng(seed);
  Matrix<double> m(rows, cols);
  fill_uniform(m, rng, scale);
  return m;
}

/// Σ_ij a_ij b_ij.
template <class A, class B>
double dot_all(const A& a, const B& b) {
  return (a.array() * b.array()).sum();
}

}  // namespace apex::test

// Runs CHECK on every result with its name attached.
#define APEX_CHECK_GRADS(results, tol)                                     \
  for (const auto& gc_ : (results)) {                                      \
    INFO("gradient " << gc_.name << ": rel " << gc_.rel_error << " over " \
                     << gc_.checked << " entries, |g| " << gc_.analytic_norm); \
    CHECK(gc_.rel_error <= (tol));                                         \
  }
