#pragma once
/// \file inference/files/checkpoint/load.hpp
/// Packed inference layers straight from a safetensors checkpoint, under the
/// state_dict names the training layers save (`router.weight`,
/// `experts.3.w_gate.weight`, `experts.3.kappa_alpha`,
/// `shared_experts.0.w_down.weight`, `shared_expert_gate.weight`, …; see
/// MoEFFN::param_values) or, with `PackedLoadOptions::family`, under the
/// Hugging Face names of an open MoE family (io/name_maps.hpp: DeepSeek-V3,
/// Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE), in F32, F64 or BF16 — or a
/// quantized checkpoint (inference/files/checkpoint/save.hpp: save_packed_moe), whose
/// U8 expert tensors hold the blocks of the type its metadata names; they go
/// into the panels bit for bit, and the layer's types are the file's.
///
/// `path` may be one safetensors file or a Hugging Face sharded folder (or
/// its `model.safetensors.index.json`), whose shards are mapped
/// (io::MappedShards) and read only for the layer's tensors; the checks are
/// the one file's, over the index's names (inference/files/checkpoint/source.hpp).
///
/// Loading goes expert by expert: one expert's three matrices are decoded
/// into a float staging buffer (3·max(f, f_s)·d floats, reused) and packed at
/// once, so the process never holds a float copy of the whole model. BF16 tensors
/// pack without loss into a bf16 layer (bf16 → float → bf16 is exact).
///
/// Checks, all before the first expert is read and packed, and as
/// load_checkpoint reports them: names (FormatError naming the missing and
/// the unexpected tensors; strict by default), dtypes (FormatError for
/// anything but F32, F64, BF16 and a quantized checkpoint's U8), shapes
/// (ShapeError; FormatError for a U8 tensor that is not [rows, row bytes]),
/// a quantized checkpoint's metadata (FormatError for a missing or unknown
/// type or version; ConfigError if options.types differ), memory and the kind's options
/// (ConfigError, core/memory_budget.hpp). Then, as the float layer would reject
/// them: a non-finite router weight or balancing bias is a ValueError (the
/// float layer's forward rejects the non-finite logits every call would
/// produce). NaN/Inf in expert weights and κ parameters are propagated, as
/// in the float layer (docs/error_model.md). A loader returns a new layer:
/// a rejected load changes nothing the caller holds.
///
/// The balancing bias is not a parameter; a file may carry it as the
/// optional tensor `expert_bias` (docs/checkpoints.md). Without it the bias
/// is zero. Under a family's names it is DeepSeek-V3's required
/// `mlp.gate.e_score_correction_bias`, and no other family has one — as
/// load_family_checkpoint reads them. An expert kind's options (κ's U, c) are
/// not in checkpoints: pass them (`options.expert_options`).
///
/// Needs the `apex::checkpoint` target (nlohmann_json), like io/checkpoint.hpp;
/// the layers themselves (inference.hpp) need only Eigen.

#include <optional>
#include <set>
#include <string>
#include <vector>

#include "../../../io/checkpoint.hpp"
#include "../../../core/errors.hpp"
#include "../../../io/mapped_shards.hpp"
#include "../../../io/safetensors.hpp"
#include "../../../io/sharded_checkpoint.hpp"
#include "../../engine/packed_moe.hpp"
#include "read.hpp"
#include "save.hpp"  // the quantized checkpoints these loaders read
#include "source.hpp"
#include "../../engine/packed_sublayer.hpp"
#include "../../engine/packed_swiglu.hpp"

