#pragma once
/// \file inference/files/gguf/save.hpp
/// A trained or packed MoE layer written as one block of a llama.cpp GGUF
/// file, in llama.cpp's names and keys (io/gguf_architectures.hpp), so
/// load_gguf_moe and llama.cpp's tools read it. The save is atomic (the
/// container writes a temporary file and renames it).
///
/// Which architecture: `options.family` names it (the family's row), or it
/// is chosen from the routing — qwen3moe (softmax, renormalised, no shared
/// experts), olmoe (softmax, not renormalised), qwen2moe (one σ-gated shared
/// expert, not renormalised), and deepseek2 for everything else llama.cpp
/// expresses: sigmoid or softmax scoring, groups, a routed scale, a selection
/// bias (`exp_probs_b`), ungated shared experts. APEX-1's router (softmax over
/// the K selected logits) is deepseek2 with `expert_gating_func` 3 (llama.cpp's
/// SOFTMAX_WEIGHT): exact while the weights come from the unbiased logits or
/// the balancing bias is zero; a trained bias with weights from the biased
/// logits has no llama.cpp form and is refused. S shared experts of width
/// f_s are written as llama.cpp's one shared MLP (the hidden units side by
/// side: the same function) of `expert_shared_count` = ⌈S·f_s / f⌉ times f
/// units, the last ones zero (they add exact zeros); load_gguf_moe reads it
/// back as one shared expert of that width. Refused (ConfigError naming the reason):
/// an `options.rms_eps` that is not a positive float (NaN, 0, 1e39: the key
/// is F32), a capacity factor (llama.cpp is dropless), a gated shared expert outside
/// qwen2moe's routing, a family whose fixed routing differs from the layer's.
///
/// gpt-oss: a layer of ClampedSwiGLU experts (PackedMoE<S, ClampedSwiGLU<float>>,
/// GptOssMoE<float>) is written as the row of its expert kind, `gpt-oss`
/// (the kind's GGUF form, inference/engine/kinds/clamped_swiglu.hpp): gate and up as ffn_gate_exps /
/// ffn_up_exps with their biases `ffn_{gate,up,down}_exps.bias` (F32, ne
/// [f, E], [f, E], [d, E]), the router's logit bias as `ffn_gate_inp.bias`
/// (zeros for a layer without one), the norm as `post_attention_norm`.
/// Refused: α or L other than llama.cpp's 1.702 and 7, routing other than
/// softmax over the K selected, a balancing bias, shared experts.
///
/// Types: the packed layer's own (a MoEFFN is packed first in `types`, f32 by
/// default, which is exact); the router, bias, shared gate and norm are F32.
/// The file holds this one block (`block_count` = layer + 1, no attention or
/// embedding tensors): a layer file, not a runnable llama.cpp model.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "../../../core/errors.hpp"
#include "../../../core/scalar_range.hpp"
#include "../../../moe/moe_ffn.hpp"
#include "../../../io/gguf_architectures.hpp"
#include "../../engine/expert_kind.hpp"
#include "../../engine/packed_moe.hpp"
#include "plan.hpp"
#include "../../engine/packed_sublayer.hpp"

