#pragma once
/// \file kernels/packed_weights.hpp
/// One SwiGLU expert's weights packed once for the kernels of kernels/fused_expert.hpp,
/// in any type of the weight-type table (kernels/weight_types.hpp: f32, bf16
/// and ggml's block formats), gate/up and down each of its own type.
///
/// The kernels compute 32 output lanes at a time (two 16-float AVX-512
/// vectors, four AVX2 vectors) over a reduction of length K, reading for each
/// k one 32-lane slab of weights. A *panel* is those slabs for k = 0…K−1,
/// stored contiguously, so a kernel streams it front to back:
///
///   float:  panel[k·32 + lane]                         K × 32 floats
///   bf16:   panel[(k/2)·64 + lane·2 + (k mod 2)]        ⌈K/2⌉ × 32 pairs
///
/// The bf16 form keeps the two k of a pair next to each other in one 32-bit
/// lane (the "VNNI" order `vdpbf16ps` multiplies); the shift-widening kernels
/// read the same bytes, the even k by `<< 16`, the odd k by masking the low
/// half. Every slab is 128 bytes and every panel starts on a 64-byte boundary,
/// so all weight loads are aligned.
///
/// Gate and up are interleaved: panel p of `gate_up` holds, in lanes 0–15, the
/// gate rows 16p…16p+15 and, in lanes 16–31, the up rows of the same outputs,
/// so one pass over the panel yields G and U of 16 hidden units and SiLU(G)·U
/// is formed in registers. Panel q of `down` holds rows 32q…32q+31 of W_down
/// (output features of the expert). Rows past f (resp. d) and the k padding
/// of an odd bf16 K are zero, so they contribute exact zeros.
///
/// Sizes: gate_up is ⌈f/16⌉ panels of K = d, down ⌈d/32⌉ panels of K = f;
/// padding costs at most 15 hidden units and 31 output features. The layouts
/// above are the f32 and bf16 entries of kernels/weight_types.hpp; the block
/// formats keep the same panels with their codes grouped by block
/// (kernels/quant_layout.hpp). A panel (kernels/panel_matrix.hpp) holds a
/// code array in its type's layout and a per-block scale array (empty for
/// f32 and bf16), both sized from the table.

#include <cstddef>
#include <string>

#include "../core/checked_size.hpp"
#include "../core/errors.hpp"
#include "../core/types.hpp"
#include "aligned_array.hpp"
#include "panel_matrix.hpp"
#include "weight_types.hpp"

namespace apex::packed {

/// The storage types of one expert's two matrices. A Dtype converts to the
/// pair of it (both matrices alike); a Q4_K_M file's experts are {q4_k,
/// q6_k} in some layers.
struct ExpertDtypes {
  Dtype gate_up = Dtype::f32;
  Dtype down = Dtype::f32;
  ExpertDtypes() = default;
  ExpertDtypes(Dtype both) : gate_up(both), down(both) {}  // NOLINT: a type is the pair of it
  ExpertDtypes(Dtype gu, Dtype dn) : gate_up(gu), down(dn) {}
  friend bool operator==(ExpertDtypes a, ExpertDtypes b) { return a.gate_up == b.gate_up && a.down == b.down; }
  friend bool operator!=(ExpertDtypes a, ExpertDtypes b) { return !(a == b); }
};

/// "q4_k" for a uniform pair, "q4_k/q6_k" (gate_up/down) otherwise.
inline std::string dtypes_name(ExpertDtypes t) {
  return t.gate_up == t.down ? std::string(dtype_name(t.gate_up))
                             : std::string(dtype_name(t.gate_up)) + "/" + dtype_name(t.down);
}

/// One SwiGLU expert, y = (SiLU(x·W_gateᵀ) ⊙ x·W_upᵀ)·W_downᵀ, packed.
/// Immutable once built: to follow changed float weights, pack again. The
/// weights are owned, or read-only views into a mapped pack-once file
/// (from_panels; inference/files/pack_once/file.hpp), which copies share.
class PackedExpert {
 public:
  /// Number of hidden units per gate/up panel (the other 16 lanes are up).
  static constexpr Index kHiddenPerPanel = 16;
  /// Output features per down panel.
  static constexpr Index kOutPerPanel = 32;

