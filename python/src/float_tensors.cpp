/// \file float_tensors.cpp
/// PackedExperts and a transformers experts module's float tensors, both
/// ways (float_experts.hpp has the layouts):
///
///  - from_float: the module's gate_up_proj, down_proj (and gpt-oss's
///    biases) packed in any storage type of the weight-type table;
///  - to_float: the packed experts written back in the module's layout, each
///    weight the exact value the kernels multiply by (PackedExpert::w_gate…:
///    bf16's rounded inputs, a block format's ggml-dequantized values), so a
///    packed module's state dict is the weights it runs on.

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <optional>
#include <string>
#include <vector>

#include <apex/ffn/core/parallel.hpp>
#include <apex/ffn/kernels/weight_types.hpp>

#include "packed_experts.hpp"
#include "tensor_args.hpp"

namespace apex::python {
namespace {

/// A storage type by name ("q4_k"), ConfigError naming the known ones otherwise.
packed::Dtype dtype_from_name(const std::string& name) {
#define APEX_PY_DTYPE(n) \
  if (name == packed::dtype_name(packed::Dtype::n)) return packed::Dtype::n;
  APEX_PACKED_WEIGHT_TYPES(APEX_PY_DTYPE)
#undef APEX_PY_DTYPE
  throw ConfigError("apex_ffn: unknown storage type '" + name + "', expected one of " + packed::dtype_names());
}

/// "q4_k" (both matrices) or "q4_k/q6_k" (gate_up/down).
packed::ExpertDtypes dtypes_from_name(const std::string& name) {
  const auto slash = name.find('/');
  if (slash == std::string::npos) return packed::ExpertDtypes(dtype_from_name(name));
  return packed::ExpertDtypes{dtype_from_name(name.substr(0, slash)), dtype_from_name(name.substr(slash + 1))};
}

/// Where one expert's slices of a module's tensors keep each weight: W_gu's
/// natural rows [gate; up] (2f × d) and W_down (d × f), in storage order.
struct ModuleOrder {
  Index d, f;
  bool transposed, interleaved;

