#pragma once
/// \file float_experts.hpp
/// Float experts read in place from a Hugging Face experts module's 3-D
/// parameters, for every layout transformers' experts interface has
/// (integrations/moe.py):
///
///     gate_up (E, 2f, d), down (E, d, f)               Qwen2/3-MoE, OLMoE, Mixtral, DeepSeek-V3…
///     gate_up (E, d, 2f), down (E, f, d)               `is_transposed` (gpt-oss)
///     gate and up rows (columns) alternating           `is_concatenated = False` (gpt-oss)
///     gate_up_bias (E, 2f), down_bias (E, d)           `has_bias`
///
/// One expert, rows x (m × d), in the training layers' notation
/// (layers/swiglu.hpp, layers/clamped_swiglu.hpp):
///
///     [G | U] = x·W_guᵀ + b_gu          A = act(G, U)          y = A·W_downᵀ + b_down
///     act: SiLU(G) ⊙ U, or gpt-oss's (clamp(U, −L, L) + 1) ⊙ Ĝ·σ(αĜ), Ĝ = min(G, L)
///
/// and its backward, the forward in reverse, each expert adding into its own
/// slices of the weight gradients:
///
///     ∂L/∂A = dy·W_down       ∂L/∂W_down += dyᵀ·A        ∂L/∂b_down += Σ_rows dy
///     [∂L/∂G | ∂L/∂U] = act'(G, U) ∘ ∂L/∂A            (the training layers' own functions)
///     ∂L/∂x = [∂L/∂G | ∂L/∂U]·W_gu   ∂L/∂W_gu += [∂L/∂G | ∂L/∂U]ᵀ·x   ∂L/∂b_gu += Σ_rows [∂L/∂G | ∂L/∂U]
///
/// The products run over the tensors' memory as it is (nothing copied or
/// packed to keep): for an expert's rows below kStreamRows, products that
/// stream each weight row once (decode, small batches); above, the packed
/// engine's f32 tiles (kernels/packed_products.hpp).
/// The work row is [G | U | A] (3f), gate and up in natural order whatever
/// the storage's interleaving, as the activations read it.

#include <algorithm>
#include <cstring>
#include <string>

#include <apex/ffn/inference/engine/expert_kinds.hpp>
#include <apex/ffn/kernels/packed_products.hpp>
#include <apex/ffn/kernels/streamed_product.hpp>
#include <apex/ffn/layers/clamped_swiglu.hpp>
#include <apex/ffn/layers/gated_products.hpp>
#include <apex/ffn/layers/swiglu.hpp>

