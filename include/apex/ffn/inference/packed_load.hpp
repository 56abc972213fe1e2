#pragma once
/// \file inference/packed_load.hpp
/// Packed inference layers straight from a safetensors checkpoint, under the
/// state_dict names the training layers save (`router.weight`,
/// `experts.3.w_gate.weight`, `experts.3.kappa_alpha`,
/// `shared_experts.0.w_down.weight`, `shared_expert_gate.weight`, …; see
/// MoEFFN::param_values) or, with `PackedLoadOptions::family`, under the
/// Hugging Face names of an open MoE family (name_maps.hpp: DeepSeek-V3,
/// Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE), in F32, F64 or BF16.
///
/// Loading goes expert by expert: one expert's three matrices are decoded
/// into a float staging buffer (3·max(f, f_s)·d floats, reused) and packed at
/// once, so the process never holds a float copy of the whole model. BF16 tensors
/// pack without loss into a bf16 layer (bf16 → float → bf16 is exact).
///
/// Checks, all before the first expert is packed and as load_checkpoint
/// reports them: names (FormatError naming the missing and the unexpected
/// tensors; strict by default), dtypes (FormatError for anything but F32,
/// F64, BF16), shapes (ShapeError), memory (ConfigError, memory_budget.hpp).
/// Then, as the float layer would reject them: a non-finite router weight or
/// balancing bias is a ValueError (the float layer's forward rejects the
/// non-finite logits every call would produce). NaN/Inf in expert weights
/// and κ parameters are propagated, as in the float layer (docs/error_model.md).
///
/// The balancing bias is not a parameter; a file may carry it as the
/// optional tensor `expert_bias` (docs/checkpoints.md). Without it the bias
/// is zero. Under a family's names it is DeepSeek-V3's required
/// `mlp.gate.e_score_correction_bias`, and no other family has one — as
/// load_family_checkpoint reads them. κ's options (U, c) are not in
/// checkpoints: pass them.
///
/// Needs the `apex::checkpoint` target (nlohmann_json), like checkpoint.hpp;
/// the layers themselves (inference.hpp) need only Eigen.

#include <algorithm>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "../checkpoint.hpp"
#include "../errors.hpp"
#include "../family_presets.hpp"
#include "../name_maps.hpp"
#include "../safetensors.hpp"
#include "packed_moe.hpp"
#include "packed_sublayer.hpp"
#include "packed_swiglu.hpp"

