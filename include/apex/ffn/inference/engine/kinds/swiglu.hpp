#pragma once
/// \file inference/engine/kinds/swiglu.hpp
/// SwiGLU's row of the expert-kind table (inference/engine/expert_kind.hpp):
/// its three projections packed, nothing kept as float, the gated activation
/// PackedMoE's `Activation` policy fused in the gate/up pass's epilogue
/// (kernels/epilogue.hpp); llama.cpp's plain MoE blocks (ffn_{gate,up,down}_exps
/// only); under adapters A = SiLU(G) ⊙ U, the training layer's expression.

#include <vector>

#include "../../../core/types.hpp"
#include "../../../io/gguf_architectures.hpp"
#include "../../../kernels/fused_expert.hpp"
#include "../../../layers/swiglu.hpp"
#include "../../../moe/expert_contract.hpp"
#include "../expert_kind.hpp"

namespace apex {

template <class T>
struct ExpertKind<SwiGLU<T>> {
  using Expert = SwiGLU<T>;
  static constexpr const char* kName = "swiglu";
  static constexpr const char* kLabel = "SwiGLU";
  using Options = NoExpertOptions;
  using Packed = SwiGLU<float>;

  // ---- frozen float parts: none
  using Extra = NoExpertExtra;
  static const SwiGLU<T>& weights(const Expert& e) { return e; }
  static SwiGLU<T>& weights(Expert& e) { return e; }
  static Extra extra(const Expert&) { return {}; }
  static std::vector<ExpertExtraTensor> extra_tensors(Index, Index) { return {}; }
  static std::vector<const RowVector<float>*> extra_rows(const Extra&) { return {}; }
  static Extra make_extra(std::vector<RowVector<float>>, const Options&) { return {}; }
  static void check_extra(const char*, const Extra&, Index, Index) {}

  // ---- packed forward: the fused kernel, any gated activation policy
  static constexpr bool kCustomActivation = true;
  static void check_kernel_options(const char*, const packed::ForwardOptions&) {}
  template <class Act>
  static void forward(const packed::PackedExpert& e, const Extra&, const float* x, Index ldx, const float*, Index m,
                      float* y, Index ldy, const packed::ForwardOptions& opt) {
    packed::forward<Act>(e, x, ldx, m, y, ldy, opt);
  }

  // ---- GGUF: the three weight tensors and nothing beside them
  struct Gguf {
    static std::vector<ExpertExtraTensor> extra_tensors(Index, Index) { return {}; }
    static Options options(const gguf::Architecture&) { return {}; }
    template <class Layer>
    static void configure(Layer&, const gguf::Architecture&) {}
    static void check_extras(const char*, const std::vector<Extra>&, const gguf::Architecture&) {}
  };

  // ---- under adapters: A = SiLU(G) ⊙ U, nothing frozen beside the weights
  struct Activation {
    using SideInput = NoSideInput;
    static Activation of(const Expert&) { return {}; }
    static Activation of(const Extra&) { return {}; }

    /// g, u: n × f arrays; a: n × f (written).
    template <class G, class U, class A>
    void forward(const ConstVectorRef<T>&, G&& g, U&& u, A&& a) const {
      a = g * array::sigmoid(g) * u;  // SwiGLU::forward_block's expression
    }
    /// dh: n × 2f, ∂L/∂A in its right half, becomes [∂L/∂G | ∂L/∂U].
    template <class Work, class DH>
    void backward(const ConstVectorRef<T>&, const Work& work, DH& dh, VectorRef<T>) const {
      detail::silu_glu_backward(work, dh);
    }
    template <class Y>
    void finish(Y&&) const {}
    void apply_to(Expert&) const {}
  };
};

}  // namespace apex
