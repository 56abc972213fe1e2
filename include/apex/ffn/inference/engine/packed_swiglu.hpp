#pragma once
/// \file inference/engine/packed_swiglu.hpp
/// `PackedSwiGLU<Storage, Activation>`: the inference-only dense SwiGLU FFN on packed
/// float or bf16 weights — the forward of `SwiGLU<float>` with no gradient
/// buffers and no float copy of the weights (docs/inference.md):
///
///     FFN(X) = (SiLU(X·W_gateᵀ) ⊙ X·W_upᵀ)·W_downᵀ
///
/// Rows are split into tiles of detail::inference::kMaxTileRows shared by
/// OpenMP threads; each tile is one call of the packed kernels, which give
/// every row the same bits whatever the tiling, so results do not depend on
/// the thread count. Rebuild after an optimiser step of the source
/// (`check_source` detects a stale copy, inference/engine/packed_types.hpp).

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "../../core/errors.hpp"
#include "../../moe/expert_tasks.hpp"
#include "../../core/memory_budget.hpp"
#include "../../kernels/fused_expert.hpp"
#include "../../core/parallel.hpp"
#include "../../layers/swiglu.hpp"
#include "../../core/types.hpp"
#include "packed_types.hpp"

namespace apex {

/// Activation: the gated activation of the gate/up pass, an epilogue policy
/// of kernels/epilogue.hpp (SwiGLU's SiLU by default; a user-defined one
/// runs the same weights as another gated FFN, e.g. GEGLU).
template <class Storage, class Activation = packed::SiluGate>
class PackedSwiGLU {
 public:
  using Scalar = float;
  using StorageType = Storage;
  using ActivationType = Activation;
  static constexpr packed::Dtype kDtype = packed_dtype<Storage>();

  /// Inference keeps nothing; the type exists so the layer fits FFNSublayer.
  struct Cache {};

  /// Packs a trained SwiGLU in `types` (Storage's by default; gate/up and
  /// down may differ). ConfigError if it would not fit in physical memory
  /// or a width is not whole blocks of its type.
  static PackedSwiGLU from(const SwiGLU<float>& src, packed::ExpertDtypes types = kDtype) {
    check_fits("PackedSwiGLU::from", src.d_model(), src.d_ffn(), 0, types);
    PackedSwiGLU out(packed::PackedExpert(src.w_gate(), src.w_up(), src.w_down(), types));
    out.fingerprint_ = fingerprint(src);
    out.has_source_ = true;
    return out;
  }
  /// Takes over packed weights of any storage types.
  explicit PackedSwiGLU(packed::PackedExpert weights) : w_(std::move(weights)) {}

  Index d_model() const { return w_.d_model(); }
  Index d_ffn() const { return w_.d_ffn(); }
  const packed::PackedExpert& weights() const { return w_; }
  std::size_t bytes() const { return w_.bytes(); }

  void set_threads(int threads) { threads_ = threads; }
  int threads() const { return threads_; }
  void set_kernel_options(const packed::ForwardOptions& o) { kernel_ = o; }
  const packed::ForwardOptions& kernel_options() const { return kernel_; }

  /// Packed bytes of a d × f layer (padding included), without allocating.
  /// ConfigError naming `where` if the count overflows.
  static std::uint64_t weight_bytes(Index d, Index f, const char* where = "PackedSwiGLU::weight_bytes",
                                    packed::ExpertDtypes types = kDtype) {
    return std::uint64_t(detail::inference::packed_expert_bytes(where, types, d, f));
  }
  /// ConfigError unless a d × f layer plus `staging` bytes fits in physical
  /// memory, or if their sum overflows (core/checked_size.hpp's rule).
  static void check_fits(const char* where, Index d, Index f, std::uint64_t staging,
                         packed::ExpertDtypes types = kDtype) {
    detail::require_config(d > 0 && f > 0, where, "d_model and d_ffn must be positive, got " + std::to_string(d) +
                                                      " and " + std::to_string(f));
    check_memory_fit(where,
                     "a packed " + packed::dtypes_name(types) + " SwiGLU (d_model " + std::to_string(d) +
                         ", d_ffn " + std::to_string(f) + ")",
                     detail::inference::checked_bytes(where, weight_bytes(d, f, where, types), staging));
  }

