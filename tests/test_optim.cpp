// The optimiser (optim/) and its state files (io/optimizer_state.hpp):
// AdamW's update against PyTorch's formula computed unfolded in double and
// against torch.optim.AdamW and clip_grad_norm_ runs (tests/data/optim_adamw_*,
// written by tools/optim_reference.py; a fresh pair when optim_interop.cmake
// made one), clipping's exact rule, the schedule against PyTorch's
// schedulers, the decay rule, rejected steps and states that change nothing,
// a resumed run bitwise equal to the uninterrupted one, and every way a
// state file is refused, by message.
#include <apex/ffn/io/checkpoint.hpp>
#include <apex/ffn/io/optimizer_state.hpp>
#include <apex/ffn/layers/rms_norm.hpp>
#include <apex/ffn/layers/swiglu.hpp>
#include <apex/ffn/optim/adamw.hpp>
#include <apex/ffn/optim/clip.hpp>
#include <apex/ffn/optim/schedule.hpp>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include "checkpoint_bytes.hpp"
#include "gradcheck.hpp"
#include "temp_dir.hpp"

using namespace apex;
namespace fs = std::filesystem;
namespace st = apex::safetensors;
using Catch::Matchers::Contains;
using Catch::Matchers::WithinAbs;
using Catch::Matchers::WithinRel;
using apex::test::read_bytes;
using apex::test::TempDir;

namespace {

/// A small model with names of both kinds: RMSNorm ("norm.weight", no decay)
/// then SwiGLU ("ffn.w_gate.weight", "ffn.w_up.weight", "ffn.w_down.weight").
template <class T>
struct OptimNet {
  RMSNorm<T> norm;
  SwiGLU<T> ffn;
  OptimNet(std::uint64_t seed, Index d_ffn = 10) : norm(6), ffn(6, d_ffn, seed) {
    Rng rng(seed + 7);
    fill_uniform(norm.gain(), rng, 0.5);
    norm.gain().array() += T(1);
  }
  ParamList<T> params() {
    ParamList<T> l;
    detail::append_prefixed(l, "norm.", norm.params());
    detail::append_prefixed(l, "ffn.", ffn.params());
    return l;
  }
  ParamList<T> param_values() {
    ParamList<T> l;
    detail::append_prefixed(l, "norm.", norm.param_values());
    detail::append_prefixed(l, "ffn.", ffn.param_values());
    return l;
  }
  /// The gradients of L = Σ ffn(norm(x)) ⊙ r for a batch drawn from `batch`.
  void gradient(std::uint64_t batch) {
    const Matrix<T> x = apex::test::random_matrix(5, 6, 100 + batch).template cast<T>();
    const Matrix<T> r = apex::test::random_matrix(5, 6, 200 + batch).template cast<T>();
    norm.zero_grad();
    ffn.zero_grad();
    typename RMSNorm<T>::Cache nc;
    typename SwiGLU<T>::Cache fc;
    (void)ffn.forward(norm.forward(x, &nc), &fc);
    (void)norm.backward(ffn.backward(r, fc), nc);
  }
};

/// One training step as a loop would run it: gradient, clipping, AdamW.
template <class T>
void optim_train_step(OptimNet<T>& net, AdamW<T>& opt, long s) {
  net.gradient(std::uint64_t(s));
  clip_grad_norm(opt.params(), 0.5);
  opt.step(warmup_cosine(s, 12, 3, 0.05));
}

template <class T>
bool optim_same_bits(const T* a, const T* b, Index n) {
  return std::memcmp(a, b, std::size_t(n) * sizeof(T)) == 0;
}

/// Whether two optimiser states are bitwise the same.
template <class T>
bool optim_same_state(const AdamWState<T>& a, const AdamWState<T>& b) {
  if (a.step != b.step || a.decay != b.decay || a.exp_avg.size() != b.exp_avg.size()) return false;
  if (a.options.beta1 != b.options.beta1 || a.options.beta2 != b.options.beta2 || a.options.eps != b.options.eps ||
      a.options.weight_decay != b.options.weight_decay)
    return false;
  for (std::size_t i = 0; i < a.exp_avg.size(); ++i)
    if (a.exp_avg[i].size() != b.exp_avg[i].size() ||
        !optim_same_bits(a.exp_avg[i].data(), b.exp_avg[i].data(), a.exp_avg[i].size()) ||
        !optim_same_bits(a.exp_avg_sq[i].data(), b.exp_avg_sq[i].data(), a.exp_avg_sq[i].size()))
      return false;
  return true;
}

/// Whether every parameter value of `a` and `b` is bitwise the same.
template <class T>
bool optim_same_values(const ParamList<T>& a, const ParamList<T>& b) {
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!optim_same_bits(a[i].value_data, b[i].value_data, a[i].size())) return false;
  return true;
}

/// max over elements of |a − b| / max(|b|, floor).
template <class A, class B>
double optim_rel_err(const A& a, const B& b, double floor = 0) {
  const Matrix<double> x = a.template cast<double>(), y = b.template cast<double>();
  double e = 0;
  for (Index i = 0; i < x.size(); ++i)
    e = std::max(e, std::abs(x.data()[i] - y.data()[i]) / std::max(std::abs(y.data()[i]), floor));
  return e;
}