namespace apex::python {

/// The activation between the projections.
enum class GateKind { silu, clamped };

/// The kind named "silu" or "clamped"; ConfigError `where: unknown gate '…'` otherwise.
inline GateKind gate_kind(const char* where, const std::string& gate) {
  if (gate == "silu") return GateKind::silu;
  if (gate == "clamped") return GateKind::clamped;
  throw ConfigError(std::string(where) + ": unknown gate '" + gate + "'");
}

/// The layout of a module's expert tensors.
struct FloatLayout {
  Index experts = 0, d = 0, f = 0;
  bool transposed = false;   ///< gate_up (E, d, 2f), down (E, f, d)
  bool interleaved = false;  ///< gate and up alternate along the 2f axis
  bool has_bias = false;
  GateKind gate = GateKind::silu;
  float alpha = 1.702f, limit = 7.0f;  ///< the clamped gate's α and L
};

namespace detail_float {
struct GuTag;  ///< m × 2f: gate/up in storage order
struct DhTag;  ///< m × 2f: [∂L/∂G | ∂L/∂U]

/// Fewer rows than this (a decode step's or a small batch's rows of one
/// expert) take the streaming products below: each weight row is read once
/// from memory and reused from L1 for every row of `a`, where a GEMM (the
/// engine's or Eigen's) would first pack the whole weight matrix for a
/// handful of rows and so run at a fraction of the memory's speed.
inline constexpr Index kStreamRows = 16;
inline constexpr Index kStreamCols = 256;  ///< out columns kept in L1 by the nn product (m × 256 floats)

/// out (m × n) = a (m × K) · Wᵀ, W: n × K row-major. Few rows: dot
/// products four weight rows at a time, each weight row read from memory
/// once and from L1 for the other rows (kernels/streamed_product.hpp);
/// else the engine's f32 tiles on W packed a chunk of panels at a time
/// (Eigen on CPUs without AVX2). Called from
/// inside the per-expert tasks, so always single-threaded: not the training
/// layers' rule, which hands a lone product to Eigen's own threads.
template <class A, class W, class Out>
void product_nt(const A& a, const W& w, Out&& out) {
  const Index m = a.rows(), n = w.rows(), K = w.cols();
  if (m >= kStreamRows) {
    const packed::TrainingEngine e = packed::training_engine();
    if (!e.enabled) return apex::detail::linear_nt(a, w, out, false);  // no AVX2: Eigen
    packed::linear_nt(e.isa, a.data(), a.outerStride(), m, w.data(), w.outerStride(), n, K, out.data(),
                      out.outerStride());
    return;
  }
  const packed::TrainingEngine e = packed::training_engine();
  packed::streamed_product_nt(e.enabled ? e.isa : packed::Isa::scalar, a.data(), a.outerStride(), m, w.data(),
                              w.outerStride(), n, K, out.data(), out.outerStride());
}

/// out (m × n) = a (m × K) · W, W: K × n row-major. Few rows: rank-1
/// updates out += a(:, k)·W(k, :) over column blocks of kStreamCols, so the
/// block of out stays in L1 while W streams; else as product_nt.
template <class A, class W, class Out>
void product_nn(const A& a, const W& w, Out&& out) {
  const Index m = a.rows(), n = w.cols(), K = w.rows();
  if (m < kStreamRows) {
    for (Index c0 = 0; c0 < n; c0 += kStreamCols) {
      const Index nc = std::min(kStreamCols, n - c0);
      for (Index i = 0; i < m; ++i) std::fill_n(out.data() + i * out.outerStride() + c0, nc, 0.0f);
      for (Index k = 0; k < K; ++k) {
        const float* wk = w.data() + k * w.outerStride() + c0;
        for (Index i = 0; i < m; ++i) {
          const float aik = a.data()[i * a.outerStride() + k];
          float* oi = out.data() + i * out.outerStride() + c0;
#pragma omp simd
          for (Index c = 0; c < nc; ++c) oi[c] += aik * wk[c];
        }
      }
    }
    return;
  }
  const packed::TrainingEngine e = packed::training_engine();
  if (!e.enabled) {  // no AVX2: Eigen
    out.noalias() = a * w;
    return;
  }
  packed::linear_nn(e.isa, a.data(), a.outerStride(), m, w.data(), w.outerStride(), n, K, out.data(),
                    out.outerStride());
}

/// Storage order (gate, up alternating) ↔ natural order ([gate | up]) of an m × 2f block.
template <class Src, class Dst>
void deinterleave(const Src& src, Dst&& dst, Index f) {
  for (Index t = 0; t < src.rows(); ++t)
    for (Index j = 0; j < f; ++j) dst(t, j) = src(t, 2 * j), dst(t, f + j) = src(t, 2 * j + 1);
}
template <class Src, class Dst>
void interleave(const Src& src, Dst&& dst, Index f) {
  for (Index t = 0; t < src.rows(); ++t)
    for (Index j = 0; j < f; ++j) dst(t, 2 * j) = src(t, j), dst(t, 2 * j + 1) = src(t, f + j);
}
}  // namespace detail_float

/// The experts of one module: pointers into its tensors and, for a
/// backward, into the gradients to write (each expert its own slices; a
/// null gradient is not computed: frozen weights cost no weight products).
struct FloatExperts {
  FloatLayout l;
  const float* gate_up = nullptr;       ///< E × (2f × d), or E × (d × 2f) transposed
  const float* down = nullptr;          ///< E × (d × f), or E × (f × d) transposed
  const float* gate_up_bias = nullptr;  ///< E × 2f (storage order) or null
  const float* down_bias = nullptr;     ///< E × d or null
  float *d_gate_up = nullptr, *d_down = nullptr, *d_gate_up_bias = nullptr, *d_down_bias = nullptr;

  Index work_cols() const { return 3 * l.f; }

  /// x: m × d (rows of expert e), work: m × 3f, y: m × d.
  template <class X, class Work, class Y>
  void forward(Index e, const X& x, Work&& work, Y&& y) const {
    const Index f = l.f, m = x.rows();
    if (m == 0) return;
    auto gu = work.leftCols(2 * f);
    if (l.interleaved) {
      auto tmp = apex::detail::thread_workspace<float, detail_float::GuTag>(m, 2 * f);
      project_gate_up(e, x, tmp);
      detail_float::deinterleave(tmp, gu, f);
    } else {
      project_gate_up(e, x, gu);
    }
    if (gate_up_bias) {  // G += b_gate, U += b_up
      Matrix<float> b(1, 2 * f);
      natural_bias(e, b);
      gu.rowwise() += b.row(0);
    }
    auto g = work.leftCols(f).array();
    auto u = work.middleCols(f, f).array();
    auto a = work.rightCols(f).array();
    if (l.gate == GateKind::silu) ExpertKind<SwiGLU<float>>::Activation{}.forward(ConstVectorRef<float>(Vector<float>()), g, u, a);
    else apex::detail::clamped_glu(g, u, a, l.alpha, l.limit);
    if (l.transposed) detail_float::product_nn(work.rightCols(f), down_t(e), y);
    else detail_float::product_nt(work.rightCols(f), down_nt(e), y);
    if (down_bias) y.rowwise() += Eigen::Map<const RowVector<float>>(down_bias + e * l.d, l.d);
  }

