#pragma once
/// \file adapters/peft_tensors.hpp
/// The values of a peft adapter tensor (adapters/peft_names.hpp's
/// PeftTensorSpec) gathered from a layer's adapters, and scattered back into
/// a staged copy of them. A load scatters every tensor of the file into the
/// stage, each element of which starts as NaN: an element written twice
/// (a tied adapter in every expert's slot, a fused gate_up's A in the gate
/// and the up projection's tensors) must get the same value both times,
/// since the layer holds it once. The file's values are checked finite
/// before, so NaN means "not written yet". Only a stage that every tensor
/// filled without conflict is committed to the layer.

#include <cmath>
#include <cstddef>
#include <limits>
#include <vector>

#include "../core/types.hpp"
#include "lora_adapter.hpp"
#include "lora_adapter_set.hpp"
#include "peft_names.hpp"

namespace apex {
namespace detail {

/// The row of a slot's B that row o of a lora_B holds; `half` = f (or f_s).
inline Index peft_b_row(PeftRows rows, Index o, Index half) {
  switch (rows) {
    case PeftRows::up_half: return half + o;
    case PeftRows::interleaved: return o % 2 ? half + o / 2 : o / 2;
    case PeftRows::all:
    case PeftRows::gate_half: break;
  }
  return o;
}

/// Calls fn(matrix, row, col, flat) for every element of spec `s`: the
/// slot's A or B (of `get(shared, e)`, the adapters of expert e) element
/// stored at index `flat` of the tensor (rows × cols, row-major).
/// `experts`: E, the routed experts a stacked tensor holds.
template <class Get, class Fn>
void peft_for_each(const PeftTensorSpec& s, Index experts, Get&& get, Fn&& fn) {
  const auto pair_of = [&](bool shared, Index e) -> auto& { return get(shared, e)[s.slot]; };
  if (s.expert >= 0) {  // one Linear: A as it is, B's rows as rows_of picks them
    auto& p = pair_of(s.shared, s.expert);
    const Index half = p.b.rows() / 2;
    for (Index i = 0; i < s.rows; ++i)
      for (Index j = 0; j < s.cols; ++j) {
        if (s.is_b) fn(p.b, peft_b_row(s.rows_of, i, half), j, i * s.cols + j);
        else fn(p.a, i, j, i * s.cols + j);
      }
    return;
  }
  for (Index e = 0; e < experts; ++e) {  // stacked: A rows e·r + k, B columns k·E + e
    auto& p = pair_of(false, e);
    const Index r = p.a.rows(), half = p.b.rows() / 2;
    if (s.is_b) {
      for (Index o = 0; o < s.rows; ++o)
        for (Index k = 0; k < r; ++k) fn(p.b, peft_b_row(s.rows_of, o, half), k, o * s.cols + k * experts + e);
    } else {
      for (Index k = 0; k < r; ++k)
        for (Index i = 0; i < s.cols; ++i) fn(p.a, k, i, (e * r + k) * s.cols + i);
    }
  }
}

/// The values of spec `s` (rows × cols, row-major) from `get(shared, e)`.
template <class T, class Get>
std::vector<T> peft_gather(const PeftTensorSpec& s, Index experts, const Get& get) {
  std::vector<T> out(std::size_t(s.rows * s.cols));
  peft_for_each(s, experts, get, [&](const Matrix<T>& m, Index i, Index j, Index flat) { out[std::size_t(flat)] = m(i, j); });
  return out;
}

/// A staged copy of a layer's routed and shared adapters, NaN until written.
template <class T>
struct PeftStage {
  std::vector<LoraExpertAdapters<T>> routed;  ///< one set (tied) or one per expert
  std::vector<LoraExpertAdapters<T>> shared;
  bool tied = false;

  static LoraExpertAdapters<T> nan_like(const LoraExpertAdapters<T>& v) {
    LoraExpertAdapters<T> out = v;
    for (auto& p : out.slot) {
      p.a.setConstant(std::numeric_limits<T>::quiet_NaN());
      p.b.setConstant(std::numeric_limits<T>::quiet_NaN());
    }
    return out;
  }
  PeftStage(const LoraAdapterSet<T>& r, const LoraAdapterSet<T>& s) : tied(r.tied()) {
    for (Index e = 0; e < (tied ? 1 : r.experts()); ++e) routed.push_back(nan_like(r.values(e)));
    for (Index e = 0; e < s.experts(); ++e) shared.push_back(nan_like(s.values(e)));
  }
  LoraExpertAdapters<T>& operator()(bool is_shared, Index e) {
    return is_shared ? shared[std::size_t(e)] : routed[std::size_t(tied ? 0 : e)];
  }

  /// Writes the tensor `v` of spec `s` into the stage. False at the first
  /// element already written with another value (nothing else is undone:
  /// the stage is dropped on failure).
  bool scatter(const PeftTensorSpec& s, Index experts, const std::vector<T>& v) {
    bool ok = true;
    peft_for_each(s, experts, *this, [&](Matrix<T>& m, Index i, Index j, Index flat) {
      T& dst = m(i, j);
      const T x = v[std::size_t(flat)];
      if (std::isnan(dst)) dst = x;
      else if (dst != x) ok = false;
    });
    return ok;
  }
  /// True if every element was written (the specs covered the layer).
  bool complete() const {
    for (const auto* group : {&routed, &shared})
      for (const auto& v : *group)
        for (const auto& p : v.slot)
          if (p.a.array().isNaN().any() || p.b.array().isNaN().any()) return false;
    return true;
  }
  /// Copies the stage into the layer's sets (same shapes: no allocation, cannot throw).
  void commit(LoraAdapterSet<T>& r, LoraAdapterSet<T>& s) const {
    for (std::size_t e = 0; e < routed.size(); ++e)
      for (int i = 0; i < kLoraSlots; ++i) {
        r.values(Index(e)).slot[std::size_t(i)].a = routed[e].slot[std::size_t(i)].a;
        r.values(Index(e)).slot[std::size_t(i)].b = routed[e].slot[std::size_t(i)].b;
      }
    for (std::size_t e = 0; e < shared.size(); ++e)
      for (int i = 0; i < kLoraSlots; ++i) {
        s.values(Index(e)).slot[std::size_t(i)].a = shared[e].slot[std::size_t(i)].a;
        s.values(Index(e)).slot[std::size_t(i)].b = shared[e].slot[std::size_t(i)].b;
      }
  }
};

}  // namespace detail
}  // namespace apex
