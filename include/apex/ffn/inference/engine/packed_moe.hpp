#pragma once
/// \file inference/engine/packed_moe.hpp
/// `PackedMoE<Storage, Expert, Activation>`: the inference-only MoE layer on packed
/// weights (kernels/packed_weights.hpp) in float or bf16 — the forward of
/// `MoEFFN<float, Expert>` without gradients, caches for backward, or a float
/// copy of the expert weights (docs/inference.md):
///
///     MoE(X) = Σ_s γ ⊙ Shared_s(X) + Σ_k g_k · Expert_{e_k}(X)
///
/// with γ = σ(X·w_gateᵀ) per token under `shared_expert_gate` (Qwen2-MoE,
/// else 1) and shared experts of width `d_shared_ffn` (inference/engine/packed_shared.hpp).
/// It is the MoE pipeline (moe/pipeline.hpp) over packed experts
/// (inference/engine/packed_runner.hpp): routing, bias, capacity, κ's α and b and
/// the shared gate stay float and are the float layer's code, so the top-K
/// choice, weights, drops, κ and γ are its bits; only the expert products run
/// on packed weights, bitwise the same for any thread count and tiling.
///
/// Build one with `PackedMoE<S, E>::from(trained_layer)` or
/// `load_packed_moe<S, E>(file, config)` (inference/files/checkpoint/load.hpp). A
/// packed layer is a snapshot: rebuild it after every optimiser step of its
/// source (`check_source` detects a stale copy, inference/engine/packed_types.hpp).
/// Memory: `weight_bytes`.

#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../../core/errors.hpp"
#include "../../core/memory_budget.hpp"
#include "../../core/types.hpp"
#include "../../kernels/fused_expert.hpp"
#include "../../layers/swiglu.hpp"
#include "../../moe/config.hpp"
#include "../../moe/moe_cache.hpp"
#include "../../moe/moe_ffn.hpp"
#include "../../moe/pipeline.hpp"
#include "../../moe/router.hpp"
#include "expert_kind.hpp"
#include "expert_kinds.hpp"
#include "packed_types.hpp"
#include "packed_runner.hpp"
#include "packed_shared.hpp"

namespace apex {

/// Inference MoE on packed `Storage` weights (float, packed::bf16 or a block
/// format such as packed::q4_k: the default of from() and the loaders, which
/// take other types per matrix and for the shared experts). Expert: any float
/// expert type with a row in the expert-kind table (expert_kind.hpp):
/// SwiGLU<float>, KappaSwiGLU<float>, ClampedSwiGLU<float> (gpt-oss), or a
/// user's; shared experts are SwiGLU, of width config.shared_ffn().
/// Activation: the routed SwiGLU experts' gated activation, a policy of the
/// kernels' epilogue (kernels/epilogue.hpp): SiLU by default, or any user's
/// over the same weights (a GEGLU model's experts, say); other kinds have their own.
template <class Storage, class Expert = SwiGLU<float>, class Activation = packed::SiluGate>
class PackedMoE {
  static_assert(detail::inference::has_expert_kind<Expert>::value,
                "PackedMoE<Storage, Expert>: Expert needs a row in the expert-kind table, a specialisation of "
                "ExpertKind<Expert> (inference/engine/expert_kind.hpp)");
  static_assert(ExpertKind<Expert>::kCustomActivation || std::is_same_v<Activation, packed::SiluGate>,
                "PackedMoE<Storage, Expert, Activation>: this expert kind has its own activation");

 public:
  using Scalar = float;
  using StorageType = Storage;
  using ExpertType = Expert;
  using ActivationType = Activation;
  using Source = MoEFFN<float, Expert>;
  /// How this layer packs, stores and runs its routed experts.
  using Kind = ExpertKind<Expert>;
  /// The float parts one routed expert keeps (κ's α and b, gpt-oss's biases; none for SwiGLU).
  using Extra = typename Kind::Extra;
  static constexpr bool kHasExtra = detail::inference::kind_has_extra<Kind>;
  static constexpr packed::Dtype kDtype = packed_dtype<Storage>();

  /// The buffers of one forward (moe/moe_cache.hpp; routing and plan are the
  /// float layer's). A forward-only cache: no input or workspaces are kept.
  using Cache = MoECache<float>;