/// Copies the state file `in` to `out` with `edit` applied to its metadata
/// and tensors (stored as F64 or F32 as they were).
template <class T>
void optim_rewrite(const std::string& in, const std::string& out,
                   const std::function<void(st::Metadata&, std::map<std::string, Matrix<T>>&)>& edit) {
  const st::Reader f(in);
  st::Metadata meta = f.metadata();
  std::map<std::string, Matrix<T>> tensors;
  for (const auto& t : f.tensors()) tensors[t.name] = f.matrix<T>(t.name);
  edit(meta, tensors);
  std::vector<st::TensorRef<T>> refs;
  for (const auto& [name, m] : tensors) refs.push_back({name, {std::uint64_t(m.rows()), std::uint64_t(m.cols())}, m.data()});
  st::save(out, refs, st::dtype_of<T>(), meta);
}

}  // namespace

TEST_CASE("AdamW's first step moves every weight by lr against its gradient", "[optim][adamw]") {
  Matrix<double> w = Matrix<double>::Constant(2, 3, 1.0), gw(2, 3);
  RowVector<double> gain = RowVector<double>::Ones(3), ggain(3);
  gw << 0.5, -2.0, 1e-3, -1e-3, 4.0, -0.25;
  ggain << 1.0, -1.0, 0.0;
  ParamList<double> params = {detail::make_param<double>("fc.weight", w, gw),
                              detail::make_param<double>("norm.weight", gain, ggain)};
  AdamWOptions o;
  o.weight_decay = 0.1;
  AdamW<double> opt(params, o);
  CHECK(opt.decays(0));
  CHECK_FALSE(opt.decays(1));
  const double lr = 0.01;
  opt.step(lr);
  // Bias correction makes m̂/√v̂ = g/|g| on step 1, whatever |g|; decay multiplies by 1 − lr·λ first.
  for (Index i = 0; i < w.size(); ++i) {
    const double g = gw.data()[i];
    CHECK_THAT(w.data()[i], WithinAbs(1.0 * (1 - lr * 0.1) - lr * g / (std::abs(g) + 1e-8), 1e-9));
  }
  CHECK_THAT(gain(0), WithinAbs(1.0 - lr, 1e-9));
  CHECK_THAT(gain(1), WithinAbs(1.0 + lr, 1e-9));
  CHECK(gain(2) == 1.0);  // no gradient, no decay: unchanged
  CHECK(opt.steps() == 1);
}

TEST_CASE("AdamW minimises a quadratic and clipping bounds the global norm", "[optim][adamw]") {
  Matrix<double> x = Matrix<double>::Zero(1, 4), g(1, 4);
  const Matrix<double> c = (Matrix<double>(1, 4) << 3, -1, 0.5, 2).finished();
  ParamList<double> params = {detail::make_param<double>("x.weight", x, g)};
  AdamWOptions o;
  o.beta2 = 0.99;
  o.weight_decay = 0;
  AdamW<double> opt(params, o);
  for (int s = 0; s < 600; ++s) {
    g = x - c;  // ∇ ½‖x − c‖²
    opt.step(warmup_cosine(s, 600, 10, 0.1, 0.01));
  }
  CHECK((x - c).norm() < 1e-2);
  CHECK(opt.steps() == 600);

  g << 3, 4, 0, 0;
  CHECK_THAT(clip_grad_norm(params, 1.0), WithinRel(5.0, 1e-12));
  CHECK_THAT(g.norm(), WithinRel(1.0, 1e-6));
  CHECK_THAT(clip_grad_norm(params, 10.0), WithinRel(1.0, 1e-6));  // under the bound: unchanged
  CHECK_THAT(g.norm(), WithinRel(1.0, 1e-6));
}

