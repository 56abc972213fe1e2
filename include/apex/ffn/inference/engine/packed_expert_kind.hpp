#pragma once
/// \file inference/engine/packed_expert_kind.hpp
/// The open table of routed-expert kinds of the packed engine: how
/// `PackedMoE<Storage, Expert>` packs, stores, checks and runs one float
/// expert type, so the MoE layer, its runner and its loaders and savers never
/// name an expert type (docs/inference.md#expert-kinds). A kind is a
/// specialisation of `PackedExpertKind<Expert>`:
///
///     static constexpr const char* kName;          // "swiglu", written in pack-once files
///     static constexpr bool kCustomActivation;     // takes PackedMoE's Activation policy
///     using Options;                               // the kind's hyper-parameters (not stored in files)
///     using Extra;                                 // the float parts one expert keeps beside its
///                                                  // packed gate/up and down panels
///     static const SwiGLU<float>& weights(const Expert&);       // what is packed
///     static Extra extra(const Expert&);                        // what is copied as float
///     static std::vector<ExpertExtraTensor> extra_tensors(Index d, Index f);  // their names, 1 × cols each
///     static std::vector<const RowVector<float>*> extra_rows(const Extra&);   // in that order
///     static Extra make_extra(std::vector<RowVector<float>> rows, const Options&);
///     template <class LoadOptions> static const Options& options_of(const LoadOptions&);
///     static void check_extra(const char* where, const Extra&, Index d, Index f);
///     static void check_kernel_options(const char* where, const packed::ForwardOptions&);
///     template <class Act> static void forward(const packed::PackedExpert&, const Extra&,
///         const float* x, Index ldx, const float* side, Index m, float* y, Index ldy,
///         const packed::ForwardOptions&);       // y (m × d) = expert(x (m × d)); side: each
///                                               // row's side input (moe/expert_contract.hpp) or null
///
/// The library's kinds: SwiGLU (here), κ-SwiGLU (inference/engine/packed_kappa.hpp)
/// and gpt-oss's clamped SwiGLU with biases (inference/engine/packed_clamped.hpp).
/// A new expert type is a new specialisation, in its own header, and
/// nothing else: the layer, the runner, pack-once files and packed
/// checkpoints read everything through this table.

#include <type_traits>
#include <vector>

#include "../../core/errors.hpp"
#include "../../core/types.hpp"
#include "../../kernels/fused_expert.hpp"
#include "../../layers/swiglu.hpp"

namespace apex {

/// One float tensor (1 × cols) an expert kind keeps per routed expert, named
/// under the expert's prefix `experts.{e}.` (packed checkpoints) or, in a
/// GGUF block, under `blk.N.` with the experts as rows (inference/files/gguf/expert_kind.hpp).
struct ExpertExtraTensor {
  const char* name;
  Index cols;
};

/// A kind without hyper-parameters or float parts.
struct NoExpertOptions {
  template <class T>
  void validate_for(const char*) const {}  ///< nothing to validate
};
struct NoExpertExtra {};

/// The kind table: specialised per float expert type (see the file comment).
template <class Expert>
struct PackedExpertKind;

/// SwiGLU: its three projections packed, nothing kept as float; the gated
/// activation is PackedMoE's `Activation` policy, fused in the gate/up
/// pass's epilogue (kernels/epilogue.hpp).
template <>
struct PackedExpertKind<SwiGLU<float>> {
  static constexpr const char* kName = "swiglu";
  static constexpr bool kCustomActivation = true;
  using Options = NoExpertOptions;
  using Extra = NoExpertExtra;

  static const SwiGLU<float>& weights(const SwiGLU<float>& e) { return e; }
  static Extra extra(const SwiGLU<float>&) { return {}; }
  static std::vector<ExpertExtraTensor> extra_tensors(Index, Index) { return {}; }
  static std::vector<const RowVector<float>*> extra_rows(const Extra&) { return {}; }
  static Extra make_extra(std::vector<RowVector<float>>, const Options&) { return {}; }
  template <class LoadOptions>
  static const Options& options_of(const LoadOptions&) {
    static const Options none;
    return none;
  }
  static void check_extra(const char*, const Extra&, Index, Index) {}
  static void check_kernel_options(const char*, const packed::ForwardOptions&) {}
  template <class Act>
  static void forward(const packed::PackedExpert& e, const Extra&, const float* x, Index ldx, const float*, Index m,
                      float* y, Index ldy, const packed::ForwardOptions& opt) {
    packed::forward<Act>(e, x, ldx, m, y, ldy, opt);
  }
};

namespace detail::inference {

/// Whether `Expert` has a row in the kind table.
template <class Expert, class = void>
struct has_packed_kind : std::false_type {};
template <class Expert>
struct has_packed_kind<Expert, std::void_t<decltype(PackedExpertKind<Expert>::kName)>> : std::true_type {};

/// Whether a kind keeps float parts per expert (PackedMoE then holds E of them).
template <class Kind>
inline constexpr bool kind_has_extra = !std::is_same_v<typename Kind::Extra, NoExpertExtra>;

/// Bytes of one expert's float parts: Σ cols × 4 over the kind's tensors.
template <class Kind>
Index kind_extra_bytes(const char* where, Index d, Index f) {
  Index bytes = 0;
  for (const ExpertExtraTensor& t : Kind::extra_tensors(d, f))
    bytes = apex::detail::checked_sum(where, "expert float bytes", bytes,
                                      apex::detail::checked_product(where, "expert float bytes", {t.cols, 4}));
  return bytes;
}

/// ShapeError unless every row of `extra` is 1 × the width its tensor names.
template <class Kind>
void check_extra_shapes(const char* where, const typename Kind::Extra& extra, Index d, Index f) {
  const auto tensors = Kind::extra_tensors(d, f);
  const auto rows = Kind::extra_rows(extra);
  for (std::size_t i = 0; i < tensors.size(); ++i)
    apex::detail::check_shape(where, (std::string("extras.") + tensors[i].name).c_str(), *rows[i], 1, tensors[i].cols);
}

}  // namespace detail::inference
}  // namespace apex
