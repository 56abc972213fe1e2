#pragma once
/// \file packed_experts.hpp
/// The routed experts of one MoE block held packed (any storage type of the
/// weight-type table, or a pack-once file's panels mapped in place), run on
/// routing given by the caller (routed_experts.hpp):
///
///  - inference: each expert through its kind's packed forward
///    (inference/engine/expert_kind.hpp) — the PackedMoE forward,
///    whose block formats quantize the activations as ggml does;
///  - training: each expert as the adapters' LoraBlock over its frozen packed
///    weights (adapters/lora_block.hpp, adapters/frozen_packed.hpp), with
///    adapters on gate_up and down or none at all: the forward keeps the
///    activations exact, and the backward gives ∂L/∂x, ∂L/∂g and the
///    adapters' gradients.
///
/// Kinds: SwiGLU (SiLU gate), and gpt-oss's clamped SwiGLU with its biases.
///
/// The adapters come as four stacked tensors, expert-major:
///     a_gu (E, r, d), b_gu (E, 2f, r), a_down (E, r, f), b_down (E, d, r)
/// (B of gate_up: gate rows, then up rows), each optional in pairs.

#include <cstring>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include <apex/ffn/adapters/frozen_packed.hpp>
#include <apex/ffn/inference/engine/expert_kinds.hpp>
#include <apex/ffn/adapters/lora_adapter.hpp>
#include <apex/ffn/adapters/lora_block.hpp>
#include <apex/ffn/inference/engine/packed_types.hpp>
#include <apex/ffn/layers/clamped_swiglu.hpp>

#include "float_experts.hpp"
#include "routed_experts.hpp"

namespace apex::python {

/// The adapters of one call: pointers into the stacked tensors (null: no adapter there).
struct Adapters {
  const float *a_gu = nullptr, *b_gu = nullptr, *a_down = nullptr, *b_down = nullptr;
  Index r_gu = 0, r_down = 0;
  float scale = 1.0f;
  float *da_gu = nullptr, *db_gu = nullptr, *da_down = nullptr, *db_down = nullptr;  ///< gradients (backward)
};

class PackedExperts {
 public:
  PackedExperts(GateKind gate, std::vector<packed::PackedExpert> experts, std::vector<ClampedBiases> biases)
      : gate_(gate), experts_(std::move(experts)), biases_(std::move(biases)) {
    constexpr const char* where = "PackedExperts";
    if (experts_.empty()) throw ConfigError(std::string(where) + ": no experts");
    d_ = experts_.front().d_model();
    f_ = experts_.front().d_ffn();
    types_ = apex::detail::inference::uniform_dtypes(where, "experts", experts_, experts_.front().dtypes());
    for (const auto& e : experts_)
      if (e.d_model() != d_ || e.d_ffn() != f_)
        throw ShapeError(std::string(where) + ": experts of different shapes (" + std::to_string(e.d_ffn()) + " x " +
                         std::to_string(e.d_model()) + " and " + std::to_string(f_) + " x " + std::to_string(d_) + ")");
    if (gate_ == GateKind::clamped) {
      if (biases_.size() != experts_.size())
        throw ShapeError(std::string(where) + ": clamped experts need " + std::to_string(experts_.size()) +
                         " bias sets, got " + std::to_string(biases_.size()));
      for (const auto& b : biases_) ExpertKind<ClampedSwiGLU<float>>::check_extra(where, b, d_, f_);
    } else if (!biases_.empty()) {
      throw ConfigError(std::string(where) + ": SiLU-gated experts have no biases in the library's expert kinds");
    }
  }

  Index experts() const { return Index(experts_.size()); }
  Index d_model() const { return d_; }
  Index d_ffn() const { return f_; }
  GateKind gate() const { return gate_; }
  packed::ExpertDtypes types() const { return types_; }
  const std::vector<packed::PackedExpert>& packed() const { return experts_; }
  const std::vector<ClampedBiases>& biases() const { return biases_; }
  std::size_t bytes() const {
    std::size_t b = 0;
    for (const auto& e : experts_) b += e.bytes();
    return b;
  }
  bool mapped() const { return !experts_.empty() && experts_.front().mapped(); }