TEMPLATE_TEST_CASE("AdamW's folded update equals PyTorch's formula computed unfolded in double", "[optim][adamw]",
                   float, double) {
  using T = TestType;
  // Three parameters, one without decay; ε = 1e-3 against gradients down to 1e-6, so ε's place matters.
  const std::vector<std::pair<Index, Index>> shapes{{4, 3}, {1, 4}, {2, 5}};
  const std::vector<std::string> names{"a.weight", "a.bias", "b.weight"};
  std::vector<Matrix<T>> value, grad;
  std::vector<Matrix<double>> theta, m, v;  // the reference, in double
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    const auto [r, c] = shapes[i];
    value.push_back(apex::test::random_matrix(r, c, 10 + i).template cast<T>());
    grad.push_back(Matrix<T>::Zero(r, c));
    theta.push_back(value.back().template cast<double>());
    m.push_back(Matrix<double>::Zero(r, c));
    v.push_back(Matrix<double>::Zero(r, c));
  }
  ParamList<T> params;
  for (std::size_t i = 0; i < shapes.size(); ++i) params.push_back(detail::make_param<T>(names[i], value[i], grad[i]));
  const AdamWOptions o{0.8, 0.97, 1e-3, 0.05};
  AdamW<T> opt(params, o);
  for (long t = 1; t <= 40; ++t) {
    const double lr = warmup_cosine(t - 1, 40, 5, 0.02);
    const double bc1 = 1 - std::pow(o.beta1, double(t)), bc2 = 1 - std::pow(o.beta2, double(t));
    for (std::size_t i = 0; i < shapes.size(); ++i) {
      Matrix<double> g = apex::test::random_matrix(grad[i].rows(), grad[i].cols(), 1000 * t + i);
      g.array() *= Eigen::pow(10.0, -6.0 * g.array().abs());  // magnitudes 1e-6 … 1
      grad[i] = g.cast<T>();
      g = grad[i].template cast<double>();  // the reference sees the same (rounded) gradient
      if (opt.decays(i)) theta[i] *= 1 - lr * o.weight_decay;
      m[i] = o.beta1 * m[i] + (1 - o.beta1) * g;
      v[i] = o.beta2 * v[i] + (1 - o.beta2) * g.cwiseProduct(g);
      theta[i].array() -= lr * (m[i].array() / bc1) / ((v[i].array() / bc2).sqrt() + o.eps);
    }
    opt.step(lr);
  }
  CHECK_FALSE(opt.decays(1));
  // float: 40 steps of rounding in θ (≈ 1) at 6e-8 each; double: at 1e-16 each.
  const double tol = std::is_same_v<T, float> ? 1e-5 : 1e-13;
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    INFO(names[i]);
    CHECK(optim_rel_err(value[i], theta[i], 1.0) <= tol);
    CHECK(optim_rel_err(opt.exp_avg(i), m[i], m[i].cwiseAbs().maxCoeff()) <= tol);
    CHECK(optim_rel_err(opt.exp_avg_sq(i), v[i], v[i].cwiseAbs().maxCoeff()) <= tol);
  }
}

TEMPLATE_TEST_CASE("AdamW and clip_grad_norm match torch.optim.AdamW and clip_grad_norm_", "[optim][reference]",
                   float, double) {
  using T = TestType;
  const bool is_float = std::is_same_v<T, float>;
  const std::string file = std::string("optim_adamw_") + (is_float ? "f32" : "f64") + ".safetensors";
  const double tol = is_float ? 1e-6 : 1e-12;
  std::vector<fs::path> dirs{fs::path(__FILE__).parent_path() / "data"};
  if (const char* d = std::getenv("APEX_FFN_OPTIM_DIR")) dirs.emplace_back(d);
  for (const fs::path& dir : dirs) {
    const std::string path = (dir / file).string();
    INFO(path);
    REQUIRE(fs::exists(path));
    const st::Reader f(path);
    const auto meta = [&](const char* key) { return std::stod(f.metadata().at(key)); };
    const std::vector<std::string> names = nlohmann::json::parse(f.metadata().at("params"));
    const std::vector<std::string> no_decay = nlohmann::json::parse(f.metadata().at("no_decay"));
    std::vector<Matrix<T>> value, grad;
    for (const auto& n : names) {
      value.push_back(f.matrix<T>("init." + n));
      grad.push_back(Matrix<T>::Zero(value.back().rows(), value.back().cols()));
    }
    ParamList<T> params;
    for (std::size_t i = 0; i < names.size(); ++i) params.push_back(detail::make_param<T>(names[i], value[i], grad[i]));
    AdamW<T> opt(params, AdamWOptions{meta("beta1"), meta("beta2"), meta("eps"), meta("weight_decay")});
    for (std::size_t i = 0; i < names.size(); ++i)  // PyTorch's weight_decay-0 group is the default rule's
      CHECK(opt.decays(i) == (std::find(no_decay.begin(), no_decay.end(), names[i]) == no_decay.end()));

    const Matrix<double> lr = f.matrix<double>("lr"), norm = f.matrix<double>("norm");
    double norm_err = 0, value_err = 0, moment_err = 0;
    int clipped = 0;
    for (Index k = 0; k < lr.size(); ++k) {
      for (std::size_t i = 0; i < names.size(); ++i)  // into the buffers the params view (not a move)
        params[i].grad() = f.matrix<T>("grad." + std::to_string(k) + "." + names[i]);
      const double n = clip_grad_norm(params, meta("max_norm"));
      clipped += n > meta("max_norm");
      norm_err = std::max(norm_err, std::abs(n - norm(k)) / norm(k));
      opt.step(lr(k));
      for (std::size_t i = 0; i < names.size(); ++i)
        value_err = std::max(value_err, optim_rel_err(value[i], f.matrix<T>("after." + std::to_string(k) + "." + names[i])));
    }
    for (std::size_t i = 0; i < names.size(); ++i)
      for (const auto& [mine, tag] : {std::pair<const Matrix<T>*, const char*>{&opt.exp_avg(i), ".exp_avg"},
                                      {&opt.exp_avg_sq(i), ".exp_avg_sq"}}) {
        const Matrix<T> theirs = f.matrix<T>("state." + names[i] + tag);
        moment_err = std::max(moment_err, optim_rel_err(*mine, theirs, double(theirs.cwiseAbs().maxCoeff())));
      }
    CHECK(clipped >= 2);                     // the run exercises both sides of the clip
    CHECK(clipped < int(lr.size()));
    CHECK(norm_err <= tol);                  // clip_grad_norm_'s returned norm
    CHECK(value_err <= tol);                 // every parameter after every step, elementwise relative
    CHECK(moment_err <= tol);                // exp_avg, exp_avg_sq, relative to each tensor's largest entry
    CHECK(opt.steps() == lr.size());
  }
}

