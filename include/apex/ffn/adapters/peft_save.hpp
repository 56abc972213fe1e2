#pragma once
/// \file adapters/peft_save.hpp
/// `save_peft_adapter`: the adapters of a model's LoraMoE layers written as
/// a peft adapter folder (adapters/peft_files.hpp), and `peft_tensors`, the
/// same tensors in memory (with `grads`, the adapters' gradients under the
/// same names: what a test compares with peft's autograd).
///
/// Every adapter of the given layers is written, in F32, F64 or BF16 (the
/// layers' scalar by default: a bit-exact round trip), the two files as one
/// save (io::write_files_atomic): both are written whole under temporary
/// names before the tensors', then the config's, replace the old ones, so a
/// failed save leaves the folder's previous adapter as it was. Tied
/// adapters are written into every expert's slot, a fused gate_up into a
/// per-Linear layout as the gate and up projections' adapters with the
/// same A. The config lists the adapted parameters by
/// their full path (stacked layouts: `model.layers.3.mlp.experts.gate_up_proj`,
/// a shared expert's `….shared_expert.gate_proj.weight`), so peft wraps
/// exactly the saved layers; the apex layout lists its Linear modules as
/// one regular expression over the saved layers.
///
/// Refused with a ConfigError naming the cause, before anything is
/// written: a layer whose expert kind or block the layout does not hold,
/// separate gate/up adapters on routed experts in a stacked layout, layers
/// of different r, α or rslora (one config holds one), a trained router
/// (`train_router`: the files hold only LoRA tensors; save the router with
/// io/checkpoint.hpp). ValueError for a dtype other than F32, F64, BF16, a
/// base_model_name_or_path or task_type that is not UTF-8, or an adapter
/// value that is NaN or Inf as the dtype stores it (load_peft_adapter's
/// value rule: a diverged run's save keeps the last good adapter).

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <initializer_list>
#include <optional>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "../core/errors.hpp"
#include "../io/safetensors.hpp"
#include "../optim/non_finite.hpp"
#include "lora_moe.hpp"
#include "peft_config.hpp"
#include "peft_layers.hpp"
#include "peft_names.hpp"
#include "peft_tensors.hpp"

namespace apex {

/// How save_peft_adapter writes.
struct PeftSaveOptions {
  PeftNames names;                          ///< layout and the blocks' path
  std::string base_model_name_or_path;      ///< written to the config ("" → null)
  std::string task_type;                    ///< e.g. "CAUSAL_LM" ("" → null)
  std::optional<safetensors::DType> dtype;  ///< F32, F64 or BF16; unset: the layers' scalar