  /// Work columns of a training forward with adapters of ranks r_gu, r_down (0: none).
  Index train_work_cols(Index r_gu, Index r_down) const { return 3 * f_ + r_gu + r_down; }

  /// The bf16 products of a forward: `paired` (`vdpbf16ps`, X and A rounded to
  /// bf16) when the caller's activations are bf16 already and the path, the
  /// weights and the gate take it; `widened` (exact activations) otherwise.
  /// A bf16 model rounds X and A to bf16 itself, so pairing loses nothing
  /// there, and on AVX-512 BF16 it is up to twice the widened products' rate
  /// (kernels/fused_expert.hpp).
  packed::ForwardOptions forward_options(packed::Isa isa, bool bf16_activations) const {
    const bool paired = bf16_activations && packed::has_bf16_pairs(isa) &&
                        types_ == packed::ExpertDtypes(packed::Dtype::bf16) && gate_ == GateKind::silu;
    return {isa, paired ? packed::Bf16Products::paired : packed::Bf16Products::widened};
  }

  /// Inference: y (N × d) from x (N × d); y_sorted: NK × d scratch the caller
  /// owns; bf16_activations: x holds bf16 values (forward_options).
  void forward(const Routing& r, const float* x, float* y_sorted, float* y, int threads, packed::Isa isa,
               bool bf16_activations) const {
    const packed::ForwardOptions opt = forward_options(isa, bf16_activations);
    python::forward(r, x, d_, y_sorted, y, threads, [&](const apex::detail::ExpertTask& t, const auto& xs, auto&& ys) {
      const auto& e = experts_[std::size_t(t.id)];
      if (gate_ == GateKind::silu)
        ExpertKind<SwiGLU<float>>::forward<packed::SiluGate>(e, {}, xs.data(), d_, nullptr, t.rows, ys.data(), d_, opt);
      else
        ExpertKind<ClampedSwiGLU<float>>::forward<packed::SiluGate>(e, biases_[std::size_t(t.id)], xs.data(), d_,
                                                                          nullptr, t.rows, ys.data(), d_, opt);
    });
  }

  /// Training forward: y, y_sorted (NK × d) and work (NK × train_work_cols) for the backward.
  void train_forward(const Routing& r, const float* x, const Adapters& ad, float* work, float* y_sorted, float* y,
                     int threads, packed::Isa isa) const {
    visit_kind([&](auto kind) {
      auto blocks = make_blocks(kind, ad, isa, false);
      const Index wc = train_work_cols(ad.r_gu, ad.r_down);
      Eigen::Map<Matrix<float>> w(work, r.plan.rows(), wc);
      python::forward(r, x, d_, y_sorted, y, threads, [&](const apex::detail::ExpertTask& t, const auto& xs, auto&& ys) {
        blocks.run[std::size_t(t.id)].forward_block(xs, w.middleRows(t.begin, t.rows), ys);
      });
    });
  }

  /// Training backward: dx (N × d), d_weights (N × K) and the adapters' gradients (written).
  void train_backward(const Routing& r, const float* x, const float* dy, const float* work, const float* y_sorted,
                      const Adapters& ad, float* dx, float* d_weights, int threads, packed::Isa isa) const {
    visit_kind([&](auto kind) {
      auto blocks = make_blocks(kind, ad, isa, true);
      const Index wc = train_work_cols(ad.r_gu, ad.r_down);
      Eigen::Map<const Matrix<float>> w(work, r.plan.rows(), wc);
      python::backward(r, x, dy, y_sorted, d_, dx, d_weights, threads,
                       [&](const apex::detail::ExpertTask& t, const auto& xs, const auto& dys, auto&& dxs) {
                         blocks.run[std::size_t(t.id)].backward_block(xs, w.middleRows(t.begin, t.rows), dys, dxs);
                       });
      blocks.write_gradients(ad, d_, f_);
    });
  }

