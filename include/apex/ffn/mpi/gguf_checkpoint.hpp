#pragma once
/// \file mpi/gguf_checkpoint.hpp
/// An MoE block of a llama.cpp GGUF model file (inference/files/gguf/load.hpp) into
/// the expert-parallel layer, each rank decoding only what it holds: the
/// replicated router, selection bias (`exp_probs_b`), shared expert and
/// shared gate, and its own experts' slices of the 3-D `ffn_{gate,up,down}_exps`
/// tensors (ggml ne [d, f, E] / [f, d, E]: expert e is a contiguous slice).
/// P ranks together decode the routed experts once, not P times; with the
/// file mapped (gguf::File::open), a rank's pages of the other experts are
/// never touched.
///
/// The checks are load_gguf_moe_float's (inference/files/gguf/check.hpp plan:
/// architecture, keys, tensors, types, shapes), except the whole-layer memory
/// check — a rank holds its share, already allocated. Then the layer the file
/// implies must be this layer: d_model, d_ffn, n_experts, n_active, the
/// shared expert (count, width, gate), the routing (scoring, renormalisation,
/// scale, groups) and weights_from_unbiased; a difference is a ConfigError
/// naming each differing field with both values. Not compared: the training
/// settings no GGUF file holds (balancer_alpha, capacity_factor). The weights
/// of any type the float loader decodes are dequantized into T exactly as
/// load_gguf_moe_float<T> does (the same slices, the same decoder), so every
/// rank's parameters equal that layer's, by name; the balancing bias is set to
/// the file's `exp_probs_b`, zero without one (the file's layer has none).
///
/// Collective and all-or-nothing across ranks, like load_checkpoint
/// (mpi/expert_parallel_checkpoint.hpp): every rank plans, checks and decodes
/// into staging copies, the ranks agree (Communicator::step), then all commit;
/// on any rank's failure every rank throws the same type and no layer changes.

#include <cstddef>
#include <cstdio>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "../core/errors.hpp"
#include "../core/param.hpp"
#include "../inference/files/gguf/load.hpp"
#include "../io/gguf.hpp"
#include "expert_parallel_moe.hpp"

namespace apex::mpi {

/// One slice of a tensor a rank decoded: bytes [offset, offset + bytes) of
/// the tensor's data (ggml order, so routed expert e of E is offset
/// e · nbytes / E).
struct GgufSliceRead {
  std::string tensor;
  std::size_t offset = 0, bytes = 0;
};

/// What a rank loaded: its parameters (MoEFFN's names) and `expert_bias`,
/// and every slice of the file it decoded, in order — which bytes it read.
struct GgufLoadResult {
  std::vector<std::string> loaded;
  std::vector<GgufSliceRead> decoded;
};

namespace detail {

/// `v` to 17 significant digits: equal texts iff equal values, readable in a message.
inline std::string round_trip(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

/// The fields of a layer that a GGUF block determines, as name and value.
inline std::vector<std::pair<std::string, std::string>> gguf_fields(const MoEConfig& c) {
  const RoutingConfig& r = c.routing;
  const bool shared = c.n_shared > 0;
  return {{"d_model", std::to_string(c.d_model)},
          {"d_ffn", std::to_string(c.d_ffn)},
          {"n_experts", std::to_string(c.n_experts)},
          {"n_active", std::to_string(c.n_active)},
          {"n_shared", std::to_string(c.n_shared)},
          {"shared width", shared ? std::to_string(c.shared_ffn()) : "-"},
          {"shared_expert_gate", c.shared_expert_gate ? "1" : "0"},
          {"weights_from_unbiased", c.weights_from_unbiased ? "1" : "0"},
          {"routing.scoring", scoring_name(r.scoring)},
          {"routing.renormalize", r.renormalize ? "1" : "0"},
          {"routing.routed_scale", round_trip(r.routed_scale)},
          {"routing.n_groups", std::to_string(r.n_groups)},
          {"routing.topk_group", std::to_string(r.topk_group)},
          {"routing.group_score", r.group_score == GroupScore::Top2Sum ? "top2_sum" : "max"}};
}

/// ConfigError unless the file's layer `file_cfg` is `layer_cfg` (file comment).
inline void check_gguf_config(const std::string& where, const MoEConfig& file_cfg, const MoEConfig& layer_cfg) {
  const auto a = gguf_fields(file_cfg), b = gguf_fields(layer_cfg);
  std::string diff;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].second != b[i].second)
      diff += (diff.empty() ? " " : "; ") + a[i].first + " " + a[i].second + " in the file, " + b[i].second +
              " in the layer";
  if (!diff.empty())
    throw ConfigError(where + ": the file's MoE block is not this layer's configuration:" + diff +
                      " (build the layer with the configuration the file implies)");
}

/// This rank's staged load: plan, check, decode (no collective; runs inside a step).
template <class T, class Expert>
void stage_gguf(const std::string& where, const gguf::File& file, Index block, ExpertParallelMoE<T, Expert>& layer,
                std::vector<Matrix<T>>& staged, RowVector<T>& bias, GgufLoadResult& result) {
  namespace g = apex::detail::gguf_moe;
  const g::Plan p = g::plan(where, file, block, false, false);
  check_gguf_config(where, p.config, layer.config());
  const auto record = [&](const g::Slice& s) { result.decoded.push_back({s.tensor->info->name, s.offset(), s.bytes()}); };
  const MoEConfig& c = p.config;
  record({&p.router, 0, c.n_experts, c.d_model});
  if (p.bias.info) record({&p.bias, 0, 1, c.n_experts});
  auto [router, file_bias] = g::router_and_bias(where, file, p);  // replicated: every rank decodes them
  for (const auto& q : layer.param_values()) {
    if (q.name == state_names::kRouter) {
      staged.push_back(router.cast<T>());
    } else {
      const g::Slice s = g::slice_of(where, p, q.name);  // this rank's experts only: its param_values()
      record(s);
      staged.push_back(g::decode(where, file, s).cast<T>());
    }
    result.loaded.push_back(q.name);
  }
  bias = file_bias.cast<T>();
  result.loaded.push_back("expert_bias");
}

}  // namespace detail

/// Loads MoE block `block` of `file` into `layer` (file comment). Every rank
/// passes its own File of the same model file. Collective.
template <class T, class Expert>
GgufLoadResult load_gguf_moe(const gguf::File& file, ExpertParallelMoE<T, Expert>& layer, Index block) {
  constexpr const char* where_c = "apex::mpi::load_gguf_moe";
  std::vector<Matrix<T>> staged;
  RowVector<T> bias;
  GgufLoadResult result;
  layer.comm().step(where_c, [&] {
    const std::string where = std::string(where_c) + "(" + file.description() + ", block " + std::to_string(block) + ")";
    detail::stage_gguf(where, file, block, layer, staged, bias, result);
  });
  // Every rank has its tensors staged: commit.
  const ParamList<T> params = layer.param_values();
  for (std::size_t i = 0; i < params.size(); ++i) params[i].value() = staged[i];
  layer.balancer().set_bias(bias);
  return result;
}

/// As above, each rank opening (mapping) the file at `path`; a file that
/// cannot be opened on one rank is a FormatError on every rank.
template <class T, class Expert>
GgufLoadResult load_gguf_moe(const std::string& path, ExpertParallelMoE<T, Expert>& layer, Index block) {
  std::optional<gguf::File> file;
  layer.comm().step("apex::mpi::load_gguf_moe", [&] { file.emplace(gguf::File::open(path)); });
  return load_gguf_moe(*file, layer, block);
}

}  // namespace apex::mpi