namespace apex {

/// How the packed loaders read a file.
struct PackedLoadOptions {
  /// Prefix of the layer's names in the file (e.g. "layers.3.ffn."). Only
  /// tensors under it are the layer's; others are ignored.
  std::string prefix;
  /// Ignore tensors under the prefix that the layer does not name.
  bool allow_unexpected = false;
  /// Name (under the prefix) of the optional balancing-bias tensor; empty:
  /// none. Ignored under a family's names (see `family`).
  std::string bias_name = "expert_bias";
  /// Read the MoE layer under the Hugging Face names of this open MoE family
  /// (name_maps.hpp; the prefix is still prepended, e.g. "model.layers.3."),
  /// with the checks of load_family_checkpoint: FormatError for another
  /// family's file or a DeepSeek-V3 file without its correction bias,
  /// ConfigError for a configuration the family's block cannot hold (its
  /// shared experts; κ-SwiGLU experts, which no family has). Unset: the
  /// library's own names.
  std::optional<MoEFamily> family;
  /// Options of κ-SwiGLU experts (not stored in checkpoints).
  KappaOptions kappa;
  /// Caps applied while reading the file.
  safetensors::Limits limits;
};

namespace detail::inference {

struct Expected {
  std::string name;
  Index rows, cols;
};

/// Checks `want` against the file as load_checkpoint does: names (missing,
/// and unexpected under `prefix` except `optional`), dtypes, shapes.
inline void check_tensors(const std::string& where, const safetensors::Reader& file, const std::vector<Expected>& want,
                          const std::string& prefix, const std::string& optional, bool allow_unexpected) {
  std::vector<std::string> missing, unexpected, bad_dtype, bad_shape;
  std::set<std::string> names;
  for (const auto& w : want) {
    names.insert(w.name);
    const safetensors::TensorInfo* t = file.header().find(w.name);
    if (!t) {
      missing.push_back(w.name);
      continue;
    }
    if (!safetensors::is_float_convertible(t->dtype))
      bad_dtype.push_back(w.name + " (" + safetensors::dtype_name(t->dtype) + ")");
    const std::vector<std::uint64_t> s{std::uint64_t(w.rows), std::uint64_t(w.cols)};
    if (apex::detail::drop_leading_ones(t->shape) != apex::detail::drop_leading_ones(s))
      bad_shape.push_back(safetensors::quote_name(w.name) + " is " + safetensors::shape_string(t->shape) +
                          " in the file, the layer needs " + safetensors::shape_string(s));
  }
  for (const auto& t : file.tensors())
    if (t.name.compare(0, prefix.size(), prefix) == 0 && !names.count(t.name) && t.name != optional)
      unexpected.push_back(t.name);
  const bool unexpected_bad = !unexpected.empty() && !allow_unexpected;
  if (!missing.empty() || unexpected_bad) {
    std::string msg = where + ": the file does not match the layer:";
    if (!missing.empty()) msg += " missing " + apex::detail::name_list(missing) + ";";
    if (unexpected_bad) msg += " unexpected " + apex::detail::name_list(unexpected) + ";";
    throw FormatError(msg);
  }
  if (!bad_dtype.empty())
    throw FormatError(where + ": only F32, F64 and BF16 tensors load into packed layers: " +
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
void read_into(const std::string& where, const safetensors::Reader& file, const std::string& name, M& m,
               bool finite) {
  file.read(file.at(name), m.data());
  if (finite && !m.allFinite())
    throw ValueError(where + ": tensor " + safetensors::quote_name(name) +
                     " contains NaN or Inf (the float layer rejects the router logits it would give)");
}

/// Reads the SwiGLU at `p` (name(p + "w_gate.weight"), …; `name` maps the
/// library's names to the file's) into the staging buffers (gu: 2f × d,
/// gate rows first; down: d × f) and packs it.
template <class Name>
packed::PackedExpert read_expert(const std::string& where, const safetensors::Reader& file, const Name& name,
                                 const std::string& p, Matrix<float>& gu, Matrix<float>& down, packed::Dtype dtype,
                                 std::uint64_t& fp) {
  const Index f = gu.rows() / 2, d = gu.cols();
  file.read(file.at(name(p + "w_gate.weight")), gu.data());
  file.read(file.at(name(p + "w_up.weight")), gu.data() + f * d);
  read_into(where, file, name(p + "w_down.weight"), down, false);
  fingerprint_add(fp, gu.data(), gu.size());
  fingerprint_add(fp, down.data(), down.size());
  return packed::PackedExpert(gu.topRows(f), gu.bottomRows(f), down, dtype);
}

inline void add_swiglu_names(std::vector<Expected>& want, const std::string& p, Index d, Index f) {
  want.push_back({p + "w_gate.weight", f, d});
  want.push_back({p + "w_up.weight", f, d});
  want.push_back({p + "w_down.weight", d, f});
}

}  // namespace detail::inference

/// A PackedMoE of `config` from `file` (see the file comment). The layer's
/// fingerprint is that of the values read, so check_source(src) passes for
/// the float layer that saved an F32 file (or loaded the same file) and has
/// not changed since.
template <class Storage, class Expert = SwiGLU<float>>
PackedMoE<Storage, Expert> load_packed_moe(const safetensors::Reader& file, const MoEConfig& config,
                                           const PackedLoadOptions& options = {}) {
  using Layer = PackedMoE<Storage, Expert>;
  namespace inf = detail::inference;
  const std::string where = "load_packed_moe(" + file.source().description() + ")";
  config.validate(where.c_str());
  const std::string& p = options.prefix;
  const std::optional<MoEFamily>& family = options.family;
  if (family) {
    detail::require_config(!Layer::kKappa, where.c_str(),
                           std::string("the ") + family_name(*family) +
                               " name map has no names for kappa-SwiGLU parameters (kappa_alpha, kappa_bias)");
    detail::check_family_fit(where.c_str(), config, *family);
    detail::check_family_file(where, file, *family, p);
  }
  // The file's name of the layer's parameter `internal` (MoEFFN::params()).
  const auto name = [&](const std::string& internal) {
    return p + (family ? detail::family_tensor_name(*family, internal) : internal);
  };
  const Index d = config.d_model, f = config.d_ffn, fs = config.shared_ffn(), E = config.n_experts;
  std::vector<inf::Expected> want{{name("router.weight"), E, d}};
  const auto add_swiglu = [&](const std::string& q, Index width) {  // width × d, width × d, d × width
    want.push_back({name(q + "w_gate.weight"), width, d});
    want.push_back({name(q + "w_up.weight"), width, d});
    want.push_back({name(q + "w_down.weight"), d, width});
  };
  for (Index e = 0; e < E; ++e) {
    const std::string q = "experts." + std::to_string(e) + ".";
    add_swiglu(q, f);
    if constexpr (Layer::kKappa) {
      want.push_back({name(q + "kappa_alpha"), 1, f});
      want.push_back({name(q + "kappa_bias"), 1, f});
    }
  }
  for (Index s = 0; s < config.n_shared; ++s) add_swiglu("shared_experts." + std::to_string(s) + ".", fs);
  if (config.shared_expert_gate) want.push_back({name("shared_expert_gate.weight"), 1, d});
  // The bias: optional under the library's names, required by DeepSeek-V3's.
  std::string bias_name;
  bool has_bias = false;
  if (family) {
    bias_name = detail::family_bias_name(*family, p);
    has_bias = !bias_name.empty();
  } else if (!options.bias_name.empty()) {
    bias_name = p + options.bias_name;
    has_bias = file.header().find(bias_name) != nullptr;
  }
  if (has_bias) want.push_back({bias_name, 1, E});
  inf::check_tensors(where, file, want, p, bias_name, options.allow_unexpected);
  const std::uint64_t staging =
      std::uint64_t(detail::checked_product(where.c_str(), "staging", {3, std::max(f, fs), d, 4}));
  Layer::check_fits(where.c_str(), config, staging);

  // Read in the order of PackedMoE::fingerprint: router, bias, experts, shared, gate.
  std::uint64_t fp = inf::kFingerprintSeed;
  Matrix<float> router(E, d);
  inf::read_into(where, file, name("router.weight"), router, true);
  RowVector<float> bias = RowVector<float>::Zero(E);
  if (has_bias) inf::read_into(where, file, bias_name, bias, true);
  inf::fingerprint_add(fp, router.data(), router.size());
  inf::fingerprint_add(fp, bias.data(), bias.size());

  Matrix<float> gu(2 * f, d), down(d, f);  // staging: one expert
  std::vector<packed::PackedExpert> experts, shared;
  std::vector<KappaGate> gates;
  experts.reserve(std::size_t(E));
  for (Index e = 0; e < E; ++e) {
    const std::string q = "experts." + std::to_string(e) + ".";
    experts.push_back(inf::read_expert(where, file, name, q, gu, down, Layer::kDtype, fp));
    if constexpr (Layer::kKappa) {
      KappaGate g{RowVector<float>(f), RowVector<float>(f), options.kappa};
      inf::read_into(where, file, name(q + "kappa_alpha"), g.alpha, false);
      inf::read_into(where, file, name(q + "kappa_bias"), g.bias, false);
      inf::fingerprint_add(fp, g.alpha.data(), f);
      inf::fingerprint_add(fp, g.bias.data(), f);
      gates.push_back(std::move(g));
    }
  }
  gu.resize(2 * fs, d);  // the shared experts' own width f_s
  down.resize(d, fs);
  for (Index s = 0; s < config.n_shared; ++s)
    shared.push_back(
        inf::read_expert(where, file, name, "shared_experts." + std::to_string(s) + ".", gu, down, Layer::kDtype, fp));
  Matrix<float> shared_gate;  // 1 × d, or empty without a shared gate
  if (config.shared_expert_gate) {
    // Not checked finite: the float layer propagates a NaN gate weight into
    // the shared experts' output, it does not reject it.
    shared_gate.resize(1, d);
    inf::read_into(where, file, name("shared_expert_gate.weight"), shared_gate, false);
    inf::fingerprint_add(fp, shared_gate.data(), shared_gate.size());
  }
  Layer out(config, router, bias, std::move(experts), std::move(gates), std::move(shared), std::move(shared_gate));
  out.set_source_fingerprint(fp);
  return out;
}

/// Opens, validates and loads `path` (see the overload above).
template <class Storage, class Expert = SwiGLU<float>>
PackedMoE<Storage, Expert> load_packed_moe(const std::string& path, const MoEConfig& config,
                                           const PackedLoadOptions& options = {}) {
  const safetensors::Reader file(path, options.limits);
  return load_packed_moe<Storage, Expert>(file, config, options);
}

/// A PackedSwiGLU of d_model × d_ffn from `file` (names `w_gate.weight`,
/// `w_up.weight`, `w_down.weight` under options.prefix).
template <class Storage>
PackedSwiGLU<Storage> load_packed_swiglu(const safetensors::Reader& file, Index d_model, Index d_ffn,
                                         const PackedLoadOptions& options = {}) {
  namespace inf = detail::inference;
  const std::string where = "load_packed_swiglu(" + file.source().description() + ")";
  PackedSwiGLU<Storage>::check_fits(where.c_str(), d_model, d_ffn, 0);
  std::vector<inf::Expected> want;
  inf::add_swiglu_names(want, options.prefix, d_model, d_ffn);
  inf::check_tensors(where, file, want, options.prefix, std::string(), options.allow_unexpected);
  PackedSwiGLU<Storage>::check_fits(
      where.c_str(), d_model, d_ffn,
      std::uint64_t(detail::checked_product(where.c_str(), "staging", {3, d_ffn, d_model, 4})));
  std::uint64_t fp = inf::kFingerprintSeed;
  Matrix<float> gu(2 * d_ffn, d_model), down(d_model, d_ffn);
  const auto name = [](const std::string& n) { return n; };
  PackedSwiGLU<Storage> out(
      inf::read_expert(where, file, name, options.prefix, gu, down, PackedSwiGLU<Storage>::kDtype, fp));
  out.set_source_fingerprint(fp);
  return out;
}

template <class Storage>
PackedSwiGLU<Storage> load_packed_swiglu(const std::string& path, Index d_model, Index d_ffn,
                                         const PackedLoadOptions& options = {}) {
  const safetensors::Reader file(path, options.limits);
  return load_packed_swiglu<Storage>(file, d_model, d_ffn, options);
}

/// A packed MoE sublayer from `file`: `norm.weight`, `ffn.…` (as
/// load_packed_moe, prefix + "ffn.") and, with `gate`, `skip_gate.…` under
/// options.prefix. Errors as load_packed_moe; tensors under the prefix that
/// are none of these are unexpected (FormatError unless allowed).
template <class Storage, class Expert = SwiGLU<float>>
PackedSublayer<PackedMoE<Storage, Expert>> load_packed_sublayer(const safetensors::Reader& file,
                                                                const MoEConfig& config,
                                                                const std::optional<SkipGateConfig>& gate = {},
                                                                const PackedLoadOptions& options = {}) {
  const std::string& p = options.prefix;
  const std::string where = "load_packed_sublayer(" + file.source().description() + ")";
  // The norm and gate parameters, loaded by load_checkpoint under the prefix.
  RMSNorm<float> norm(config.d_model);
  std::optional<SkipGate<float>> g;
  if (gate) g.emplace(*gate);
  ParamList<float> small;
  detail::append_prefixed(small, p + "norm.", norm.param_values());  // values only: no gradients allocated
  if (g) detail::append_prefixed(small, p + "skip_gate.", g->param_values());
  // Names under the prefix that belong to nobody.
  if (!options.allow_unexpected) {
    std::vector<std::string> unexpected;
    std::set<std::string> small_names;
    for (const auto& q : small) small_names.insert(q.name);
    const std::string ffn = p + "ffn.";
    for (const auto& t : file.tensors())
      if (t.name.compare(0, p.size(), p) == 0 && t.name.compare(0, ffn.size(), ffn) != 0 && !small_names.count(t.name))
        unexpected.push_back(t.name);
    if (!unexpected.empty())
      throw FormatError(where + ": the file does not match the layer: unexpected " +
                        detail::name_list(unexpected) + ";");
  }
  LoadOptions lo;
  lo.allow_unexpected = true;  // the FFN's tensors; names under the prefix were checked above
  lo.limits = options.limits;
  load_checkpoint(file, small, lo);
  PackedLoadOptions fo = options;
  fo.prefix = p + "ffn.";
  auto ffn = load_packed_moe<Storage, Expert>(file, config, fo);
  auto out = g ? PackedSublayer<PackedMoE<Storage, Expert>>(config.d_model, std::move(ffn), std::move(*g))
               : PackedSublayer<PackedMoE<Storage, Expert>>(config.d_model, std::move(ffn));
  out.norm() = std::move(norm);
  out.set_mode(SublayerMode::inference);
  return out;
}

}  // namespace apex