  /// w_gate, w_up: f × d, w_down: d × f (PyTorch `[out, in]`, as SwiGLU stores
  /// them), quantized or rounded to `dtypes`. Checked in the library's order
  /// (docs/error_model.md#order-of-checks), whatever the types: ShapeError if
  /// the shapes disagree, then ConfigError if d or f is 0 or is not whole
  /// blocks of a block format, then ValueError for a weight the type cannot
  /// hold (NaN, Inf, a block beyond the format's range; f16: |w| ≥ 65520),
  /// naming the matrix and row.
  PackedExpert(const ConstMatrixRef<float>& w_gate, const ConstMatrixRef<float>& w_up,
               const ConstMatrixRef<float>& w_down, ExpertDtypes dtypes)
      : PackedExpert("PackedExpert", agreed_d(w_gate, w_up, w_down), w_gate.rows(), dtypes) {
    // One lane is one weight row (row-major `[out, in]`: contiguous).
    const char* matrix = "w_gate";
    Index row = 0;
    try {
      for (Index j = 0; j < f_; ++j) {
        const Index p = j / kHiddenPerPanel, l = j % kHiddenPerPanel;
        row = j, matrix = "w_gate";
        gate_up_.pack_row(p, l, w_gate.row(j).data());
        matrix = "w_up";
        gate_up_.pack_row(p, kHiddenPerPanel + l, w_up.row(j).data());
      }
      matrix = "w_down";
      for (Index i = 0; i < d_; ++i) row = i, down_.pack_row(i / kOutPerPanel, i % kOutPerPanel, w_down.row(i).data());
    } catch (const ValueError& e) {
      throw ValueError(std::string("PackedExpert: ") + matrix + " row " + std::to_string(row) + ": " + e.what());
    }
  }

  /// An expert from its three tensors in file form (row-major `[out, in]`,
  /// each row the blocks of its type: PanelMatrix::row_bytes), the bits
  /// moved unchanged. gate, up: f rows of d weights; down: d rows of f.
  /// ValueError naming the matrix, row and block for a block whose values
  /// would not be finite (PanelMatrix::put_row).
  static PackedExpert from_file_rows(Index d, Index f, ExpertDtypes dtypes, const std::byte* gate,
                                     const std::byte* up, const std::byte* down) {
    PackedExpert e("PackedExpert::from_file_rows", d, f, dtypes);
    const Index gu_row = e.gate_up_.row_bytes(), down_row = e.down_.row_bytes();
    const char* matrix = "gate";
    Index row = 0;
    try {
      for (Index j = 0; j < f; ++j) {
        const Index p = j / kHiddenPerPanel, l = j % kHiddenPerPanel;
        row = j, matrix = "gate";
        e.gate_up_.put_row(p, l, gate + j * gu_row);
        matrix = "up";
        e.gate_up_.put_row(p, kHiddenPerPanel + l, up + j * gu_row);
      }
      matrix = "down";
      for (Index i = 0; i < d; ++i) row = i, e.down_.put_row(i / kOutPerPanel, i % kOutPerPanel, down + i * down_row);
    } catch (const ValueError& x) {
      throw ValueError(std::string("PackedExpert::from_file_rows: ") + matrix + " row " + std::to_string(row) + ": " +
                       x.what());
    }
    return e;
  }
  /// An expert over matrices already in panel order (owned or views into a
  /// mapped file: PanelMatrix::view), taken as they are. ShapeError naming
  /// `where` unless gate_up is ⌈f/16⌉ panels of K = d and down ⌈d/32⌉ panels
  /// of K = f; ConfigError for a d or f below 1.
  static PackedExpert from_panels(const char* where, Index d, Index f, PanelMatrix gate_up, PanelMatrix down) {
    const auto check = [&](const char* what, const PanelMatrix& m, Index k, Index panels) {
      if (m.k() != k || m.panels() != panels)
        throw ShapeError(std::string(where) + ": " + what + " has " + std::to_string(m.panels()) + " panels of K = " +
                         std::to_string(m.k()) + "; a d_model " + std::to_string(d) + ", d_ffn " + std::to_string(f) +
                         " expert needs " + std::to_string(panels) + " of K = " + std::to_string(k));
    };
    PackedExpert e(where, d, f);
    check("gate_up", gate_up, d, (f + kHiddenPerPanel - 1) / kHiddenPerPanel);
    check("down", down, f, (d + kOutPerPanel - 1) / kOutPerPanel);
    e.dtypes_ = {gate_up.dtype(), down.dtype()};
    e.gate_up_ = std::move(gate_up);
    e.down_ = std::move(down);
    return e;
  }
  /// True if the weights are views into a mapped file.
  bool mapped() const { return gate_up_.mapped() || down_.mapped(); }
  /// The same expert in owned storage (a copy of mapped weights).
  PackedExpert to_owned() const {
    PackedExpert e = *this;  // owned matrices copied once, mapped ones shared until copied here
    if (gate_up_.mapped()) e.gate_up_ = gate_up_.to_owned();
    if (down_.mapped()) e.down_ = down_.to_owned();
    return e;
  }