  /// x, work as forward left them, dy: m × d (∂L/∂y of these rows), dx: m × d (written).
  template <class X, class Work, class DY, class DX>
  void backward(Index e, const X& x, const Work& work, const DY& dy, DX&& dx) const {
    const Index f = l.f, m = x.rows(), d = l.d;
    if (m == 0) return;
    auto dh = apex::detail::thread_workspace<float, detail_float::DhTag>(m, 2 * f);  // [dG | dU]
    const auto a = work.rightCols(f);
    // ∂L/∂A = dy·W_down (in the dU half until act' replaces it), ∂L/∂W_down += dyᵀ·A, ∂L/∂b_down += Σ dy
    if (l.transposed) {
      detail_float::product_nt(dy, down_t(e), dh.rightCols(f));
      if (d_down) Eigen::Map<Matrix<float>>(d_down + e * f * d, f, d).noalias() += a.transpose() * dy;
    } else {
      detail_float::product_nn(dy, down_nt(e), dh.rightCols(f));
      if (d_down) Eigen::Map<Matrix<float>>(d_down + e * d * f, d, f).noalias() += dy.transpose() * a;
    }
    if (d_down_bias) Eigen::Map<RowVector<float>>(d_down_bias + e * d, d) += dy.colwise().sum();
    if (l.gate == GateKind::silu) apex::detail::silu_glu_backward(work, dh);
    else apex::detail::clamped_glu_backward(work, dh, l.alpha, l.limit);
    // ∂L/∂x = dH·W_gu, ∂L/∂W_gu += dHᵀ·x, ∂L/∂b_gu += Σ dH (dH in storage order)
    if (l.interleaved) {
      auto tmp = apex::detail::thread_workspace<float, detail_float::GuTag>(m, 2 * f);
      detail_float::interleave(dh, tmp, f);
      gate_up_backward(e, x, tmp, dx);
    } else {
      gate_up_backward(e, x, dh, dx);
    }
  }

 private:
  Eigen::Map<const Matrix<float>> gate_up_nt(Index e) const { return {gate_up + e * 2 * l.f * l.d, 2 * l.f, l.d}; }
  Eigen::Map<const Matrix<float>> gate_up_t(Index e) const { return {gate_up + e * 2 * l.f * l.d, l.d, 2 * l.f}; }
  Eigen::Map<const Matrix<float>> down_nt(Index e) const { return {down + e * l.d * l.f, l.d, l.f}; }
  Eigen::Map<const Matrix<float>> down_t(Index e) const { return {down + e * l.d * l.f, l.f, l.d}; }

  /// out (m × 2f, storage order) = x·W_guᵀ.
  template <class X, class Out>
  void project_gate_up(Index e, const X& x, Out&& out) const {
    if (l.transposed) detail_float::product_nn(x, gate_up_t(e), out);
    else detail_float::product_nt(x, gate_up_nt(e), out);
  }
  /// The gate/up bias of expert e in natural order ([b_gate | b_up]).
  void natural_bias(Index e, Matrix<float>& b) const {
    const Eigen::Map<const Matrix<float>> src(gate_up_bias + e * 2 * l.f, 1, 2 * l.f);
    if (l.interleaved) detail_float::deinterleave(src, b, l.f);
    else b = src;
  }
  /// dx = dH·W_gu and the gate/up weight (and bias) gradients; dh in storage order.
  template <class X, class DH, class DX>
  void gate_up_backward(Index e, const X& x, const DH& dh, DX&& dx) const {
    const Index f = l.f, d = l.d;
    if (l.transposed) {
      detail_float::product_nt(dh, gate_up_t(e), dx);
      if (d_gate_up) Eigen::Map<Matrix<float>>(d_gate_up + e * 2 * f * d, d, 2 * f).noalias() += x.transpose() * dh;
    } else {
      detail_float::product_nn(dh, gate_up_nt(e), dx);
      if (d_gate_up) Eigen::Map<Matrix<float>>(d_gate_up + e * 2 * f * d, 2 * f, d).noalias() += dh.transpose() * x;
    }
    if (d_gate_up_bias) Eigen::Map<RowVector<float>>(d_gate_up_bias + e * 2 * f, 2 * f) += dh.colwise().sum();
  }
};

}  // namespace apex::python
