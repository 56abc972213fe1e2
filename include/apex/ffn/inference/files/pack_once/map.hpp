#pragma once
/// \file inference/files/pack_once/map.hpp
/// `map_packed_moe`: a PackedMoE whose expert weights are views into a
/// mapped pack-once file (inference/files/pack_once/file.hpp has the contract
/// and the save). Split from the save so each header stays one concept.

#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "../../../io/file/mapped_file.hpp"
#include "format.hpp"
#include "../../engine/packed_moe.hpp"
#include "../checkpoint/read.hpp"  // PackedLoadOptions

namespace apex {
namespace detail::inference {

/// The float tensors of a pack-once file of `c` with experts of `Kind`: name → shape.
template <class Kind>
std::map<std::string, std::vector<std::uint64_t>> layout_float_tensors(const MoEConfig& c) {
  const auto u = [](Index n) { return std::uint64_t(n); };
  std::map<std::string, std::vector<std::uint64_t>> out{{state_names::kRouter, {u(c.n_experts), u(c.d_model)}},
                                                        {"expert_bias", {u(c.n_experts)}}};
  if (c.router_bias) out[state_names::kRouterBias] = {u(c.n_experts)};
  for (Index e = 0; e < c.n_experts; ++e)
    for (const ExpertExtraTensor& t : Kind::extra_tensors(c.d_model, c.d_ffn))
      out[state_names::routed_expert(e) + t.name] = {1, u(t.cols)};
  if (c.shared_expert_gate) out[state_names::kSharedGate] = {1, u(c.d_model)};
  return out;
}

/// FormatError naming `where` unless the file's tensors are exactly the
/// float tensors and panel arrays of the layer (dtype and shape each, so
/// each panel array's size is the bytes its matrix needs), plus padding.
template <class Kind>
void check_layout_tensors(const std::string& where, const safetensors::Reader& file, const MoEConfig& c,
                          const std::vector<PanelTensor>& panels) {
  using safetensors::DType;
  using safetensors::quote_name;
  std::map<std::string, std::pair<DType, std::vector<std::uint64_t>>> want;
  for (auto& [name, shape] : layout_float_tensors<Kind>(c)) want[name] = {DType::F32, shape};
  for (const auto& p : panels) want[p.name] = {DType::U8, p.shape()};
  std::vector<std::string> missing, unexpected;
  for (const auto& t : file.tensors()) {
    if (t.name.compare(0, std::string(kPadPrefix).size(), kPadPrefix) == 0 && t.dtype == DType::U8 &&
        t.shape.size() == 1)
      continue;
    const auto it = want.find(t.name);
    if (it == want.end()) {
      unexpected.push_back(t.name);
      continue;
    }
    if (t.dtype != it->second.first || t.shape != it->second.second)
      throw FormatError(where + ": tensor " + quote_name(t.name) + " is " + safetensors::dtype_name(t.dtype) + " " +
                        safetensors::shape_string(t.shape) + "; the layer's panels need " +
                        safetensors::dtype_name(it->second.first) + " " + safetensors::shape_string(it->second.second));
  }
  for (const auto& [name, _] : want)
    if (!file.header().find(name)) missing.push_back(name);
  if (!missing.empty() || !unexpected.empty())
    throw FormatError(where + ": the file does not match the layer:" +
                      (missing.empty() ? std::string() : " missing " + name_list(missing) + ";") +
                      (unexpected.empty() ? std::string() : " unexpected " + name_list(unexpected) + ";"));
}

/// The views of every expert of the file, routed then shared (alignment and
/// bounds checked by PanelMatrix::view).
inline std::vector<packed::PackedExpert> layout_experts(const std::string& where, const safetensors::Reader& file,
                                                        const std::shared_ptr<const io::MappedFile>& map,
                                                        const std::vector<PanelTensor>& panels, Index d, bool shared,
                                                        Index count, Index f) {
  const auto offset = [&](const std::string& name) -> std::uint64_t {
    const safetensors::TensorInfo* t = file.header().find(name);
    return t ? file.header().data_offset() + t->begin : 0;  // absent scales: 0 bytes
  };
  std::map<std::string, packed::Dtype> dtypes;  // name → type, one lookup a matrix
  for (const auto& p : panels) dtypes.emplace(p.name, p.dtype);
  const auto dtype_of = [&](const std::string& name) {
    const auto it = dtypes.find(name);
    if (it == dtypes.end()) throw FormatError(where + ": no panel array " + name);  // checked before: unreachable
    return it->second;
  };
  std::vector<packed::PackedExpert> out;
  out.reserve(std::size_t(count));
  for (Index e = 0; e < count; ++e) {
    const std::string q = shared ? state_names::shared_expert(e) : state_names::routed_expert(e);
    const auto view = [&](const std::string& m, Index k, Index n) {
      return packed::PanelMatrix::view(dtype_of(q + m + ".codes"), k, n, map, offset(q + m + ".codes"),
                                       offset(q + m + ".scales"), where, "tensor '" + q + m + "'");
    };
    const auto ceil_div = [](Index n, Index k) { return n / k + (n % k != 0); };
    out.push_back(packed::PackedExpert::from_panels(
        where.c_str(), d, f, view("gate_up", d, ceil_div(f, packed::PackedExpert::kHiddenPerPanel)),
        view("down", f, ceil_div(d, packed::PackedExpert::kOutPerPanel))));
  }
  return out;
}

}  // namespace detail::inference

/// A PackedMoE of `config` over the pack-once file at `path`, its expert
/// weights views into a read-only mapping of the file (see
/// inference/files/pack_once/file.hpp). Of `options`, the expert kind's
/// options (`expert_options`), `types` (must equal the file's if set) and `limits` apply; a
/// prefix or family is a ConfigError (a pack-once file holds one layer
/// under the library's names). No memory-fit check: the weights are the
/// page cache's, paged in and out by the kernel. The layer has no float
/// source, so check_source refuses it.
template <class Storage, class Expert = SwiGLU<float>, class Activation = packed::SiluGate>
PackedMoE<Storage, Expert, Activation> map_packed_moe(const std::string& path, const MoEConfig& config,
                                                      const PackedLoadOptions& options = {}) {
  namespace inf = detail::inference;
  using Layer = PackedMoE<Storage, Expert, Activation>;
  const std::shared_ptr<const io::MappedFile> map = io::MappedFile::open("safetensors", path);
  const std::string where = "map_packed_moe(" + map->description() + ")";
  if (!options.prefix.empty() || options.family)
    throw ConfigError(where + ": a pack-once file holds one layer under the library's names; "
                      "options.prefix and options.family do not apply");
  const safetensors::Reader file(std::make_unique<io::MappedSource>(map), options.limits);
  config.validate_for<float>(where.c_str());
  const PackedTypes types = inf::file_layout_types(where, file.metadata());
  if (options.types && !(*options.types == types))
    throw ConfigError(where + ": options.types asks for " + packed_types_name(*options.types) + " but the file holds " +
                      packed_types_name(types));
  const auto shape = file.metadata().find(inf::kLayoutShapeKey);
  const std::string want = inf::layout_shape(config, Layer::Kind::kName);
  if (shape == file.metadata().end() || shape->second != want)
    throw FormatError(where + ": the file holds a layer of " +
                      (shape == file.metadata().end() ? std::string("unrecorded shape") : shape->second) +
                      "; the config asks for " + want);
  const auto panels = inf::layer_panel_tensors(config, types);
  inf::check_layout_tensors<typename Layer::Kind>(where, file, config, panels);
  const Index d = config.d_model;
  auto experts = inf::layout_experts(where, file, map, panels, d, false, config.n_experts, config.d_ffn);
  auto shared = inf::layout_experts(where, file, map, panels, d, true, config.n_shared, config.shared_ffn());
  // The float parts, read (copied) out of the mapping: small.
  const Matrix<float> router = file.matrix<float>(state_names::kRouter);  // E × d
  const RowVector<float> bias = file.matrix<float>("expert_bias");        // 1 × E
  using Kind = typename Layer::Kind;
  std::vector<typename Layer::Extra> extras;
  if constexpr (Layer::kHasExtra)
    for (Index e = 0; e < config.n_experts; ++e) {
      std::vector<RowVector<float>> rows;
      for (const ExpertExtraTensor& t : Kind::extra_tensors(d, config.d_ffn))
        rows.push_back(file.matrix<float>(state_names::routed_expert(e) + t.name));
      extras.push_back(Kind::make_extra(std::move(rows), options.expert_options.template get<Expert>()));
    }
  Matrix<float> gate = config.shared_expert_gate ? file.matrix<float>(state_names::kSharedGate) : Matrix<float>();
  Layer out(config, router, bias, std::move(experts), std::move(extras), std::move(shared), std::move(gate));
  if (config.router_bias) out.set_logit_bias(file.matrix<float>(state_names::kRouterBias));  // 1 × E, finite-checked
  return out;
}

}  // namespace apex
