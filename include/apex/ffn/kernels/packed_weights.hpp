#pragma once
/// \file kernels/packed_weights.hpp
/// One SwiGLU expert's weights packed once for the kernels of kernels/fused_expert.hpp,
/// in any type of the weight-type table (kernels/weight_types.hpp: f32, bf16).
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
/// above are the f32 and bf16 entries of kernels/weight_types.hpp; a panel
/// holds a code array in its type's layout and a per-block scale array
/// (empty for f32 and bf16), both sized from the table.

#include <cstddef>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <utility>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "../core/checked_size.hpp"
#include "../core/errors.hpp"
#include "../core/types.hpp"
#include "bf16_vectors.hpp"
#include "weight_types.hpp"

namespace apex::packed {

namespace detail {

/// Zero-initialised array of a trivial type on a 64-byte boundary (the
/// kernels' aligned loads need it; `std::vector` guarantees only 16).
///
/// Arrays of 2 MiB or more are placed on 2 MiB boundaries and, on Linux,
/// offered to transparent huge pages (`madvise`; a no-op where THP is off).
/// A decode step streams every expert's weights once: with 4 KiB pages that
/// is one TLB miss per 4 KiB, and hardware prefetchers stop at each 4 KiB
/// boundary, which costs a measurable share of the memory bandwidth.
template <class T>
class AlignedArray {
 public:
  static constexpr std::size_t kAlign = 64;
  static constexpr std::size_t kHugePage = std::size_t(2) << 20;
  AlignedArray() = default;
  explicit AlignedArray(Index n) : n_(n) {
    if (n == 0) return;
    const std::size_t bytes = std::size_t(n) * sizeof(T);
    const std::size_t align = bytes >= kHugePage ? kHugePage : kAlign;
    void* raw = ::operator new(bytes, std::align_val_t(align));
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (align == kHugePage) ::madvise(raw, bytes / kHugePage * kHugePage, MADV_HUGEPAGE);  // advice only
#endif
    p_ = std::unique_ptr<T, Free>(static_cast<T*>(raw), Free{align});
    std::uninitialized_value_construct_n(p_.get(), std::size_t(n));  // zeros
  }
  AlignedArray(const AlignedArray& o) : AlignedArray(o.n_) {
    if (n_) std::memcpy(p_.get(), o.p_.get(), std::size_t(n_) * sizeof(T));
  }
  AlignedArray(AlignedArray&& o) noexcept : p_(std::move(o.p_)), n_(std::exchange(o.n_, 0)) {}
  AlignedArray& operator=(AlignedArray o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    return *this;
  }
  T* data() { return p_.get(); }
  const T* data() const { return p_.get(); }
  Index size() const { return n_; }

 private:
  struct Free {
    std::size_t align = kAlign;
    void operator()(T* p) const { ::operator delete(p, std::align_val_t(align)); }
  };
  std::unique_ptr<T, Free> p_;
  Index n_ = 0;
};

/// buf's data, reallocated (zeroed) to at least n elements if it is smaller.
template <class T>
T* grow(AlignedArray<T>& buf, Index n) {
  if (buf.size() < n) buf = AlignedArray<T>(n);
  return buf.data();
}

}  // namespace detail

/// A K × (32·panels) weight block in the panel order of its type's table
/// entry. Lane `l` of panel `p` is logical output `32p + l`; what that
/// output is (a gate row, an up row, a down row) is the owner's business.
class PanelMatrix {
 public:
  static constexpr Index kLanes = kPanelLanes;

  /// Bytes of a matrix of `panels` panels of reduction length k, codes and
  /// scales, computed without allocating; ConfigError naming `where` and
  /// `what` past the index range.
  static Index bytes_for(const char* where, const char* what, Dtype dtype, Index k, Index panels) {
    return visit_dtype(dtype, [&](auto tag) {
      using W = WeightType<decltype(tag)::value>;
      const Index blocks = detail::padded_k<decltype(tag)::value>(where, k) / W::kBlockWeights;
      return apex::detail::checked_product(where, what, {panels, blocks, kLanes, W::kBlockBytes});
    });
  }