 private:
  template <class Expert>
  struct Kind {
    using Act = typename ExpertKind<Expert>::Activation;
    using Block = LoraBlock<FrozenPackedExpert, Act>;
  };

  template <class Fn>
  void visit_kind(Fn&& fn) const {
    if (gate_ == GateKind::silu) fn(Kind<SwiGLU<float>>{});
    else fn(Kind<ClampedSwiGLU<float>>{});
  }

  /// Every expert's block of one call, with its adapters copied in and its gradients.
  template <class K>
  struct Blocks {
    std::vector<typename K::Act> acts;
    std::vector<LoraExpertAdapters<float>> values, grads;
    std::vector<typename K::Block> run;

    /// The gradients into the stacked tensors, expert by expert.
    void write_gradients(const Adapters& ad, Index d, Index f) const {
      for (std::size_t e = 0; e < grads.size(); ++e) {
        const auto& g = grads[e];
        if (ad.r_gu) {
          copy_out(g[LoraSlot::gate_up].a, ad.da_gu + e * ad.r_gu * d);
          copy_out(g[LoraSlot::gate_up].b, ad.db_gu + e * 2 * f * ad.r_gu);
        }
        if (ad.r_down) {
          copy_out(g[LoraSlot::down].a, ad.da_down + e * ad.r_down * f);
          copy_out(g[LoraSlot::down].b, ad.db_down + e * d * ad.r_down);
        }
      }
    }
    static void copy_out(const Matrix<float>& m, float* dst) {
      std::memcpy(dst, m.data(), std::size_t(m.size()) * sizeof(float));
    }
  };

  template <class K>
  Blocks<K> make_blocks(K, const Adapters& ad, packed::Isa isa, bool with_grads) const {
    const Index n = experts();
    Blocks<K> b;
    b.acts.reserve(std::size_t(n));
    b.values.resize(std::size_t(n));
    if (with_grads) b.grads.resize(std::size_t(n));
    const auto pair = [](const float* a, const float* bm, Index e, Index r, Index in, Index out) {
      LoraPair<float> p;
      p.a = Eigen::Map<const Matrix<float>>(a + e * r * in, r, in);
      p.b = Eigen::Map<const Matrix<float>>(bm + e * out * r, out, r);
      return p;
    };
    for (Index e = 0; e < n; ++e) {
      if constexpr (std::is_same_v<typename K::Act, ExpertKind<SwiGLU<float>>::Activation>) b.acts.push_back({});
      else b.acts.push_back(K::Act::of(biases_[std::size_t(e)]));
      auto& v = b.values[std::size_t(e)];
      if (ad.r_gu) v[LoraSlot::gate_up] = pair(ad.a_gu, ad.b_gu, e, ad.r_gu, d_, 2 * f_);
      if (ad.r_down) v[LoraSlot::down] = pair(ad.a_down, ad.b_down, e, ad.r_down, f_, d_);
      if (with_grads)
        for (int s = 0; s < kLoraSlots; ++s)
          if (!v.slot[std::size_t(s)].empty()) b.grads[std::size_t(e)].slot[std::size_t(s)] = apex::detail::zero_like(v.slot[std::size_t(s)]);
    }
    b.run.reserve(std::size_t(n));
    for (Index e = 0; e < n; ++e)
      b.run.emplace_back(FrozenPackedExpert{&experts_[std::size_t(e)], isa}, &b.acts[std::size_t(e)],
                         &b.values[std::size_t(e)], with_grads ? &b.grads[std::size_t(e)] : nullptr, ad.scale);
    return b;
  }

  GateKind gate_;
  std::vector<packed::PackedExpert> experts_;
  std::vector<ClampedBiases> biases_;  ///< E (clamped) or empty
  Index d_ = 0, f_ = 0;
  packed::ExpertDtypes types_;
};

}  // namespace apex::python
