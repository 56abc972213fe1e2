#pragma once
/// \file kernels/panel_matrix.hpp
/// `PanelMatrix`: K × 32 lanes per panel, in the layout of its type's entry
/// of the weight-type table (kernels/packed_weights.hpp explains the panel
/// order; kernels/quant_layout.hpp the block formats'), with the type's
/// per-block scale array beside the codes. The bytes are owned or a
/// read-only view into a mapped file (kernels/panel_bytes.hpp); the kernels
/// read both through the same panel(p) and scales(p).

#include <cstddef>
#include <cstring>
#include <string>

#include "../core/checked_size.hpp"
#include "../core/errors.hpp"
#include "../core/types.hpp"
#include "aligned_array.hpp"
#include "panel_bytes.hpp"
#include "weight_types.hpp"

namespace apex::packed {

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
  /// Owned, zeroed storage for `panels` panels of reduction length k.
  PanelMatrix(Dtype dtype, Index k, Index panels) : PanelMatrix(Geometry{}, dtype, k, panels) {
    codes_ = PanelBytes(panels_ * panel_bytes_);
    scales_ = PanelBytes(panels_ * scale_bytes_);
  }

  /// A read-only view of a matrix stored in panel order inside `file`: its
  /// codes_bytes() bytes at `codes_offset`, its scales_bytes() at
  /// `scales_offset`, each 64-byte aligned (FormatError naming `where` and
  /// `what` otherwise, or if a range is past the file's end). No byte is
  /// read or copied; the matrix holds the mapping.
  static PanelMatrix view(Dtype dtype, Index k, Index panels, const std::shared_ptr<const MappedBytes>& file,
                          std::uint64_t codes_offset, std::uint64_t scales_offset, const std::string& where,
                          const std::string& what) {
    PanelMatrix m(Geometry{}, dtype, k, panels);
    m.codes_ = PanelBytes::view(file, codes_offset, m.codes_bytes(), where, what + " codes");
    m.scales_ = PanelBytes::view(file, scales_offset, m.scales_bytes(), where, what + " scales");
    return m;
  }

  /// Bytes of one panel's codes and of its scales.
  Index panel_code_bytes() const { return panel_bytes_; }
  Index panel_scale_bytes() const { return scale_bytes_; }
  /// Bytes of the code array and of the scale array (panel order, all panels).
  Index codes_bytes() const { return panels_ * panel_bytes_; }
  Index scales_bytes() const { return panels_ * scale_bytes_; }
  /// The code and scale arrays, for a writer of the panel order.
  const std::byte* codes_data() const { return codes_.data(); }
  const std::byte* scales_data() const { return scales_.data(); }
  /// True if the bytes are a view into a mapped file (mutators then throw).
  bool mapped() const { return codes_.mapped() || scales_.mapped(); }
  /// The mapping a mapped matrix holds (null for owned storage).
  const std::shared_ptr<const MappedBytes>& mapping() const { return codes_.mapping(); }
  /// The same matrix in owned storage (a copy of a mapped one's bytes).
  PanelMatrix to_owned() const {
    PanelMatrix m = *this;  // owned bytes copied once, mapped ones shared until copied here
    if (codes_.mapped()) m.codes_ = codes_.to_owned();
    if (scales_.mapped()) m.scales_ = scales_.to_owned();
    return m;
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
  /// converted. ValueError naming the block for a block whose values would
  /// not be finite (WeightType::check_file_block), checked as it moves.
  void put_row(Index p, Index lane, const std::byte* row) {
    visit_dtype(dtype_, [&](auto tag) {
      using W = WeightType<decltype(tag)::value>;
      for (Index b = 0; b < kpad_ / W::kBlockWeights; ++b) {
        typename W::Block blk;
        std::memcpy(&blk, row + b * Index(sizeof blk), sizeof blk);
        if constexpr (W::kQuantized) W::check_file_block(blk, b);  // before its bytes move in
        W::put_block(blk, b, lane, codes(p, tag, "PanelMatrix::put_row"), mutable_scales(p, "PanelMatrix::put_row"));
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
      W::pack_row(w, k_, lane, codes(p, tag, "PanelMatrix::pack_row"), mutable_scales(p, "PanelMatrix::pack_row"));
    });
  }
  /// The stored weight (k, lane) of panel p, as float.
  float get(Index p, Index k, Index lane) const {
    return visit_dtype(dtype_, [&](auto tag) {
      return WeightType<decltype(tag)::value>::weight(panel<decltype(tag)::value>(p), scales(p), k, lane);
    });
  }

 private:
  struct Geometry {};
  /// The sizes of a matrix, no storage (the constructors add it).
  PanelMatrix(Geometry, Dtype dtype, Index k, Index panels) : dtype_(dtype), k_(k), panels_(panels) {
    constexpr const char* where = "PanelMatrix";
    bytes_for(where, "packed weights (panels x K x 32 lanes x bytes)", dtype, k, panels);  // fits, checked
    visit_dtype(dtype, [&](auto tag) {
      using W = WeightType<decltype(tag)::value>;
      kpad_ = detail::padded_k<decltype(tag)::value>(where, k);
      const Index blocks = kpad_ / W::kBlockWeights;  // per lane
      panel_bytes_ = blocks * kLanes * (W::kBlockBytes - W::kScaleBytes);
      scale_bytes_ = blocks * kLanes * W::kScaleBytes;
    });
  }
  // Writable panel p: ConfigError naming `where` for a mapped matrix.
  template <class Tag>
  typename WeightType<Tag::value>::Element* codes(Index p, Tag, const char* where) {
    return reinterpret_cast<typename WeightType<Tag::value>::Element*>(codes_.mutable_data(where) + p * panel_bytes_);
  }
  std::byte* mutable_scales(Index p, const char* where) { return scales_.mutable_data(where) + p * scale_bytes_; }

  Dtype dtype_ = Dtype::f32;
  Index k_ = 0, kpad_ = 0, panels_ = 0;
  Index panel_bytes_ = 0, scale_bytes_ = 0;  // per panel
  PanelBytes codes_;                         // panels × panel_bytes_, owned or mapped
  PanelBytes scales_;                        // panels × scale_bytes_
};

}  // namespace apex::packed