TEST_CASE("warmup_cosine is PyTorch's LinearLR then CosineAnnealingLR and keeps its floor", "[optim][schedule]") {
  const st::Reader f((fs::path(__FILE__).parent_path() / "data" / "optim_adamw_f64.safetensors").string());
  const auto meta = [&](const char* key) { return std::stod(f.metadata().at(key)); };
  const long warmup = long(meta("schedule_warmup")), total = long(meta("schedule_total"));
  const Matrix<double> torch_lr = f.matrix<double>("schedule.lr");
  REQUIRE(torch_lr.size() == total + 1);
  for (long s = 0; s <= total; ++s) {
    INFO("step " << s);
    CHECK_THAT(warmup_cosine(s, total, warmup, meta("schedule_peak"), meta("schedule_floor")),
               WithinRel(torch_lr(s), 1e-12));
  }
  CHECK(warmup_cosine(3, 100, 10, 1.0) == 0.4);           // (s + 1) / W · peak
  CHECK(warmup_cosine(9, 100, 10, 1.0) == 1.0);           // the peak at W − 1 …
  CHECK_THAT(warmup_cosine(10, 100, 10, 1.0), WithinRel(1.0, 1e-15));  // … and at W
  CHECK_THAT(warmup_cosine(55, 100, 10, 1.0), WithinRel(0.55, 1e-12));  // half way: f + (1 − f)/2
  CHECK_THAT(warmup_cosine(500, 100, 10, 2.0, 0.25), WithinRel(0.5, 1e-15));  // past the end: the floor
  CHECK_THAT(warmup_cosine(0, 10, 0, 1.0), WithinRel(1.0, 1e-15));    // no warmup
  CHECK(warmup_cosine(7, 5, 100, 1.0) == 0.08);           // a warmup longer than the run
  CHECK_THROWS_WITH(warmup_cosine(-1, 10, 2, 1.0), "warmup_cosine: step must be >= 0, got -1");
  CHECK_THROWS_WITH(warmup_cosine(0, 0, 0, 1.0), "warmup_cosine: total must be >= 1, got 0");
  CHECK_THROWS_WITH(warmup_cosine(0, 10, -2, 1.0), "warmup_cosine: warmup must be >= 0, got -2");
  CHECK_THROWS_WITH(warmup_cosine(0, 10, 2, std::nan("")), "warmup_cosine: peak must be finite and >= 0, got nan");
  CHECK_THROWS_WITH(warmup_cosine(0, 10, 2, 1.0, 1.5), "warmup_cosine: floor_fraction must lie in [0, 1], got 1.5");
}

TEST_CASE("clip_grad_norm scales exactly where PyTorch does and refuses a non-finite norm", "[optim][clip]") {
  Matrix<double> a(1, 2), ga(1, 2), b(1, 3), gb(1, 3);
  a.setZero();
  b.setZero();
  ParamList<double> params = {detail::make_param<double>("a.weight", a, ga),
                              detail::make_param<double>("b.weight", b, gb)};
  ga << 3, 0;
  gb << 0, 4, 0;
  // ‖g‖ = max_norm exactly: c = 5 / (5 + 1e-6) < 1 scales it, as min(c, 1) does in PyTorch.
  CHECK(clip_grad_norm(params, 5.0) == 5.0);
  CHECK(ga(0) == 3.0 * (5.0 / (5.0 + 1e-6)));
  CHECK(gb(1) == 4.0 * (5.0 / (5.0 + 1e-6)));
  // ‖g‖ below max_norm − 1e-6: c ≥ 1, the gradients keep their bits.
  ga << 3, 0;
  gb << 0, 4, 0;
  CHECK(clip_grad_norm(params, 5.00001) == 5.0);
  CHECK(ga(0) == 3.0);
  CHECK(gb(1) == 4.0);
  // A zero gradient stays zero (c = max_norm / 1e-6 ≥ 1).
  ga.setZero();
  gb.setZero();
  CHECK(clip_grad_norm(params, 1.0) == 0.0);
  CHECK(grad_norm(params) == 0.0);

  // Finite gradients whose squares overflow double still have a norm.
  ga << 3e200, 0;
  gb << 0, 4e200, 0;
  CHECK_THAT(clip_grad_norm(params, 1.0), WithinRel(5e200, 1e-15));
  CHECK_THAT(ga(0), WithinRel(0.6, 1e-12));
  CHECK_THAT(gb(1), WithinRel(0.8, 1e-12));

  ga << 1, 2;
  gb << 3, std::nan(""), 5;
  CHECK_THROWS_MATCHES(clip_grad_norm(params, 1.0), ValueError,
                       Catch::Matchers::Message("grad_norm: the gradient of 'b.weight' is NaN at element 1 (row 0, column 1)"));
  CHECK(ga(1) == 2.0);  // nothing scaled
  CHECK(gb(2) == 5.0);
  gb(1) = -std::numeric_limits<double>::infinity();
  CHECK_THROWS_WITH(grad_norm(params), Contains("'b.weight' is -Inf at element 1"));

  gb << 3, 4, 5;
  for (double bad : {0.0, -1.0, std::nan(""), HUGE_VAL})
    CHECK_THROWS_MATCHES(clip_grad_norm(params, bad), ConfigError,
                         Catch::Matchers::Message("clip_grad_norm: max_norm must be finite and > 0, got " + detail::number(bad)));
  CHECK(gb(2) == 5.0);
}

