/// \file float_ops.cpp
/// Float experts on a module's own 3-D tensors (float_experts.hpp), forward
/// and backward, over routing given by the caller (routed_experts.hpp).

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cstring>
#include <optional>
#include <string>

#include "float_experts.hpp"
#include "routed_experts.hpp"
#include "runtime.hpp"
#include "tensor_args.hpp"

namespace apex::python {
namespace {

/// The layout from the flags, ConfigError for an unknown gate.
FloatLayout layout_of(const std::string& gate, bool transposed, bool interleaved, bool has_bias, double alpha,
                      double limit) {
  FloatLayout l;
  l.transposed = transposed;
  l.interleaved = interleaved;
  l.has_bias = has_bias;
  if (gate == "silu") l.gate = GateKind::silu;
  else if (gate == "clamped") l.gate = GateKind::clamped;
  else throw ConfigError("apex_ffn: gate '" + gate + "' is not one of the library's: silu, clamped");
  l.alpha = float(alpha);
  l.limit = float(limit);
  if (l.gate == GateKind::clamped) ClampedSwiGLUOptions{alpha, limit}.validate("apex_ffn: clamped gate");
  return l;
}

/// The checked views of one call: shapes from gate_up and x.
struct FloatCall {
  FloatExperts experts;
  View<const float> x;
  View<const std::int64_t> ids;
  View<const float> w;
};

FloatCall float_call(const char* where, const Array& x, const Array& ids, const Array& w, const Array& gate_up,
                     const Array& down, const std::optional<Array>& gu_bias, const std::optional<Array>& down_bias,
                     FloatLayout l) {
  FloatCall c;
  c.x = view<const float>(where, "hidden_states", x, Elem::f32, 2);
  c.ids = view<const std::int64_t>(where, "top_k_index", ids, Elem::i64, 2);
  c.w = view<const float>(where, "top_k_weights", w, Elem::f32, 2);
  const auto gu = view<const float>(where, "gate_up_proj", gate_up, Elem::f32, 3);
  const auto dn = view<const float>(where, "down_proj", down, Elem::f32, 3);
  const Index e = gu.dim(0), d = c.x.dim(1);
  const Index two_f = l.transposed ? gu.dim(2) : gu.dim(1);
  if (two_f % 2 != 0) throw ShapeError(std::string(where) + ": argument 'gate_up_proj' has an odd gate/up width " + std::to_string(two_f));
  const Index f = two_f / 2;
  if (e < 1) throw ShapeError(std::string(where) + ": argument 'gate_up_proj' holds no experts");
  if (l.transposed) {
    expect_shape(where, "gate_up_proj", gu, {e, d, 2 * f});
    expect_shape(where, "down_proj", dn, {e, f, d});
  } else {
    expect_shape(where, "gate_up_proj", gu, {e, 2 * f, d});
    expect_shape(where, "down_proj", dn, {e, d, f});
  }
  expect_shape(where, "top_k_index", c.ids, {c.x.dim(0), -1});
  expect_shape(where, "top_k_weights", c.w, {c.x.dim(0), c.ids.dim(1)});
  l.experts = e, l.d = d, l.f = f;
  c.experts.l = l;
  c.experts.gate_up = gu.data;
  c.experts.down = dn.data;
  // The callers derive has_bias from gate_up_proj's bias alone: a down_proj bias without it would be dropped.
  if (gu_bias.has_value() != down_bias.has_value())
    throw ConfigError(std::string(where) + ": give both biases or neither; only '" +
                      (gu_bias ? "gate_up_proj_bias" : "down_proj_bias") + "' was given");
  if (l.has_bias) {
    const auto gb = view<const float>(where, "gate_up_proj_bias", *gu_bias, Elem::f32, 2);
    const auto db = view<const float>(where, "down_proj_bias", *down_bias, Elem::f32, 2);
    expect_shape(where, "gate_up_proj_bias", gb, {e, 2 * f});
    expect_shape(where, "down_proj_bias", db, {e, d});
    c.experts.gate_up_bias = gb.data;
    c.experts.down_bias = db.data;
  }
  return c;
}

void float_forward(const Array& x, const Array& ids, const Array& w, const Array& gate_up, const Array& down,
             const std::optional<Array>& gu_bias, const std::optional<Array>& down_bias, const std::string& gate,
             bool transposed, bool interleaved, double alpha, double limit, bool expert_parallel, const MutArray& y,
             const MutArray& y_sorted, const MutArray& work, int threads) {
  constexpr const char* where = "apex_ffn.float_experts";
  const FloatCall c = float_call(where, x, ids, w, gate_up, down, gu_bias, down_bias,
                                 layout_of(gate, transposed, interleaved, gu_bias.has_value(), alpha, limit));
  const Index n = c.x.dim(0), k = c.ids.dim(1), d = c.experts.l.d;
  const auto yv = view<float>(where, "y", y, Elem::f32, 2);
  const auto ys = view<float>(where, "y_sorted", y_sorted, Elem::f32, 2);
  const auto wk = view<float>(where, "work", work, Elem::f32, 2);
  expect_shape(where, "y", yv, {n, d});
  expect_shape(where, "y_sorted", ys, {n * k, d});
  expect_shape(where, "work", wk, {n * k, c.experts.work_cols()});
  nb::gil_scoped_release release;
  const Routing r = make_routing(where, c.ids.data, c.w.data, n, k, c.experts.l.experts, expert_parallel);
  Eigen::Map<Matrix<float>> wm(wk.data, n * k, c.experts.work_cols());
  wm.bottomRows(n * k - r.routed_rows()).setZero();
  python::forward(r, c.x.data, d, ys.data, yv.data, threads, [&](const apex::detail::ExpertTask& t, const auto& xs, auto&& yr) {
    c.experts.forward(t.id, xs, wm.middleRows(t.begin, t.rows), yr);
  });
}

void float_backward(const Array& x, const Array& ids, const Array& w, const Array& gate_up, const Array& down,
              const std::optional<Array>& gu_bias, const std::optional<Array>& down_bias, const std::string& gate,
              bool transposed, bool interleaved, double alpha, double limit, bool expert_parallel, const Array& dy,
              const Array& y_sorted, const Array& work, const MutArray& dx, const MutArray& d_weights,
              const std::optional<MutArray>& d_gate_up, const std::optional<MutArray>& d_down,
              const std::optional<MutArray>& d_gu_bias,
              const std::optional<MutArray>& d_down_bias, int threads) {
  constexpr const char* where = "apex_ffn.float_experts_backward";
  FloatCall c = float_call(where, x, ids, w, gate_up, down, gu_bias, down_bias,
                           layout_of(gate, transposed, interleaved, gu_bias.has_value(), alpha, limit));
  const Index n = c.x.dim(0), k = c.ids.dim(1), d = c.experts.l.d, f = c.experts.l.f, e = c.experts.l.experts;
  const auto dyv = view<const float>(where, "dy", dy, Elem::f32, 2);
  const auto ys = view<const float>(where, "y_sorted", y_sorted, Elem::f32, 2);
  const auto wk = view<const float>(where, "work", work, Elem::f32, 2);
  const auto dxv = view<float>(where, "dx", dx, Elem::f32, 2);
  const auto dw = view<float>(where, "d_weights", d_weights, Elem::f32, 2);
  expect_shape(where, "dy", dyv, {n, d});
  expect_shape(where, "y_sorted", ys, {n * k, d});
  expect_shape(where, "work", wk, {n * k, c.experts.work_cols()});
  expect_shape(where, "dx", dxv, {n, d});
  expect_shape(where, "d_weights", dw, {n, k});
  if (d_gate_up.has_value() != d_down.has_value())
    throw ConfigError(std::string(where) + ": give both weight gradients or neither");
  View<float> dgu, ddn;
  if (d_gate_up) {
    dgu = view<float>(where, "d_gate_up", *d_gate_up, Elem::f32, 3);
    ddn = view<float>(where, "d_down", *d_down, Elem::f32, 3);
    expect_shape(where, "d_gate_up", dgu, {e, transposed ? d : 2 * f, transposed ? 2 * f : d});
    expect_shape(where, "d_down", ddn, {e, transposed ? f : d, transposed ? d : f});
    c.experts.d_gate_up = dgu.data;
    c.experts.d_down = ddn.data;
  }
  if (d_gu_bias.has_value() != d_down_bias.has_value())
    throw ConfigError(std::string(where) + ": give both bias gradients or neither");
  if (d_gu_bias && !c.experts.l.has_bias) throw ConfigError(std::string(where) + ": bias gradients of experts without biases");
  if (d_gu_bias) {
    const auto gb = view<float>(where, "d_gate_up_bias", *d_gu_bias, Elem::f32, 2);
    const auto db = view<float>(where, "d_down_bias", *d_down_bias, Elem::f32, 2);
    expect_shape(where, "d_gate_up_bias", gb, {e, 2 * f});
    expect_shape(where, "d_down_bias", db, {e, d});
    c.experts.d_gate_up_bias = gb.data;
    c.experts.d_down_bias = db.data;
  }
  nb::gil_scoped_release release;
  const Routing r = make_routing(where, c.ids.data, c.w.data, n, k, e, expert_parallel);
  // Gradients are written: every expert's slices start at zero (experts with no rows keep them).
  if (dgu.data) std::memset(dgu.data, 0, std::size_t(dgu.size()) * sizeof(float));
  if (ddn.data) std::memset(ddn.data, 0, std::size_t(ddn.size()) * sizeof(float));
  if (c.experts.d_gate_up_bias) std::memset(c.experts.d_gate_up_bias, 0, std::size_t(e * 2 * f) * sizeof(float));
  if (c.experts.d_down_bias) std::memset(c.experts.d_down_bias, 0, std::size_t(e * d) * sizeof(float));
  Eigen::Map<const Matrix<float>> wm(wk.data, n * k, c.experts.work_cols());
  python::backward(r, c.x.data, dyv.data, ys.data, d, dxv.data, dw.data, threads,
                   [&](const apex::detail::ExpertTask& t, const auto& xs, const auto& dys, auto&& dxs) {
                     c.experts.backward(t.id, xs, wm.middleRows(t.begin, t.rows), dys, dxs);
                   });
}

}  // namespace

void bind_float_experts(nb::module_& m) {
  m.def("float_experts", &float_forward, nb::arg("hidden_states"), nb::arg("top_k_index"), nb::arg("top_k_weights"),
        nb::arg("gate_up_proj"), nb::arg("down_proj"), nb::arg("gate_up_proj_bias").none(),
        nb::arg("down_proj_bias").none(), nb::arg("gate"), nb::arg("transposed"), nb::arg("interleaved"),
        nb::arg("alpha"), nb::arg("limit"), nb::arg("expert_parallel"), nb::arg("y"), nb::arg("y_sorted"),
        nb::arg("work"), nb::arg("threads"),
        "Float experts' forward into y (N x d), y_sorted (NK x d) and work (NK x 3f).");
  m.def("float_experts_backward", &float_backward, nb::arg("hidden_states"), nb::arg("top_k_index"),
        nb::arg("top_k_weights"), nb::arg("gate_up_proj"), nb::arg("down_proj"), nb::arg("gate_up_proj_bias").none(),
        nb::arg("down_proj_bias").none(), nb::arg("gate"), nb::arg("transposed"), nb::arg("interleaved"),
        nb::arg("alpha"), nb::arg("limit"), nb::arg("expert_parallel"), nb::arg("dy"), nb::arg("y_sorted"),
        nb::arg("work"), nb::arg("dx"), nb::arg("d_weights"), nb::arg("d_gate_up").none(), nb::arg("d_down").none(),
        nb::arg("d_gate_up_bias").none(), nb::arg("d_down_bias").none(), nb::arg("threads"),
        "The backward of float_experts: dx, d_weights and the weight (and bias) gradients given, written.");
}

}  // namespace apex::python
