#pragma once
/// \file inference/packed_load.hpp
/// Packed inference layers straight from a safetensors checkpoint, under the
/// state_dict names the training layers save (`router.weight`,
/// `experts.3.w_gate.weight`, `experts.3.kappa_alpha`,
/// `shared_experts.0.w_down.weight`, …; see MoEFFN::param_values), in F32, F64 or
/// BF16.
///
/// Loading goes expert by expert: one expert's three matrices are decoded
/// into a float staging buffer (3·f·d floats, reused) and packed at once, so
/// the process never holds a float copy of the whole model. BF16 tensors
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
/// is zero. κ's options (U, c) are not in checkpoints: pass them.
///
/// Needs the `apex::checkpoint` target (nlohmann_json), like checkpoint.hpp;
/// the layers themselves (inference.hpp) need only Eigen.

#include <optional>
#include <set>
#include <string>
#include <vector>

#include "../checkpoint.hpp"
#include "../errors.hpp"
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
  /// Name (under the prefix) of the optional balancing-bias tensor; empty: none.
  std::string bias_name = "expert_bias";
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

/// Reads the SwiGLU at `p` (p + "w_gate.weight", …) into the staging
/// buffers (gu: 2f × d, gate rows first; down: d × f) and packs it.
inline packed::PackedExpert read_expert(const std::string& where, const safetensors::Reader& file,
                                        const std::string& p, Matrix<float>& gu, Matrix<float>& down,
                                        packed::Dtype dtype, std::uint64_t& fp) {
  const Index f = gu.rows() / 2, d = gu.cols();
  file.read(file.at(p + "w_gate.weight"), gu.data());
  file.read(file.at(p + "w_up.weight"), gu.data() + f * d);
  read_into(where, file, p + "w_down.weight", down, false);
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
/// the float layer that saved an F32 file and has not changed since.
template <class Storage, class Expert = SwiGLU<float>>
PackedMoE<Storage, Expert> load_packed_moe(const safetensors::Reader& file, const MoEConfig& config,
                                           const PackedLoadOptions& options = {}) {
  using Layer = PackedMoE<Storage, Expert>;
  namespace inf = detail::inference;
  const std::string where = "load_packed_moe(" + file.source().description() + ")";
  config.validate(where.c_str());
  const std::string& p = options.prefix;
  const Index d = config.d_model, f = config.d_ffn, E = config.n_experts;
  std::vector<inf::Expected> want{{p + "router.weight", E, d}};
  for (Index e = 0; e < E; ++e) {
    const std::string q = p + "experts." + std::to_string(e) + ".";
    inf::add_swiglu_names(want, q, d, f);
    if constexpr (Layer::kKappa) {
      want.push_back({q + "kappa_alpha", 1, f});
      want.push_back({q + "kappa_bias", 1, f});
    }
  }
  for (Index s = 0; s < config.n_shared; ++s)
    inf::add_swiglu_names(want, p + "shared_experts." + std::to_string(s) + ".", d, f);
  const std::string bias_name = options.bias_name.empty() ? std::string() : p + options.bias_name;
  const bool has_bias = !bias_name.empty() && file.header().find(bias_name) != nullptr;
  if (has_bias) want.push_back({bias_name, 1, E});
  inf::check_tensors(where, file, want, p, bias_name, options.allow_unexpected);
  const std::uint64_t staging = std::uint64_t(detail::checked_product(where.c_str(), "staging", {3, f, d, 4}));
  Layer::check_fits(where.c_str(), config, staging);

  std::uint64_t fp = inf::kFingerprintSeed;
  Matrix<float> router(E, d);
  inf::read_into(where, file, p + "router.weight", router, true);
  RowVector<float> bias = RowVector<float>::Zero(E);
  if (has_bias) inf::read_into(where, file, bias_name, bias, true);
  inf::fingerprint_add(fp, router.data(), router.size());
  inf::fingerprint_add(fp, bias.data(), bias.size());

  Matrix<float> gu(2 * f, d), down(d, f);  // staging: one expert
  std::vector<packed::PackedExpert> experts, shared;
  std::vector<KappaGate> gates;
  experts.reserve(std::size_t(E));
  for (Index e = 0; e < E; ++e) {
    const std::string q = p + "experts." + std::to_string(e) + ".";
    experts.push_back(inf::read_expert(where, file, q, gu, down, Layer::kDtype, fp));
    if constexpr (Layer::kKappa) {
      KappaGate g{RowVector<float>(f), RowVector<float>(f), options.kappa};
      inf::read_into(where, file, q + "kappa_alpha", g.alpha, false);
      inf::read_into(where, file, q + "kappa_bias", g.bias, false);
      inf::fingerprint_add(fp, g.alpha.data(), f);
      inf::fingerprint_add(fp, g.bias.data(), f);
      gates.push_back(std::move(g));
    }
  }
  for (Index s = 0; s < config.n_shared; ++s)
    shared.push_back(
        inf::read_expert(where, file, p + "shared_experts." + std::to_string(s) + ".", gu, down, Layer::kDtype, fp));
  Layer out(config, router, bias, std::move(experts), std::move(gates), std::move(shared));
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
  PackedSwiGLU<Storage> out(inf::read_expert(where, file, options.prefix, gu, down, PackedSwiGLU<Storage>::kDtype, fp));
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