TEST_CASE("The decay rule skips gains, biases and kappa's alpha and can be replaced", "[optim][adamw]") {
  CHECK(name_ends_with("layers.1.ffn.experts.0.kappa_bias", "bias"));
  CHECK_FALSE(decays_by_default("layers.0.norm.weight"));
  CHECK_FALSE(decays_by_default("embed.proj.bias"));
  CHECK_FALSE(decays_by_default("router.bias"));
  CHECK_FALSE(decays_by_default("experts.2.kappa_alpha"));
  CHECK(decays_by_default("layers.1.ffn.router.weight"));
  CHECK(decays_by_default("experts.3.w_gate.weight"));

  // A rule that decays nothing, with λ = 0.5, moves the weights as λ = 0 does.
  OptimNet<double> a(1), b(1);
  AdamWOptions decayed, plain;
  decayed.weight_decay = 0.5;
  plain.weight_decay = 0;
  AdamW<double> oa(a.params(), decayed, [](const std::string&) { return false; });
  AdamW<double> ob(b.params(), plain);
  for (long s = 0; s < 3; ++s) {
    optim_train_step(a, oa, s);
    optim_train_step(b, ob, s);
  }
  CHECK(optim_same_values(a.param_values(), b.param_values()));
  OptimNet<double> c(1);
  AdamW<double> oc(c.params(), decayed);  // the default rule with λ = 0.5 does change them
  for (long s = 0; s < 3; ++s) optim_train_step(c, oc, s);
  CHECK_FALSE(optim_same_values(c.param_values(), b.param_values()));
}

TEMPLATE_TEST_CASE("AdamW rejects bad options, learning rates and gradients and changes nothing", "[optim][adamw]",
                   float, double) {
  using T = TestType;
  OptimNet<T> net(3);
  const auto options = [](double b1, double b2, double eps, double wd) { return AdamWOptions{b1, b2, eps, wd}; };
  const auto rejects = [&](const AdamWOptions& o, const std::string& msg) {
    CHECK_THROWS_MATCHES(AdamW<T>(net.params(), o), ConfigError, Catch::Matchers::Message(msg));
  };
  rejects(options(1.0, 0.999, 1e-8, 0), "AdamW: beta1 must lie in [0, 1), got 1");
  rejects(options(0.9, -0.1, 1e-8, 0), "AdamW: beta2 must lie in [0, 1), got -0.1");
  rejects(options(0.9, std::nan(""), 1e-8, 0), "AdamW: beta2 must lie in [0, 1), got nan");
  rejects(options(0.9, 0.999, 0, 0), "AdamW: eps must be finite and > 0, got 0");
  rejects(options(0.9, 0.999, HUGE_VAL, 0), "AdamW: eps must be finite and > 0, got inf");
  rejects(options(0.9, 0.999, 1e-8, -1), "AdamW: weight_decay must be finite and >= 0, got -1");
  rejects(options(0.9, 0.999, 1e-8, std::nan("")), "AdamW: weight_decay must be finite and >= 0, got nan");
  if constexpr (std::is_same_v<T, float>) {
    rejects(options(0.9, 0.999, 1e39, 0), "AdamW: eps must lie within the range of the layer's scalar type float "
                                          "(|value| <= 3.40282e+38), got 1e+39");
    CHECK_THROWS_WITH(AdamW<T>(net.params(), options(0.9, 0.999, 1e-44, 0)),
                      Contains("eps must not vanish in float: the first step adds eps·sqrt(1 - beta2)"));
  } else {
    CHECK_NOTHROW(AdamW<T>(net.params(), options(0.9, 0.999, 1e-44, 0)));
  }
  CHECK_THROWS_MATCHES(AdamW<T>(net.param_values()), NoGradientError,
                       Catch::Matchers::Message("AdamW: parameter 'norm.weight' is a values-only view (param_values()); take "
                                      "the list from params()"));

  AdamW<T> opt(net.params());
  optim_train_step(net, opt, 0);  // a state worth keeping
  const AdamWState<T> before = opt.state();
  const auto values = apex::test::snapshot(net.param_values());
  for (double lr : {std::nan(""), -1e-3, HUGE_VAL})
    CHECK_THROWS_MATCHES(opt.step(lr), ConfigError,
                         Catch::Matchers::Message("AdamW::step: lr must be finite and >= 0, got " + detail::number(lr)));
  net.gradient(1);
  net.ffn.params()[2].grad()(1, 2) = std::numeric_limits<T>::quiet_NaN();  // ffn.w_down.weight: 6 × 10
  CHECK_THROWS_MATCHES(opt.step(1e-3), ValueError,
                       Catch::Matchers::Message("AdamW::step: the gradient of 'ffn.w_down.weight' is NaN at element 12 "
                                      "(row 1, column 2)"));
  net.ffn.params()[2].grad()(1, 2) = std::numeric_limits<T>::infinity();
  CHECK_THROWS_WITH(opt.step(1e-3), Contains("is +Inf at element 12"));
  CHECK(optim_same_state(opt.state(), before));  // the earlier parameters' gradients were finite: still untouched
  CHECK(apex::test::unchanged(net.param_values(), values));
}

