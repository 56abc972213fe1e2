#pragma once
/// \file inference/packed_sublayer.hpp
/// The inference FFN sublayer on packed weights:
///
///     y = x + m ⊙ FFN(RMSNorm(x)),   m_t = 1[g(x_t) ≥ τ]   (m ≡ 1 without a gate)
///
/// It *is* `FFNSublayer<float, FFN>` with a packed FFN (PackedMoE or
/// PackedSwiGLU) in inference mode: the norm and the skip gate are the float
/// layer's own code and weights, so skip decisions are bit for bit those of
/// the float sublayer, and skipped tokens never reach the FFN. The norm gain
/// (d floats) and the gate (h·d + 2h + 1 floats) are small and stay float.
/// Only forward is meant to be called: backward and params() need a float FFN.
///
///     auto inf = apex::pack_sublayer<apex::packed::bf16>(trained);    // from a trained sublayer
///     auto inf = apex::load_packed_sublayer<float>(file, cfg, gate);  // from a checkpoint

#include <optional>
#include <set>
#include <string>
#include <utility>

#include "../checkpoint.hpp"
#include "../ffn_sublayer.hpp"
#include "packed_load.hpp"
#include "packed_moe.hpp"
#include "packed_swiglu.hpp"

namespace apex {

/// The inference sublayer type over a packed FFN.
template <class FFN>
using PackedSublayer = FFNSublayer<float, FFN>;

namespace detail::inference {
/// The sublayer around `ffn` with src's norm and gate, in inference mode.
template <class FFN, class Src>
PackedSublayer<FFN> wrap_sublayer(const Src& src, FFN ffn) {
  const Index d = src.d_model();
  auto out = src.skip_gate() ? PackedSublayer<FFN>(d, std::move(ffn), *src.skip_gate())
                             : PackedSublayer<FFN>(d, std::move(ffn));
  out.norm() = src.norm();
  out.set_mode(SublayerMode::inference);
  return out;
}
}  // namespace detail::inference

/// Packs a trained MoE sublayer (norm and gate copied, the MoE packed).
template <class Storage, class Expert>
PackedSublayer<PackedMoE<Storage, Expert>> pack_sublayer(const FFNSublayer<float, MoEFFN<float, Expert>>& src) {
  return detail::inference::wrap_sublayer(src, PackedMoE<Storage, Expert>::from(src.ffn()));
}
/// Packs a trained dense sublayer.
template <class Storage>
PackedSublayer<PackedSwiGLU<Storage>> pack_sublayer(const FFNSublayer<float, SwiGLU<float>>& src) {
  return detail::inference::wrap_sublayer(src, PackedSwiGLU<Storage>::from(src.ffn()));
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
  detail::append_prefixed(small, p + "norm.", norm.params());
  if (g) detail::append_prefixed(small, p + "skip_gate.", g->params());
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