  /// Packs a trained float layer: router weights (and logit bias), bias, the
  /// experts' float parts and options (Kind::extra) and the shared gate
  /// weight copied, expert weights packed in
  /// `types` (bf16: rounded to nearest even; block formats: ggml's reference
  /// quantizers). ConfigError if the packed layer would not fit in physical
  /// memory (core/memory_budget.hpp), or if a width is not whole blocks of
  /// its type; ValueError for a weight its type cannot hold (pack_expert).
  static PackedMoE from(const Source& src, const PackedTypes& types = kDtype) {
    const MoEConfig& cfg = src.config();
    check_fits("PackedMoE::from", cfg, 0, types);
    std::vector<packed::PackedExpert> experts, shared;
    std::vector<Extra> extras;
    experts.reserve(std::size_t(cfg.n_experts));
    for (const auto& e : src.experts()) {
      experts.push_back(detail::inference::pack_expert("expert", experts.size(), Kind::weights(e), types.routed));
      if constexpr (kHasExtra) extras.push_back(Kind::extra(e));
    }
    for (const auto& s : src.shared_experts())
      shared.push_back(detail::inference::pack_expert("shared expert", shared.size(), s, types.shared));
    PackedMoE out(cfg, src.router().weight(), src.balancer().bias(), std::move(experts), std::move(extras),
                  std::move(shared), src.shared_gate_weight());
    if (cfg.router_bias) out.set_logit_bias(src.router().logit_bias());
    out.fingerprint_ = fingerprint(src);
    out.has_source_ = true;
    return out;
  }

  /// Assembles a layer from its parts (the loaders use this): router weight
  /// E × d, bias 1 × E (finite), E packed experts of f × d, their float parts
  /// (E of them for a kind that has some, Kind::check_extra; else empty),
  /// S packed shared experts of f_s × d (f_s = config.shared_ffn()),
  /// and the shared gate weight: 1 × d with config.shared_expert_gate, else
  /// empty. With config.router_bias the logit bias starts at 0: set_logit_bias.
  /// ShapeError or ValueError on a mismatch, as the float layer would
  /// raise them; ConfigError for routed (or shared) experts of mixed types.
  PackedMoE(const MoEConfig& config, const Matrix<float>& router_weight, const RowVector<float>& bias,
            std::vector<packed::PackedExpert> experts, std::vector<Extra> extras,
            std::vector<packed::PackedExpert> shared, Matrix<float> shared_gate = Matrix<float>())
      : config_((config.validate_for<float>("PackedMoE"), config)),
        router_(make_router(config)),
        bias_(bias),
        experts_(std::move(experts)),
        extras_(std::move(extras)),
        routed_types_(detail::inference::uniform_dtypes("PackedMoE", "experts", experts_, kDtype)),
        shared_("PackedMoE", config, routed_types_, std::move(shared), std::move(shared_gate)) {
    constexpr const char* where = "PackedMoE";
    const Index d = config.d_model, f = config.d_ffn;
    detail::check_shape(where, "router_weight", router_weight, config.n_experts, d);
    detail::check_finite(where, "router_weight", router_weight);
    detail::check_shape(where, "bias", bias_, 1, config.n_experts);
    detail::check_finite(where, "bias", bias_);
    router_.weight() = router_weight;
    if (Index(experts_.size()) != config.n_experts)
      throw ShapeError(std::string(where) + ": argument 'experts' holds " + std::to_string(experts_.size()) +
                       " experts, expected " + std::to_string(config.n_experts));
    for (const auto& e : experts_) detail::check_shape(where, "experts", e.d_ffn(), e.d_model(), f, d);
    if (Index(extras_.size()) != (kHasExtra ? config.n_experts : 0))
      throw ShapeError(std::string(where) + ": argument 'extras' holds " + std::to_string(extras_.size()) + " " +
                       Kind::kName + " expert parts, expected " + std::to_string(kHasExtra ? config.n_experts : 0));
    for (const auto& x : extras_) Kind::check_extra(where, x, d, f);
  }