TEMPLATE_TEST_CASE("AdamW::restore checks the whole state before it changes anything", "[optim][adamw]", float,
                   double) {
  using T = TestType;
  OptimNet<T> net(4);
  AdamW<T> opt(net.params());
  optim_train_step(net, opt, 0);
  const AdamWState<T> before = opt.state();
  const auto refused = [&](const std::function<void(AdamWState<T>&)>& edit) {
    AdamWState<T> s = before;
    s.step = 9;  // every accepted field changed too, so a partial commit would show
    s.exp_avg[0].setConstant(T(0.25));
    edit(s);
    return s;
  };
  CHECK_THROWS_MATCHES(opt.restore(refused([](auto& s) { s.exp_avg.pop_back(); })), ShapeError,
                       Catch::Matchers::Message("AdamW::restore: the state has 4 decay flags, 3 exp_avg and 4 exp_avg_sq "
                                      "tensors; the optimiser has 4 parameters"));
  CHECK_THROWS_MATCHES(opt.restore(refused([](auto& s) { s.exp_avg_sq[3].resize(10, 6); })), ShapeError,
                       Catch::Matchers::Message("AdamW::restore: argument 'ffn.w_down.weight.exp_avg_sq' has shape [10 x 6], "
                                      "expected [6 x 10]"));
  CHECK_THROWS_MATCHES(opt.restore(refused([](auto& s) { s.exp_avg[2](0, 3) = T(NAN); })), ValueError,
                       Catch::Matchers::Message("AdamW::restore: 'ffn.w_up.weight.exp_avg' is NaN at element 3 (row 0, "
                                      "column 3)"));
  CHECK_THROWS_MATCHES(opt.restore(refused([](auto& s) { s.exp_avg_sq[1](1, 1) = T(-0.5); })), ValueError,
                       Catch::Matchers::Message("AdamW::restore: 'ffn.w_gate.weight.exp_avg_sq' is negative (-0.5) at element 7 "
                                      "(row 1, column 1); a second moment is a mean of squares"));
  CHECK_THROWS_MATCHES(opt.restore(refused([](auto& s) { s.step = -1; })), ValueError,
                       Catch::Matchers::Message("AdamW::restore: step must be >= 0, got -1"));
  CHECK_THROWS_MATCHES(opt.restore(refused([](auto& s) { s.options.beta1 = 2; })), ConfigError,
                       Catch::Matchers::Message("AdamW::restore: beta1 must lie in [0, 1), got 2"));
  CHECK(optim_same_state(opt.state(), before));
  AdamWState<T> good = refused([](auto&) {});
  opt.restore(good);
  CHECK(opt.steps() == 9);
  CHECK(optim_same_state(opt.state(), good));
}

TEMPLATE_TEST_CASE("A run resumed from saved state continues bitwise as the uninterrupted run", "[optim][state]",
                   float, double) {
  using T = TestType;
  TempDir dir;
  const long k = 4, n = 9;
  OptimNet<T> a(1);
  AdamW<T> oa(a.params());
  for (long s = 0; s < k; ++s) optim_train_step(a, oa, s);
  save_checkpoint(dir / "model.safetensors", a.param_values());
  save_optimizer_state(dir / "adamw.safetensors", oa);
  for (long s = k; s < n; ++s) optim_train_step(a, oa, s);

  OptimNet<T> b(2);  // other weights until loaded
  load_checkpoint(dir / "model.safetensors", b.param_values());
  AdamW<T> ob(b.params());
  load_optimizer_state(dir / "adamw.safetensors", ob);
  CHECK(ob.steps() == k);
  for (long s = k; s < n; ++s) optim_train_step(b, ob, s);
  CHECK(optim_same_values(a.param_values(), b.param_values()));
  CHECK(optim_same_state(oa.state(), ob.state()));

  // Without the state (fresh moments, step 0) the same continuation differs: the state is what carries it.
  OptimNet<T> c(2);
  load_checkpoint(dir / "model.safetensors", c.param_values());
  AdamW<T> oc(c.params());
  for (long s = k; s < n; ++s) optim_train_step(c, oc, s);
  CHECK_FALSE(optim_same_values(a.param_values(), c.param_values()));
}