  PanelMatrix() = default;
  PanelMatrix(Dtype dtype, Index k, Index panels) : dtype_(dtype), k_(k), panels_(panels) {
    constexpr const char* where = "PanelMatrix";
    bytes_for(where, "packed weights (panels x K x 32 lanes x bytes)", dtype, k, panels);  // fits, checked
    visit_dtype(dtype, [&](auto tag) {
      using W = WeightType<decltype(tag)::value>;
      kpad_ = detail::padded_k<decltype(tag)::value>(where, k);
      const Index blocks = kpad_ / W::kBlockWeights;  // per lane
      panel_bytes_ = blocks * kLanes * (W::kBlockBytes - W::kScaleBytes);
      scale_bytes_ = blocks * kLanes * W::kScaleBytes;
    });
    codes_ = detail::AlignedArray<std::byte>(panels_ * panel_bytes_);
    scales_ = detail::AlignedArray<std::byte>(panels_ * scale_bytes_);
  }

  Dtype dtype() const { return dtype_; }
  Index k() const { return k_; }           ///< reduction length
  Index k_padded() const { return kpad_; } ///< k rounded up to whole groups and blocks of the type
  Index panels() const { return panels_; }
  Index panel_size() const { return kpad_ * kLanes; }  ///< weights per panel, padding included
  /// Bytes of codes and scales (what a pass over the matrix reads).
  std::size_t bytes() const { return std::size_t(panels_ * (panel_bytes_ + scale_bytes_)); }

  /// Panel p's codes in type T's layout, 64-byte aligned; T must be the
  /// matrix's dtype (checked by eigen_assert).
  template <Dtype T>
  const typename WeightType<T>::Element* panel(Index p) const {
    eigen_assert(T == dtype_);
    return reinterpret_cast<const typename WeightType<T>::Element*>(codes_.data() + p * panel_bytes_);
  }
  /// Panel p's per-block scales (nullptr-sized for unscaled types).
  const std::byte* scales(Index p) const { return scales_.data() + p * scale_bytes_; }
  /// The f32 and bf16 panels under their earlier names.
  const float* f32_panel(Index p) const { return panel<Dtype::f32>(p); }
  const bf16* bf16_panel(Index p) const { return panel<Dtype::bf16>(p); }

  /// Element offset of (k, lane) inside a panel (f32 and bf16: a block
  /// format's codes have no per-weight offset; ConfigError for one).
  Index offset(Index k, Index lane) const {
    return visit_dtype(dtype_, [&](auto tag) -> Index {
      using W = WeightType<decltype(tag)::value>;
      if constexpr (W::kQuantized) {
        throw ConfigError(std::string("PanelMatrix::offset: ") + W::kName + " codes have no per-weight offset");
      } else {
        return W::offset(k, lane);
      }
    });
  }
  /// Bytes of one lane's row in its file form: K / B blocks of the type's
  /// block bytes (4 a weight for f32, 2 for bf16, ggml's blocks otherwise).
  Index row_bytes() const {
    return visit_dtype(dtype_, [&](auto tag) {
      using W = WeightType<decltype(tag)::value>;
      return kpad_ / W::kBlockWeights * Index(sizeof(typename W::Block));
    });
  }
  /// Lane `lane` of panel p from a file row (row_bytes() bytes, the blocks
  /// of a GGUF or safetensors row of this type): the bits are moved, not
  /// converted.
  void put_row(Index p, Index lane, const std::byte* row) {
    visit_dtype(dtype_, [&](auto tag) {
      using W = WeightType<decltype(tag)::value>;
      for (Index b = 0; b < kpad_ / W::kBlockWeights; ++b) {
        typename W::Block blk;
        std::memcpy(&blk, row + b * Index(sizeof blk), sizeof blk);
        W::put_block(blk, b, lane, codes(p, tag), scales_.data() + p * scale_bytes_);
      }
    });
  }
  /// The file row of lane `lane` of panel p (the inverse of put_row).
  void get_row(Index p, Index lane, std::byte* row) const {
    visit_dtype(dtype_, [&](auto tag) {
      using W = WeightType<decltype(tag)::value>;
      for (Index b = 0; b < kpad_ / W::kBlockWeights; ++b) {
        const typename W::Block blk = W::get_block(panel<decltype(tag)::value>(p), scales(p), b, lane);
        std::memcpy(row + b * Index(sizeof blk), &blk, sizeof blk);
      }
    });
  }
  /// Lane `lane` of panel p as k floats: exactly the stored values (a block
  /// format's through ggml's dequantizer).
  void unpack_row(Index p, Index lane, float* w) const {
    visit_dtype(dtype_, [&](auto tag) {
      using W = WeightType<decltype(tag)::value>;
      if constexpr (W::kQuantized) {
        W::unpack_row(panel<decltype(tag)::value>(p), scales(p), k_, lane, w);
      } else {
        for (Index k = 0; k < k_; ++k) w[k] = W::weight(panel<decltype(tag)::value>(p), scales(p), k, lane);
      }
    });
  }
  /// Packs lane `lane` of panel p from w[0..k) (the type's rounding).
  void pack_row(Index p, Index lane, const float* w) {
    visit_dtype(dtype_, [&](auto tag) {
      using W = WeightType<decltype(tag)::value>;
      W::pack_row(w, k_, lane, codes(p, tag), scales_.data() + p * scale_bytes_);
    });
  }
  /// The stored weight (k, lane) of panel p, as float.
  float get(Index p, Index k, Index lane) const {
    return visit_dtype(dtype_, [&](auto tag) {
      return WeightType<decltype(tag)::value>::weight(panel<decltype(tag)::value>(p), scales(p), k, lane);
    });
  }

