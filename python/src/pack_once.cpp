/// \file pack_once.cpp
/// The library's pack-once file (inference/files/pack_once/file.hpp) for
/// the extension's PackedExperts, both ways:
///
///  - save: one MoE block's routed experts, with the router weight (and
///    logit bias) the caller passes, written as a PackedMoE layer by the
///    library's writer (save_packed_layout: atomic, so a failed save leaves
///    no half-written file), a file map_packed_moe reads as that layer;
///  - map: the file opened by map_packed_moe against the block's shape, the
///    experts kept as views into the mapping (no expert byte read or copied;
///    the views hold the mapping alive), the router and balancer bias the
///    file also holds dropped (the model keeps its own router).
///
/// The block has no shared experts: a model's shared experts stay in the
/// model, outside the experts module this extension replaces.

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <apex/ffn/inference/files/pack_once/file.hpp>

#include "packed_experts.hpp"
#include "runtime.hpp"
#include "tensor_args.hpp"

namespace nb = nanobind;

namespace apex::python {
namespace {

/// The layer config of one block: E experts of f × d, top_k of them a token, no shared experts.
MoEConfig block_config(Index experts, Index d, Index f, Index top_k, bool router_bias) {
  MoEConfig c;
  c.d_model = d, c.d_ffn = f, c.n_experts = experts, c.n_active = top_k, c.router_bias = router_bias;
  return c;
}

/// Writes `p` with the router weight (E × d) and logit bias (E, optional) to `path`.
void save_pack_once(const PackedExperts& p, const std::string& path, const Array& router_weight,
                    const std::optional<Array>& router_bias, Index top_k) {
  constexpr const char* where = "apex_ffn.save_pack_once";
  const Index e = p.experts(), d = p.d_model();
  const auto w = view<const float>(where, "router weight", router_weight, Elem::f32, 2);
  expect_shape(where, "router weight", w, {e, d});
  RowVector<float> logit_bias;
  if (router_bias) {
    const auto b = view<const float>(where, "router bias", *router_bias, Elem::f32, 1);
    expect_shape(where, "router bias", b, {e});
    logit_bias = Eigen::Map<const RowVector<float>>(b.data, e);
  }
  const MoEConfig c = block_config(e, d, p.d_ffn(), top_k, router_bias.has_value());
  const Matrix<float> router = ConstMap<const float>(w.data, e, d);
  nb::gil_scoped_release release;
  // The layer takes its experts by value: owned panels are copied (one block at a time), views shared.
  const auto save = [&](auto layer) {
    if (c.router_bias) layer.set_logit_bias(logit_bias);
    save_packed_layout(path, layer);
  };
  const RowVector<float> balance = RowVector<float>::Zero(e);
  if (p.gate() == GateKind::silu)
    save(PackedMoE<float, SwiGLU<float>>(c, router, balance, p.packed(), {}, {}));
  else
    save(PackedMoE<float, ClampedSwiGLU<float>>(c, router, balance, p.packed(), p.biases(), {}));
}

/// The experts of the pack-once file at `path`, which must hold a block of
/// `experts` experts of d × f of kind `gate` (with a router bias if
/// `router_bias`): FormatError naming the file otherwise.
PackedExperts map_pack_once(const std::string& path, Index experts, Index d, Index f, Index top_k, bool router_bias,
                            const std::string& gate, double alpha, double limit) {
  constexpr const char* where = "apex_ffn.PackedExperts.map_pack_once";
  const GateKind kind = gate_kind(where, gate);
  const MoEConfig c = block_config(experts, d, f, top_k, router_bias);
  PackedLoadOptions options;
  if (kind == GateKind::clamped) {
    options.expert_options.of<ClampedSwiGLU<float>>() = ClampedSwiGLUOptions{alpha, limit};
    options.expert_options.of<ClampedSwiGLU<float>>().validate(where);
  }
  nb::gil_scoped_release release;
  if (kind == GateKind::silu) {
    const auto layer = map_packed_moe<float, SwiGLU<float>>(path, c, options);
    return PackedExperts(kind, layer.experts(), {});  // copies of views: the mapping is shared
  }
  const auto layer = map_packed_moe<float, ClampedSwiGLU<float>>(path, c, options);
  return PackedExperts(kind, layer.experts(), layer.extras());
}

}  // namespace

void bind_pack_once(nb::module_& m) {
  m.def("save_pack_once", &save_pack_once, nb::arg("packed"), nb::arg("path"), nb::arg("router_weight"),
        nb::arg("router_bias").none(), nb::arg("top_k"),
        "Writes one block's packed experts and its router as a pack-once file (atomically).");
  m.def("map_pack_once", &map_pack_once, nb::arg("path"), nb::arg("experts"), nb::arg("d_model"), nb::arg("d_ffn"),
        nb::arg("top_k"), nb::arg("router_bias"), nb::arg("gate"), nb::arg("alpha"), nb::arg("limit"),
        "One block's experts as views into the mapped pack-once file at `path` (checked against the shape).");
}

}  // namespace apex::python
