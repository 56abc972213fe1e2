#pragma once
/// \file inference/engine/packed_shared.hpp
/// The shared experts of a PackedMoE (docs/inference.md): S always-active
/// SwiGLU experts, packed at their own hidden width f_s =
/// MoEConfig::shared_ffn() (Qwen2-MoE's shared expert is 4× as wide as its
/// routed ones; DeepSeek-V3 fuses its shared experts into one), and, with
/// `MoEConfig::shared_expert_gate`, Qwen2-MoE's gate weight w_gate (1 × d),
/// which scales every shared expert's output per token:
///
///     D_s(X) ← σ(X·w_gateᵀ) ⊙ D_s(X)      (one scalar per row)
///
/// w_gate stays float and σ is MoEFFN::compute's own expression, so the gate
/// values are bit for bit the float layer's; only D_s runs on packed weights.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "../../core/checked_size.hpp"
#include "../../core/errors.hpp"
#include "../../moe/config.hpp"
#include "../../kernels/fused_expert.hpp"
#include "../../core/types.hpp"
#include "packed_types.hpp"

namespace apex::detail::inference {

class PackedShared {
 public:
  PackedShared() = default;

  /// Takes over S = config.n_shared packed experts of d × config.shared_ffn(),
  /// all of one storage pair (`fallback` when S = 0), and the gate weight:
  /// 1 × d with config.shared_expert_gate, else empty. ShapeError on a wrong
  /// count, shape or gate, ConfigError on mixed types, each naming `where`
  /// and the argument.
  PackedShared(const char* where, const MoEConfig& config, packed::ExpertDtypes fallback,
               std::vector<packed::PackedExpert> experts, Matrix<float> gate_weight)
      : experts_(std::move(experts)), gate_(std::move(gate_weight)) {
    const Index d = config.d_model, fs = config.shared_ffn();
    if (Index(experts_.size()) != config.n_shared)
      throw ShapeError(std::string(where) + ": argument 'shared' holds " + std::to_string(experts_.size()) +
                       " experts, expected " + std::to_string(config.n_shared));
    dtypes_ = uniform_dtypes(where, "shared", experts_, fallback);
    // f_s × d: the shared width, which may differ from the routed experts' d_ffn
    for (const auto& e : experts_) check_shape(where, "shared", e.d_ffn(), e.d_model(), fs, d);
    if (config.shared_expert_gate) check_shape(where, "shared_gate", gate_, 1, d);
    else check_shape(where, "shared_gate (config.shared_expert_gate is off)", gate_, 0, 0);
  }

  const std::vector<packed::PackedExpert>& experts() const { return experts_; }
  /// 1 × d (shared_expert_gate) or 0 × 0.
  const Matrix<float>& gate_weight() const { return gate_; }
  Index size() const { return Index(experts_.size()); }
  packed::ExpertDtypes dtypes() const { return dtypes_; }

  /// Packed bytes of the experts (padding included); the gate is counted by
  /// weight_bytes, with the other float parts.
  std::size_t expert_bytes() const {
    std::size_t b = 0;
    for (const auto& e : experts_) b += e.bytes();
    return b;
  }

  /// Bytes the shared part of a layer of `config` holds: S packed experts of
  /// d × f_s, plus the float gate weight (4·d) if there is one.
  static Index weight_bytes(const char* where, const MoEConfig& config, packed::ExpertDtypes dtypes) {
    const Index one = packed_expert_bytes(where, dtypes, config.d_model, config.shared_ffn());
    const Index all = checked_product(where, "shared experts bytes", {config.n_shared, one});
    const Index gate = config.shared_expert_gate ? checked_product(where, "shared gate bytes", {config.d_model, 4}) : 0;
    return checked_sum(where, "shared bytes", all, gate);
  }

  /// Rows [b, b + m) of shared expert s: ys.middleRows(b, m) (ys: N × d,
  /// contiguous) = Shared_s(x.middleRows(b, m)).
  void forward(Index s, const ConstMatrixRef<float>& x, Index b, Index m, Matrix<float>& ys,
               const packed::ForwardOptions& kernel) const {
    packed::forward(experts_[std::size_t(s)], x.data() + b * x.outerStride(), x.outerStride(), m,
                    ys.data() + b * ys.cols(), ys.cols(), kernel);
  }

  /// Adds the experts' float source weights and the gate to a fingerprint,
  /// in the order the loaders read them.
  template <class SharedList>
  static void fingerprint_source(std::uint64_t& h, const SharedList& shared, const Matrix<float>& gate) {
    for (const auto& s : shared) {
      fingerprint_add(h, s.w_gate_up().data(), s.w_gate_up().size());
      fingerprint_add(h, s.w_down().data(), s.w_down().size());
    }
    if (gate.size() > 0) fingerprint_add(h, gate.data(), gate.size());
  }

 private:
  std::vector<packed::PackedExpert> experts_;  ///< S, each f_s × d
  Matrix<float> gate_;                         ///< 1 × d (shared_expert_gate) or 0 × 0
  packed::ExpertDtypes dtypes_;
};

}  // namespace apex::detail::inference