  /// The position along the 2f axis of gate row j (up = false) or up row j.
  Index gate_up_row(Index j, bool up) const { return interleaved ? 2 * j + Index(up) : j + (up ? f : 0); }
  /// Offset in gate_up (2f × d, or d × 2f transposed) of (row along 2f, column c < d).
  Index gate_up(Index row, Index c) const { return transposed ? c * 2 * f + row : row * d + c; }
  /// Offset in down (d × f, or f × d transposed) of W_down(r, c), r < d, c < f.
  Index down(Index r, Index c) const { return transposed ? c * d + r : r * f + c; }
};

/// The expert tensors' views, checked: gate_up (E, 2f, d) and down (E, d, f), or (E, d, 2f) and (E, f, d)
/// transposed (ShapeError otherwise); d and f from gate_up.
template <class T>
ModuleOrder module_order(const char* where, const View<T>& gu, const View<T>& dn, bool transposed, bool interleaved) {
  const Index e = gu.dim(0), d = transposed ? gu.dim(1) : gu.dim(2), two_f = transposed ? gu.dim(2) : gu.dim(1);
  if (two_f % 2) throw ShapeError(std::string(where) + ": argument 'gate_up_proj' has an odd gate/up width");
  const Index f = two_f / 2;
  expect_shape(where, "down_proj", dn, transposed ? std::initializer_list<Index>{e, f, d} : std::initializer_list<Index>{e, d, f});
  return {d, f, transposed, interleaved};
}

void check_threads(const char* where, int threads) {
  // as apex_ffn.set_num_threads refuses it (parallel_for would run 0 or -1 threads as one)
  if (threads < 1)
    throw nb::value_error((std::string(where) + ": argument 'threads': expected a positive int, got " +
                           std::to_string(threads)).c_str());
}

/// Packs a module's float tensors in `types`.
PackedExperts from_float(const Array& gate_up, const Array& down, const std::optional<Array>& gu_bias,
                         const std::optional<Array>& down_bias, const std::string& gate, bool transposed,
                         bool interleaved, double alpha, double limit, const std::string& types, int threads) {
  constexpr const char* where = "apex_ffn.PackedExperts.from_float";
  check_threads(where, threads);
  const auto gu = view<const float>(where, "gate_up_proj", gate_up, Elem::f32, 3);
  const auto dn = view<const float>(where, "down_proj", down, Elem::f32, 3);
  const ModuleOrder o = module_order(where, gu, dn, transposed, interleaved);
  const Index e = gu.dim(0), d = o.d, f = o.f;
  const GateKind kind = gate_kind(where, gate);
  const bool has_bias = gu_bias.has_value();
  if (has_bias != down_bias.has_value()) throw ConfigError(std::string(where) + ": give both biases or neither");
  if (kind == GateKind::silu && has_bias)
    throw ConfigError(std::string(where) + ": packed SiLU experts with biases are not one of the library's expert "
                      "kinds (SwiGLU has none; the clamped gpt-oss kind has them)");
  View<const float> gb, db;
  if (has_bias) {
    gb = view<const float>(where, "gate_up_proj_bias", *gu_bias, Elem::f32, 2);
    db = view<const float>(where, "down_proj_bias", *down_bias, Elem::f32, 2);
    expect_shape(where, "gate_up_proj_bias", gb, {e, 2 * f});
    expect_shape(where, "down_proj_bias", db, {e, d});
  }
  const packed::ExpertDtypes dt = dtypes_from_name(types);
  ClampedSwiGLUOptions options{alpha, limit};
  if (kind == GateKind::clamped) options.validate(where);
  std::vector<std::optional<packed::PackedExpert>> slots(static_cast<std::size_t>(e));
  std::vector<ClampedBiases> biases(kind == GateKind::clamped ? std::size_t(e) : 0);
  {
    nb::gil_scoped_release release;
    apex::detail::parallel_for(e, threads, [&](Index i) {
      Matrix<float> g(f, d), u(f, d), w_down(d, f);  // W_gate, W_up: f × d; W_down: d × f
      const float* gs = gu.data + i * 2 * f * d;
      for (Index j = 0; j < f; ++j)
        for (Index c = 0; c < d; ++c) {
          g(j, c) = gs[o.gate_up(o.gate_up_row(j, false), c)];
          u(j, c) = gs[o.gate_up(o.gate_up_row(j, true), c)];
        }
      const float* ds = dn.data + i * d * f;
      for (Index r = 0; r < d; ++r)
        for (Index c = 0; c < f; ++c) w_down(r, c) = ds[o.down(r, c)];
      slots[std::size_t(i)] = apex::detail::inference::for_expert(where, "expert", i, [&] {
        return packed::PackedExpert(g, u, w_down, dt);
      });
      if (kind == GateKind::clamped) {
        ClampedBiases& b = biases[std::size_t(i)];
        b.options = options;
        b.gate = RowVector<float>::Zero(f), b.up = RowVector<float>::Zero(f), b.down = RowVector<float>::Zero(d);
        if (!has_bias) return;
        for (Index j = 0; j < f; ++j) {
          b.gate(j) = gb.data[i * 2 * f + o.gate_up_row(j, false)];
          b.up(j) = gb.data[i * 2 * f + o.gate_up_row(j, true)];
        }
        b.down = Eigen::Map<const RowVector<float>>(db.data + i * d, d);
      }
    });
  }
  std::vector<packed::PackedExpert> experts;
  experts.reserve(slots.size());
  for (auto& s : slots) experts.push_back(std::move(*s));
  return PackedExperts(kind, std::move(experts), std::move(biases));
}

/// Writes experts first … first + n − 1 into a module's float tensors of n experts (from_float's layouts;
/// the biases only for the clamped kind, whose experts hold them: zero when the module had none).
void to_float(const PackedExperts& p, const MutArray& gate_up, const MutArray& down,
              const std::optional<MutArray>& gu_bias, const std::optional<MutArray>& down_bias, bool transposed,
              bool interleaved, Index first, int threads) {
  constexpr const char* where = "apex_ffn.PackedExperts.to_float";
  check_threads(where, threads);
  const auto gu = view<float>(where, "gate_up_proj", gate_up, Elem::f32, 3);
  const auto dn = view<float>(where, "down_proj", down, Elem::f32, 3);
  const Index e = gu.dim(0), d = p.d_model(), f = p.d_ffn();
  if (first < 0 || e > p.experts() - first)
    throw ShapeError(std::string(where) + ": " + std::to_string(e) + " experts from expert " + std::to_string(first) +
                     " asked of a block of " + std::to_string(p.experts()));
  expect_shape(where, "gate_up_proj", gu, transposed ? std::initializer_list<Index>{e, d, 2 * f}
                                                     : std::initializer_list<Index>{e, 2 * f, d});
  const ModuleOrder o = module_order(where, gu, dn, transposed, interleaved);
  const bool has_bias = gu_bias.has_value();
  if (has_bias != down_bias.has_value()) throw ConfigError(std::string(where) + ": give both biases or neither");
  if (has_bias && p.gate() != GateKind::clamped)
    throw ConfigError(std::string(where) + ": SiLU-gated experts have no biases to write");
  View<float> gb, db;
  if (has_bias) {
    gb = view<float>(where, "gate_up_proj_bias", *gu_bias, Elem::f32, 2);
    db = view<float>(where, "down_proj_bias", *down_bias, Elem::f32, 2);
    expect_shape(where, "gate_up_proj_bias", gb, {e, 2 * f});
    expect_shape(where, "down_proj_bias", db, {e, d});
  }
  nb::gil_scoped_release release;
  apex::detail::parallel_for(e, threads, [&](Index i) {
    const packed::PackedExpert& x = p.packed()[std::size_t(first + i)];
    const Matrix<float> g = x.w_gate(), u = x.w_up(), w_down = x.w_down();  // f × d, f × d, d × f
    float* gs = gu.data + i * 2 * f * d;
    for (Index j = 0; j < f; ++j)
      for (Index c = 0; c < d; ++c) {
        gs[o.gate_up(o.gate_up_row(j, false), c)] = g(j, c);
        gs[o.gate_up(o.gate_up_row(j, true), c)] = u(j, c);
      }
    float* ds = dn.data + i * d * f;
    for (Index r = 0; r < d; ++r)
      for (Index c = 0; c < f; ++c) ds[o.down(r, c)] = w_down(r, c);
    if (!has_bias) return;
    const ClampedBiases& b = p.biases()[std::size_t(first + i)];
    for (Index j = 0; j < f; ++j) {
      gb.data[i * 2 * f + o.gate_up_row(j, false)] = b.gate(j);
      gb.data[i * 2 * f + o.gate_up_row(j, true)] = b.up(j);
    }
    Eigen::Map<RowVector<float>>(db.data + i * d, d) = b.down;
  });
}

}  // namespace

void bind_float_tensors(nb::class_<PackedExperts>& cls) {
  cls.def_static("from_float", &from_float, nb::arg("gate_up_proj"), nb::arg("down_proj"),
                 nb::arg("gate_up_proj_bias").none(), nb::arg("down_proj_bias").none(), nb::arg("gate"),
                 nb::arg("transposed"), nb::arg("interleaved"), nb::arg("alpha"), nb::arg("limit"),
                 nb::arg("types"), nb::arg("threads"),
                 "Packs float expert tensors (a transformers experts module's layout) in `types` ('q4_k', 'q4_k/q6_k').")
      .def("to_float", &to_float, nb::arg("gate_up_proj"), nb::arg("down_proj"),
           nb::arg("gate_up_proj_bias").none(), nb::arg("down_proj_bias").none(), nb::arg("transposed"),
           nb::arg("interleaved"), nb::arg("first"), nb::arg("threads"),
           "Writes experts first, first + 1, … (as many as the tensors hold) into float32 tensors of a\n"
           "transformers experts module's layout (from_float's): each weight the value the kernels multiply by\n"
           "(a block format's dequantized values); the biases (clamped experts only) when given.");
}

}  // namespace apex::python