  /// x: N × d → N × d (ShapeError otherwise).
  Matrix<float> forward(const ConstMatrixRef<float>& x, Cache* = nullptr) const {
    detail::check_shape("PackedSwiGLU::forward", "x", x, detail::kAny, d_model());
    Matrix<float> y(x.rows(), d_model());
    compute(x, y.data());
    return y;
  }
  /// As forward, into y (N × d): any row stride (a block of a wider
  /// matrix), and y may be or overlap x. A contiguous y apart from x is
  /// written directly; otherwise the result goes through a scratch matrix
  /// and is copied (the kernels write rows of stride d, and read x while
  /// they write). Either way y gets forward's bits.
  void forward_into(const ConstMatrixRef<float>& x, MatrixRef<float> y) const {
    detail::check_shape("PackedSwiGLU::forward_into", "x", x, detail::kAny, d_model());
    detail::check_shape("PackedSwiGLU::forward_into", "y", y, x.rows(), d_model());
    if (y.outerStride() == d_model() && !detail::inference::overlaps(x, y)) return compute(x, y.data());
    const Matrix<float> tmp = forward(x);
    y = tmp;
  }

  /// ShapeError if src's shape differs, ValueError if its weights changed
  /// since packing (or this layer was not packed from a float layer).
  void check_source(const SwiGLU<float>& src) const {
    constexpr const char* where = "PackedSwiGLU::check_source";
    if (src.d_model() != d_model() || src.d_ffn() != d_ffn())
      throw ShapeError(std::string(where) + ": the source layer is d_model " + std::to_string(src.d_model()) +
                       ", d_ffn " + std::to_string(src.d_ffn()) + "; this packed layer was built for d_model " +
                       std::to_string(d_model()) + ", d_ffn " + std::to_string(d_ffn()));
    if (!has_source_ || fingerprint(src) != fingerprint_)
      throw ValueError(std::string(where) +
                       ": the source layer's weights changed since this layer was packed (stale copy); "
                       "rebuild it with PackedSwiGLU::from");
  }
  static std::uint64_t fingerprint(const SwiGLU<float>& src) {
    std::uint64_t h = detail::inference::kFingerprintSeed;
    detail::inference::fingerprint_add(h, src.w_gate_up().data(), src.w_gate_up().size());
    detail::inference::fingerprint_add(h, src.w_down().data(), src.w_down().size());
    return h;
  }
  void set_source_fingerprint(std::uint64_t fp) {
    fingerprint_ = fp;
    has_source_ = true;
  }

 private:
  void compute(const ConstMatrixRef<float>& x, float* y) const {
    const Index n = x.rows(), d = d_model();
    // the tiles of one shared expert over n rows (moe/expert_tasks.hpp),
    // kept between calls on this thread (a decode step allocates nothing)
    static const std::vector<Index> no_routed{0};
    const auto& tiles = detail::kept_forward_tasks<PackedSwiGLU>(no_routed, 1, n, detail::inference::kMaxTileRows);
    detail::parallel_for(Index(tiles.size()), resolve_threads(threads_), [&](Index i) {
      const Index b = tiles[std::size_t(i)].begin, m = tiles[std::size_t(i)].rows;
      packed::forward<Activation>(w_, x.data() + b * x.outerStride(), x.outerStride(), m, y + b * d, d, kernel_);
    });
  }

  packed::PackedExpert w_;
  packed::ForwardOptions kernel_;
  int threads_ = 0;
  std::uint64_t fingerprint_ = 0;
  bool has_source_ = false;
};

}  // namespace apex