  PeftSaveOptions() = default;
  PeftSaveOptions(PeftNames n) : names(std::move(n)) {}  // NOLINT: implicit, a PeftNames is the common case
};

namespace detail {

/// Regular-expression text matching `s` literally.
inline std::string peft_regex_escape(const std::string& s) {
  std::string o;
  for (char ch : s) {
    if (!(std::isalnum(static_cast<unsigned char>(ch)) || ch == '_')) o += '\\';
    o += ch;
  }
  return o;
}

/// Adds layer `index`'s targets to `c`: stacked layouts, the full paths of
/// its adapted parameters; apex, one alternative of the modules' regular
/// expression (joined by the caller).
inline void add_peft_targets(PeftAdapterConfig& c, std::vector<std::string>& alternatives, const PeftNames& n,
                             Index index, const std::vector<LoraSlot>& routed, const std::vector<PeftTensorSpec>& specs) {
  const std::string path = n.block_path(index), key = n.key_prefix(index), tail = ".lora_A.weight";
  std::vector<std::string> modules[2];  // apex: the Linear names under experts.{e}. and shared_experts.{s}.
  for (const auto& s : specs) {
    if (s.is_b || s.expert < 0) continue;
    const std::string module = s.name.substr(key.size(), s.name.size() - key.size() - tail.size());
    if (n.layout != PeftLayout::apex) {
      c.target_parameters.push_back(path + module + ".weight");  // a shared expert's Linear
      continue;
    }
    auto& list = modules[s.shared ? 1 : 0];
    const std::string leaf = module.substr(module.rfind('.') + 1);
    if (std::find(list.begin(), list.end(), leaf) == list.end()) list.push_back(leaf);
  }
  if (n.layout != PeftLayout::apex) {
    for (const char* p : peft_stacked_of(routed)) c.target_parameters.push_back(path + "experts." + p);
    return;
  }
  const auto any_of = [](const std::vector<std::string>& v) {
    std::string g;
    for (const auto& s : v) g += (g.empty() ? "" : "|") + s;
    return "(" + g + ")";
  };
  std::string alt = peft_regex_escape(path) + "(experts\\.[0-9]+\\." + any_of(modules[0]);
  if (!modules[1].empty()) alt += "|shared_experts\\.[0-9]+\\." + any_of(modules[1]);
  alternatives.push_back(alt + ")");
}

/// ValueError (require_finite_values, the load's rule) unless every value
/// of `t` is finite as `dtype` stores it: a NaN or Inf the adapters hold
/// (a diverged run), or a value beyond the dtype's range (a double above
/// 3.4e38 saved as F32 or BF16), would give a file the load refuses.
template <class T>
void require_storable_peft_tensor(const std::string& where, const safetensors::TensorRef<T>& t,
                                  safetensors::DType dtype) {
  const std::size_t n = std::size_t(t.shape[0] * t.shape[1]);
  const std::vector<T> stored = safetensors::detail::as_stored(dtype, t.data, n);
  require_finite_values(where, "tensor " + safetensors::quote_name(t.name), stored.data(), t.data, Index(n),
                        Index(t.shape[1]), std::string("as ") + safetensors::dtype_name(dtype) +
                            " stores it; load_peft_adapter refuses NaN, Inf and values beyond the dtype's range");
}

/// ConfigError unless every layer can be saved in layout n under one r, α, rslora.
template <class Base>
void check_peft_save(const std::string& where, const std::vector<PeftLayerRef<Base>>& layers, const PeftNames& n) {
  check_peft_layer_list(where, layers, n);
  const LoraOptions& first = layers.front().layer->options();
  for (const auto& l : layers) {
    const std::string at = where + ": layer " + std::to_string(l.index);
    check_peft_layer(at, *l.layer, n);
    const LoraOptions& o = l.layer->options();
    require_config(!o.train_router, at.c_str(),
                   "LoraOptions::train_router: the router trains, and a peft adapter file holds only LoRA "
                   "tensors; save the router with save_checkpoint");
    require_config(o.rank == first.rank && o.alpha == first.alpha && o.rslora == first.rslora, at.c_str(),
                   "its r, alpha or rslora differ from layer " + std::to_string(layers.front().index) +
                       "'s: adapter_config.json holds one r and lora_alpha (rank_pattern is not written)");
  }
}

}  // namespace detail

/// The layer's adapters (or, with `grads`, their gradients, allocated if
/// not yet) as the tensors of its adapter file for decoder layer `index`:
/// (name, rows × cols) in file order. A tied adapter's gradient is the
/// total, in every expert's slot. ConfigError as save_peft_adapter.
template <class Base>
std::vector<std::pair<std::string, Matrix<typename LoraMoE<Base>::Scalar>>> peft_tensors(
    LoraMoE<Base>& layer, Index index, const PeftNames& names, bool grads = false) {
  using T = typename LoraMoE<Base>::Scalar;
  detail::check_peft_layer("peft_tensors: layer " + std::to_string(index), layer, names);
  if (grads) layer.allocate_gradients();
  const auto get = [&](bool shared, Index e) -> const LoraExpertAdapters<T>& {
    const LoraAdapterSet<T>& set = shared ? layer.shared_adapters() : layer.routed_adapters();
    return grads ? set.grad(e) : set.values(e);
  };
  std::vector<std::pair<std::string, Matrix<T>>> out;
  for (const auto& s : detail::peft_save_specs(layer, index, names)) {
    const std::vector<T> v = detail::peft_gather<T>(s, layer.config().n_experts, get);
    out.emplace_back(s.name, Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>(
                                 v.data(), s.rows, s.cols));
  }
  return out;
}

/// Saves the adapters of `layers` (each with its decoder layer index) to
/// the folder `folder` (created if missing). See the file comment.
template <class Base>
void save_peft_adapter(const std::string& folder, const std::vector<PeftLayerRef<Base>>& layers,
                       const PeftSaveOptions& options = {}) {
  using T = typename LoraMoE<Base>::Scalar;
  const std::string where = "save_peft_adapter('" + folder + "')";
  detail::check_peft_save(where, layers, options.names);
  const safetensors::DType dtype = options.dtype.value_or(safetensors::dtype_of<T>());
  if (!safetensors::is_float_convertible(dtype))
    throw ValueError(where + ": dtype " + safetensors::dtype_name(dtype) + " cannot be written; choose F32, F64 or BF16");
  const LoraOptions& o = layers.front().layer->options();
  PeftAdapterConfig c;
  c.rank = o.rank, c.alpha = o.alpha, c.rslora = o.rslora;
  c.base_model_name_or_path = options.base_model_name_or_path, c.task_type = options.task_type;
  std::vector<std::string> alternatives;
  std::vector<std::pair<std::string, Matrix<T>>> tensors;  // rows × cols each, in file order
  for (const auto& l : layers) {
    const auto one = peft_tensors(*l.layer, l.index, options.names);
    tensors.insert(tensors.end(), one.begin(), one.end());
    detail::add_peft_targets(c, alternatives, options.names, l.index,
                             detail::peft_slots(l.layer->routed_adapters().values(0)),
                             detail::peft_save_specs(*l.layer, l.index, options.names));
  }
  for (const auto& a : alternatives) c.target_modules_regex += (c.target_modules_regex.empty() ? "" : "|") + a;
  std::vector<Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>> rows_major;
  rows_major.reserve(tensors.size());
  std::vector<safetensors::TensorRef<T>> refs;
  for (const auto& [name, m] : tensors) {
    rows_major.emplace_back(m);
    refs.push_back({name, {std::uint64_t(m.rows()), std::uint64_t(m.cols())}, rows_major.back().data()});
    detail::require_storable_peft_tensor(where, refs.back(), dtype);  // before anything is written
  }
  // The config's text before anything is written: it can fail (text that is
  // not UTF-8), and a failure must not leave new tensors beside an old config.
  std::string text;
  try {
    text = peft_config_text(c);
  } catch (const ValueError& e) {
    throw ValueError(where + ": " + e.what());
  }
  std::error_code ec;
  std::filesystem::create_directories(folder, ec);
  if (ec) throw FormatError(where + ": cannot create the folder: " + ec.message());
  namespace fs = std::filesystem;
  // One save of the pair: both files are written whole before either replaces the old one.
  io::write_files_atomic(
      where, {{(fs::path(folder) / kPeftWeightsName).string(),
               [&](safetensors::ByteSink& out) { safetensors::write(out, refs, dtype, {{"format", "pt"}}); }},
              {(fs::path(folder) / kPeftConfigName).string(),
               [&](safetensors::ByteSink& out) { out.write(text.data(), text.size()); }}});
}

/// The same, `layers` as a braced list: {peft_layer(0, l0), peft_layer(1, l1)}.
template <class Base>
void save_peft_adapter(const std::string& folder, std::initializer_list<PeftLayerRef<Base>> layers,
                       const PeftSaveOptions& options = {}) {
  save_peft_adapter(folder, std::vector<PeftLayerRef<Base>>(layers), options);
}

/// One layer, decoder layer `index`.
template <class Base>
void save_peft_adapter(const std::string& folder, Index index, LoraMoE<Base>& layer,
                       const PeftSaveOptions& options = {}) {
  save_peft_adapter(folder, std::vector<PeftLayerRef<Base>>{peft_layer(index, layer)}, options);
}

}  // namespace apex