  const MoEConfig& config() const { return config_; }
  Index d_model() const { return config_.d_model; }
  const Router<float>& router() const { return router_; }
  const RowVector<float>& bias() const { return bias_; }
  const std::vector<packed::PackedExpert>& experts() const { return experts_; }
  const std::vector<packed::PackedExpert>& shared_experts() const { return shared_.experts(); }
  /// The shared gate weight w_gate: 1 × d with shared_expert_gate, else 0 × 0.
  const Matrix<float>& shared_gate_weight() const { return shared_.gate_weight(); }
  /// Each routed expert's float parts (Kind::Extra): E of them, or none.
  const std::vector<Extra>& extras() const { return extras_; }
  /// Sets the router's trained logit bias b_r (config.router_bias, gpt-oss):
  /// 1 × E. ShapeError for another shape, ConfigError without router_bias,
  /// ValueError if not finite; the layer is unchanged then.
  void set_logit_bias(const RowVector<float>& b) {
    constexpr const char* where = "PackedMoE::set_logit_bias";
    detail::require_config(config_.router_bias, where, "the layer's config has no router bias (router_bias is off)");
    detail::check_shape(where, "b", b, 1, config_.n_experts);
    detail::check_finite(where, "b", b);
    router_.logit_bias() = b;
  }
  /// The storage types of the routed and shared experts.
  PackedTypes types() const { return {routed_types_, shared_.dtypes()}; }

  /// Threads for dispatch (0 = OpenMP's default; ignored without OpenMP).
  void set_threads(int threads) { threads_ = threads; }
  int threads() const { return threads_; }
  /// Kernel path and bf16 product choice (kernels/fused_expert.hpp); checked at
  /// the next forward.
  void set_kernel_options(const packed::ForwardOptions& o) { kernel_ = o; }
  const packed::ForwardOptions& kernel_options() const { return kernel_; }

  /// Bytes of packed expert weights (routed and shared, padding included).
  std::size_t expert_bytes() const {
    std::size_t b = 0;
    for (const auto& e : experts_) b += e.bytes();
    return b + shared_.expert_bytes();
  }

  /// Bytes a layer of `config` holds (packed routed experts with padding and
  /// their float parts, packed shared experts at their width and the shared gate,
  /// router weights, bias), computed without allocating. ConfigError naming
  /// `where` if the count overflows.
  static std::uint64_t weight_bytes(const MoEConfig& config, const char* where = "PackedMoE::weight_bytes",
                                    const PackedTypes& types = kDtype) {
    const Index d = config.d_model, f = config.d_ffn, e = config.n_experts;
    const Index extra = detail::inference::kind_extra_bytes<Kind>(where, d, f);
    const Index one = detail::checked_sum(where, "routed expert bytes",
                                          detail::inference::packed_expert_bytes(where, types.routed, d, f), extra);
    const Index routed = detail::checked_product(where, "routed experts bytes", {e, one});
    const Index shared = detail::inference::PackedShared::weight_bytes(where, config, types.shared);
    // The router holds its E × d weights only: its gradient is never allocated here (core/param.hpp).
    const Index router = detail::checked_product(where, "router and bias bytes", {e, detail::checked_sum(where, "router width", d, 1), 4});
    return std::uint64_t(detail::checked_sum(where, "layer bytes", detail::checked_sum(where, "experts bytes", routed, shared),
                                             router));
  }

  /// ConfigError unless a layer of `config` (plus `staging` bytes held while
  /// it is built) fits in physical memory (core/memory_budget.hpp), or if the
  /// byte count overflows (core/checked_size.hpp's rule).
  static void check_fits(const char* where, const MoEConfig& config, std::uint64_t staging,
                         const PackedTypes& types = kDtype) {
    config.validate_for<float>(where);  // computes in float
    check_memory_fit(where,
                     "a packed " + packed_types_name(types) + " MoE layer (d_model " +
                         std::to_string(config.d_model) + ", d_ffn " + std::to_string(config.d_ffn) +
                         (config.d_shared_ffn > 0 ? ", d_shared_ffn " + std::to_string(config.d_shared_ffn) : "") + ", " +
                         std::to_string(config.n_experts) + " + " + std::to_string(config.n_shared) + " experts)",
                     detail::inference::checked_bytes(where, weight_bytes(config, where, types), staging));
  }

  /// x: N × d → N × d. ShapeError on a wrong width, ValueError on non-finite
  /// router logits (as MoEFFN::forward).
  Matrix<float> forward(const ConstMatrixRef<float>& x, Cache* cache = nullptr) const {
    Matrix<float> y(x.rows(), d_model());
    compute("PackedMoE::forward", x, y, cache);
    return y;
  }

  /// As forward, into the caller's y (N × d): any row stride (a block of a
  /// wider matrix), and y may be or overlap x — every read of x precedes the
  /// combine, which alone writes y, row by row through its stride. y gets
  /// forward's bits.
  void forward_into(const ConstMatrixRef<float>& x, MatrixRef<float> y, Cache* cache = nullptr) const {
    detail::check_shape("PackedMoE::forward_into", "x", x, detail::kAny, d_model());
    detail::check_shape("PackedMoE::forward_into", "y", y, x.rows(), d_model());
    compute("PackedMoE::forward_into", x, y, cache);
  }

