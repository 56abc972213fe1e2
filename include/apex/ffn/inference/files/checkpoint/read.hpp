#pragma once
/// \file inference/files/checkpoint/read.hpp
/// How the packed loaders (inference/files/checkpoint/load.hpp) read a checkpoint: the
/// tensor list a layer needs under the library's or a family's
/// names, the checks that all run before the first weight is read (names,
/// dtypes, shapes, a quantized checkpoint's types, memory, the kind's options), and
/// the expert-by-expert read into a reused staging buffer: floats packed at
/// once, or a quantized checkpoint's blocks moved into the panels as they are.

#include <algorithm>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "../../../core/state_names.hpp"
#include "../../../io/checkpoint.hpp"
#include "../../../core/errors.hpp"
#include "../../../moe/families.hpp"
#include "../../../io/name_maps.hpp"
#include "../../../io/safetensors.hpp"
#include "load_options.hpp"
#include "../../engine/packed_moe.hpp"
#include "source.hpp"
#include "stored.hpp"

namespace apex {

namespace detail::inference {

/// The experts' storage types a load uses: options.types, else `fallback`
/// (the layer's Storage) for every matrix.
inline PackedTypes load_types(const PackedLoadOptions& options, packed::Dtype fallback) {
  return options.types ? *options.types : PackedTypes(fallback);
}

/// The file dtypes a packed layer loads: those the reader widens to float
/// (F32, F64, BF16: packing goes through float) and the file spelling of
/// every weight-type table entry (kernels/weight_types.hpp), in that order.
inline std::vector<safetensors::DType> packed_file_dtypes() {
  std::vector<safetensors::DType> out{safetensors::DType::F32, safetensors::DType::F64, safetensors::DType::BF16};
  for (const char* name : packed::file_dtypes()) {
    safetensors::DType t{};
    if (safetensors::parse_dtype(name, t) && std::find(out.begin(), out.end(), t) == out.end()) out.push_back(t);
  }
  return out;
}
inline bool packed_file_dtype(safetensors::DType t) {
  const auto all = packed_file_dtypes();
  return std::find(all.begin(), all.end(), t) != all.end();
}
/// "F32, F64 and BF16": the list above for error messages.
inline std::string packed_file_dtype_names() {
  const auto all = packed_file_dtypes();
  std::string s;
  for (std::size_t i = 0; i < all.size(); ++i)
    s += std::string(i == 0 ? "" : (i + 1 == all.size() ? " and " : ", ")) + safetensors::dtype_name(all[i]);
  return s;
}

/// Checks `want` against the file (or folder) as load_checkpoint does: names (missing,
/// and unexpected under `prefix` except `optional`), dtypes, shapes; the
/// dtype and shape of a stored (U8) tensor were checked by file_types.
inline void check_tensors(const std::string& where, const PackedSource& file, const std::vector<Expected>& want,
                          const std::string& prefix, const std::string& optional, bool allow_unexpected) {
  std::vector<std::string> missing, unexpected, bad_dtype, bad_shape;
  std::set<std::string> names;
  for (const auto& w : want) {
    names.insert(w.name);
    const safetensors::TensorInfo* t = file.find(w.name);
    if (!t) {
      missing.push_back(w.name);
      continue;
    }
    if (w.stored) continue;
    if (!packed_file_dtype(t->dtype))
      bad_dtype.push_back(w.name + " (" + safetensors::dtype_name(t->dtype) + ")");
    const std::vector<std::uint64_t> s{std::uint64_t(w.rows), std::uint64_t(w.cols)};
    if (apex::detail::drop_leading_ones(t->shape) != apex::detail::drop_leading_ones(s))
      bad_shape.push_back(safetensors::quote_name(w.name) + " is " + safetensors::shape_string(t->shape) +
                          " in the file, the layer needs " + safetensors::shape_string(s));
  }
  for (const std::string& n : file.names_under(prefix))
    if (!names.count(n) && n != optional) unexpected.push_back(n);
  const bool unexpected_bad = !unexpected.empty() && !allow_unexpected;
  if (!missing.empty() || unexpected_bad) {
    std::string msg = where + ": the file does not match the layer:";
    if (!missing.empty()) msg += " missing " + apex::detail::name_list(missing) + ";";
    if (unexpected_bad) msg += " unexpected " + apex::detail::name_list(unexpected) + ";";
    throw FormatError(msg);
  }
  if (!bad_dtype.empty())
    throw FormatError(where + ": only " + packed_file_dtype_names() + " tensors load into packed layers: " +
                      apex::detail::name_list(bad_dtype));
  if (!bad_shape.empty()) {
    std::string msg = where + ": shape mismatch:";
    for (std::size_t i = 0; i < bad_shape.size() && i < 12; ++i) msg += (i ? "; " : " ") + bad_shape[i];
    if (bad_shape.size() > 12) msg += "; and " + std::to_string(bad_shape.size() - 12) + " more";
    throw ShapeError(msg);
  }
}

/// Reads `name` into m (already of its shape); ValueError naming the tensor
/// if `finite` and it holds NaN or Inf.
template <class M>
void read_into(const std::string& where, const PackedSource& file, const std::string& name, M& m,
               bool finite) {
  file.read(name, m.data());
  if (finite && !m.allFinite())
    throw ValueError(where + ": tensor " + safetensors::quote_name(name) +
                     " contains NaN or Inf (the float layer rejects the router logits it would give)");
}

/// Reads the SwiGLU at `p` (name(p + state_names::kGate), …; `name` maps the
/// library's names to the file's) into the staging buffers (gu: 2f × d,
/// gate rows first; down: d × f) and packs it.
template <class Name>
packed::PackedExpert read_expert(const std::string& where, const PackedSource& file, const Name& name,
                                 const std::string& p, Matrix<float>& gu, Matrix<float>& down, packed::ExpertDtypes dtype,
                                 std::uint64_t& fp) {
  const Index f = gu.rows() / 2, d = gu.cols();
  file.read(name(p + state_names::kGate), gu.data());
  file.read(name(p + state_names::kUp), gu.data() + f * d);
  read_into(where, file, name(p + state_names::kDown), down, false);
  fingerprint_add(fp, gu.data(), gu.size());
  fingerprint_add(fp, down.data(), down.size());
  return packed::PackedExpert(gu.topRows(f), gu.bottomRows(f), down, dtype);
}

inline void add_swiglu_names(std::vector<Expected>& want, const std::string& p, Index d, Index f) {
  want.push_back({p + state_names::kGate, f, d});
  want.push_back({p + state_names::kUp, f, d});
  want.push_back({p + state_names::kDown, d, f});
}

/// The file's name of a layer parameter `internal` (MoEFFN::param_values()):
/// the prefix and, under a family, its Hugging Face name (io/name_maps.hpp).
struct FileNames {
  std::string prefix;
  std::optional<MoEFamily> family;
  std::string operator()(const std::string& internal) const {
    return prefix + (family ? apex::family_tensor_name(*family, internal) : internal);
  }
};

/// What load_packed_moe found, before it reads any weight: the tensors it
/// reads and the bias tensor ("" for none).
struct MoEPlan {
  FileNames name;
  std::vector<Expected> want;
  std::string bias_name;
  /// A quantized checkpoint's expert types (file_types); empty: the file's
  /// floats are packed in load_types.
  std::optional<PackedTypes> file_types;
};

/// The tensors of a PackedMoE of `config` under `name`, each routed expert's
/// float parts (`extra`, its kind's extra_tensors) included.
inline std::vector<Expected> moe_tensors(const MoEConfig& config, const FileNames& name,
                                         const std::vector<ExpertExtraTensor>& extra) {
  const Index d = config.d_model;
  std::vector<Expected> want{{name(state_names::kRouter), config.n_experts, d}};
  if (config.router_bias) want.push_back({name(state_names::kRouterBias), 1, config.n_experts});
  const auto add = [&](const std::string& q, Index width, int gate_up) {  // width × d, width × d, d × width
    for (const char* w : {state_names::kGate, state_names::kUp}) want.push_back({name(q + w), width, d, gate_up});
    want.push_back({name(q + state_names::kDown), d, width, gate_up + 1});
  };
  for (Index e = 0; e < config.n_experts; ++e) {
    const std::string q = state_names::routed_expert(e);
    add(q, config.d_ffn, kRoutedGateUp);
    for (const ExpertExtraTensor& t : extra) want.push_back({name(q + t.name), 1, t.cols});
  }
  for (Index s = 0; s < config.n_shared; ++s) add(state_names::shared_expert(s), config.shared_ffn(), kSharedGateUp);
  if (config.shared_expert_gate) want.push_back({name(state_names::kSharedGate), 1, d});
  return want;
}

/// ConfigError unless the family's blocks hold experts of `Kind` (its row's
/// `experts`): the family's names name no other kind's float parts.
template <class Kind>
void check_family_kind(const std::string& where, const FamilyTraits& row, const MoEConfig& config) {
  if (std::string(row.experts.name) == Kind::kName) return;
  std::string names;
  for (const ExpertExtraTensor& t : Kind::extra_tensors(config.d_model, config.d_ffn))
    names += (names.empty() ? "" : ", ") + std::string(t.name);
  throw ConfigError(where + ": the " + row.model_type + " name map has no names for " + Kind::kName +
                    " experts' parameters (" + names + ")");
}

/// Every check of load_packed_moe, in the order it reports them: the
/// configuration, the family and the kind's options, names, dtypes and shapes, and
/// memory. Reads no tensor.
template <class Layer>
MoEPlan plan_moe(const std::string& where, const PackedSource& file, const MoEConfig& config,
                 const PackedLoadOptions& options) {
  config.validate(where.c_str());
  MoEPlan plan{FileNames{options.prefix, options.family}, {}, {}, {}};
  const std::string& p = options.prefix;
  if (options.family) {
    const MoEFamily f = *options.family;
    check_family_kind<typename Layer::Kind>(where, family_traits(f, where.c_str()), config);
    apex::check_family_fit(where.c_str(), config, f);
    file.check_family(where, f, p);
    plan.bias_name = apex::family_bias_name(f, p);  // required by DeepSeek-V3's names
  } else if (!options.bias_name.empty() && file.find(p + options.bias_name)) {
    plan.bias_name = p + options.bias_name;  // optional under the library's names
  }
  options.expert_options.template get<typename Layer::ExpertType>().template validate_for<float>(where.c_str());
  plan.want = moe_tensors(config, plan.name, Layer::Kind::extra_tensors(config.d_model, config.d_ffn));
  if (!plan.bias_name.empty()) plan.want.push_back({plan.bias_name, 1, config.n_experts});
  plan.file_types = file_types(where, file, plan.want);
  check_tensors(where, file, plan.want, p, plan.bias_name, options.allow_unexpected);
  PackedTypes types = load_types(options, Layer::kDtype);
  if (plan.file_types) {
    const PackedTypes& f = *plan.file_types;  // without shared experts, their type is moot
    if (options.types && (options.types->routed != f.routed || (config.n_shared > 0 && options.types->shared != f.shared)))
      throw ConfigError(where + ": options.types asks for " + packed_types_name(*options.types) +
                        " experts, the file holds " + packed_types_name(f) + " experts (a quantized checkpoint)");
    types = f;
  }
  // A stored expert is staged as panel rows (≤ 4 bytes a weight) besides one matrix of floats.
  const Index staging = apex::detail::checked_product(
      where.c_str(), "staging bytes",
      {plan.file_types ? 4 : 3, std::max(config.d_ffn, config.shared_ffn()), config.d_model, 4});
  // also refuses widths that are not whole blocks of their type, before any read
  Layer::check_fits(where.c_str(), config, std::uint64_t(staging), types);
  return plan;
}

/// Reads and packs the experts (routed, with their kind's float parts; then shared) and
/// the shared gate of a checked plan, adding them to the fingerprint `fp`.
template <class Layer>
Layer build_moe(const std::string& where, const PackedSource& file, const MoEConfig& config,
                const PackedLoadOptions& options, const MoEPlan& plan, const Matrix<float>& router,
                const RowVector<float>& bias, std::uint64_t fp) {
  const Index d = config.d_model, f = config.d_ffn, fs = config.shared_ffn();
  const bool stored = plan.file_types.has_value();
  Matrix<float> gu(stored ? 0 : 2 * f, d), down(d, stored ? 0 : f);  // staging: one expert (float files)
  StoredStaging raw;                                                   // staging: one expert (quantized files)
  const PackedTypes types = stored ? *plan.file_types : load_types(options, Layer::kDtype);
  const auto next = [&](const std::string& q, Index width, packed::ExpertDtypes t) {
    try {  // a weight or block the type cannot hold: named by matrix, row and block, here by expert
      if (stored) return read_stored_expert(file, plan.name, q, d, width, t, raw);
      gu.resize(2 * width, d);  // the shared experts have their own width f_s
      down.resize(d, width);
      return read_expert(where, file, plan.name, q, gu, down, t, fp);
    } catch (const ValueError& e) {
      throw ValueError(where + ": expert '" + q + "': " + e.what());
    }
  };
  using Kind = typename Layer::Kind;
  const typename Kind::Options kind_options = options.expert_options.template get<typename Layer::ExpertType>();
  std::vector<packed::PackedExpert> experts, shared;
  std::vector<typename Layer::Extra> extras;
  experts.reserve(std::size_t(config.n_experts));
  for (Index e = 0; e < config.n_experts; ++e) {
    const std::string q = state_names::routed_expert(e);
    experts.push_back(next(q, f, types.routed));
    if constexpr (Layer::kHasExtra) {
      std::vector<RowVector<float>> rows;
      for (const ExpertExtraTensor& t : Kind::extra_tensors(d, f)) {
        rows.emplace_back(t.cols);
        read_into(where, file, plan.name(q + t.name), rows.back(), false);
        fingerprint_add(fp, rows.back().data(), t.cols);
      }
      extras.push_back(Kind::make_extra(std::move(rows), kind_options));
    }
  }
  for (Index s = 0; s < config.n_shared; ++s) shared.push_back(next(state_names::shared_expert(s), fs, types.shared));
  Matrix<float> shared_gate;  // 1 × d, or empty without a shared gate
  if (config.shared_expert_gate) {
    // Not checked finite: the float layer propagates a NaN gate weight into
    // the shared experts' output, it does not reject it.
    shared_gate.resize(1, d);
    read_into(where, file, plan.name(state_names::kSharedGate), shared_gate, false);
    fingerprint_add(fp, shared_gate.data(), shared_gate.size());
  }
  Layer out(config, router, bias, std::move(experts), std::move(extras), std::move(shared), std::move(shared_gate));
  // A quantized file holds no float weights to compare a source with: check_source refuses.
  if (!stored) out.set_source_fingerprint(fp);
  return out;
}

/// A PackedMoE from a checked plan: the router and bias first (ValueError
/// if either holds NaN or Inf, before any expert is read), then the experts.
/// Reads in the order of PackedMoE::fingerprint: router, bias, experts,
/// shared, gate.
template <class Layer>
Layer load_moe(const std::string& where, const PackedSource& file, const MoEConfig& config,
               const PackedLoadOptions& options, const MoEPlan& plan) {
  Matrix<float> router(config.n_experts, config.d_model);
  read_into(where, file, plan.name(state_names::kRouter), router, true);
  RowVector<float> logit_bias(config.router_bias ? config.n_experts : 0);  // 1 × E with router_bias
  if (config.router_bias) read_into(where, file, plan.name(state_names::kRouterBias), logit_bias, true);
  RowVector<float> bias = RowVector<float>::Zero(config.n_experts);
  if (!plan.bias_name.empty()) read_into(where, file, plan.bias_name, bias, true);
  std::uint64_t fp = kFingerprintSeed;
  fingerprint_add(fp, router.data(), router.size());
  if (config.router_bias) fingerprint_add(fp, logit_bias.data(), logit_bias.size());
  fingerprint_add(fp, bias.data(), bias.size());
  Layer out = build_moe<Layer>(where, file, config, options, plan, router, bias, fp);
  if (config.router_bias) out.set_logit_bias(logit_bias);  // read finite above: cannot throw
  return out;
}

}  // namespace detail::inference

}  // namespace apex
