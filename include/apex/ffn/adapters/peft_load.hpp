#pragma once
/// \file adapters/peft_load.hpp
/// `load_peft_adapter`: a peft adapter folder (adapters/peft_files.hpp) read
/// into existing LoraMoE layers, and `peft_lora_options`, the LoraOptions
/// of a layer that fits one of the folder's layers.
///
/// All or nothing: before any layer is written, the load checks
///  - the layers: distinct indices, each a different LoraMoE (ConfigError);
///  - the config: plain LoRA (adapters/peft_config.hpp), its r, lora_alpha,
///    use_rslora and (stacked layouts) targeted expert parameters equal to
///    each layer's (ConfigError naming the key);
///  - names: every tensor of the layers' adapters is in the file, and every
///    file tensor under a given layer's block is one of them; tensors
///    outside the given blocks only with allow_unexpected (FormatError
///    naming the missing and the unexpected);
///  - dtypes F16, BF16, F32 or F64, as peft saves them (FormatError);
///  - shapes, exactly (ShapeError naming the tensor, its shape and the one expected);
///  - values: finite after conversion to the layer's scalar (ValueError naming
///    the tensor and the first element that is not: detail::require_finite_values,
///    which save_peft_adapter applies to the values as it stores them);
///  - that every value the layer holds once gets one value: a tied
///    adapter's copies in every expert, a fused gate_up's A in the gate and
///    the up projection (ConfigError naming the tensor).
/// The file is read into a staged copy of every layer's adapters
/// (adapters/peft_tensors.hpp), which is committed only when all passed: a
/// rejected load leaves every layer unchanged.

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <initializer_list>
#include <set>
#include <string>
#include <vector>

#include "../core/errors.hpp"
#include "../io/checkpoint.hpp"
#include "../io/safetensors.hpp"
#include "../optim/non_finite.hpp"
#include "../quant/half.hpp"
#include "lora_moe.hpp"
#include "peft_config.hpp"
#include "peft_layers.hpp"
#include "peft_names.hpp"
#include "peft_tensors.hpp"

namespace apex {

/// How load_peft_adapter reads.
struct PeftLoadOptions {
  PeftNames names;
  bool allow_unexpected = false;  ///< ignore tensors outside the given layers' blocks (other layers, attention)
  safetensors::Limits limits;