  /// Throws unless this layer was packed from `src` as it is now: ShapeError
  /// if src's shapes differ (d, f, E, K, S, the shared width f_s and whether
  /// the shared experts are gated), ValueError if its weights, bias or
  /// shared gate weight changed since packing (sampled fingerprint,
  /// inference/engine/packed_types.hpp) or this layer was not packed from a float layer.
  void check_source(const Source& src) const {
    constexpr const char* where = "PackedMoE::check_source";
    const auto shape = [](const MoEConfig& c) {
      return "d_model " + std::to_string(c.d_model) + ", d_ffn " + std::to_string(c.d_ffn) + ", E " +
             std::to_string(c.n_experts) + ", K " + std::to_string(c.n_active) + ", S " + std::to_string(c.n_shared) +
             " of width " + std::to_string(c.shared_ffn()) + (c.shared_expert_gate ? " gated" : "");
    };
    if (shape(src.config()) != shape(config_))
      throw ShapeError(std::string(where) + ": the source layer has " + shape(src.config()) +
                       "; this packed layer was built for " + shape(config_));
    const MoEConfig& c = src.config();
    if (!has_source_ || fingerprint(src) != fingerprint_ || c.weights_from_unbiased != config_.weights_from_unbiased)
      throw ValueError(std::string(where) +
                       ": the source layer's weights changed since this layer was packed (stale copy); "
                       "rebuild it with PackedMoE::from");
  }

  /// The sampled fingerprint of a float layer's parameters (shared gate
  /// weight included) and bias.
  static std::uint64_t fingerprint(const Source& src) {
    std::uint64_t h = detail::inference::kFingerprintSeed;
    const auto add = [&](const auto& m) { detail::inference::fingerprint_add(h, m.data(), m.size()); };
    add(src.router().weight());
    if (src.config().router_bias) add(src.router().logit_bias());
    add(src.balancer().bias());
    for (const auto& e : src.experts()) {
      add(Kind::weights(e).w_gate_up());
      add(Kind::weights(e).w_down());
      if constexpr (kHasExtra) {
        const Extra parts = Kind::extra(e);  // the rows below point into it
        for (const RowVector<float>* r : Kind::extra_rows(parts)) add(*r);
      }
    }
    detail::inference::PackedShared::fingerprint_source(h, src.shared_experts(), src.shared_gate_weight());
    return h;
  }
  /// Records `fp` as the fingerprint of the source this layer holds (for a
  /// loader that computed it over the tensors it packed).
  void set_source_fingerprint(std::uint64_t fp) {
    fingerprint_ = fp;
    has_source_ = true;
  }

 private:
  /// A router of the config's shape; its weights are replaced at once.
  static Router<float> make_router(const MoEConfig& c) {
    Rng rng(0);
    Router<float> r(c.d_model, c.n_experts, c.n_active, rng, c.router_bias);
    r.set_routing(c.routing);  // scoring, groups, renormalisation, scale (docs/routing.md)
    return r;
  }

  template <class>
  friend struct detail::inference::PackedRunner;

  /// forward's body (moe/pipeline.hpp over the packed experts); y checked by the caller.
  void compute(const char* where, const ConstMatrixRef<float>& x, MatrixRef<float> y, Cache* cache) const {
    Kind::check_kernel_options(where, kernel_);
    const detail::inference::PackedRunner<PackedMoE> runner{*this};
    detail::MoEPipeline::forward<float>(where, runner, x, y, cache ? *cache : detail::MoEPipeline::scratch<float, PackedMoE>(),
                                        false);
  }

  MoEConfig config_;
  Router<float> router_;
  RowVector<float> bias_;                   ///< 1 × E: the balancing bias, selection only
  std::vector<packed::PackedExpert> experts_;
  std::vector<Extra> extras_;               ///< E (a kind with float parts) or empty
  packed::ExpertDtypes routed_types_;       ///< every routed expert's
  detail::inference::PackedShared shared_;  ///< S experts of f_s × d, and the shared gate
  packed::ForwardOptions kernel_;
  int threads_ = 0;
  std::uint64_t fingerprint_ = 0;
  bool has_source_ = false;
};

}  // namespace apex