namespace apex {

/// How save_gguf_moe names and describes the block.
struct GgufSaveOptions {
  Index layer = 0;                    ///< the block index N of `blk.N.`
  std::optional<MoEFamily> family;    ///< write as this family's architecture; unset: chosen (file comment)
  double rms_eps = 1e-6;              ///< `attention.layer_norm_rms_epsilon` (llama.cpp requires the key)
  /// The FFN norm's gain (1 × d), written when set as the architecture's
  /// norm tensor: `ffn_norm.weight` (gpt-oss: `post_attention_norm.weight`).
  std::optional<RowVector<float>> norm_gain;
};

namespace detail::gguf_moe {

inline bool all_zero(const RowVector<float>& b) { return b.size() == 0 || (b.array() == 0.0f).all(); }

/// ConfigError unless architecture `a` computes a layer of `c` with selection bias `b`.
inline void check_expressible(const char* where, const gguf::Architecture& a, const MoEConfig& c,
                              const RowVector<float>& b) {
  const auto need = [&](bool ok, const std::string& why) {
    apex::detail::require_config(ok, where, std::string("llama.cpp's ") + a.name + " cannot hold this layer: " + why);
  };
  const RoutingConfig& r = c.routing;
  need(r.capacity_factor == 0, "llama.cpp routes without a capacity limit (capacity_factor must be 0)");
  need(!c.router_bias || a.router_bias, "its router has no logit bias (ffn_gate_inp.bias), the layer's has");
  if (!a.reads_routing_keys) {
    need(r.scoring == a.scoring, std::string("its router's scoring is ") + scoring_name(a.scoring) + ", the layer's is " +
                                     scoring_name(r.scoring));
    // softmax over the selected sums to 1: renormalisation does not apply
    need(r.scoring == Scoring::SoftmaxSelected || r.renormalize == a.renormalize,
         std::string("its weights are ") + (a.renormalize ? "" : "not ") + "renormalised, the layer's are " +
             (r.renormalize ? "" : "not"));
    need(r.n_groups == 1 && r.routed_scale == 1.0, "it has no expert groups and no routed scale");
    need(all_zero(b), "it has no selection bias (exp_probs_b), the layer's balancing bias is not zero");
    if (a.shared == FamilySharedLayout::OneGated)
      need(c.n_shared == 1 && c.shared_expert_gate, "it has exactly one sigmoid-gated shared expert");
    else
      need(c.n_shared == 0 && !c.shared_expert_gate, "it has no shared experts");
    return;
  }
  need(!c.shared_expert_gate, "its shared expert has no sigmoid gate");
  need(r.scoring != Scoring::SoftmaxSelected || c.weights_from_unbiased || all_zero(b),
       "softmax over the selected (expert_gating_func 3) weighs the unbiased logits; the layer weighs the biased "
       "ones and its balancing bias is not zero");
}

/// ConfigError naming the option unless `o` describes a block of a layer of
/// `c`: rms_eps a positive float (the key is F32: NaN, 0 or 1e39 would be
/// written as they are, or as +inf), layer a block index whose block_count
/// fits the key's uint32, the norm's gain 1 × d.
inline void check_options(const char* where, const GgufSaveOptions& o, const MoEConfig& c) {
  const std::string eps = apex::detail::positive_float_problem(o.rms_eps);
  apex::detail::require_config(eps.empty(), where, "options.rms_eps (attention.layer_norm_rms_epsilon) " + eps);
  apex::detail::require_config(o.layer >= 0 && o.layer < Index(UINT32_MAX), where,
                               "options.layer must lie in [0, 4294967294] (block_count = layer + 1 is a uint32), got " +
                                   std::to_string(o.layer));
  if (o.norm_gain) apex::detail::check_shape(where, "options.norm_gain", *o.norm_gain, 1, c.d_model);
}

/// Whether architecture `a` has a fixed block (no routing keys) that routes
/// as `c` does with selection bias `bias`: its scoring and renormalisation,
/// no groups, routed scale or bias, and its shared experts.
inline bool fixed_block_fits(const gguf::Architecture& a, const MoEConfig& c, const RowVector<float>& bias) {
  const RoutingConfig& r = c.routing;
  const bool shared = a.shared == FamilySharedLayout::OneGated ? c.n_shared == 1 && c.shared_expert_gate
                                                                : c.n_shared == 0 && !c.shared_expert_gate;
  return !a.reads_routing_keys && r.scoring == a.scoring &&
         (r.scoring == Scoring::SoftmaxSelected || r.renormalize == a.renormalize) && r.n_groups == 1 &&
         r.routed_scale == 1.0 && all_zero(bias) && shared;
}

/// The architecture a layer of `kind` experts is written as (file comment):
/// the named family's row's; else, among the architectures of the layer's
/// kind in table order, the first whose fixed block routes as the layer
/// does, else the first that reads its routing from the keys (deepseek2),
/// else the kind's first, whose checks then name what differs.
inline const gguf::Architecture& choose(const char* where, const MoEConfig& c, const RowVector<float>& bias,
                                        const std::optional<MoEFamily>& family, const ExpertKindName& kind) {
  if (family) {
    const gguf::Architecture& a = gguf::architecture_of(*family);
    apex::detail::require_config(std::string(a.experts.name) == kind.name, where,
                                 std::string("family ") + family_name(*family) + "'s architecture " + a.name + " has " +
                                     a.experts.label + " experts, the layer's are " + kind.label);
    return a;
  }
  const std::vector<const gguf::Architecture*> rows = gguf::architectures_of_kind(kind, where);
  for (const gguf::Architecture* a : rows)
    if (fixed_block_fits(*a, c, bias)) return *a;
  for (const gguf::Architecture* a : rows)
    if (a->reads_routing_keys) return *a;
  return *rows.front();
}

/// deepseek2's `expert_shared_count`: the S shared experts side by side,
/// S·f_s hidden units, in whole d_ffn (padded with zero units).
inline Index shared_count(const MoEConfig& c) {
  const Index w = c.n_shared * c.shared_ffn();
  return w / c.d_ffn + (w % c.d_ffn != 0);
}

/// The metadata of block `layer` of a layer of `c` as architecture `a`.
inline void write_keys(gguf::Writer& w, const gguf::Architecture& a, const MoEConfig& c, const GgufSaveOptions& o) {
  namespace k = gguf::keys;
  const auto u32 = [&](const char* key, Index v) { w.set_u32(a.key(key), std::uint32_t(v)); };
  w.set_string(k::kArchitecture, a.name);
  u32(k::kBlockCount, o.layer + 1);
  u32(k::kEmbedding, c.d_model);
  u32(a.width_key, c.d_ffn);
  u32(k::kExpertCount, c.n_experts);
  u32(k::kExpertUsed, c.n_active);
  w.set_f32(a.key(k::kRmsEps), float(o.rms_eps));
  if (a.shared == FamilySharedLayout::OneGated) u32(k::kSharedFeedForward, c.shared_ffn());
  if (!a.reads_routing_keys) return;
  const RoutingConfig& r = c.routing;
  u32(k::kLeadingDense, 0);
  u32(k::kSharedCount, shared_count(c));
  const gguf::GatingFunc g = r.scoring == Scoring::Sigmoid   ? gguf::GatingFunc::sigmoid
                             : r.scoring == Scoring::SoftmaxAll ? gguf::GatingFunc::softmax
                                                                : gguf::GatingFunc::softmax_weight;
  u32(k::kGatingFunc, Index(g));
  w.set_bool(a.key(k::kWeightsNorm), r.scoring != Scoring::SoftmaxSelected && r.renormalize);
  w.set_f32(a.key(k::kWeightsScale), float(r.routed_scale));
  u32(k::kGroupCount, r.n_groups);
  u32(k::kGroupUsed, r.topk_group);
}

/// The file rows of `experts`, concatenated: by expert (a 3-D tensor), or
/// with `fused_width` > 0 the hidden units side by side as one MLP of that
/// width, the units past the experts' zero (zero bytes are zero weights in
/// every type: a zero scale). Zero units add exact zeros: the same function.
struct ExpertBytes {
  std::vector<std::byte> gate, up, down;
};
inline ExpertBytes expert_bytes(const std::vector<packed::PackedExpert>& experts, Index fused_width = 0) {
  ExpertBytes out;
  if (experts.empty()) return out;
  const Index d = experts[0].d_model(), f = experts[0].d_ffn();
  const std::size_t gu_row = std::size_t(experts[0].gate_up().row_bytes()), dn_row = std::size_t(experts[0].down().row_bytes());
  const std::size_t n = experts.size(), units = fused_width > 0 ? std::size_t(fused_width) : n * std::size_t(f);
  // down rows of the fused MLP: `units` weights, i.e. units / f expert rows' bytes
  const std::size_t fused_row = fused_width > 0 ? dn_row * units / std::size_t(f) : 0;
  out.gate.assign(units * gu_row, std::byte{0}), out.up.assign(out.gate.size(), std::byte{0});
  out.down.assign(fused_width > 0 ? std::size_t(d) * fused_row : n * std::size_t(d) * dn_row, std::byte{0});
  std::vector<std::byte> down(std::size_t(d) * dn_row);
  for (std::size_t e = 0; e < n; ++e) {
    std::byte* dst = fused_width > 0 ? down.data() : out.down.data() + e * down.size();
    experts[e].file_rows(out.gate.data() + e * std::size_t(f) * gu_row, out.up.data() + e * std::size_t(f) * gu_row, dst);
    if (fused_width > 0)  // row i of the fused down matrix: expert 0's row i, then expert 1's, …, then zeros
      for (Index i = 0; i < d; ++i)
        std::memcpy(out.down.data() + std::size_t(i) * fused_row + e * dn_row, down.data() + std::size_t(i) * dn_row, dn_row);
  }
  return out;
}

/// Float part i (Kind::extra_rows order, 1 × cols) of every expert, by
/// expert: the F32 rows of a GGUF ne [cols, E] tensor.
template <class Kind>
std::vector<float> extra_column(const std::vector<typename Kind::Extra>& extras, std::size_t i) {
  std::vector<float> out;
  for (const auto& x : extras) {
    const RowVector<float>& r = *Kind::extra_rows(x).at(i);
    out.insert(out.end(), r.data(), r.data() + r.size());
  }
  return out;
}

}  // namespace detail::gguf_moe

/// Writes `layer` as block options.layer of a GGUF file at `path` (file
/// comment). ConfigError for a layer llama.cpp cannot express, before any
/// byte is written; a failed save leaves an existing file unchanged.
template <class Storage, class Expert>
void save_gguf_moe(const std::string& path, const PackedMoE<Storage, Expert>& layer, const GgufSaveOptions& options = {}) {
  namespace g = detail::gguf_moe;
  namespace tn = gguf::tensor_names;
  using Kind = typename PackedMoE<Storage, Expert>::Kind;
  static_assert(detail::inference::kind_has_gguf<Kind>,
                "save_gguf_moe: this expert kind has no llama.cpp form (its ExpertKind row's Gguf is NoGgufForm)");
  const std::string where_s = "save_gguf_moe(" + path + ")";
  const char* where = where_s.c_str();
  const MoEConfig& c = layer.config();
  const ExpertKindName kind = gguf::experts_named(Kind::kName, Kind::kLabel);
  const gguf::Architecture& a = g::choose(where, c, layer.bias(), options.family, kind);
  g::check_expressible(where, a, c, layer.bias());
  Kind::Gguf::check_extras(where, layer.extras(), a);
  g::check_options(where, options, c);
  gguf::Writer w;
  g::write_keys(w, a, c, options);
  const auto d = std::uint64_t(c.d_model), f = std::uint64_t(c.d_ffn), e = std::uint64_t(c.n_experts);
  const auto name = [&](const char* n) { return gguf::block_tensor(options.layer, n); };
  const auto f32 = [&](const char* n, const float* p, std::vector<std::uint64_t> ne, std::size_t count) {
    w.add_tensor(name(n), gguf::TensorType::F32, ne, reinterpret_cast<const std::byte*>(p), count * 4);
  };
  const Matrix<float>& router = layer.router().weight();  // E × d: ne [d, E]
  f32(tn::kRouter, router.data(), {d, e}, std::size_t(router.size()));
  const RowVector<float> logit_bias =  // 1 × E; zeros: a router without one
      c.router_bias ? layer.router().logit_bias() : RowVector<float>(RowVector<float>::Zero(c.n_experts));
  if (a.router_bias) f32(tn::kRouterBias, logit_bias.data(), {e}, std::size_t(e));
  if (!g::all_zero(layer.bias())) f32(tn::kProbsBias, layer.bias().data(), {e}, std::size_t(e));
  const packed::ExpertDtypes rt = layer.types().routed, st = layer.types().shared;
  const g::ExpertBytes routed = g::expert_bytes(layer.experts());
  w.add_tensor(name(tn::kGateExps), g::file_type_of(rt.gate_up), {d, f, e}, routed.gate.data(), routed.gate.size());
  w.add_tensor(name(tn::kUpExps), g::file_type_of(rt.gate_up), {d, f, e}, routed.up.data(), routed.up.size());
  w.add_tensor(name(tn::kDownExps), g::file_type_of(rt.down), {f, d, e}, routed.down.data(), routed.down.size());
  const std::vector<ExpertExtraTensor> extra = Kind::Gguf::extra_tensors(c.d_model, c.d_ffn);
  std::vector<std::vector<float>> columns;  // kept alive until w.save
  for (std::size_t i = 0; i < extra.size(); ++i) {  // ne [cols, E]: row e is expert e's
    columns.push_back(g::extra_column<Kind>(layer.extras(), i));
    f32(extra[i].name, columns.back().data(), {std::uint64_t(extra[i].cols), e}, columns.back().size());
  }
  // deepseek2: count × f units; qwen2moe: its one expert as it is
  const Index fused = a.reads_routing_keys ? g::shared_count(c) * c.d_ffn : c.shared_ffn();
  const g::ExpertBytes shared = g::expert_bytes(layer.shared_experts(), fused);
  if (c.n_shared > 0) {
    const auto fs = std::uint64_t(fused);
    w.add_tensor(name(tn::kGateShexp), g::file_type_of(st.gate_up), {d, fs}, shared.gate.data(), shared.gate.size());
    w.add_tensor(name(tn::kUpShexp), g::file_type_of(st.gate_up), {d, fs}, shared.up.data(), shared.up.size());
    w.add_tensor(name(tn::kDownShexp), g::file_type_of(st.down), {fs, d}, shared.down.data(), shared.down.size());
  }
  if (c.shared_expert_gate) f32(tn::kSharedGate, layer.shared_gate_weight().data(), {d}, std::size_t(d));
  if (options.norm_gain) f32(a.norm_tensor, options.norm_gain->data(), {d}, std::size_t(d));
  w.save(path);
}

/// A trained float layer, packed in `types` (f32: exact; block formats:
/// ggml's reference quantizers) and written as above.
template <class Expert>
void save_gguf_moe(const std::string& path, const MoEFFN<float, Expert>& layer,
                   const PackedTypes& types = packed::Dtype::f32, const GgufSaveOptions& options = {}) {
  save_gguf_moe(path, PackedMoE<float, Expert>::from(layer, types), options);
}

/// A packed sublayer: its MoE and its norm's gain and ε (`ffn_norm`;
/// gpt-oss: `post_attention_norm`). ConfigError for a skip gate, which
/// llama.cpp has no form for.
template <class Storage, class Expert>
void save_gguf_sublayer(const std::string& path, const PackedSublayer<PackedMoE<Storage, Expert>>& sub,
                        GgufSaveOptions options = {}) {
  apex::detail::require_config(!sub.skip_gate(), ("save_gguf_sublayer(" + path + ")").c_str(),
                               "llama.cpp has no skip gate: save the sublayer without one");
  options.norm_gain = sub.norm().gain();
  options.rms_eps = double(sub.norm().eps());
  save_gguf_moe(path, sub.ffn(), options);
}

}  // namespace apex
