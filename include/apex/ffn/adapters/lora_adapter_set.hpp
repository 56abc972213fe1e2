#pragma once
/// \file adapters/lora_adapter_set.hpp
/// The adapters of a group of experts (a layer's routed experts, or its
/// shared experts) and their gradients: one set per expert, or one set
/// *tied* across every routed expert (LoraOptions::per_expert = false).
///
/// Gradients follow the layer contract (core/param.hpp): allocated on first
/// need, never moved, added into by backward. Experts run their backward
/// concurrently, and an expert must not write what another writes
/// (moe/expert_contract.hpp), so a tied set gives every expert a partial
/// gradient of its own; after the experts' backward, `reduce_partials` adds
/// them into the tied gradient in expert order (bitwise the same for any
/// thread count) and clears them.
///
/// Names, as the expert's state_dict names its weights:
///     experts.{e}.w_gate_up.lora_A.weight   (r × d)      experts.{e}.w_down.lora_B.weight (d × r)
///     experts.w_gate_up.lora_A.weight       (tied)       shared_experts.{s}.…

#include <string>
#include <vector>

#include "../core/init.hpp"
#include "../core/param.hpp"
#include "../core/types.hpp"
#include "lora_adapter.hpp"
#include "lora_options.hpp"

namespace apex {

template <class T>
class LoraAdapterSet {
 public:
  LoraAdapterSet() = default;
  /// `experts` experts of widths d, f; adapters as `o` targets them (o
  /// validated by the caller), drawn from rng expert by expert, slot by slot
  /// (only A draws); `tied`: one set for all. `prefix`: "experts." or "shared_experts.".
  LoraAdapterSet(Index experts, Index d, Index f, const LoraOptions& o, bool tied, std::string prefix, Rng& rng)
      : experts_(experts), tied_(tied), prefix_(std::move(prefix)) {
    values_.resize(std::size_t(tied ? 1 : experts));
    for (auto& v : values_) {
      const auto add = [&](LoraSlot s, bool on, Index in, Index out) {
        if (on) v[s] = detail::new_lora_pair<T>(in, out, o.rank, rng);
      };
      add(LoraSlot::gate, o.targets.gate, d, f);
      add(LoraSlot::up, o.targets.up, d, f);
      add(LoraSlot::gate_up, o.targets.gate_up, d, 2 * f);
      add(LoraSlot::down, o.targets.down, f, d);
    }
  }

  Index experts() const { return experts_; }
  bool tied() const { return tied_; }
  /// Expert e's adapter values (the tied set for every e when tied).
  const LoraExpertAdapters<T>& values(Index e) const { return values_[std::size_t(tied_ ? 0 : e)]; }
  LoraExpertAdapters<T>& values(Index e) { return values_[std::size_t(tied_ ? 0 : e)]; }
  /// Where expert e's backward adds (its partial when tied across several
  /// experts); allocated first.
  LoraExpertAdapters<T>* grads_of(Index e) { return partials() ? &grads_[std::size_t(e)] : &grad(e); }
  /// The gradients params() lists: per expert, or the tied total.
  LoraExpertAdapters<T>& grad(Index e) { return tied_ ? total_ : grads_[std::size_t(e)]; }
  const LoraExpertAdapters<T>& grad(Index e) const { return tied_ ? total_ : grads_[std::size_t(e)]; }

  bool has_gradients() const { return has_grads_ || experts_ == 0; }
  void allocate_gradients() {
    if (has_gradients()) return;
    if (!tied_ || partials()) {
      grads_.resize(std::size_t(experts_));
      for (Index e = 0; e < experts_; ++e) grads_[std::size_t(e)] = zero_like(values(e));
    }
    if (tied_) total_ = zero_like(values_.front());
    has_grads_ = true;
  }
  void zero_grad() {
    allocate_gradients();
    for (auto& g : grads_) set_zero(g);
    if (tied_) set_zero(total_);
  }
  /// Tied across several experts: total += Σ_e partial_e in expert order,
  /// partials cleared. Else nothing.
  void reduce_partials() {
    if (!partials() || grads_.empty()) return;
    for (auto& g : grads_)
      for (int s = 0; s < kLoraSlots; ++s) {
        auto& part = g.slot[std::size_t(s)];
        if (part.empty()) continue;
        total_.slot[std::size_t(s)].a += part.a;
        total_.slot[std::size_t(s)].b += part.b;
        part.a.setZero();
        part.b.setZero();
      }
  }

  /// The adapters' parameters (with gradients when `grads`), state_dict order.
  ParamList<T> params(bool grads) {
    ParamList<T> out;
    for (std::size_t i = 0; i < values_.size(); ++i) {
      const std::string expert = prefix_ + (tied_ ? "" : std::to_string(i) + ".");
      LoraExpertAdapters<T>* g = grads ? &grad(Index(i)) : nullptr;
      for (int s = 0; s < kLoraSlots; ++s) {
        LoraPair<T>& v = values_[i].slot[std::size_t(s)];
        if (v.empty()) continue;
        const std::string name = expert + lora_slot_name(LoraSlot(s));
        LoraPair<T>* gp = g ? &g->slot[std::size_t(s)] : nullptr;
        out.push_back(detail::make_param<T>(name + ".lora_A.weight", v.a, gp ? &gp->a : nullptr));
        out.push_back(detail::make_param<T>(name + ".lora_B.weight", v.b, gp ? &gp->b : nullptr));
      }
    }
    return out;
  }
  /// Scalars of every adapter (the tied set once).
  Index size() const {
    Index n = 0;
    for (const auto& v : values_) n += v.size();
    return n;
  }

 private:
  static LoraExpertAdapters<T> zero_like(const LoraExpertAdapters<T>& v) {
    LoraExpertAdapters<T> g;
    for (int s = 0; s < kLoraSlots; ++s)
      if (!v.slot[std::size_t(s)].empty()) g.slot[std::size_t(s)] = detail::zero_like(v.slot[std::size_t(s)]);
    return g;
  }
  static void set_zero(LoraExpertAdapters<T>& g) {
    for (auto& p : g.slot) {
      p.a.setZero();
      p.b.setZero();
    }
  }

  /// One set written by several experts' concurrent backward: each gets a partial.
  bool partials() const { return tied_ && experts_ > 1; }

  Index experts_ = 0;
  bool tied_ = false;
  bool has_grads_ = false;
  std::string prefix_;
  std::vector<LoraExpertAdapters<T>> values_;  ///< 1 (tied) or one per expert
  std::vector<LoraExpertAdapters<T>> grads_;   ///< one per expert once allocated: its gradient, or its partial (tied)
  LoraExpertAdapters<T> total_;                ///< tied: the gradient params() lists
};

}  // namespace apex