  PeftLoadOptions() = default;
  PeftLoadOptions(PeftNames n) : names(std::move(n)) {}  // NOLINT: implicit, a PeftNames is the common case
};

/// What load_peft_adapter read.
struct PeftLoadResult {
  PeftAdapterConfig config;
  std::vector<std::string> loaded;   ///< every tensor read
  std::vector<std::string> ignored;  ///< tensors outside the given blocks (allow_unexpected)
};

namespace detail {

/// Tensor t (F16, BF16, F32 or F64) converted to T.
template <class T>
std::vector<T> read_peft_tensor(const safetensors::Reader& file, const safetensors::TensorInfo& t) {
  std::vector<T> out(std::size_t(t.numel()));
  if (t.dtype != safetensors::DType::F16) {
    file.read(t, out.data());
    return out;
  }
  std::vector<unsigned char> raw(std::size_t(t.nbytes()));
  file.read_bytes(t, raw.data());
  for (std::size_t i = 0; i < out.size(); ++i)  // little-endian binary16, exact in float
    out[i] = T(quant::fp16_to_fp32(std::uint16_t(raw[2 * i] | (unsigned(raw[2 * i + 1]) << 8))));
  return out;
}

/// A tensor the load expects: which of the given layers, its spec, its entry.
struct PeftExpected {
  std::size_t layer = 0;
  PeftTensorSpec spec;
  const safetensors::TensorInfo* info = nullptr;
};

/// Finds every expected tensor in the file and checks names, dtypes and
/// shapes (the file comment). `blocks`: the given layers' key prefixes.
/// Returns the tensors outside them (ignored with allow_unexpected).
inline std::vector<std::string> match_peft_file(const std::string& where, const safetensors::Reader& file,
                                                std::vector<PeftExpected>& expected,
                                                const std::vector<std::string>& blocks, bool allow_unexpected) {
  std::vector<std::string> missing, in_block, outside, bad_dtype, bad_shape;
  std::set<std::string> wanted;
  for (auto& e : expected) {
    wanted.insert(e.spec.name);
    e.info = file.header().find(e.spec.name);
    if (!e.info) {
      missing.push_back(e.spec.name);
      continue;
    }
    const safetensors::DType d = e.info->dtype;
    if (!(safetensors::is_float_convertible(d) || d == safetensors::DType::F16))
      bad_dtype.push_back(e.spec.name + " (" + safetensors::dtype_name(d) + ")");
    const std::vector<std::uint64_t> want{std::uint64_t(e.spec.rows), std::uint64_t(e.spec.cols)};
    if (e.info->shape != want)
      bad_shape.push_back(safetensors::quote_name(e.spec.name) + " is " + safetensors::shape_string(e.info->shape) +
                          " in the file, expected " + safetensors::shape_string(want));
  }
  for (const auto& t : file.tensors()) {
    if (wanted.count(t.name)) continue;
    bool under = false;
    for (const auto& b : blocks) under = under || t.name.rfind(b, 0) == 0;
    (under ? in_block : outside).push_back(t.name);
  }
  if (!missing.empty() || !in_block.empty() || (!outside.empty() && !allow_unexpected)) {
    std::string msg = where + ": the adapter does not match the layers' adapters:";
    if (!missing.empty()) msg += " missing " + name_list(missing) + ";";
    if (!in_block.empty())
      msg += " unexpected " + name_list(in_block) + ", under a given layer's block but not an adapter it holds "
             "(a projection it does not adapt, or names of another layout);";
    if (!outside.empty() && !allow_unexpected)
      msg += " unexpected " + name_list(outside) + ", outside the given layers' blocks (PeftLoadOptions::"
             "allow_unexpected ignores other layers' and modules' adapters);";
    throw FormatError(msg);
  }
  if (!bad_dtype.empty())
    throw FormatError(where + ": adapter tensors must be F16, BF16, F32 or F64: " + name_list(bad_dtype));
  if (!bad_shape.empty()) {
    std::string msg = where + ": shape mismatch:";
    for (std::size_t i = 0; i < bad_shape.size() && i < 12; ++i) msg += (i ? "; " : " ") + bad_shape[i];
    if (bad_shape.size() > 12) msg += "; and " + std::to_string(bad_shape.size() - 12) + " more";
    throw ShapeError(msg);
  }
  return outside;
}

/// Why tensor `s` could not be staged: it set a value the layer holds once differently.
inline std::string peft_conflict(const std::string& where, Index index, const PeftTensorSpec& s, bool tied) {
  std::string why;
  if (tied && !s.shared)
    why = "the layer's routed adapters are tied (LoraOptions::per_expert = false), so every expert's copy must be "
          "equal (load into a layer with per_expert = true)";
  if (!s.is_b && s.slot == LoraSlot::gate_up && s.expert >= 0)
    why += std::string(why.empty() ? "" : "; or ") +
           "the layer adapts gate and up as one gate_up with one A, so the gate and up projections' lora_A must "
           "be equal (load into a layer with targets.gate and targets.up, or LoraOptions::shared_targets)";
  return where + ": layer " + std::to_string(index) + ": tensor " + safetensors::quote_name(s.name) +
         " sets a value the layer holds once differently from a tensor or expert slice read before: " + why;
}

}  // namespace detail

/// Loads the adapter in `folder` into `layers` (each with its decoder layer
/// index). See the file comment.
template <class Base>
PeftLoadResult load_peft_adapter(const std::string& folder, const std::vector<PeftLayerRef<Base>>& layers,
                                 const PeftLoadOptions& options = {}) {
  using T = typename LoraMoE<Base>::Scalar;
  namespace fs = std::filesystem;
  const std::string where = "load_peft_adapter('" + folder + "')";
  detail::check_peft_layer_list(where, layers, options.names);
  // Each layer is committed in turn: one layer given under two indices
  // would end up silently holding the later index's adapters.
  std::set<const LoraMoE<Base>*> distinct;
  for (const auto& l : layers)
    detail::require_config(distinct.insert(l.layer).second, where.c_str(),
                           "layer " + std::to_string(l.index) + " is the same LoraMoE as a layer given before it: "
                           "each decoder layer's adapters load into a layer of their own");
  PeftLoadResult result;
  result.config = read_peft_config(folder, options.limits);
  const safetensors::Reader file((fs::path(folder) / kPeftWeightsName).string(), options.limits);
  const PeftNames& names = options.names;
  std::vector<detail::PeftExpected> expected;
  std::vector<std::string> blocks;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const auto& l = layers[i];
    detail::check_peft_layer(where + ": layer " + std::to_string(l.index), *l.layer, names);
    for (auto& s : detail::peft_load_specs(where, *l.layer, l.index, names, result.config))
      expected.push_back({i, std::move(s), nullptr});
    blocks.push_back(names.key_prefix(l.index));
  }
  result.ignored = detail::match_peft_file(where, file, expected, blocks, options.allow_unexpected);
  std::vector<detail::PeftStage<T>> stages;
  for (const auto& l : layers) stages.emplace_back(l.layer->routed_adapters(), l.layer->shared_adapters());
  for (const auto& e : expected) {
    const std::vector<T> v = detail::read_peft_tensor<T>(file, *e.info);
    detail::require_finite_values(where, "tensor " + safetensors::quote_name(e.spec.name), v.data(), v.data(),
                                  Index(v.size()), e.spec.cols, "in the file, or out of the range of the layer's scalar");
    const PeftLayerRef<Base>& l = layers[e.layer];
    if (!stages[e.layer].scatter(e.spec, l.layer->config().n_experts, v))
      throw ConfigError(detail::peft_conflict(where, l.index, e.spec, stages[e.layer].tied));
    result.loaded.push_back(e.spec.name);
  }
  for (std::size_t i = 0; i < layers.size(); ++i)
    if (!stages[i].complete())  // the specs cover every slot; kept as the commit's precondition
      throw FormatError(where + ": layer " + std::to_string(layers[i].index) + ": the file left adapter values unset");
  for (std::size_t i = 0; i < layers.size(); ++i)  // every check passed: nothing below throws
    stages[i].commit(layers[i].layer->routed_adapters(), layers[i].layer->shared_adapters());
  return result;
}

