#pragma once
/// \file inference/engine/expert_kind.hpp
/// The table of routed-expert kinds. Training an expert type in `MoEFFN`
/// needs only the expert contract (moe/expert_contract.hpp); everything else
/// the library does with it — pack and run it (`PackedMoE<Storage, Expert>`),
/// store its float parts in packed checkpoints, pack-once and GGUF files,
/// train adapters through it frozen (adapters/lora_moe.hpp) — reads the
/// kind's one row, `ExpertKind<Expert>`, so none of those layers, loaders or
/// savers names an expert type (docs/inference.md#expert-kinds).
///
/// A kind is one partial specialisation on its expert template (any scalar
/// T; the packed engine uses T = float), in its own header under
/// inference/engine/kinds/:
///
///     // what it is
///     static constexpr const char* kName;    // "swiglu": in pack-once files, and how family
///                                            // and GGUF architecture rows name their experts
///     static constexpr const char* kLabel;   // "SwiGLU": in messages
///     using Options;                         // its hyper-parameters (not in files), validate_for<T>(where)
///     using Packed;                          // the expert type of the packed layer (T = float)
///     // its frozen float parts, beside the packed panels or under adapters
///     using Extra;                           // one expert's (NoExpertExtra: none)
///     static const SwiGLU<T>& weights(const Expert&);   // the three projections (and a mutable overload)
///     static Extra extra(const Expert&);
///     static std::vector<ExpertExtraTensor> extra_tensors(Index d, Index f);  // names under experts.{e}., 1 × cols
///     static std::vector<const RowVector<float>*> extra_rows(const Extra&);   // in that order
///     static Extra make_extra(std::vector<RowVector<float>> rows, const Options&);
///     static void check_extra(const char* where, const Extra&, Index d, Index f);
///     // its packed forward
///     static constexpr bool kCustomActivation;        // takes PackedMoE's Activation policy
///     static void check_kernel_options(const char* where, const packed::ForwardOptions&);
///     template <class Act> static void forward(const packed::PackedExpert&, const Extra&,
///         const float* x, Index ldx, const float* side, Index m, float* y, Index ldy,
///         const packed::ForwardOptions&);  // y (m × d) = expert(x (m × d)); side: each row's
///                                          // side input (moe/expert_contract.hpp) or null
///     // its GGUF form: NoGgufForm (llama.cpp has none), or a type with
///     //   extra_tensors(d, f)                 llama.cpp's names of the float parts under blk.N.
///     //                                       (ne [cols, E]: row e is expert e's), in extra_tensors order
///     //   options(const gguf::Architecture&)  the kind's Options an architecture row fixes
///     //   configure(layer, arch)              a float MoEFFN's experts get them
///     //   check_extras(where, extras, arch)   ConfigError for float parts the row cannot hold
///     using Gguf;
///     // its activation with the frozen parts, for the adapters' layers (adapters/lora_block.hpp)
///     using Activation;  // SideInput; of(const Expert&), of(const Extra&);
///                        // forward(side, g, u, a), backward(side, work, dh, ds), finish(y), apply_to(expert)
///
/// The library's rows: kinds/swiglu.hpp, kinds/kappa_swiglu.hpp and
/// kinds/clamped_swiglu.hpp (gpt-oss), included together by expert_kinds.hpp.
/// Options reach a load through the kind too (`PackedLoadOptions::expert_options`).

#include <string>
#include <type_traits>
#include <vector>

#include "../../core/checked_size.hpp"
#include "../../core/errors.hpp"
#include "../../core/types.hpp"
#include "../../kernels/fused_expert.hpp"

namespace apex {

/// One float tensor (1 × cols) an expert kind keeps per routed expert, named
/// under the expert's prefix `experts.{e}.` (packed checkpoints, pack-once
/// files) or, in a GGUF block, under `blk.N.` with the experts as rows.
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
/// The GGUF form of a kind llama.cpp has no block for.
struct NoGgufForm {};

/// The kind table: specialised per expert template (see the file comment).
template <class Expert>
struct ExpertKind;

/// The options of `Expert`'s kind.
template <class Expert>
using ExpertOptions = typename ExpertKind<Expert>::Options;

namespace detail::inference {

/// Whether `Expert` has a row in the kind table.
template <class Expert, class = void>
struct has_expert_kind : std::false_type {};
template <class Expert>
struct has_expert_kind<Expert, std::void_t<decltype(ExpertKind<Expert>::kName)>> : std::true_type {};

/// Whether a kind keeps float parts per expert (PackedMoE then holds E of them).
template <class Kind>
inline constexpr bool kind_has_extra = !std::is_same_v<typename Kind::Extra, NoExpertExtra>;

/// Whether a kind has a GGUF form.
template <class Kind>
inline constexpr bool kind_has_gguf = !std::is_same_v<typename Kind::Gguf, NoGgufForm>;

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

/// ConfigError naming the kind for `paired` bf16 products, which form G·U in
/// one product: a kind whose activation needs G and U apart cannot take them.
inline void require_unpaired(const char* where, const packed::ForwardOptions& opt, const char* kind) {
  apex::detail::require_config(opt.bf16_products != packed::Bf16Products::paired, where, [&] {
    return std::string("bf16_products = paired is not supported for ") + kind + " experts";
  });
}

}  // namespace detail::inference
}  // namespace apex
