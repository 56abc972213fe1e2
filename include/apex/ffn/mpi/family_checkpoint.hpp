#pragma once
/// \file mpi/family_checkpoint.hpp
/// Hugging Face checkpoints of the open MoE families (io/family_names.hpp)
/// into the expert-parallel layer: one safetensors file or a sharded folder
/// (`model.safetensors.index.json`, how the families publish their models),
/// each rank reading only the tensors it holds — the replicated router and
/// shared experts, and its own experts — so P ranks together read the layer
/// once, not P times.
///
/// The checks are the single-process loader's (io/name_maps.hpp,
/// load_family_checkpoint): another family's names or a DeepSeek-V3 file
/// without `e_score_correction_bias` is a FormatError, a layer whose shared
/// experts the family's block cannot hold a ConfigError, a NaN bias a
/// ValueError; the load is collective and all-or-nothing across ranks
/// (mpi/expert_parallel_checkpoint.hpp, detail::load_named).

#include <string>

#include "../io/family_names.hpp"
#include "../io/name_maps.hpp"
#include "expert_parallel_checkpoint.hpp"

namespace apex::mpi {

/// Loads a family checkpoint at `path` (a file, a sharded folder or its
/// index) into `layer`, the layer's tensors under `prefix` (e.g.
/// "model.layers.3.mlp." is "model.layers.3." here: the family's names
/// begin with the block, "mlp." or "block_sparse_moe."). Collective.
template <class T, class Expert>
LoadResult load_family_checkpoint(const std::string& path, ExpertParallelMoE<T, Expert>& layer, MoEFamily f,
                                  const std::string& prefix = "", const LoadOptions& options = {}) {
  constexpr const char* where = "apex::mpi::load_family_checkpoint";
  detail::NamedLoad checks;
  checks.check_file = [&](const std::string& w, const safetensors::Reader& file) {
    apex::detail::check_family_file(w, file, f, prefix);
  };
  checks.check_index = [&](const std::string& w, const ShardIndex& index) {
    apex::detail::check_family_index(w, index, f, prefix);
  };
  ParamList<T> params;
  std::string bias_name;
  layer.comm().step(where, [&] {  // a configuration the family cannot hold fails on every rank alike
    check_family_fit(where, layer.config(), f);
    params = layer.param_values();
    for (auto& p : params) p.name = prefix + family_tensor_name(f, p.name);
    bias_name = family_bias_name(f, prefix);
  });
  return detail::load_named(where, path, layer, params, bias_name, checks, options);
}

}  // namespace apex::mpi