 private:
  template <class Tag>
  typename WeightType<Tag::value>::Element* codes(Index p, Tag) {
    return reinterpret_cast<typename WeightType<Tag::value>::Element*>(codes_.data() + p * panel_bytes_);
  }

  Dtype dtype_ = Dtype::f32;
  Index k_ = 0, kpad_ = 0, panels_ = 0;
  Index panel_bytes_ = 0, scale_bytes_ = 0;  // per panel
  detail::AlignedArray<std::byte> codes_;    // panels × panel_bytes_
  detail::AlignedArray<std::byte> scales_;   // panels × scale_bytes_
};

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
/// Immutable once built: to follow changed float weights, pack again.
class PackedExpert {
 public:
  /// Number of hidden units per gate/up panel (the other 16 lanes are up).
  static constexpr Index kHiddenPerPanel = 16;
  /// Output features per down panel.
  static constexpr Index kOutPerPanel = 32;

  /// w_gate, w_up: f × d, w_down: d × f (PyTorch `[out, in]`, as SwiGLU stores
  /// them), quantized or rounded to `dtypes`. ConfigError if d or f is 0 or
  /// is not whole blocks of a block format, ShapeError if the shapes disagree.
  PackedExpert(const ConstMatrixRef<float>& w_gate, const ConstMatrixRef<float>& w_up,
               const ConstMatrixRef<float>& w_down, ExpertDtypes dtypes)
      : PackedExpert("PackedExpert", w_gate.cols(), w_gate.rows(), dtypes) {
    constexpr const char* where = "PackedExpert";
    apex::detail::check_shape(where, "w_up", w_up, f_, d_);
    apex::detail::check_shape(where, "w_down", w_down, d_, f_);
    // One lane is one weight row (row-major `[out, in]`: contiguous).
    for (Index j = 0; j < f_; ++j) {
      const Index p = j / kHiddenPerPanel, l = j % kHiddenPerPanel;
      gate_up_.pack_row(p, l, w_gate.row(j).data());
      gate_up_.pack_row(p, kHiddenPerPanel + l, w_up.row(j).data());
    }
    for (Index i = 0; i < d_; ++i) down_.pack_row(i / kOutPerPanel, i % kOutPerPanel, w_down.row(i).data());
  }

  /// An expert from its three tensors in file form (row-major `[out, in]`,
  /// each row the blocks of its type: PanelMatrix::row_bytes), the bits
  /// moved unchanged. gate, up: f rows of d weights; down: d rows of f.
  static PackedExpert from_file_rows(Index d, Index f, ExpertDtypes dtypes, const std::byte* gate,
                                     const std::byte* up, const std::byte* down) {
    PackedExpert e("PackedExpert::from_file_rows", d, f, dtypes);
    const Index gu_row = e.gate_up_.row_bytes(), down_row = e.down_.row_bytes();
    for (Index j = 0; j < f; ++j) {
      const Index p = j / kHiddenPerPanel, l = j % kHiddenPerPanel;
      e.gate_up_.put_row(p, l, gate + j * gu_row);
      e.gate_up_.put_row(p, kHiddenPerPanel + l, up + j * gu_row);
    }
    for (Index i = 0; i < d; ++i) e.down_.put_row(i / kOutPerPanel, i % kOutPerPanel, down + i * down_row);
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
  PackedExpert(const char* where, Index d, Index f, ExpertDtypes dtypes) : d_(d), f_(f), dtypes_(dtypes) {
    if (d_ < 1 || f_ < 1) {
      throw ConfigError(std::string(where) + ": argument 'w_gate' has shape [" + std::to_string(f_) + " x " +
                        std::to_string(d_) + "], d_model and d_ffn must be at least 1");
    }
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
