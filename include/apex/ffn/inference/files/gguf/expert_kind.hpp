#pragma once
/// \file inference/files/gguf/expert_kind.hpp
/// How the GGUF MoE loaders and savers (inference/files/gguf/load.hpp,
/// save.hpp) map an expert type to an architecture row's
/// `expert_kind` (io/gguf_architectures.hpp) and to llama.cpp's tensors of
/// its float parts, so that neither the loaders nor the savers name an
/// architecture or an expert type. A specialisation of `GgufExpertKind<Expert>`
/// (Expert a float expert type, `SwiGLU<float>` for the packed layer and
/// `SwiGLU<T>` for the float one alike) gives:
///
///     static constexpr gguf::ExpertKind kKind;     // the rows it reads and writes
///     using Packed;                                // the packed layer's expert type (float)
///     static std::vector<ExpertExtraTensor> extra_tensors(Index d, Index f);  // in
///         PackedExpertKind's extra_tensors() order: GGUF name under `blk.N.`, 1 × cols per expert
///     static Options options(const gguf::Architecture&);    // the row's hyper-parameters
///     template <class Layer> static void configure(Layer&, const Architecture&);
///     static void check_extras(const char* where, const std::vector<Extra>&, const Architecture&);
///         // the savers: ConfigError for float parts the row cannot express
///
/// A GGUF bias tensor of the experts is ne [cols, E]: row e is expert e's.

#include <string>
#include <type_traits>
#include <vector>

#include "../../../core/errors.hpp"
#include "../../../core/types.hpp"
#include "../../../io/gguf_architectures.hpp"
#include "../../../layers/clamped_swiglu.hpp"
#include "../../../layers/swiglu.hpp"
#include "../../engine/packed_clamped.hpp"
#include "../../engine/packed_expert_kind.hpp"

namespace apex {

template <class Expert>
struct GgufExpertKind;

/// SwiGLU experts: the plain rows; nothing beside the three weight tensors.
template <class T>
struct GgufExpertKind<SwiGLU<T>> {
  static constexpr gguf::ExpertKind kKind = gguf::ExpertKind::SwiGLU;
  using Packed = SwiGLU<float>;  ///< the packed layer's expert type
  using Options = NoExpertOptions;
  static std::vector<ExpertExtraTensor> extra_tensors(Index, Index) { return {}; }
  static Options options(const gguf::Architecture&) { return {}; }
  template <class Layer>
  static void configure(Layer&, const gguf::Architecture&) {}
  template <class Extra>
  static void check_extras(const char*, const std::vector<Extra>&, const gguf::Architecture&) {}
};

/// gpt-oss's clamped SwiGLU: the three bias tensors, α and L from the row.
template <class T>
struct GgufExpertKind<ClampedSwiGLU<T>> {
  static constexpr gguf::ExpertKind kKind = gguf::ExpertKind::ClampedSwiGLU;
  using Packed = ClampedSwiGLU<float>;
  using Options = ClampedSwiGLUOptions;
  /// In PackedExpertKind<ClampedSwiGLU<float>>::extra_tensors() order: b_gate, b_up, b_down.
  static std::vector<ExpertExtraTensor> extra_tensors(Index d, Index f) {
    namespace tn = gguf::tensor_names;
    return {{tn::kGateExpsBias, f}, {tn::kUpExpsBias, f}, {tn::kDownExpsBias, d}};
  }
  static Options options(const gguf::Architecture& a) {
    Options o;
    o.alpha = a.clamp_alpha, o.limit = a.clamp_limit;
    return o;
  }
  /// The float layer's experts get the row's α and L.
  template <class Layer>
  static void configure(Layer& layer, const gguf::Architecture& a) {
    for (auto& e : layer.experts()) e.set_options(options(a));
  }
  /// ConfigError unless every expert's α and L are the ones llama.cpp computes.
  static void check_extras(const char* where, const std::vector<ClampedBiases>& experts, const gguf::Architecture& a) {
    for (std::size_t e = 0; e < experts.size(); ++e) {
      const Options& o = experts[e].options;
      detail::require_config(o.alpha == a.clamp_alpha && o.limit == a.clamp_limit, where,
                             std::string("llama.cpp's ") + a.name + " cannot hold this layer: its clamped SwiGLU has " +
                                 "alpha " + std::to_string(a.clamp_alpha) + " and limit " +
                                 std::to_string(a.clamp_limit) + ", expert " + std::to_string(e) + "'s are " +
                                 std::to_string(o.alpha) + " and " + std::to_string(o.limit));
    }
  }
};

namespace detail::gguf_moe {

/// Whether `Expert` has a GGUF row (κ-SwiGLU, say, has none: llama.cpp has no such expert).
template <class Expert, class = void>
struct has_gguf_kind : std::false_type {};
template <class Expert>
struct has_gguf_kind<Expert, std::void_t<decltype(GgufExpertKind<Expert>::kKind)>> : std::true_type {};

/// ConfigError unless the file's architecture `a` has experts of `Expert`'s
/// kind: naming the architecture, its experts and the type asked for.
template <class Expert>
void check_expert_kind(const std::string& where, const gguf::Architecture& a) {
  static_assert(has_gguf_kind<Expert>::value,
                "GGUF MoE blocks: this expert type has no llama.cpp form (a GgufExpertKind<Expert> specialisation, "
                "inference/files/gguf/expert_kind.hpp)");
  const gguf::ExpertKind want = GgufExpertKind<Expert>::kKind;
  if (a.expert_kind != want)
    throw ConfigError(where + ": architecture '" + a.name + "' has " + gguf::expert_kind_name(a.expert_kind) +
                      " experts, the layer asked for has " + gguf::expert_kind_name(want) + " experts: load it as " +
                      (a.expert_kind == gguf::ExpertKind::SwiGLU ? "a SwiGLU layer (the default expert type)"
                                                                 : "a ClampedSwiGLU layer (GptOssMoE / PackedMoE<S, ClampedSwiGLU<float>>)"));
}

}  // namespace detail::gguf_moe
}  // namespace apex