namespace apex {

namespace detail::inference {

/// Calls `fn(source)` on the PackedSource of `path`: a sharded folder or its
/// index (io/sharded_checkpoint.hpp's rule) opened through mappings
/// (io::MappedShards: every shard mapped and its header validated, no
/// weight read), else one safetensors file, mapped as well (Reader::map). Errors of opening as
/// MappedShards and safetensors::Reader report them (FormatError).
template <class Fn>
decltype(auto) with_packed_source(const std::string& path, const safetensors::Limits& limits, Fn&& fn) {
  if (apex::detail::is_sharded_path(path)) {
    const io::MappedShards shards(path, limits);
    return fn(PackedSource(shards, shard_index_path(path)));
  }
  // Mapped too: the header is read out of the mapping and each tensor
  // decoded in place, with no chunk buffer; open_regular_file refuses a
  // FIFO or device at once, as the pread reader does.
  const safetensors::Reader file = safetensors::Reader::map(path, limits);
  return fn(PackedSource(file));
}

/// load_packed_moe over any source: every check, then the read.
template <class Layer>
Layer load_packed_moe_from(const PackedSource& file, const MoEConfig& config, const PackedLoadOptions& options) {
  const std::string where = "load_packed_moe(" + file.description() + ")";
  const auto plan = plan_moe<Layer>(where, file, config, options);
  return load_moe<Layer>(where, file, config, options, plan);
}

}  // namespace detail::inference

/// A PackedMoE of `config` from `file` (see the file comment). Every check
/// (names, dtypes, shapes, memory, the kind's options, a non-finite router weight or
/// bias) runs before the first expert is read and packed. The layer's
/// fingerprint is that of the values read, so check_source(src) passes for
/// the float layer that saved an F32 file (or loaded the same file) and has
/// not changed since; a layer from a quantized checkpoint has no float
/// weights to compare, and check_source refuses it.
template <class Storage, class Expert = SwiGLU<float>, class Activation = packed::SiluGate>
PackedMoE<Storage, Expert, Activation> load_packed_moe(const safetensors::Reader& file, const MoEConfig& config,
                                                       const PackedLoadOptions& options = {}) {
  using Layer = PackedMoE<Storage, Expert, Activation>;
  return detail::inference::load_packed_moe_from<Layer>(detail::inference::PackedSource(file), config, options);
}

/// Opens, validates and loads `path`: one safetensors file, or a Hugging
/// Face sharded checkpoint (its folder or its `model.safetensors.index.json`;
/// docs/model_files.md, "Hugging Face sharded folders"). A folder's shards
/// are mapped, not read: each expert's tensors are decoded (or, quantized,
/// copied) from the mapping into the one-expert staging buffer and packed,
/// so the load touches the layer's own tensors only. The checks are the
/// one file's, over the index's names: tensors under the prefix that the
/// layer does not name are unexpected, the shards' tensors outside it
/// (other layers) are ignored; a shard the index names that is missing or
/// malformed, or lacks a tensor the index puts in it, is a FormatError
/// before any weight is read.
template <class Storage, class Expert = SwiGLU<float>, class Activation = packed::SiluGate>
PackedMoE<Storage, Expert, Activation> load_packed_moe(const std::string& path, const MoEConfig& config,
                                                       const PackedLoadOptions& options = {}) {
  using Layer = PackedMoE<Storage, Expert, Activation>;
  return detail::inference::with_packed_source(path, options.limits, [&](const detail::inference::PackedSource& src) {
    return detail::inference::load_packed_moe_from<Layer>(src, config, options);
  });
}

namespace detail::inference {
template <class Storage>
PackedSwiGLU<Storage> load_packed_swiglu_from(const PackedSource& file, Index d_model, Index d_ffn,
                                              const PackedLoadOptions& options) {
  const std::string where = "load_packed_swiglu(" + file.description() + ")";
  const packed::ExpertDtypes types = load_types(options, PackedSwiGLU<Storage>::kDtype).routed;
  PackedSwiGLU<Storage>::check_fits(where.c_str(), d_model, d_ffn, 0, types);
  std::vector<Expected> want;
  add_swiglu_names(want, options.prefix, d_model, d_ffn);
  check_tensors(where, file, want, options.prefix, std::string(), options.allow_unexpected);
  PackedSwiGLU<Storage>::check_fits(
      where.c_str(), d_model, d_ffn,
      std::uint64_t(apex::detail::checked_product(where.c_str(), "staging", {3, d_ffn, d_model, 4})), types);
  std::uint64_t fp = kFingerprintSeed;
  Matrix<float> gu(2 * d_ffn, d_model), down(d_model, d_ffn);  // 2f × d (gate rows first), d × f
  const auto name = [](const std::string& n) { return n; };
  PackedSwiGLU<Storage> out(read_expert(where, file, name, options.prefix, gu, down, types, fp));
  out.set_source_fingerprint(fp);
  return out;
}
}  // namespace detail::inference

/// A PackedSwiGLU of d_model × d_ffn from `file` (names `w_gate.weight`,
/// `w_up.weight`, `w_down.weight` under options.prefix).
template <class Storage>
PackedSwiGLU<Storage> load_packed_swiglu(const safetensors::Reader& file, Index d_model, Index d_ffn,
                                         const PackedLoadOptions& options = {}) {
  return detail::inference::load_packed_swiglu_from<Storage>(detail::inference::PackedSource(file), d_model, d_ffn,
                                                             options);
}

/// As above from `path`: one file or a sharded folder (as load_packed_moe).
template <class Storage>
PackedSwiGLU<Storage> load_packed_swiglu(const std::string& path, Index d_model, Index d_ffn,
                                         const PackedLoadOptions& options = {}) {
  return detail::inference::with_packed_source(path, options.limits, [&](const detail::inference::PackedSource& src) {
    return detail::inference::load_packed_swiglu_from<Storage>(src, d_model, d_ffn, options);
  });
}

namespace detail::inference {
template <class Storage, class Expert>
PackedSublayer<PackedMoE<Storage, Expert>> load_packed_sublayer_from(const PackedSource& file, const MoEConfig& config,
                                                                     const std::optional<SkipGateConfig>& gate,
                                                                     const PackedLoadOptions& options) {
  const std::string& p = options.prefix;
  const std::string where = "load_packed_sublayer(" + file.description() + ")";
  // The norm and gate parameters, loaded with load_checkpoint's checks under the prefix.
  RMSNorm<float> norm(config.d_model);
  std::optional<SkipGate<float>> g;
  if (gate) g.emplace(*gate);
  ParamList<float> small;
  apex::detail::append_prefixed(small, p + "norm.", norm.param_values());  // values only: no gradients allocated
  if (g) apex::detail::append_prefixed(small, p + "skip_gate.", g->param_values());
  // Names under the prefix that belong to nobody.
  if (!options.allow_unexpected) {
    std::vector<std::string> unexpected;
    std::set<std::string> small_names;
    for (const auto& q : small) small_names.insert(q.name);
    const std::string ffn = p + "ffn.";
    for (const std::string& n : file.names_under(p))
      if (n.compare(0, ffn.size(), ffn) != 0 && !small_names.count(n)) unexpected.push_back(n);
    if (!unexpected.empty())
      throw FormatError(where + ": the file does not match the layer: unexpected " +
                        apex::detail::name_list(unexpected) + ";");
  }
  // The FFN's checks first, so a file the FFN rejects costs no read at all.
  PackedLoadOptions fo = options;
  fo.prefix = p + "ffn.";
  using FFN = PackedMoE<Storage, Expert>;
  const std::string ffn_where = "load_packed_moe(" + file.description() + ")";
  const auto plan = plan_moe<FFN>(ffn_where, file, config, fo);
  LoadOptions lo;
  lo.allow_unexpected = true;  // the FFN's tensors; names under the prefix were checked above
  lo.limits = options.limits;
  file.load_params(small, lo);
  auto ffn = load_moe<FFN>(ffn_where, file, config, fo, plan);
  auto out = g ? PackedSublayer<FFN>(config.d_model, std::move(ffn), std::move(*g))
               : PackedSublayer<FFN>(config.d_model, std::move(ffn));
  out.norm() = std::move(norm);
  out.set_mode(SublayerMode::inference);
  return out;
}
}  // namespace detail::inference

/// A packed MoE sublayer from `file`: `norm.weight`, `ffn.…` (as
/// load_packed_moe, prefix + "ffn.") and, with `gate`, `skip_gate.…` under
/// options.prefix. Errors as load_packed_moe and load_checkpoint, all before
/// any expert is read; tensors under the prefix that are none of these are
/// unexpected (FormatError unless allowed).
template <class Storage, class Expert = SwiGLU<float>>
PackedSublayer<PackedMoE<Storage, Expert>> load_packed_sublayer(const safetensors::Reader& file,
                                                                const MoEConfig& config,
                                                                const std::optional<SkipGateConfig>& gate = {},
                                                                const PackedLoadOptions& options = {}) {
  return detail::inference::load_packed_sublayer_from<Storage, Expert>(detail::inference::PackedSource(file), config,
                                                                       gate, options);
}

/// As above from `path`: one file or a sharded folder (as load_packed_moe;
/// the norm and gate come from the shards the index gives, a name it lacks
/// is missing).
template <class Storage, class Expert = SwiGLU<float>>
PackedSublayer<PackedMoE<Storage, Expert>> load_packed_sublayer(const std::string& path, const MoEConfig& config,
                                                                const std::optional<SkipGateConfig>& gate = {},
                                                                const PackedLoadOptions& options = {}) {
  return detail::inference::with_packed_source(path, options.limits, [&](const detail::inference::PackedSource& src) {
    return detail::inference::load_packed_sublayer_from<Storage, Expert>(src, config, gate, options);
  });
}

}  // namespace apex