TEST_CASE("A state file holds exp_avg and exp_avg_sq per parameter and the options as metadata", "[optim][state]") {
  TempDir dir;
  OptimNet<float> net(5);
  AdamW<float> opt(net.params());
  for (long s = 0; s < 2; ++s) optim_train_step(net, opt, s);
  save_optimizer_state(dir / "adamw.safetensors", opt);
  const st::Reader f(dir / "adamw.safetensors");
  const st::Metadata want{{"optimizer", "AdamW"}, {"step", "2"},          {"beta1", "0.9"},
                          {"beta2", "0.999"},     {"eps", "1e-08"},       {"weight_decay", "0.01"},
                          {"no_decay", "[\"norm.weight\"]"}};
  CHECK(f.metadata() == want);
  REQUIRE(f.tensors().size() == 8);
  const ParamList<float> params = opt.params();
  for (std::size_t i = 0; i < params.size(); ++i) {
    for (const auto& [tag, m] : {std::pair<const char*, const Matrix<float>*>{".exp_avg", &opt.exp_avg(i)},
                                 {".exp_avg_sq", &opt.exp_avg_sq(i)}}) {
      const st::TensorInfo& t = f.at(params[i].name + tag);
      CHECK(t.dtype == st::DType::F32);
      CHECK(t.shape == std::vector<std::uint64_t>{std::uint64_t(params[i].rows), std::uint64_t(params[i].cols)});
      const Matrix<float> stored = f.matrix<float>(t.name);
      CHECK(optim_same_bits(stored.data(), m->data(), m->size()));
    }
  }
}

TEST_CASE("A state file that does not fit the optimiser is refused by name and changes nothing", "[optim][state]") {
  TempDir dir;
  const std::string good = dir / "adamw.safetensors", bad = dir / "bad.safetensors";
  OptimNet<double> src(6);
  AdamW<double> saved(src.params());
  for (long s = 0; s < 2; ++s) optim_train_step(src, saved, s);
  save_optimizer_state(good, saved);

  OptimNet<double> net(7);
  AdamW<double> opt(net.params());
  optim_train_step(net, opt, 5);
  const AdamWState<double> before = opt.state();
  const auto refused = [&](AdamW<double>& o, const std::string& path, const std::string& msg,
                           const OptimizerStateOptions& lo = {}) {
    const AdamWState<double> was = o.state();
    CHECK_THROWS_WITH(load_optimizer_state(path, o, lo), Contains(msg));
    CHECK(optim_same_state(o.state(), was));
  };
  const auto edited = [&](const std::function<void(st::Metadata&, std::map<std::string, Matrix<double>>&)>& edit) {
    optim_rewrite<double>(good, bad, edit);
    return bad;
  };

  // Names, shapes, dtypes.
  OptimNet<double> wider(7, 12);
  AdamW<double> o_wider(wider.params());
  CHECK_THROWS_AS(load_optimizer_state(good, o_wider), ShapeError);
  refused(o_wider, good, "shape mismatch: 'ffn.w_gate.weight.exp_avg' is [10, 6] in the file, the parameter [12, 6]; ");
  refused(o_wider, good, "; 'ffn.w_down.weight.exp_avg' is [6, 10] in the file, the parameter [6, 12]; ");
  ParamList<double> ffn_only;
  detail::append_prefixed(ffn_only, "ffn.", net.ffn.params());
  AdamW<double> o_ffn(ffn_only);
  CHECK_THROWS_AS(load_optimizer_state(good, o_ffn), FormatError);
  refused(o_ffn, good, "the file does not match the optimiser's parameters: unexpected 'norm.weight.exp_avg', "
                       "'norm.weight.exp_avg_sq';");
  Matrix<double> extra = Matrix<double>::Ones(2, 2), extra_grad = Matrix<double>::Zero(2, 2);
  ParamList<double> more = net.params();
  more.push_back(detail::make_param<double>("extra.weight", extra, extra_grad));
  AdamW<double> o_more(more);
  refused(o_more, good, "missing 'extra.weight.exp_avg', 'extra.weight.exp_avg_sq';");
  OptimNet<float> single(7);
  AdamW<float> o_float(single.params());
  const AdamWState<float> float_before = o_float.state();
  CHECK_THROWS_WITH(load_optimizer_state(good, o_float),
                    Contains("the state of an AdamW<float> loads only from F32 tensors: "
                             "'norm.weight.exp_avg (F64)', 'norm.weight.exp_avg_sq (F64)', 'ffn.w_gate"));
  CHECK(optim_same_state(o_float.state(), float_before));
  save_checkpoint(bad, src.param_values());
  refused(opt, bad, "the file's metadata has no 'optimizer' (not an AdamW state file?)");

  // Options: a mismatch names the field unless the file's are taken.
  AdamWOptions other;
  other.beta2 = 0.99;
  AdamW<double> o_beta(net.params(), other);
  CHECK_THROWS_AS(load_optimizer_state(good, o_beta), ConfigError);
  refused(o_beta, good, "beta2 is 0.999 in the file, 0.99 in the optimiser (set take_file_options to adopt the file's)");
  AdamW<double> o_rule(net.params(), AdamWOptions{}, [](const std::string&) { return true; });
  refused(o_rule, good, "no_decay: the optimiser decays 'norm.weight', the file does not");
  OptimizerStateOptions take;
  take.take_file_options = true;
  load_optimizer_state(good, o_beta, take);
  CHECK(o_beta.options().beta2 == 0.999);
  load_optimizer_state(good, o_rule, take);
  CHECK_FALSE(o_rule.decays(0));
  CHECK(optim_same_state(o_rule.state(), saved.state()));

  // Malformed metadata and values.
  refused(opt, edited([](auto& m, auto&) { m["optimizer"] = "SGD"; }), "the file holds the state of 'SGD', not of AdamW");
  refused(opt, edited([](auto& m, auto&) { m["step"] = "12x"; }), "metadata 'step' is '12x', not a number");
  refused(opt, edited([](auto& m, auto&) { m["step"] = "-3"; }), "metadata 'step' is -3, expected >= 0");
  refused(opt, edited([](auto& m, auto&) { m.erase("eps"); }), "the file's metadata has no 'eps'");
  refused(opt, edited([](auto& m, auto&) { m["no_decay"] = "{\"norm.weight\": 1}"; }),
          "metadata 'no_decay' is not a JSON array of parameter names");
  refused(opt, edited([](auto& m, auto&) { m["no_decay"] = "[\"norm.weight\", \"gone.bias\"]"; }),
          "metadata 'no_decay' names 'gone.bias', which is not a parameter");
  refused(opt, edited([](auto& m, auto&) { m["beta1"] = "1.5"; }), "beta1 is 1.5 in the file, 0.9 in the optimiser");
  refused(opt, edited([](auto& m, auto&) { m["beta1"] = "1.5"; }), "beta1 must lie in [0, 1), got 1.5", take);
  refused(opt, edited([](auto&, auto& t) { t["ffn.w_up.weight.exp_avg"](0, 3) = NAN; }),
          "): AdamW::restore: 'ffn.w_up.weight.exp_avg' is NaN at element 3 (row 0, column 3)");
  refused(opt, edited([](auto&, auto& t) { t["norm.weight.exp_avg_sq"](0, 1) = -1; }),
          "'norm.weight.exp_avg_sq' is negative (-1) at element 1 (row 0, column 1)");
  CHECK(optim_same_state(opt.state(), before));
  load_optimizer_state(edited([](auto&, auto&) {}), opt);  // the untouched copy loads
  CHECK(optim_same_state(opt.state(), saved.state()));
}

