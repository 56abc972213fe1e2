/// \file packed_ops.cpp
/// PackedExperts (packed_experts.hpp) for Python: the inference forward, and
/// the training forward and backward with or without adapters (packing a
/// module's float tensors and the way back: float_tensors.cpp).

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include <apex/ffn/core/workspace.hpp>
#include <apex/ffn/kernels/bf16_vectors.hpp>
#include <apex/ffn/kernels/weight_types.hpp>

#include "packed_experts.hpp"
#include "routed_experts.hpp"
#include "runtime.hpp"
#include "tensor_args.hpp"
#include "torch_tensors.hpp"

namespace apex::python {
namespace {

struct Call {
  View<const float> x;
  View<const std::int64_t> ids;
  View<const float> w;
  Index n = 0, k = 0;
};

Call call_of(const char* where, const PackedExperts& p, const Array& x, const Array& ids, const Array& w) {
  Call c;
  c.x = view<const float>(where, "hidden_states", x, Elem::f32, 2);
  c.ids = view<const std::int64_t>(where, "top_k_index", ids, Elem::i64, 2);
  c.w = view<const float>(where, "top_k_weights", w, Elem::f32, 2);
  c.n = c.x.dim(0), c.k = c.ids.dim(1);
  expect_shape(where, "hidden_states", c.x, {-1, p.d_model()});
  expect_shape(where, "top_k_index", c.ids, {c.n, -1});
  expect_shape(where, "top_k_weights", c.w, {c.n, c.k});
  return c;
}

/// The adapters' views: each pair given or neither, shapes checked against the experts.
Adapters adapters_of(const char* where, const PackedExperts& p, const std::optional<Array>& a_gu,
                     const std::optional<Array>& b_gu, const std::optional<Array>& a_down,
                     const std::optional<Array>& b_down, double scale) {
  const Index e = p.experts(), d = p.d_model(), f = p.d_ffn();
  Adapters ad;
  ad.scale = float(scale);
  if (a_gu.has_value() != b_gu.has_value() || a_down.has_value() != b_down.has_value())
    throw ConfigError(std::string(where) + ": an adapter needs both lora_A and lora_B");
  if (a_gu) {
    const auto a = view<const float>(where, "gate_up lora_A", *a_gu, Elem::f32, 3);
    const auto b = view<const float>(where, "gate_up lora_B", *b_gu, Elem::f32, 3);
    ad.r_gu = a.dim(1);
    expect_shape(where, "gate_up lora_A", a, {e, ad.r_gu, d});
    expect_shape(where, "gate_up lora_B", b, {e, 2 * f, ad.r_gu});
    ad.a_gu = a.data, ad.b_gu = b.data;
  }
  if (a_down) {
    const auto a = view<const float>(where, "down lora_A", *a_down, Elem::f32, 3);
    const auto b = view<const float>(where, "down lora_B", *b_down, Elem::f32, 3);
    ad.r_down = a.dim(1);
    expect_shape(where, "down lora_A", a, {e, ad.r_down, f});
    expect_shape(where, "down lora_B", b, {e, d, ad.r_down});
    ad.a_down = a.data, ad.b_down = b.data;
  }
  if ((a_gu && ad.r_gu < 1) || (a_down && ad.r_down < 1)) throw ConfigError(std::string(where) + ": adapter rank 0");
  return ad;
}

/// A forward's inputs and outputs, checked alike for both entry points.
struct ForwardCall {
  Call in;
  View<float> y, y_sorted;  // n × d, n·k × d
};

struct YSortedTag {};

/// The calling thread's y_sorted scratch (n·k × d) for a forward whose caller does not read it.
float* y_sorted_scratch(const char* where, Index n, Index k, Index d) {
  const Index rows = apex::detail::checked_product(where, "rows x k", {n, k});
  return apex::detail::thread_workspace<float, YSortedTag>(rows, d).data();
}

/// y_sorted absent (inference from Python: nothing reads it afterwards): the
/// calling thread's scratch, so the call allocates and imports one tensor
/// less (each costs microseconds when the step has left the caches cold).
ForwardCall forward_call_of(const char* where, const PackedExperts& p, const Array& x, const Array& ids,
                            const Array& w, const MutArray& y, const std::optional<MutArray>& y_sorted) {
  ForwardCall f{call_of(where, p, x, ids, w), view<float>(where, "y", y, Elem::f32, 2), {}};
  expect_shape(where, "y", f.y, {f.in.n, p.d_model()});
  if (y_sorted) {
    f.y_sorted = view<float>(where, "y_sorted", *y_sorted, Elem::f32, 2);
    expect_shape(where, "y_sorted", f.y_sorted, {f.in.n * f.in.k, p.d_model()});
  } else {
    f.y_sorted.data = y_sorted_scratch(where, f.in.n, f.in.k, p.d_model());
  }
  return f;
}

void packed_forward(const PackedExperts& p, const Array& x, const Array& ids, const Array& w, bool expert_parallel,
                    const MutArray& y, const std::optional<MutArray>& y_sorted, int threads, bool bf16_activations) {
  constexpr const char* where = "apex_ffn.PackedExperts.forward";
  const ForwardCall f = forward_call_of(where, p, x, ids, w, y, y_sorted);
  const packed::Isa isa = current_isa();
  nb::gil_scoped_release release;
  const Routing& r = thread_routing(where, f.in.ids.data, f.in.w.data, f.in.n, f.in.k, p.experts(), expert_parallel);
  p.forward(r, f.in.x.data, f.y_sorted.data, f.y.data, threads, isa, bf16_activations);
}

struct XTag {};
struct WTag {};
struct YTag {};

/// The inference forward of PackedExpertsModule's call: the module's own
/// arguments read without DLPack (torch_tensors.hpp) and y allocated here,
/// so a decode step crosses into the extension once. x and w both float32,
/// or both bfloat16 (a bf16 model: widened exactly, y rounded to bf16 as
/// torch's .to(bfloat16) rounds, and bf16 experts may multiply in pairs as
/// PackedExperts.forward's bf16_activations says), ids int64; threads
/// apex_ffn.get_num_threads() unless given. None unless
/// every argument is plain and the shapes agree: the module then takes the
/// checked path, which names what is wrong. Expert ids are checked here as
/// there (build_routing).
nb::object packed_infer(const PackedExperts& p, nb::handle x, nb::handle ids, nb::handle w, bool expert_parallel,
                        std::optional<int> threads_arg) {
  constexpr const char* where = "apex_ffn.PackedExperts.infer";
  const auto px = plain_2d(x), pi = plain_2d(ids), pw = plain_2d(w);
  if (!px || !pi || !pw || px->elem == TorchElem::i64 || pi->elem != TorchElem::i64 || pw->elem != px->elem ||
      px->cols != p.d_model() || pi->rows != px->rows || pw->rows != px->rows || pw->cols != pi->cols)
    return nb::none();
  const int threads = threads_arg ? *threads_arg : package_threads();
  if (threads < 1) throw ConfigError(std::string(where) + ": threads must be at least 1, got " + std::to_string(threads));
  const Index n = px->rows, k = pi->cols, d = p.d_model();
  const bool bf16 = px->elem == TorchElem::bf16;
  const OutputSpares::Output y = OutputSpares::take(n, d, px->elem);
  if (!y.data) return nb::none();
  void* y_data = y.data;
  const packed::Isa isa = current_isa();
  {
    nb::gil_scoped_release release;
    const float* xf = static_cast<const float*>(px->data);
    const float* wf = static_cast<const float*>(pw->data);
    float* yf = static_cast<float*>(y_data);
    if (bf16) {  // exact widening in; y computed in float, rounded once on the way out
      float* xw = apex::detail::thread_workspace<float, XTag>(n, d).data();
      float* ww = apex::detail::thread_workspace<float, WTag>(n, k).data();
      packed::to_float(static_cast<const packed::bf16*>(px->data), xw, n * d, isa);
      packed::to_float(static_cast<const packed::bf16*>(pw->data), ww, n * k, isa);
      xf = xw, wf = ww, yf = apex::detail::thread_workspace<float, YTag>(n, d).data();
    }
    float* y_sorted = y_sorted_scratch(where, n, k, d);
    const Routing& r = thread_routing(where, static_cast<const std::int64_t*>(pi->data), wf, n, k, p.experts(),
                                      expert_parallel);
    p.forward(r, xf, y_sorted, yf, threads, isa, bf16);
    if (bf16) packed::to_bf16(yf, static_cast<packed::bf16*>(y_data), n * d, isa);
  }
  return y.tensor;
}

/// The median seconds of `reps` forwards on these inputs (the routing built each time, as the op does),
/// timed inside C++ with no Python between calls: the reference the Python call's overhead is measured
/// against (tools/bench_python.py).
double packed_forward_seconds(const PackedExperts& p, const Array& x, const Array& ids, const Array& w,
                              bool expert_parallel, const MutArray& y, const std::optional<MutArray>& y_sorted,
                              int threads, int reps, bool bf16_activations) {
  constexpr const char* where = "apex_ffn.PackedExperts.forward_seconds";
  if (reps < 1) throw ConfigError(std::string(where) + ": reps must be at least 1, got " + std::to_string(reps));
  const ForwardCall f = forward_call_of(where, p, x, ids, w, y, y_sorted);
  const packed::Isa isa = current_isa();
  nb::gil_scoped_release release;
  std::vector<double> seconds;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    const Routing& r = thread_routing(where, f.in.ids.data, f.in.w.data, f.in.n, f.in.k, p.experts(), expert_parallel);
    p.forward(r, f.in.x.data, f.y_sorted.data, f.y.data, threads, isa, bf16_activations);
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::nth_element(seconds.begin(), seconds.begin() + reps / 2, seconds.end());
  return seconds[std::size_t(reps / 2)];
}

void packed_train_forward(const PackedExperts& p, const Array& x, const Array& ids, const Array& w,
                   const std::optional<Array>& a_gu, const std::optional<Array>& b_gu,
                   const std::optional<Array>& a_down, const std::optional<Array>& b_down, double scale,
                   bool expert_parallel, const MutArray& y, const MutArray& y_sorted, const MutArray& work,
                   int threads) {
  constexpr const char* where = "apex_ffn.PackedExperts.train_forward";
  const Call c = call_of(where, p, x, ids, w);
  const Adapters ad = adapters_of(where, p, a_gu, b_gu, a_down, b_down, scale);
  const auto yv = view<float>(where, "y", y, Elem::f32, 2);
  const auto ys = view<float>(where, "y_sorted", y_sorted, Elem::f32, 2);
  const auto wk = view<float>(where, "work", work, Elem::f32, 2);
  expect_shape(where, "y", yv, {c.n, p.d_model()});
  expect_shape(where, "y_sorted", ys, {c.n * c.k, p.d_model()});
  expect_shape(where, "work", wk, {c.n * c.k, p.train_work_cols(ad.r_gu, ad.r_down)});
  const packed::Isa isa = current_isa();
  nb::gil_scoped_release release;
  const Routing r = make_routing(where, c.ids.data, c.w.data, c.n, c.k, p.experts(), expert_parallel);
  Eigen::Map<Matrix<float>>(wk.data, c.n * c.k, wk.dim(1)).bottomRows(c.n * c.k - r.routed_rows()).setZero();
  p.train_forward(r, c.x.data, ad, wk.data, ys.data, yv.data, threads, isa);
}

void packed_train_backward(const PackedExperts& p, const Array& x, const Array& ids, const Array& w,
                    const std::optional<Array>& a_gu, const std::optional<Array>& b_gu,
                    const std::optional<Array>& a_down, const std::optional<Array>& b_down, double scale,
                    bool expert_parallel, const Array& dy, const Array& y_sorted, const Array& work,
                    const MutArray& dx, const MutArray& d_weights, const std::optional<MutArray>& da_gu,
                    const std::optional<MutArray>& db_gu, const std::optional<MutArray>& da_down,
                    const std::optional<MutArray>& db_down, int threads) {
  constexpr const char* where = "apex_ffn.PackedExperts.train_backward";
  const Call c = call_of(where, p, x, ids, w);
  Adapters ad = adapters_of(where, p, a_gu, b_gu, a_down, b_down, scale);
  const Index d = p.d_model(), f = p.d_ffn(), e = p.experts();
  const auto dyv = view<const float>(where, "dy", dy, Elem::f32, 2);
  const auto ys = view<const float>(where, "y_sorted", y_sorted, Elem::f32, 2);
  const auto wk = view<const float>(where, "work", work, Elem::f32, 2);
  const auto dxv = view<float>(where, "dx", dx, Elem::f32, 2);
  const auto dw = view<float>(where, "d_weights", d_weights, Elem::f32, 2);
  expect_shape(where, "dy", dyv, {c.n, d});
  expect_shape(where, "y_sorted", ys, {c.n * c.k, d});
  expect_shape(where, "work", wk, {c.n * c.k, p.train_work_cols(ad.r_gu, ad.r_down)});
  expect_shape(where, "dx", dxv, {c.n, d});
  expect_shape(where, "d_weights", dw, {c.n, c.k});
  const auto grad = [&](const std::optional<MutArray>& g, const char* name, std::initializer_list<Index> shape) {
    if (!g) throw ConfigError(std::string(where) + ": the gradient '" + name + "' was not given");
    const auto v = view<float>(where, name, *g, Elem::f32, 3);
    expect_shape(where, name, v, shape);
    return v.data;
  };
  if (ad.r_gu) ad.da_gu = grad(da_gu, "d gate_up lora_A", {e, ad.r_gu, d}), ad.db_gu = grad(db_gu, "d gate_up lora_B", {e, 2 * f, ad.r_gu});
  if (ad.r_down) ad.da_down = grad(da_down, "d down lora_A", {e, ad.r_down, f}), ad.db_down = grad(db_down, "d down lora_B", {e, d, ad.r_down});
  const packed::Isa isa = current_isa();
  nb::gil_scoped_release release;
  const Routing r = make_routing(where, c.ids.data, c.w.data, c.n, c.k, e, expert_parallel);
  p.train_backward(r, c.x.data, dyv.data, wk.data, ys.data, ad, dxv.data, dw.data, threads, isa);
}

}  // namespace

void bind_float_tensors(nb::class_<PackedExperts>& cls);  // float_tensors.cpp

void bind_packed_experts(nb::module_& m) {
  auto cls = nb::class_<PackedExperts>(m, "PackedExperts", "The routed experts of one MoE block, packed");
  bind_float_tensors(cls);
  cls
      .def_prop_ro("experts", &PackedExperts::experts)
      .def_prop_ro("d_model", &PackedExperts::d_model)
      .def_prop_ro("d_ffn", &PackedExperts::d_ffn)
      .def_prop_ro("gate", [](const PackedExperts& p) { return std::string(p.gate() == GateKind::silu ? "silu" : "clamped"); })
      .def_prop_ro("types", [](const PackedExperts& p) { return packed::dtypes_name(p.types()); })
      .def_prop_ro("nbytes", &PackedExperts::bytes, "Bytes of the packed expert weights (padding included).")
      .def_prop_ro("mapped", &PackedExperts::mapped, "True if the weights are views into a mapped pack-once file.")
      .def("train_work_cols", &PackedExperts::train_work_cols, nb::arg("r_gate_up"), nb::arg("r_down"))
      .def("forward", &packed_forward, nb::arg("hidden_states"), nb::arg("top_k_index"), nb::arg("top_k_weights"),
           nb::arg("expert_parallel"), nb::arg("y"), nb::arg("y_sorted").none(), nb::arg("threads"),
           nb::arg("bf16_activations") = false,
           "y_sorted: the experts' outputs in plan order (N*K x d), or None for the calling thread's scratch.\n"
           "bf16_activations: the inputs hold bf16 values (a bf16 model); bf16 experts on the avx512_bf16 and\n"
           "amx_bf16 paths then multiply in pairs (`vdpbf16ps`, AMX tiles), rounding the hidden activations\n"
           "to bf16 as the model would.")
      .def("infer", &packed_infer, nb::arg("hidden_states"), nb::arg("top_k_index"), nb::arg("top_k_weights"),
           nb::arg("expert_parallel"), nb::arg("threads").none() = nb::none(),
           "The module's inference forward in one call: y (N x d) in the inputs' dtype, or None unless the\n"
           "arguments are plain CPU tensors (exact torch.Tensor, contiguous, x and weights both float32 or both\n"
           "bfloat16, ids int64, shapes agreeing); forward() then checks them and names what is wrong.")
      .def("forward_seconds", &packed_forward_seconds, nb::arg("hidden_states"), nb::arg("top_k_index"),
           nb::arg("top_k_weights"), nb::arg("expert_parallel"), nb::arg("y"), nb::arg("y_sorted").none(),
           nb::arg("threads"), nb::arg("reps"), nb::arg("bf16_activations") = false,
           "Median seconds of `reps` forwards timed in C++ (the reference for the Python call's overhead).")
      .def("train_forward", &packed_train_forward, nb::arg("hidden_states"), nb::arg("top_k_index"), nb::arg("top_k_weights"),
           nb::arg("a_gate_up").none(), nb::arg("b_gate_up").none(), nb::arg("a_down").none(), nb::arg("b_down").none(),
           nb::arg("scale"), nb::arg("expert_parallel"), nb::arg("y"), nb::arg("y_sorted"), nb::arg("work"),
           nb::arg("threads"))
      .def("train_backward", &packed_train_backward, nb::arg("hidden_states"), nb::arg("top_k_index"),
           nb::arg("top_k_weights"), nb::arg("a_gate_up").none(), nb::arg("b_gate_up").none(),
           nb::arg("a_down").none(), nb::arg("b_down").none(), nb::arg("scale"), nb::arg("expert_parallel"),
           nb::arg("dy"), nb::arg("y_sorted"), nb::arg("work"), nb::arg("dx"), nb::arg("d_weights"),
           nb::arg("d_a_gate_up").none(), nb::arg("d_b_gate_up").none(), nb::arg("d_a_down").none(),
           nb::arg("d_b_down").none(), nb::arg("threads"));
  m.def("storage_types", [] {
    std::vector<std::string> out;
#define APEX_PY_NAME(n) out.push_back(packed::dtype_name(packed::Dtype::n));
    APEX_PACKED_WEIGHT_TYPES(APEX_PY_NAME)
#undef APEX_PY_NAME
    return out;
  }, "The storage types of packed experts.");
}

}  // namespace apex::python
