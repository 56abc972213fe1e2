#pragma once
/// \file inference/engine/packed_sublayer.hpp
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
///     auto inf = apex::load_packed_sublayer<float>(file, cfg, gate);  // inference/files/checkpoint/load.hpp

#include <optional>
#include <string>
#include <utility>

#include "../../layers/ffn_sublayer.hpp"
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

/// Packs a trained MoE sublayer (norm and gate copied, the MoE packed in
/// `types`, Storage's by default).
template <class Storage, class Expert>
PackedSublayer<PackedMoE<Storage, Expert>> pack_sublayer(const FFNSublayer<float, MoEFFN<float, Expert>>& src,
                                                         const PackedTypes& types = packed_dtype<Storage>()) {
  return detail::inference::wrap_sublayer(src, PackedMoE<Storage, Expert>::from(src.ffn(), types));
}
/// Packs a trained dense sublayer.
template <class Storage>
PackedSublayer<PackedSwiGLU<Storage>> pack_sublayer(const FFNSublayer<float, SwiGLU<float>>& src,
                                                    packed::ExpertDtypes types = packed_dtype<Storage>()) {
  return detail::inference::wrap_sublayer(src, PackedSwiGLU<Storage>::from(src.ffn(), types));
}

}  // namespace apex