/// The same, `layers` as a braced list: {peft_layer(0, l0), peft_layer(1, l1)}.
template <class Base>
PeftLoadResult load_peft_adapter(const std::string& folder, std::initializer_list<PeftLayerRef<Base>> layers,
                                 const PeftLoadOptions& options = {}) {
  return load_peft_adapter(folder, std::vector<PeftLayerRef<Base>>(layers), options);
}

/// One layer, decoder layer `index` (the file's other layers need allow_unexpected).
template <class Base>
PeftLoadResult load_peft_adapter(const std::string& folder, Index index, LoraMoE<Base>& layer,
                                 const PeftLoadOptions& options = {}) {
  return load_peft_adapter(folder, std::vector<PeftLayerRef<Base>>{peft_layer(index, layer)}, options);
}

/// LoraOptions of a layer that loads decoder layer `index` of the adapter
/// in `folder`: r, α, rslora from its config; the routed targets from the
/// config's target_parameters (stacked layouts) or the tensors of expert 0
/// (apex layout: separate gate and up, which loads any file); the shared
/// experts' from their tensors (separate gate and up; `shared_targets`
/// where they differ from the routed ones); per_expert, no router
/// training. ConfigError if the adapter adapts no routed projection of the
/// layer (a LoraMoE adapts at least one).
inline LoraOptions peft_lora_options(const std::string& folder, Index index, const PeftNames& names = {},
                                     const safetensors::Limits& limits = {}) {
  namespace fs = std::filesystem;
  const std::string where = "peft_lora_options('" + folder + "')";
  const PeftAdapterConfig c = read_peft_config(folder, limits);
  const safetensors::Reader file((fs::path(folder) / kPeftWeightsName).string(), limits);
  const std::string key = names.key_prefix(index);
  const auto has = [&](const std::string& module) { return file.header().find(key + module + ".lora_A.weight"); };
  LoraOptions o;
  o.rank = c.rank, o.alpha = c.alpha, o.rslora = c.rslora;
  LoraTargets routed{false, false, false, false}, shared{false, false, false, false};
  if (names.layout == PeftLayout::apex) {
    routed = {bool(has("experts.0.w_gate")), bool(has("experts.0.w_up")), false, bool(has("experts.0.w_down"))};
    shared = {bool(has("shared_experts.0.w_gate")), bool(has("shared_experts.0.w_up")), false,
              bool(has("shared_experts.0.w_down"))};
  } else {
    for (const char* p : detail::peft_stacked_targeted(c, names, index))
      (std::string(p) == "gate_up_proj" ? routed.gate_up : routed.down) = true;
    if (names.layout == PeftLayout::family && family_traits(names.family, where.c_str()).names.shared_block) {
      const detail::PeftSharedNames sn = detail::peft_shared_names(names);
      shared = {bool(has(sn.module + sn.gate)), bool(has(sn.module + sn.up)), false, bool(has(sn.module + sn.down))};
    }
  }
  detail::require_config(routed.gate || routed.up || routed.gate_up || routed.down, where.c_str(),
                         "layer " + std::to_string(index) + ": the adapter adapts none of the routed experts' "
                         "projections (names under '" + key + "'), and a LoraMoE adapts at least one");
  o.targets = routed;
  o.shared_experts = shared.gate || shared.up || shared.down;
  if (o.shared_experts && !(shared.gate == routed.gate && shared.up == routed.up && !routed.gate_up &&
                            shared.down == routed.down))
    o.shared_targets = shared;
  return o;
}

}  // namespace apex