TEST_CASE("Saving optimiser state is atomic and refuses names it cannot store", "[optim][state]") {
  TempDir dir;
  const std::string path = dir / "adamw.safetensors";
  OptimNet<double> net(8);
  AdamW<double> first(net.params()), second(net.params());
  optim_train_step(net, second, 0);
  save_optimizer_state(path, first);
  save_optimizer_state(path, second);  // replaces the file whole
  AdamW<double> back(net.params());
  load_optimizer_state(path, back);
  CHECK(optim_same_state(back.state(), second.state()));
  CHECK(dir.entries() == 1);

  const auto bytes = read_bytes(path);
  Matrix<double> w = Matrix<double>::Ones(1, 2), g = Matrix<double>::Zero(1, 2);
  // A name that is not UTF-8 fails inside the write, after the temporary file was made.
  AdamW<double> bad_name(ParamList<double>{detail::make_param<double>("w\xff.weight", w, g)});
  CHECK_THROWS_AS(save_optimizer_state(path, bad_name), ValueError);
  CHECK_THROWS_WITH(save_optimizer_state(path, bad_name), Contains("not valid UTF-8"));
  AdamW<double> twice(ParamList<double>{detail::make_param<double>("w.weight", w, g),
                                        detail::make_param<double>("w.weight", w, g)});
  CHECK_THROWS_MATCHES(save_optimizer_state(path, twice), ValueError,
                       Catch::Matchers::Message("save_optimizer_state: the parameter list names 'w.weight' twice"));
  // A state load_optimizer_state refuses (ValueError) was saved, replacing
  // the last good one: a finite gradient whose square overflows leaves v at
  // +Inf. Fixed: the save checks the load's value rule first.
  Matrix<double> g_big = Matrix<double>::Zero(1, 2);
  AdamW<double> diverged(ParamList<double>{detail::make_param<double>("w.weight", w, g_big)});
  g_big(0, 1) = 1e200;
  diverged.step(1e-3);
  REQUIRE(std::isinf(diverged.exp_avg_sq(0)(0, 1)));
  CHECK_THROWS_MATCHES(save_optimizer_state(path, diverged), ValueError,
                       Catch::Matchers::Message("save_optimizer_state: 'w.weight.exp_avg_sq' is +Inf at element 1 "
                                                "(row 0, column 1)"));
  CHECK(read_bytes(path) == bytes);  // the previous file, whole
  CHECK(dir.entries() == 1);         // and no temporary file left
}