  /// The three tensors in file form (the inverse of from_file_rows): gate and
  /// up f × gate_up().row_bytes() bytes, down d × down().row_bytes().
  void file_rows(std::byte* gate, std::byte* up, std::byte* down) const {
    const Index gu_row = gate_up_.row_bytes(), down_row = down_.row_bytes();
    for (Index j = 0; j < f_; ++j) {
      const Index p = j / kHiddenPerPanel, l = j % kHiddenPerPanel;
      gate_up_.get_row(p, l, gate + j * gu_row);
      gate_up_.get_row(p, kHiddenPerPanel + l, up + j * gu_row);
    }
    for (Index i = 0; i < d_; ++i) down_.get_row(i / kOutPerPanel, i % kOutPerPanel, down + i * down_row);
  }

  /// Bytes of a packed d × f expert of `dtypes`, from the table, without
  /// allocating; ConfigError naming `where` if the count overflows.
  static Index bytes_for(const char* where, ExpertDtypes dtypes, Index d, Index f) {
    // Panel counts without forming f + 15 or d + 31 (ceil(n/k) = n/k + [n mod k ≠ 0]).
    const auto panels = [](Index n, Index k) { return n / k + (n % k != 0); };
    return apex::detail::checked_sum(
        where, "expert bytes",
        PanelMatrix::bytes_for(where, "gate_up bytes", dtypes.gate_up, d, panels(f, kHiddenPerPanel)),
        PanelMatrix::bytes_for(where, "down bytes", dtypes.down, f, panels(d, kOutPerPanel)));
  }

  Index d_model() const { return d_; }
  Index d_ffn() const { return f_; }
  /// The gate/up type (the down type may differ: dtypes()).
  Dtype dtype() const { return dtypes_.gate_up; }
  ExpertDtypes dtypes() const { return dtypes_; }
  /// Bytes of packed weights (what a forward streams), padding included.
  std::size_t bytes() const { return gate_up_.bytes() + down_.bytes(); }

  const PanelMatrix& gate_up() const { return gate_up_; }
  const PanelMatrix& down() const { return down_; }

  /// The weights as float, `[out, in]`: exactly the packed values (for bf16,
  /// the bf16-rounded inputs; for a block format, ggml's dequantized
  /// values). w_gate, w_up: f × d, w_down: d × f.
  Matrix<float> w_gate() const { return unpack_gate_up(0); }
  Matrix<float> w_up() const { return unpack_gate_up(kHiddenPerPanel); }
  Matrix<float> w_down() const {
    Matrix<float> w(d_, f_);  // d × f
    for (Index i = 0; i < d_; ++i) down_.unpack_row(i / kOutPerPanel, i % kOutPerPanel, w.row(i).data());
    return w;
  }

 private:
  /// d of w_gate (f × d), once w_up (f × d) and w_down (d × f) agree with it: ShapeError otherwise.
  static Index agreed_d(const ConstMatrixRef<float>& w_gate, const ConstMatrixRef<float>& w_up,
                        const ConstMatrixRef<float>& w_down) {
    apex::detail::check_shape("PackedExpert", "w_up", w_up, w_gate.rows(), w_gate.cols());
    apex::detail::check_shape("PackedExpert", "w_down", w_down, w_gate.cols(), w_gate.rows());
    return w_gate.cols();
  }
  // d and f checked, no storage yet (from_panels adds views).
  PackedExpert(const char* where, Index d, Index f) : d_(d), f_(f) {
    if (d_ < 1 || f_ < 1) {
      throw ConfigError(std::string(where) + ": argument 'w_gate' has shape [" + std::to_string(f_) + " x " +
                        std::to_string(d_) + "], d_model and d_ffn must be at least 1");
    }
  }
  PackedExpert(const char* where, Index d, Index f, ExpertDtypes dtypes) : PackedExpert(where, d, f) {
    dtypes_ = dtypes;
    gate_up_ = PanelMatrix(dtypes.gate_up, d_, (f_ + kHiddenPerPanel - 1) / kHiddenPerPanel);
    down_ = PanelMatrix(dtypes.down, f_, (d_ + kOutPerPanel - 1) / kOutPerPanel);
  }
  Matrix<float> unpack_gate_up(Index lane0) const {
    Matrix<float> w(f_, d_);  // f × d
    for (Index j = 0; j < f_; ++j)
      gate_up_.unpack_row(j / kHiddenPerPanel, lane0 + j % kHiddenPerPanel, w.row(j).data());
    return w;
  }

  Index d_, f_;
  ExpertDtypes dtypes_;
  PanelMatrix gate_up_;  // ⌈f/16⌉ panels × K = d: lanes 0–15 gate, 16–31 up
  PanelMatrix down_;     // ⌈d/32⌉ panels × K = f: lanes = W_down rows
};

}  // namespace apex::packed
